"""Every decoder family users post-train, as a tiny random model (posttrain.models.families), against the model's
own forward over each sequence alone: the log-probs and gradients of the training passes (packed rows, shared
prompts, token budgets, LoRA, gradient checkpointing, bf16 autocast at its tolerance), the sampler's log-probs,
and a two-step GRPO run and a two-step DPO run. Prompts and completions are longer than every sliding window
(posttrain.models.families.WINDOW), so each windowed layer drops keys."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.architecture import cache_unsupported_reason, head_unsupported_reason, packing_unsupported_reason
from posttrain.models.families import FAMILIES, MORE_FAMILIES, UNBATCHABLE_FAMILIES, WINDOW, tiny_model
from posttrain.models.logprobs import PATH_TOLERANCE, completion_logprobs, own_logprobs

FAMILY_NAMES = list(FAMILIES)
STATEFUL = {"qwen3_next", "qwen3_5_text", "lfm2", "granitemoehybrid"}
"""The families with layers other than attention (linear attention, convolutions, Mamba): not packed."""
MIXTURES = {"qwen3_moe", "qwen3_next", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "granitemoehybrid"}
MODIFIED_HEADS = {"gemma2", "gemma3_text", "granitemoehybrid"}
"""The families whose tiny configs soft-cap or scale their logits after the LM head: no folded head."""


def sequences(vocab_size: int = 64, seed: int = 0):
    """Two prompts of 14 and 9 tokens, each with completions of 11, 5, 8 and 1 tokens: every one longer than
    the window but the last, a one-token completion (an empty piece of a packed row)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator) for n in (14, 9)]
    completions = [torch.randint(3, vocab_size, (n,), generator=generator) for n in (11, 5, 8, 1) * 2]
    assert min(len(p) for p in prompts) > WINDOW and max(len(c) for c in completions) > WINDOW
    return [p for p in prompts for _ in range(4)], completions


def own(model, prompts, completions, temperature=1.0):
    return [own_logprobs(model, p, c, temperature) for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_families_paths_are_the_declared_ones(family):
    """Which fast paths each family takes: packed passes for every family whose layers are all attention, the
    folded head where the logits are the head's output, the decode loop's cache for full attention only."""
    from posttrain.models.compute import use_packed_attention

    model = tiny_model(family)
    assert (packing_unsupported_reason(model) is None) == (family not in STATEFUL)
    assert use_packed_attention(model) == (family not in STATEFUL)
    assert (head_unsupported_reason(model) is None) == (family not in MODIFIED_HEADS)
    full_attention = family not in STATEFUL and family not in {"qwen2", "mistral", "mixtral", "phi3", "gemma2",
                                                                "gemma3_text", "gpt_oss"}
    assert (cache_unsupported_reason(model) is None) == full_attention


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_completion_logprobs_equal_the_models_own_forward(family):
    """posttrain.completion_logprobs (the training passes' code) against the model's own forward over each
    prompt + completion alone, to 1e-4 in float32: prompts shared and not, micro-batches by rows and by a token
    budget that splits the groups, and a sampling temperature."""
    model = tiny_model(family)
    prompts, completions = sequences()
    expected = own(model, prompts, completions)
    for settings in (dict(), dict(share_prompts=False), dict(max_tokens_per_micro_batch=40), dict(micro_batch_size=3)):
        got = completion_logprobs(model, [p.tolist() for p in prompts], [c.tolist() for c in completions], **settings)
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4, msg=lambda m: f"{settings}: {m}")
    hot = completion_logprobs(model, [p.tolist() for p in prompts], [c.tolist() for c in completions], temperature=0.7)
    for mine, theirs in zip(hot, own(model, prompts, completions, 0.7), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)


def _lora(model):
    from posttrain.config import ModelConfig
    from posttrain.models.lora import apply_lora

    wrapped = apply_lora(model, ModelConfig(lora_r=2))
    with torch.no_grad():  # B starts at zero: give it values, so every adapter's gradient is exercised
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return wrapped


@pytest.mark.parametrize("variant", ["full", "lora", "checkpointed"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_training_pass_gradients_equal_the_models_own(family, variant, monkeypatch):
    """The training step's forward (modeling.forward on a collated micro-batch: packed and prompts shared where
    the family allows) and its backward, against the model's own forward over each sequence alone: log-probs and
    every trainable parameter's gradient, in full fine-tuning, under LoRA and with gradient checkpointing."""
    from posttrain.models import modeling
    from posttrain.models.modeling import collate
    from posttrain.models.compute import checkpoint_layers, use_packed_attention

    model = tiny_model(family).train()
    if variant == "lora":
        pytest.importorskip("peft")
        model = _lora(model)
    use_packed_attention(model)
    if variant == "checkpointed":
        checkpoint_layers(model)
    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)  # these prompts are too short to pay
    prompts, completions = sequences()
    width = max(len(c) for c in completions)
    ids = torch.zeros(len(completions), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, c in enumerate(completions):
        ids[row, :len(c)], mask[row, :len(c)] = c, 1
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]

    def gradients(loss):
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    batch = collate(prompts, ids, mask, 0, torch.device("cpu"))
    assert batch.owner_n is not None  # rows share their prompts
    out = modeling.forward(model, batch)
    mine = gradients((out.logprobs * weights * mask).sum())
    theirs_logprobs = []
    for row, (p, c) in enumerate(zip(prompts, completions)):
        logits = model(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0, len(p) - 1:-1]
        theirs_logprobs.append(logits.log_softmax(-1).gather(-1, c[:, None])[:, 0])
    theirs = gradients(sum((lp * weights[row, :len(lp)]).sum() for row, lp in enumerate(theirs_logprobs)))
    for row, lp in enumerate(theirs_logprobs):
        torch.testing.assert_close(out.logprobs[row, :len(lp)].detach(), lp.detach(), rtol=0, atol=1e-4)
    assert any(g.abs().sum() > 0 for g in theirs)
    for (name, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(b.abs().max())), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_autocast_passes_are_the_models_own_within_bf16_rounding(family):
    """Under bf16 mixed precision (the decoder stack in autocast, the head in float32), the training passes
    against the model's own forward under the same autocast: the mean gap per token within the run's bf16
    tolerance, and far below the gap of a wrong attention (the Mistral window bug was 0.11 nats)."""
    from posttrain.models.compute import use_mixed_precision

    model = tiny_model(family)
    use_mixed_precision(model)
    prompts, completions = sequences()
    got = completion_logprobs(model, [p.tolist() for p in prompts], [c.tolist() for c in completions])
    gap = torch.cat([(a - b).abs() for a, b in zip(got, own(model, prompts, completions))]).mean()
    assert gap <= PATH_TOLERANCE[torch.bfloat16] / 5


def _char_tokenizer(vocab_size: int):
    from posttrain.models.tiny import SPECIAL_TOKENS, char_tokenizer

    alphabet = "".join(chr(c) for c in range(ord("!"), ord("~") + 1))[:vocab_size - len(SPECIAL_TOKENS)]
    return char_tokenizer(alphabet)


@pytest.mark.parametrize("family", [*FAMILY_NAMES, *MORE_FAMILIES])
def test_the_samplers_logprobs_are_the_models_own(family):
    """The default sampler (posttrain's decode loop, or transformers' generate for a cache it cannot hold) gives,
    with each sampled token, its log-prob under the distribution drawn from; at temperature 1 and no filter,
    the model's own forward over the prompt and sampled completion alone. OpenAI GPT's forward takes no cache
    (one passed to it was ignored: the decode loop saw only the new token), so it samples through generate;
    MiniMax's generate is not its own forward over a left-padded prompt, so its prompts go one length at a time."""
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import FastGenerator, make_generator

    model = tiny_model(family)
    tokenizer = _char_tokenizer(64)
    generator = make_generator("hf", model, tokenizer, SamplingParams(12, 1.0, 1.0, 0), [2])
    assert isinstance(generator, FastGenerator)
    prompts, _ = sequences()
    torch.manual_seed(0)
    completions = generator.generate(prompts[::4], num_samples=3)
    assert (generator.fallback_reason == "") == (cache_unsupported_reason(model) is None)
    assert completions.sampling_logprobs is not None
    # Zamba2's cached step runs its Mamba2 recurrence token by token where its forward runs the chunked scan: 1.5e-3
    # apart in float32 with or without padding, far below a sampler that is another model (MiniMax padded: 2.6)
    tolerance = 2e-3 if family == "zamba2" else 1e-4
    for row in range(len(completions.completion_ids)):
        n = int(completions.mask[row].sum())
        expected = own_logprobs(model, prompts[::4][row // 3], completions.completion_ids[row, :n])
        torch.testing.assert_close(completions.sampling_logprobs[row, :n], expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_two_grpo_steps_and_two_dpo_steps_run(family, tmp_path, capsys):
    """A two-step GRPO run and a two-step DPO run from posttrain.train, each with the family's tiny model: each
    trains (two logged steps, weights changed), checks its passes at the start, and says in one line each why
    it declines a fast path."""
    import posttrain
    from posttrain.models.tiny import char_tokenizer
    from posttrain.tracking.metrics import read_metrics

    tokenizer = char_tokenizer("0123456789+=,|")
    quick = dict(max_steps=2, report_to="none", progress=False, eval_every=0, save_every=0, eval_size=2,
                 learning_rate=1e-2)
    prompts = [{"prompt": f"{a}+{b}="} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]

    def length(prompts, completions, **columns):  # varies between samples of a random model: a gradient every step
        return [len(c) / 10 for c in completions]

    model = tiny_model(family, vocab_size=len(tokenizer))
    start = [p.detach().clone() for p in model.parameters()]
    result = posttrain.train(model=model, tokenizer=tokenizer, algorithm="grpo", train_dataset=prompts,
                             reward_funcs=[length], prompts_per_step=2, group_size=4, max_new_tokens=10,
                             output=str(tmp_path / "grpo"), **quick)
    steps = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert all(("moe/expert_load_max" in row) == (family in MIXTURES) for row in steps)  # expert load logged
    said = capsys.readouterr().err
    assert "training passes checked against" in said
    assert ("packed passes: off for" in said) == (family in STATEFUL)
    assert ("folded LM head: off for" in said) == (family in MODIFIED_HEADS)
    pairs = [{"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{a + b + 1}"} for a, b in [(1, 2), (3, 4), (5, 6)]]
    model = tiny_model(family, vocab_size=len(tokenizer))
    start = [p.detach().clone() for p in model.parameters()]
    result = posttrain.train(model=model, tokenizer=tokenizer, algorithm="dpo", train_dataset=pairs, pairs_per_step=2,
                             output=str(tmp_path / "dpo"), **quick)
    assert [row["step"] for row in read_metrics(result["run_dir"]) if "loss" in row] == [1, 2]
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))


@pytest.mark.parametrize("kind, message", [
    ("t5", "is an encoder-decoder model \\(T5ForConditionalGeneration\\); posttrain trains decoder-only causal LMs"),
    ("bert", "is an encoder \\(BertForMaskedLM\\), which attends to later tokens too"),
    ("remote", "is built by its own code \\(modeling_mine.MyForCausalLM, in the model directory\\).*--trust-remote-code"),
])
def test_a_model_posttrain_cannot_train_is_refused_naming_its_architecture(kind, message, tmp_path):
    """An encoder-decoder, an encoder (transformers would load BERT through a causal LM head and run it both
    ways) and a model that needs its own code without --trust-remote-code are each one ConfigError that says
    what the model is and what to do, before any weight is read."""
    import json

    from transformers import AutoConfig

    from posttrain.config import ConfigError
    from posttrain.models.loading import load_model_and_tokenizer

    if kind == "remote":
        config = {"model_type": "my_model", "architectures": ["MyForCausalLM"],
                  "auto_map": {"AutoConfig": "configuration_mine.MyConfig",
                               "AutoModelForCausalLM": "modeling_mine.MyForCausalLM"}}
        (tmp_path / "config.json").write_text(json.dumps(config))
    else:
        config = AutoConfig.for_model(kind, vocab_size=32, d_model=16, hidden_size=16, num_layers=1,
                                      num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
        config.architectures = ["T5ForConditionalGeneration" if kind == "t5" else "BertForMaskedLM"]
        config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        load_model_and_tokenizer(str(tmp_path), device="cpu")


def test_a_bidirectional_model_is_refused_by_the_runs_causality_check():
    """A model whose predictions for a position change when a later token does is refused before training,
    whatever its class says: BERT through transformers' causal LM head (BertLMHeadModel without is_decoder),
    the model a user gets by loading an encoder as a causal LM."""
    from transformers import BertConfig, BertLMHeadModel

    from posttrain.config import ConfigError
    from posttrain.models.logprobs import check_causal

    torch.manual_seed(0)
    encoder = BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=16, is_decoder=False, initializer_range=0.3)).eval()
    with pytest.raises(ConfigError, match="BertLMHeadModel \\(bert\\) is not causal"):
        check_causal(encoder, 64)
    check_causal(tiny_model("llama"), 64)  # a causal model passes


def test_a_training_path_that_is_not_the_models_own_stops_the_run_naming_it(monkeypatch):
    """The run's probe: a packed attention that ignored the sliding window (the bug a tiny Mistral showed)
    stops the run with the family, the paths it took and the flags that avoid them."""
    from posttrain.models import packing
    from posttrain.models.logprobs import TrainingPathError, check_training_path
    from posttrain.models.compute import use_packed_attention

    model = tiny_model("mistral")
    use_packed_attention(model)
    assert check_training_path(model, 64) < 1e-5
    wrong = packing._packed_attention
    monkeypatch.setattr(packing, "_packed_attention", lambda q, k, v, layout, scaling, window=None, dropout=0.0:
                        wrong(q, k, v, layout, scaling, None, dropout))
    with pytest.raises(TrainingPathError, match="MistralForCausalLM \\(mistral\\) \\(packed rows, a prompt shared by "
                       "its completions, the folded LM head\\).*--no-trim-padding --no-share-prompts"):
        check_training_path(model, 64)


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_more_families_train_on_their_own_forward_or_decline(family, monkeypatch):
    """Families beyond the named ones, each as its tiny model: completion_logprobs (the training passes' code)
    equals the model's own forward to 1e-4, the run's probe passes, and the training pass's gradients are the
    model's own. A family whose packed pass is not exact (Nemotron: its layers do not hand the layout to their
    attention; Doge: its attention adds a bias learned from the values, which the packed one leaves out) is not
    packed, by the measured check, and says why."""
    from posttrain.models import modeling
    from posttrain.models.modeling import collate, forward
    from posttrain.models.compute import use_packed_attention
    from posttrain.models.logprobs import check_training_path

    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)  # a prompt shared by its completions
    model = tiny_model(family)  # eval mode: some configs (Seed-OSS) default to dropout, which no two passes share
    packed = use_packed_attention(model)
    assert packed == (packing_unsupported_reason(model) is None)
    if family in ("nemotron", "doge"):
        assert not packed and "its layers may not hand the layout to their attention" in packing_unsupported_reason(model)
    prompts, completions = sequences()
    got = completion_logprobs(model, [p.tolist() for p in prompts], [c.tolist() for c in completions])
    for mine, theirs in zip(got, own(model, prompts, completions), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)
    assert check_training_path(model, 64) < 1e-5
    width = max(len(c) for c in completions)
    ids = torch.zeros(len(completions), width, dtype=torch.long)
    for row, c in enumerate(completions):
        ids[row, :len(c)] = c
    mask = (torch.arange(width)[None] < torch.tensor([len(c) for c in completions])[:, None]).long()
    params = [p for p in model.parameters() if p.requires_grad]
    out = forward(model, collate(prompts, ids, mask, 0, torch.device("cpu")))
    mine = torch.autograd.grad(out.logprobs.sum(), params, allow_unused=True)
    theirs = torch.autograd.grad(sum(model(input_ids=torch.cat([p, c])[None], use_cache=False).logits[0, len(p) - 1:-1]
                                     .log_softmax(-1).gather(-1, c[:, None]).sum() for p, c in zip(prompts, completions)),
                                 params, allow_unused=True)
    for a, b in zip(mine, theirs, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(b.abs().max())))


def test_gradient_gap_by_hand():
    """Each parameter's largest difference relative to its own largest gradient (the model's own forward's), or to
    a hundredth of the largest anywhere where its own are smaller; a parameter only the model's own forward
    reaches counts 1."""
    from posttrain.models.compute import gradient_gap

    mine = [torch.tensor([1.0, 2.0]), None, torch.tensor([0.001])]
    theirs = [torch.tensor([1.0, 2.5]), torch.tensor([-4.0]), torch.tensor([0.0])]
    assert gradient_gap(mine, theirs) == pytest.approx(1.0)  # the second: |0 - (-4)| / 4
    # without it the largest is 2.5: the first 0.5 / 2.5 = 0.2, the third 0.001 / (2.5 / 100) = 0.04
    assert gradient_gap(mine[::2], theirs[::2]) == pytest.approx(0.2)
    assert gradient_gap([torch.tensor([0.03]), None], [torch.tensor([0.0]), torch.tensor([2.0])]) == \
        pytest.approx(1.5)  # the first: 0.03 / (2 / 100), over the second's 1 (reached only by the own forward)
    assert gradient_gap([torch.tensor([0.03])], [torch.tensor([0.01])]) == pytest.approx(2.0)  # 0.02 / 0.01


def test_the_runs_probe_checks_gradients_too(monkeypatch):
    """Doge's attention adds a bias learned from the values, which the packed attention leaves out: at
    initialisation it changes no log-prob, only gradients. Its packing is declined by the measured check; forced,
    the run's probe stops the run on the gradients alone and names the padded rows, which are exact."""
    from posttrain.models import compute
    from posttrain.models.compute import use_packed_attention
    from posttrain.models.logprobs import TrainingPathError, check_training_path

    model = tiny_model("doge")
    assert not use_packed_attention(model) and "or their gradients" in packing_unsupported_reason(model)
    assert check_training_path(model, 64) < 1e-5
    forced = tiny_model("doge")
    monkeypatch.setattr(compute, "packed_pass_gap", lambda model: 0.0)
    assert use_packed_attention(forced)
    with pytest.raises(TrainingPathError, match="DogeForCausalLM \\(doge\\) \\(packed rows.*\\) give the same log-probs, "
                       "but gradients 1 apart.*--no-trim-padding --no-share-prompts"):
        check_training_path(forced, 64)


@pytest.mark.parametrize("family", list(UNBATCHABLE_FAMILIES))
def test_a_family_whose_padded_rows_are_not_its_own_is_refused_naming_why(family, tmp_path):
    """RWKV ignores the attention mask (a padded row's log-probs move); RecurrentGemma's padded rows give its
    log-probs but not their gradients. The run's probe finds each (in float32) and says that even padded rows
    fail; a run refuses both by name before its probe, in any dtype."""
    import posttrain
    from posttrain.config import ConfigError
    from posttrain.models.logprobs import TrainingPathError, check_training_path
    from posttrain.models.tiny import char_tokenizer

    model = tiny_model(family)
    said = "log-probs" if family == "rwkv" else "the same log-probs, but gradients"
    with pytest.raises(TrainingPathError, match=f"give {said}.*padded rows give .*Even its padded rows are not"):
        check_training_path(model, 64)
    tokenizer = char_tokenizer("0123456789+=")
    with pytest.raises(ConfigError, match=f"posttrain cannot train {type(model).__name__} \\({family}\\) exactly: "):
        posttrain.train(model=tiny_model(family, vocab_size=len(tokenizer)), tokenizer=tokenizer, algorithm="grpo",
                        train_dataset=[{"prompt": "1+2="}], reward_funcs=[lambda prompts, completions, **c: [0.0]],
                        prompts_per_step=1, group_size=2, max_new_tokens=4, max_steps=1, report_to="none",
                        output=str(tmp_path / "run"))


def test_gpt2_trains_with_its_dropout_and_lora_on_its_conv1d_projections(tmp_path):
    """GPT-2's config keeps dropout (0.1) on, which the online trainer runs: the causality check sets it aside
    (with it on, the logits moved by chance and the run was refused as not causal). Its projections are
    transformers' Conv1D, which the default LoRA targets include: a two-step GRPO run with --lora-r trains only
    adapters on c_attn, c_proj and c_fc."""
    import posttrain
    from posttrain.models.logprobs import check_causal
    from posttrain.models.lora import default_target_modules
    from posttrain.models.tiny import char_tokenizer
    from posttrain.tracking.metrics import read_metrics

    tokenizer = char_tokenizer("0123456789+=,|")
    model = tiny_model("gpt2", vocab_size=len(tokenizer))
    assert model.config.resid_pdrop == 0.1 and default_target_modules(model) == ["c_attn", "c_fc", "c_proj"]
    check_causal(model.train(), len(tokenizer))
    assert model.training  # as it was
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = posttrain.train(model=model, tokenizer=tokenizer, algorithm="grpo", lora_r=4, learning_rate=1e-2,
                             train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)],
                             reward_funcs=[lambda prompts, completions, **c: [len(x) / 10 for x in completions]],
                             prompts_per_step=2, group_size=4, max_new_tokens=10, max_steps=2, report_to="none",
                             progress=False, eval_every=0, save_every=0, eval_size=2, output=str(tmp_path / "run"))
    assert [row["step"] for row in read_metrics(result["run_dir"]) if "loss" in row] == [1, 2]
    weights = {name.replace(".base_layer", ""): p for name, p in model.named_parameters() if "lora_" not in name}
    assert weights.keys() == start.keys()  # peft's adapters sit inside the model; its own weights stay as they were
    assert all(torch.equal(p, start[name]) for name, p in weights.items())
    trained = [name for name, p in model.named_parameters() if "lora_B" in name and p.abs().max() > 0]
    assert {name.split(".")[-4] for name in trained} == {"c_attn", "c_fc", "c_proj"}
