"""The preference loop on a tiny random model: every preset trains on exactly its functional loss
from completion-only log-probs; the reference is frozen, absent when unused, and precomputable;
micro-batching and resuming change nothing; held-out accuracy uses each preset's implicit reward."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from torch.nn.functional import log_softmax

import posttrain.functional as F
import posttrain.training.preference as preference
import posttrain.training.preference_passes as preference_passes
import posttrain.training.setup as setup
from posttrain.training.api import run
from posttrain.algorithms.presets import ALGORITHMS, PreferenceAlgorithm
from posttrain.config import Config, ConfigError, OptimConfig
from posttrain.tracking.metrics import read_metrics
from posttrain.training.optim import apply_gradients, build_optimizer
from posttrain.training.preference import (
    PreferenceSession, evaluate, example_sequences, example_tokens, implicit_rewards, mismatched_sequences,
    reference_logps, sequence_logps, train_step,
)
from posttrain.data.preference import encode, unpair
from posttrain.models.batching import item_micro_batches
from posttrain.training.runner import run_training
from posttrain.data.tasks.addition import make_rows
from posttrain.data.tasks.addition_pairs import pair_row
from conftest import assert_runs_identical, resumed, run_interrupted

PRESETS = [name for name, preset in ALGORITHMS.items() if isinstance(preset, PreferenceAlgorithm)]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    """32 training and 8 held-out addition pairs as JSONL files."""
    train, test = make_rows(seed=1, n_train=32, n_test=8)
    root = tmp_path_factory.mktemp("pairs")
    for name, rows in (("train", train), ("test", test)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(pair_row(r)) + "\n" for r in rows))
    return root / "train.jsonl", root / "test.jsonl"


def make_config(model_dir, pair_files, algorithm="dpo", **flat) -> Config:
    base = dict(
        algorithm=algorithm, model=str(model_dir), dataset=str(pair_files[0]), eval_dataset=str(pair_files[1]),
        pairs_per_step=4, micro_batch_size=64, learning_rate=1e-3, max_steps=2, eval_size=8,
        progress=False, report_to="none", seed=0,
    )
    base.update(flat)
    return Config.from_flat(base)


def manual_logp(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """sum_t log p(completion_t | prompt, completion_<t) from one unpadded forward pass of the whole text."""
    ids = torch.cat([prompt, completion]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]  # position j predicts token j + 1
    token_logps = log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return token_logps[len(prompt) - 1:].sum()  # the predictions of completion tokens only


def manual_logps(model, data, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """[K, n] for (prompt example, completion example) index pairs; K columns of completions."""
    return torch.stack([torch.stack([manual_logp(model, data.prompt_ids[i], column[j]) for i, j in pairs])
                        for column in data.completion_ids])


def test_sums_hold_completion_tokens_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = [torch.tensor([1, 4, 5, 6, 7]), torch.tensor([1, 8])]  # different lengths: left padding
    completions = [torch.tensor([9, 10, 2]), torch.tensor([11, 12, 13, 14, 2])]
    with torch.no_grad():
        sums, lengths = sequence_logps(model, prompts, completions, pad_id=0)
    for got, p, c in zip(sums, prompts, completions):
        expected = manual_logp(model, p, c)
        assert float(got) == pytest.approx(float(expected), abs=1e-5)
        # The prompt's own tokens would change the sum: the test can tell them apart.
        assert abs(float(manual_logp(model, p[:1], torch.cat([p[1:], c]))) - float(expected)) > 1e-2
    assert lengths.tolist() == [3.0, 5.0]


def expected_loss(name, alg, pi, ref, lengths, data, idx, kl_pi=None, kl_ref=None):
    """The preset's loss by the functional API, written out per loss (the test may branch on names)."""
    if name == "dpo":
        return F.dpo_loss(pi[0], pi[1], ref[0], ref[1], beta=alg.beta)[0]
    if name == "odpo":
        offset = F.odpo_offset(data.scores[0, idx], data.scores[1, idx], alpha=alg.alpha)
        return F.dpo_loss(pi[0], pi[1], ref[0], ref[1], beta=alg.beta, offset=offset)[0]
    if name == "simpo":
        return F.simpo_loss(pi[0], pi[1], lengths[0], lengths[1], beta=alg.beta, gamma=alg.gamma)[0]
    if name == "orpo":
        return F.orpo_loss(pi[0], pi[1], lengths[0], lengths[1], lam=alg.lam)[0]
    if name == "ipo":
        return F.ipo_loss(pi[0], pi[1], ref[0], ref[1], beta=alg.beta, chosen_lengths=lengths[0],
                          rejected_lengths=lengths[1])[0]
    return F.kto_loss(pi[0], ref[0], data.desirable[idx], kl_pi, kl_ref, beta=alg.beta)[0]


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_trains_on_exactly_its_functional_loss(name, tiny_model_dir, pair_files):
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, name, micro_batch_size=3))
    initial = copy.deepcopy(s.policy)  # the reference's weights
    train_step(s)  # move the policy away from the reference first: at step 0 DPO's loss is log 2 for any data
    s.step += 1
    before = copy.deepcopy(s.policy)
    metrics = train_step(s)
    idx = s.last_batch
    data = s.train
    matched = [(i, i) for i in idx]
    pi, ref = manual_logps(before, data, matched), manual_logps(initial, data, matched)
    lengths = torch.stack([torch.tensor([float(len(column[i])) for i in idx]) for column in data.completion_ids])
    kl_pi = kl_ref = None
    if name == "kto":  # prompt i with completion i - 1, cyclic
        shifted = list(zip(idx, idx[-1:] + idx[:-1]))
        kl_pi, kl_ref = manual_logps(before, data, shifted)[0], manual_logps(initial, data, shifted)[0]
    expected = expected_loss(name, s.preset, pi, ref, lengths, data, idx, kl_pi, kl_ref)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    logged = s.last_inputs["chosen_logps" if s.preset.paired else "logps"]
    assert torch.allclose(logged, pi[0], atol=1e-5)
    assert metrics["skipped_steps"] == 0 and metrics["grad_norm"] > 0


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_reference_model_is_never_updated(name, tiny_model_dir, pair_files):
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, name))
    ref_before = copy.deepcopy(s.ref.state_dict())
    policy_before = copy.deepcopy(s.policy.state_dict())
    for _ in range(2):
        metrics = train_step(s)
        s.step += 1
    assert all(torch.equal(ref_before[k], v) for k, v in s.ref.state_dict().items())
    assert not any(p.requires_grad for p in s.ref.parameters())
    assert any(not torch.equal(policy_before[k], v) for k, v in s.policy.state_dict().items())
    assert metrics["rewards/margin" if name == "dpo" else "rewards/desirable"] != 0  # the policy left the reference


@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_reference_free_presets_never_create_a_reference(name, tiny_model_dir, pair_files, monkeypatch):
    def no_copy(model):
        raise AssertionError(f"{name} made a reference model")

    monkeypatch.setattr(setup, "reference_model", no_copy)
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, name, precompute_reference=True))
    assert s.ref is None and s.ref_logps is None and s.test_ref_logps is None
    assert [v for v in vars(s).values() if isinstance(v, torch.nn.Module)] == [s.policy]  # one model
    assert math.isfinite(train_step(s)["loss"])
    # held-out accuracy by the policy's own score of each pair (ties count half), worked out from
    # manual log-probs: SimPO beta * pi / |y|, ORPO the log odds of a = pi / |y|
    pairs = [(i, i) for i in range(len(s.test))]
    logps = manual_logps(s.policy, s.test, pairs)
    lengths = torch.stack([torch.tensor([float(len(c)) for c in column]) for column in s.test.completion_ids])
    a = logps / lengths
    score = s.preset.beta * a if name == "simpo" else a - torch.log(-torch.expm1(a))
    wins = (score[0] > score[1]).float() + 0.5 * (score[0] == score[1]).float()
    assert evaluate(s)["eval/pairwise_accuracy"] == pytest.approx(wins.mean().item())


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_precomputed_reference_equals_on_the_fly(name, tiny_model_dir, pair_files):
    live = PreferenceSession.create(make_config(tiny_model_dir, pair_files, name))
    table = PreferenceSession.create(make_config(tiny_model_dir, pair_files, name, precompute_reference=True))
    assert (table.ref is None) == table.preset.paired  # freed unless KTO's mismatched pairs need it
    idx = list(range(len(live.train)))
    assert torch.allclose(reference_logps(table, idx), reference_logps(live, idx), atol=1e-5)
    a, b = train_step(live), train_step(table)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


@pytest.mark.parametrize("name, extra", [*((n, {}) for n in PRESETS), *((n, {"rpo_alpha": 1.0}) for n in ("dpo", "kto"))])
def test_micro_batching_gives_the_same_gradient(name, extra, tiny_model_dir, pair_files, monkeypatch):
    """Micro-batches of 3 sequences (one pair; three KTO examples) and of a token budget (examples placed
    out of order) accumulate the whole batch's gradient (with RPO's NLL term too) and log its loss."""
    grads = []

    def capture(optimizer, scheduler, optim, bad_steps):
        grads[-1] += [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
        optimizer.zero_grad()
        return 1.0, 0

    monkeypatch.setattr(preference, "apply_gradients", capture)
    losses, costs = [], []  # costs: each example's tokens, read from the first sessions' sampler
    for settings in ({}, dict(micro_batch_size=3), "budget"):
        if settings == "budget":  # the longest example and the shortest fit: several passes, not in order
            budget = max(costs) + min(costs)
            micros = item_micro_batches(costs, per_pass=0, budget=budget)
            assert 1 < len(micros) < 5 and sum(micros, []) != list(range(5))
            settings = dict(max_tokens_per_micro_batch=budget)
        s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, name, **{"micro_batch_size": 64, **settings},
                                                 pairs_per_step=5, **extra))
        s.update_check.done = True  # the captured step applies nothing, on purpose
        costs = example_tokens(s.train, copy.deepcopy(s.sampler).next(5), share_prompts=True)
        grads.append([])
        losses.append(train_step(s)["loss"])
    assert any(g.abs().max() > 0 for g in grads[0])
    for other, loss in zip(grads[1:], losses[1:]):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for a, b in zip(grads[0], other, strict=True):  # as many gradients either way: none compared vacuously
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_kto_mismatched_pairs_are_the_cyclic_shift(tiny_model_dir, pair_files):
    from transformers import AutoTokenizer

    from posttrain.data.prompts import read_rows

    rows = unpair(read_rows(str(pair_files[0])))
    data = encode(rows, AutoTokenizer.from_pretrained(tiny_model_dir), paired=False, with_scores=False,
                  max_length=1024, max_prompt_length=512)
    idx = [5, 2, 7, 0]
    prompts, completions = mismatched_sequences(data, idx, max_length=1024)
    for i, j, p, c in zip(idx, [0, 5, 2, 7], prompts, completions, strict=True):  # example i: (i-1)'s completion
        assert torch.equal(p, data.prompt_ids[i]) and torch.equal(c, data.completion_ids[0][j])
    _, cut = mismatched_sequences(data, idx, max_length=12)
    assert all(len(p) + len(c) <= 12 for p, c in zip(prompts, cut, strict=True))


def test_one_forward_pass_per_micro_batch_holds_chosen_then_rejected(tiny_model_dir, pair_files, monkeypatch):
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, "dpo", pairs_per_step=6,
                                             micro_batch_size=8))  # 4 pairs per pass: passes of 4 and 2
    prompts, completions = example_sequences(s.train, [3, 1])
    assert [c.tolist() for c in completions] == [s.train.completion_ids[k][i].tolist() for k in (0, 1) for i in (3, 1)]
    assert all(torch.equal(p, s.train.prompt_ids[i]) for p, i in zip(prompts, [3, 1, 3, 1]))
    passes = []

    def counting_forward(model, batch, **kw):
        passes.append((model is s.policy, batch.input_ids.shape[0]))
        return forward(model, batch, **kw)

    forward = preference_passes.forward
    monkeypatch.setattr(preference_passes, "forward", counting_forward)
    train_step(s)
    assert [rows for is_policy, rows in passes if is_policy] == [8, 4]  # chosen and rejected together
    assert [rows for is_policy, rows in passes if not is_policy] == [8, 4]  # the reference, likewise


def test_truncated_examples_are_counted_per_step(tiny_model_dir, pair_files):
    # Prompts are 7-9 tokens (BOS included), chosen completions 8-30: max_length 16 cuts most of them.
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, "dpo", max_length=16, max_prompt_length=6))
    lengths = [len(p) + max(len(c[i]) for c in s.train.completion_ids) for i, p in enumerate(s.train.prompt_ids)]
    assert max(lengths) == 16
    metrics = train_step(s)
    assert metrics["data/truncated"] == float(s.train.truncated[s.last_batch].sum()) > 0


def test_implicit_rewards_by_hand():
    """Pairs: (pi_w, pi_l) = (-1, -3) and (-2, -1); ref -2 everywhere; lengths (2, 4) and (1, 1)."""
    logps = torch.tensor([[-1.0, -2.0], [-3.0, -1.0]])
    lengths = torch.tensor([[2.0, 1.0], [4.0, 1.0]])
    ref = torch.full((2, 2), -2.0)
    # DPO and KTO: beta (pi - ref) = 0.1 * (1, 0) chosen, 0.1 * (-1, 1) rejected.
    for name in ("dpo", "kto"):
        r = implicit_rewards(ALGORITHMS[name], logps, lengths, ref, None)
        assert torch.allclose(r, torch.tensor([[0.1, 0.0], [-0.1, 0.1]]))
    # SimPO: beta pi / |y| = 2 * (-1/2, -2/1) chosen, 2 * (-3/4, -1/1) rejected.
    r = implicit_rewards(ALGORITHMS["simpo"], logps, lengths, None, None)
    assert torch.allclose(r, torch.tensor([[-1.0, -4.0], [-1.5, -2.0]]))
    # ORPO: log odds of a = pi / |y|: a - log(1 - e^a).
    a = torch.tensor([[-0.5, -2.0], [-0.75, -1.0]])
    r = implicit_rewards(ALGORITHMS["orpo"], logps, lengths, None, None)
    assert torch.allclose(r, a - torch.log(1 - torch.exp(a)), atol=1e-6)


def test_held_out_accuracy_is_chance_before_training_for_reference_presets(tiny_model_dir, pair_files):
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, "dpo"))
    before = evaluate(s)
    assert before["eval/pairwise_accuracy"] == 0.5 and before["eval/reward_margin"] == 0  # all ties
    train_step(s)
    assert evaluate(s)["eval/pairwise_accuracy"] != 0.5


def test_builtin_task_gives_generation_accuracy(tiny_model_dir, monkeypatch):
    from posttrain.data import preference as preference_data
    from posttrain.data.tasks import addition_pairs

    monkeypatch.setitem(preference_data.PREFERENCE_TASKS, "addition",
                        lambda seed: addition_pairs.make_task(seed, n_train=16, n_test=4))
    config = Config.from_flat(dict(algorithm="kto", model=str(tiny_model_dir), task="addition", pairs_per_step=4,
                                   pairs_from="dataset", progress=False, report_to="none"))
    s = PreferenceSession.create(config)
    assert len(s.train) == 32 and s.train.desirable.sum() == 16  # the pairs, unpaired
    metrics = evaluate(s)
    assert set(metrics) >= {"eval/pairwise_accuracy", "eval/accuracy"}
    assert metrics["eval/accuracy"] == 0.0  # a random model does not add


def test_non_finite_gradient_skips_the_step(tiny_model_dir, pair_files):
    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, "simpo", max_bad_steps=2))
    with torch.no_grad():
        s.policy.get_input_embeddings().weight[4:] = float("nan")  # every sequence's log-prob is NaN
    before = copy.deepcopy(s.policy.state_dict())
    metrics = train_step(s)
    assert metrics["skipped_steps"] == 1 and s.bad_steps == 1
    assert all(torch.equal(before[k].nan_to_num(), v.nan_to_num()) for k, v in s.policy.state_dict().items())
    with pytest.raises(FloatingPointError, match="2 consecutive"):
        train_step(s)


def test_apply_gradients_drops_a_non_finite_gradient_and_counts():
    weight = torch.nn.Parameter(torch.ones(2))
    optim = OptimConfig(max_bad_steps=3)
    optimizer, scheduler = build_optimizer([weight], optim, total_steps=10)
    weight.grad = torch.tensor([1.0, float("inf")])
    norm, bad = apply_gradients(optimizer, scheduler, optim, bad_steps=1)
    assert math.isinf(norm) and bad == 2 and torch.equal(weight.detach(), torch.ones(2)) and weight.grad is None
    weight.grad = torch.tensor([3.0, 4.0])  # norm 5, clipped to 1, then applied
    norm, bad = apply_gradients(optimizer, scheduler, optim, bad_steps=bad)
    assert norm == pytest.approx(5.0) and bad == 0 and not torch.equal(weight.detach(), torch.ones(2))


LORA = dict(lora_r=4, lora_alpha=8.0)
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")


@pytest.mark.parametrize("name, extra", [("kto", {}), pytest.param("dpo", LORA, marks=needs_peft, id="dpo-lora")])
def test_resumed_run_equals_uninterrupted(name, extra, tiny_model_dir, pair_files, tmp_path):
    common = dict(max_steps=4, eval_every=2, save_every=2, log_samples_every=2, **extra)
    whole = make_config(tiny_model_dir, pair_files, name, output=str(tmp_path / "whole"), **common)
    run_training(PreferenceSession.create(whole), whole, train_step, evaluate)

    first = make_config(tiny_model_dir, pair_files, name, output=str(tmp_path / "split"), **common)
    run_interrupted(PreferenceSession.create(first), first, train_step, evaluate, after=2)
    second = resumed(first, tmp_path / "split")
    run_training(PreferenceSession.create(second), second, train_step, evaluate)

    assert_runs_identical(tmp_path / "whole", tmp_path / "split")
    assert len(read_metrics(tmp_path / "whole")) == 5  # step 0 evaluation + 4 steps


@needs_peft
@pytest.mark.parametrize("precompute", [False, True])
def test_lora_dpo_trains_only_the_adapters_against_the_base_model(precompute, tiny_model_dir, pair_files):
    from transformers import AutoModelForCausalLM

    s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, "dpo", precompute_reference=precompute,
                                             **LORA))
    named = dict(s.policy.named_parameters())
    adapters = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 14  # 7 projections x (A, B) in the one layer
    assert {id(p) for g in s.optimizer.param_groups for p in g["params"]} == {id(named[n]) for n in adapters}
    # The reference is the base model: its log-probs equal a fresh copy's.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    idx = list(range(len(s.train)))
    expected = manual_logps(base, s.train, [(i, i) for i in idx])
    before = copy.deepcopy(s.policy.state_dict())
    for _ in range(2):
        train_step(s)
    assert torch.allclose(reference_logps(s, idx), expected, atol=1e-5)
    changed = {n for n, v in s.policy.state_dict().items() if not torch.equal(before[n], v)}
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)


def test_config_errors_name_the_field(tiny_model_dir, pair_files):
    with pytest.raises(ConfigError, match="pairs_per_step"):
        make_config(tiny_model_dir, pair_files, pairs_per_step=0)
    with pytest.raises(ConfigError, match="max_length > max_prompt_length"):
        make_config(tiny_model_dir, pair_files, max_length=8, max_prompt_length=8)
    with pytest.raises(ConfigError, match="pairs_per_step >= 2"):  # before any model is loaded
        PreferenceSession.create(make_config("does-not-exist", pair_files, "kto", pairs_per_step=1))
    with pytest.raises(ConfigError, match="more than the 32 training examples; use --pairs-per-step 32 or fewer"):
        PreferenceSession.create(make_config("does-not-exist", pair_files, "dpo", pairs_per_step=33))


def test_cli_has_the_preference_flags():
    from posttrain.cli import build_parser

    args = build_parser().parse_args(["train", "--algorithm", "dpo", "--pairs-per-step", "8",
                                      "--precompute-reference", "--max-length", "64"])
    assert (args.pairs_per_step, args.precompute_reference, args.max_length) == (8, True, 64)


@pytest.fixture(scope="module")
def weaker_start(tmp_path_factory) -> Path:
    """The built-in recipe stopped at 25% instead of 40% (32.8% greedy accuracy on all 500 held-out
    prompts, the recipe's v1 model): a policy that still ranks pairs imperfectly. From the default
    model (38.6%) the reference-free presets already rank 0.94 of held-out pairs right by their own
    score, and SimPO went 0.94 -> 0.92 there (docs/decisions.md 17)."""
    from posttrain.models.tiny import BUILTIN_MODELS, build_from_recipe

    path = tmp_path_factory.mktemp("weaker-start")
    model, tokenizer, _ = build_from_recipe(dataclasses.replace(BUILTIN_MODELS["tiny-addition"], target_accuracy=0.25))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_raises_held_out_pairwise_accuracy(name, weaker_start, tmp_path):
    """`posttrain train --algorithm NAME --pairs-from dataset --max-steps 150 --model WEAKER_START`: the built-in
    fixed pairs, default settings.

    Before: 0.5 for the reference presets (all ties), 0.875-0.93 for SimPO and ORPO (the warm-started
    model already prefers the correct scratchpad per token); after: 0.79-0.99 (KTO lowest, ORPO highest).

    SimPO is held to what it optimises instead: the held-out margin of its length-normalised reward.
    Its held-out ranking does not reliably rise on these pairs (docs/decisions.md 17): 0.875 -> 0.900
    at first, 0.93 -> 0.89 from the same recipe built by later code, 0.865 -> 0.825 from a recipe
    stopped at 15%, while the margin went 0.575 -> 1.370 and 0.454 -> 1.184.
    """
    # 200 held-out pairs: the numbers above were measured on them (on all 500, SimPO went 0.892 -> 0.908)
    config = Config.from_flat(dict(algorithm=name, model=str(weaker_start), pairs_from="dataset", max_steps=150,
                                   eval_every=0, save_every=0, log_samples_every=0, eval_size=200,
                                   output=str(tmp_path / name), progress=False, report_to="none"))
    result = run(config)
    before, after = result["before"]["eval/pairwise_accuracy"], result["after"]["eval/pairwise_accuracy"]
    if name == "simpo":
        margins = result["before"]["eval/reward_margin"], result["after"]["eval/reward_margin"]
        assert margins[1] >= 1.5 * margins[0] and after >= before - 0.06, (margins, before, after)
    else:
        assert after >= before + 0.02, (before, after)


def test_gradient_checkpointing_changes_no_step(tiny_model_dir, pair_files):
    """The preference trainer's policy runs in eval mode (no dropout); its layers are still recomputed
    in the backward, and two DPO steps end at the same weights, bit for bit."""
    from posttrain.models.compute import is_checkpointed

    weights = []
    for checkpointing in (False, True):
        config = make_config(tiny_model_dir, pair_files, "dpo", gradient_checkpointing=checkpointing)
        s = PreferenceSession.create(config)
        assert is_checkpointed(s.policy) == checkpointing
        start = {k: v.clone() for k, v in s.policy.state_dict().items()}
        for _ in range(2):
            train_step(s)
            s.step += 1
        weights.append(s.policy.state_dict())
        assert any(not torch.equal(start[k], v) for k, v in weights[-1].items())  # the steps did train
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("algorithm", ["dpo", "kto"])
def test_offloaded_reference_changes_no_step(tiny_model_dir, pair_files, algorithm):
    """--offload-reference and --offload-optimizer: DPO's reference pass and KTO's reference point read
    the offloaded copy, AdamW its stored moments; two steps end at the same weights, bit for bit, as
    with both resident."""
    weights = []
    for offloaded in (False, True):
        s = PreferenceSession.create(make_config(tiny_model_dir, pair_files, algorithm, offload_reference=offloaded,
                                                 offload_optimizer=offloaded))
        for _ in range(2):
            train_step(s)
            s.step += 1
            assert all(p.numel() == 0 for p in s.ref.parameters()) == offloaded
            assert all(s.optimizer.state[p]["exp_avg"].numel() == 0 for p in s.policy.parameters()) == offloaded
        weights.append(s.policy.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_offloaded_reference_can_precompute(tiny_model_dir, pair_files):
    plain, offloaded = (PreferenceSession.create(make_config(tiny_model_dir, pair_files, "dpo", precompute_reference=True,
                                                             offload_reference=flag)) for flag in (False, True))
    assert plain.ref is None and offloaded.ref is None  # freed once everything is scored
    assert torch.equal(plain.ref_logps, offloaded.ref_logps) and torch.equal(plain.test_ref_logps,
                                                                             offloaded.test_ref_logps)


# --- pairs sampled from the policy (pairs_from policy) --------------------------------------------


def test_pairs_from_samples_pair_the_kth_correct_with_the_kth_incorrect_completion():
    from posttrain.data.preference import pairs_from_samples

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    texts = ["2", "3", "2 ", "5", "4", "4", "4", "4", "1", "2", "3", "6"]  # G = 4 per prompt, in order
    correct = [True, False, True, False, True, True, True, True, False, False, False, True]
    pairs = pairs_from_samples(rows, texts, correct, group_size=4)
    # prompt 1: two right, two wrong -> 2 pairs; prompt 2 always right -> none; prompt 3: one right -> 1
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [
        ("1+1=", "2", "3"), ("1+1=", "2 ", "5"), ("3+3=", "6", "1")]
    assert all(p["score_chosen"] == 1.0 and p["score_rejected"] == 0.0 and "answer" in p for p in pairs)


@pytest.fixture
def labelled_by_length(monkeypatch):
    """The built-in addition task, small, with an answer check that a random model passes about half the
    time: a completion is "correct" when its text has an even number of characters."""
    from posttrain.data import preference as preference_data
    from posttrain.data.tasks import addition_pairs

    def make(seed):
        task = addition_pairs.make_task(seed, n_train=64, n_test=4)
        source = dataclasses.replace(task.source, correct=lambda prompts, texts, **_: [len(t) % 2 == 0 for t in texts])
        return dataclasses.replace(task, source=source)

    monkeypatch.setitem(preference_data.PREFERENCE_TASKS, "addition", make)


def policy_config(model_dir, algorithm="dpo", **flat) -> Config:
    return Config.from_flat(dict(
        algorithm=algorithm, model=str(model_dir), task="addition", pairs_from="policy", resample_every=2,
        prompts_per_step=4, group_size=4, max_new_tokens=6, pairs_per_step=2, learning_rate=1e-3, max_steps=4,
        eval_size=4, progress=False, report_to="none", seed=0, **flat))


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_policy_pairs_are_the_policys_samples_labelled_by_the_task_and_resampled(name, tiny_model_dir,
                                                                                 labelled_by_length):
    s = PreferenceSession.create(policy_config(tiny_model_dir, name))
    assert s.train is None  # nothing to train on until the first round is sampled
    first = train_step(s)
    rows = s.pair_rows
    assert first["pairs/count"] == len(rows) > 0 and 0 < first["pairs/sample_accuracy"] < 1
    assert all(len(p["chosen"]) % 2 == 0 and len(p["rejected"]) % 2 == 1 for p in rows)  # labelled by the check
    assert len({p["prompt"] for p in rows}) <= 4 * 2  # prompts_per_step x resample_every prompts per round
    assert len(s.train) == (len(rows) if name == "dpo" else 2 * len(rows))  # KTO: the pairs unpaired
    s.step += 1
    assert "pairs/count" not in train_step(s) and s.pair_rows is rows  # within the round: the same pairs
    s.step += 1
    assert "pairs/count" in train_step(s) and s.pair_rows is not rows  # a new round from the current policy


def test_policy_pairs_resume_mid_round_as_if_never_stopped(tiny_model_dir, labelled_by_length, tmp_path):
    common = dict(save_every=1, eval_every=2, log_samples_every=0, rpo_alpha=1.0)
    whole = policy_config(tiny_model_dir, output=str(tmp_path / "whole"), **common)
    run_training(PreferenceSession.create(whole), whole, train_step, evaluate)
    first = policy_config(tiny_model_dir, output=str(tmp_path / "split"), **common)
    run_interrupted(PreferenceSession.create(first), first, train_step, evaluate, after=3)  # mid-round 2
    second = resumed(first, tmp_path / "split")
    run_training(PreferenceSession.create(second), second, train_step, evaluate)
    assert_runs_identical(tmp_path / "whole", tmp_path / "split")


def test_policy_pairs_need_a_task_with_an_answer_check(tiny_model_dir, pair_files):
    with pytest.raises(ConfigError, match="pairs_from"):
        PreferenceSession.create(make_config(tiny_model_dir, pair_files, pairs_from="policy"))
    with pytest.raises(ConfigError, match="precompute_reference"):
        Config.from_flat(dict(algorithm="dpo", task="addition", pairs_from="policy", precompute_reference=True))


def test_policy_pairs_never_right_or_never_wrong_is_a_loud_error(tiny_model_dir, monkeypatch):
    from posttrain.data import preference as preference_data
    from posttrain.training.guards import NoLearningSignal
    from posttrain.data.tasks import addition_pairs

    monkeypatch.setitem(preference_data.PREFERENCE_TASKS, "addition",
                        lambda seed: addition_pairs.make_task(seed, n_train=64, n_test=4))
    s = PreferenceSession.create(policy_config(tiny_model_dir))  # a random model never adds
    with pytest.raises(NoLearningSignal, match="sample accuracy 0.000"):
        train_step(s)


# --- the built-in task's default: pairs of the policy's own samples, with RPO's NLL -----------------


def default_config(model_dir, algorithm="dpo", **flat) -> Config:
    """A built-in task run with no pairs_from and no rpo_alpha given: what `posttrain train --algorithm NAME`
    builds (small)."""
    return Config.from_flat(dict(
        algorithm=algorithm, model=str(model_dir), task="addition", resample_every=2, prompts_per_step=4,
        group_size=4, max_new_tokens=6, pairs_per_step=2, max_steps=2, eval_size=4, progress=False,
        report_to="none", seed=0, **flat))


@pytest.mark.parametrize("name, rpo_alpha", [("dpo", 1.0), ("odpo", 1.0), ("simpo", 1.0), ("kto", 1.0),
                                             ("orpo", None)])
def test_a_built_in_task_trains_by_default_on_the_policys_pairs_with_rpos_nll(name, rpo_alpha, tiny_model_dir,
                                                                             labelled_by_length, capsys):
    s = PreferenceSession.create(default_config(tiny_model_dir, name))
    assert s.train is None and s.prompt_sampler is not None  # pairs come from the policy's first round
    assert s.preset.rpo_alpha == rpo_alpha  # ORPO's loss has its NLL already
    said = capsys.readouterr().err + capsys.readouterr().out
    assert "pairs sampled from the policy" in said
    assert ("per-token NLL (RPO; --rpo-alpha 0 for the paper's loss alone)" in said) == (rpo_alpha is not None)
    assert "pairs/count" in train_step(s)


def test_the_default_keeps_a_users_rpo_alpha_and_a_users_pairs(tiny_model_dir, pair_files, labelled_by_length):
    assert PreferenceSession.create(default_config(tiny_model_dir, rpo_alpha=0)).preset.rpo_alpha == 0
    assert PreferenceSession.create(default_config(tiny_model_dir, rpo_alpha=0.5)).preset.rpo_alpha == 0.5
    given = PreferenceSession.create(make_config(tiny_model_dir, pair_files))  # --dataset: auto is dataset
    assert given.prompt_sampler is None and len(given.train) == 32 and given.preset.rpo_alpha is None
    fixed = PreferenceSession.create(default_config(tiny_model_dir, pairs_from="dataset"))  # the synthetic pairs
    assert fixed.prompt_sampler is None and len(fixed.train) == 64 and fixed.preset.rpo_alpha is None
    with pytest.raises(ConfigError, match="precompute_reference: pairs sampled from the policy"):
        PreferenceSession.create(default_config(tiny_model_dir, precompute_reference=True))


def test_posttrain_algorithms_says_what_the_built_in_default_adds():
    from posttrain.algorithms.tables import format_side_by_side

    dpo, orpo = format_side_by_side(["dpo"]), format_side_by_side(["orpo"])
    assert "pairs sampled from the policy" in dpo and "adds 1.0 x the chosen completions' per-token NLL" in dpo
    assert "pairs sampled from the policy" in orpo and "NLL (RPO)" not in orpo
