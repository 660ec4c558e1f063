"""posttrain's dpo and ipo presets against TRL's DPOTrainer (``loss_type`` sigmoid and ipo), end to end.

The same tiny random Llama, the same five (prompt, chosen, rejected) string pairs of different lengths (so the
batch is padded and IPO's division by each completion's length matters), the same beta, one batch of all five:

1. TRL's ``DPOTrainer`` built from a TRL ``DPOConfig``; posttrain's ``PreferenceSession`` built from a flat
   config in TRL's names (``loss_type``, ``beta``, ``per_device_train_batch_size``), so the translation of
   ``posttrain.config.trl`` is on the path too (TRL's ``beta`` must reach the preset: 0.25 is neither preset's
   own default).
2. The token ids are the same on both sides (asserted): a string prompt is tokenized with the tokenizer's special
   tokens (BOS), a completion without them and with EOS appended. TRL appends the EOS *text* and tokenizes
   prompt + completion in one piece, then splits at the common prefix with the prompt's ids; posttrain tokenizes
   the completion alone and appends the EOS id. With a character tokenizer nothing merges across the boundary,
   so the two give equal ids; a BPE tokenizer can merge there and give different ones, which is a tokenization
   difference, not a loss difference, and is why the ids are compared first.
3. Before any update, the loss of TRL's ``compute_loss`` on the collated batch and the loss of posttrain's own
   micro-batch pass (``train_micro_batch``: its forward over the packed, prompt-sharing rows and the preset's
   loss) agree to float32 rounding, and so do the gradients of every parameter (TRL's forward pads the rows;
   posttrain's folds the LM head and shares each prompt by its completions: only the order of float sums
   differs).
4. One optimizer step of each (TRL's ``train()`` with ``max_steps`` 1; posttrain's ``train_step``: AdamW with
   torch's defaults, no weight decay, clipping at norm 1 and the full learning rate at step 1 in both) moves
   the weights the same way and lowers the loss on the batch by the same amount (TRL's config turns gradient
   checkpointing on by default: the same arithmetic).

The policy starts as the reference plus fixed noise: at policy = reference every log-ratio is 0, so the losses
would be log 2 and (1 / (2 beta))^2 whatever the log-probs. Both are papers' losses alone: TRL's one loss type
without ``loss_weights``, posttrain's preset without ``rpo_alpha`` (no NLL term). Both run without dropout.

The metrics are not compared: for ipo, TRL reports ``beta * (pi - ref)`` summed over the completion, posttrain
the length-normalised ratio that enters its loss.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import posttrain.functional as F
from posttrain.config import Config
from posttrain.training.preference import (
    PreferenceSession,
    loss_inputs,
    reference_logps,
    train_micro_batch,
    train_step,
)
from posttrain.training.preference_passes import example_sequences, sequence_logps

trl = pytest.importorskip("trl")

PAIRS = [  # over the tiny model's characters "0123456789+=,|"; prompts of 3 to 11 and completions of 2 to 8 tokens
    {"prompt": "12+34=", "chosen": "46", "rejected": "47,|9"},
    {"prompt": "7+8=", "chosen": "15|", "rejected": "1"},
    {"prompt": "100+200+3=", "chosen": "303", "rejected": "3,0,3"},
    {"prompt": "9=", "chosen": "9,9,9,9", "rejected": "8"},
    {"prompt": "5+5+5=", "chosen": "15", "rejected": "15,15"},
]
BETA = 0.25
LEARNING_RATE = 1e-2
RTOL = 1e-5  # float32 with sums in another order; measured: losses 1e-7 to 2e-7 apart (relative), gradients 5e-7


def perturb(model: torch.nn.Module) -> None:
    """Move every parameter by twice its std (at least 0.02) of seeded noise, the same on both sides."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(2 * p.std().nan_to_num(0.02).clamp(min=0.02) * torch.randn(p.shape, generator=generator))


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all the tensors together (b: TRL's)."""
    assert a.keys() == b.keys()
    return math.sqrt(sum(float((a[k] - b[k]).square().sum()) for k in b) / sum(float(b[k].square().sum()) for k in b))


def trl_run(model_dir, output, loss_type: str) -> dict:
    """TRL's loss and gradients on the whole batch at the perturbed start, then one ``train()`` step."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = trl.DPOConfig(output_dir=str(output), loss_type=[loss_type], beta=BETA, learning_rate=LEARNING_RATE,
                         per_device_train_batch_size=len(PAIRS), max_steps=1, bf16=False, use_cpu=True,
                         report_to=[], save_strategy="no", disable_tqdm=True, seed=0)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    perturb(policy)
    start = {name: p.detach().clone() for name, p in policy.named_parameters()}
    trainer = trl.DPOTrainer(model=policy, ref_model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                             train_dataset=Dataset.from_list(PAIRS),
                             processing_class=AutoTokenizer.from_pretrained(model_dir))
    tokens = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    batch = trainer.data_collator(tokens)
    trainer.model.train()  # as Trainer.training_step runs it
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    trainer.train()  # one AdamW step on the one batch of all the pairs
    with torch.no_grad():
        loss_after = trainer.compute_loss(trainer.model, batch)
    return {"tokens": tokens, "loss": loss.item(), "grads": grads, "loss_after": float(loss_after), "start": start,
            "update": {name: p.detach() - start[name] for name, p in trainer.model.named_parameters()}}


@pytest.mark.parametrize("loss_type, algorithm", [("sigmoid", "dpo"), ("ipo", "ipo")])
def test_the_loss_gradient_and_step_are_trls(loss_type, algorithm, tiny_model_dir, tmp_path):
    theirs = trl_run(tiny_model_dir, tmp_path / "trl", loss_type)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    config = Config.from_flat({  # TRL's names where TRL has them
        "algorithm": algorithm, "loss_type": loss_type, "beta": BETA, "learning_rate": LEARNING_RATE,
        "per_device_train_batch_size": len(PAIRS), "model": str(tiny_model_dir),
        "dataset": str(tmp_path / "pairs.jsonl"), "device": "cpu", "max_steps": 1, "eval_size": 0, "progress": False,
        "report_to": "none", "seed": 0})
    s = PreferenceSession.create(config)
    assert (s.preset.loss, s.preset.beta, s.preset.rpo_alpha) == (algorithm, BETA, None)
    perturb(s.policy)  # the policy only: s.ref keeps the saved weights, as TRL's ref_model does
    start = {name: p.detach().clone() for name, p in s.policy.named_parameters()}
    assert relative_distance(start, theirs["start"]) == 0  # one starting point
    for i, row in enumerate(theirs["tokens"]):
        assert s.train.prompt_ids[i].tolist() == row["prompt_ids"]
        assert [column[i].tolist() for column in s.train.completion_ids] == [row["chosen_ids"], row["rejected_ids"]]

    idx = list(range(len(PAIRS)))
    inputs, _ = train_micro_batch(s, idx, 1.0, {})  # the trainer's pass over the whole batch, and backward
    loss, _ = s.preset.preference_loss(**inputs)
    grads = {name: p.grad.clone() for name, p in s.policy.named_parameters()}
    s.policy.zero_grad(set_to_none=True)
    assert loss.item() == pytest.approx(theirs["loss"], rel=RTOL)
    assert relative_distance(grads, theirs["grads"]) < RTOL
    # what the comparison can tell apart: the policy is away from the reference (DPO is not log 2), and IPO
    # without the division by lengths (eq. (17) on summed log-probs) is far from TRL's
    if loss_type == "sigmoid":
        assert abs(theirs["loss"] - math.log(2)) > 1e3 * RTOL
    else:
        unnormalised, _ = F.ipo_loss(inputs["chosen_logps"], inputs["rejected_logps"], inputs["ref_chosen_logps"],
                                     inputs["ref_rejected_logps"], beta=BETA)
        assert abs(float(unnormalised) - theirs["loss"]) > 1e3 * RTOL * theirs["loss"]

    metrics = train_step(s)  # its whole batch is the five pairs, in a shuffled order
    assert metrics["loss"] == pytest.approx(theirs["loss"], rel=RTOL)  # logged from the pre-update log-probs
    update = {name: p.detach() - start[name] for name, p in s.policy.named_parameters()}
    # Adam's first step is lr * g / (|g| + eps) per weight: where |g| is within a few orders of eps (a handful of
    # the 10,912 weights here have |g| < 1e-5) it turns float32 noise in g into a visible difference of step, so
    # the update is held to 10 x RTOL (measured: 4e-7 for dpo, 6e-6 for ipo); the loss after it, to RTOL
    assert relative_distance(update, theirs["update"]) < 10 * RTOL
    with torch.no_grad():
        logps, lengths = sequence_logps(s.policy, *example_sequences(s.train, idx), s.pad_id)
        loss_after, _ = s.preset.preference_loss(**loss_inputs(s.preset, s.train, idx, logps.view(2, -1),
                                                               lengths.view(2, -1), reference_logps(s, idx)))
    assert theirs["loss_after"] < theirs["loss"] - 1e3 * RTOL * theirs["loss"]  # the step moved it
    assert float(loss_after) == pytest.approx(theirs["loss_after"], rel=RTOL)
