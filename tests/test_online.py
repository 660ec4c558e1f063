"""The online loop on a tiny random model: every preset's update is the functional loss,
the pieces a preset asks for behave as specified, micro-batching and resuming change nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.algorithms.presets import ALGORITHMS, OnlineAlgorithm
from posttrain.config import Config, ConfigError
from posttrain.models.modeling import collate, forward
from posttrain.models.packing import has_packed_attention
from posttrain.training import online
from posttrain.training.online import has_signal, mini_batch_rows, train_step
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession, evaluate
from conftest import assert_online_resume_is_exact, assert_runs_identical, resumed, run_interrupted

ONLINE = [name for name, preset in ALGORITHMS.items() if isinstance(preset, OnlineAlgorithm)]


def make_config(model_dir, reward_file, algorithm="grpo", reward="sevens", **flat) -> Config:
    """reward: one function of conftest's REWARDS, or None for two (sevens, starts_even)."""
    names = [reward] if reward else ["sevens", "starts_even"]
    base = dict(
        algorithm=algorithm, model=str(model_dir), task="addition", reward=[f"{reward_file}:{n}" for n in names],
        prompts_per_step=4, group_size=4, max_new_tokens=12, eval_size=8, micro_batch_size=64,
        learning_rate=1e-3, max_steps=2, progress=False, report_to="none", seed=0,
    )
    base.update(flat)
    return Config.from_flat(base)


def recompute_loss(s: OnlineSession, policy, value_head) -> torch.Tensor:
    """The step's loss from the logged batch, by the functional API, with the pre-update weights, through one
    padded pass (no packing, no shared prompt): the training step's packed passes must give its loss."""
    g, alg = s.last_groups, s.alg
    comp = g.completions
    batch = collate(g.prompt_ids, comp.completion_ids, comp.mask, s.pad_id, s.device, share_prompts=False,
                    trim_padding=False)
    with torch.no_grad():
        out = forward(policy, batch, value_head=value_head)
    t = out.logprobs.shape[1]
    ref = online.reference_logprobs(s, g) if s.ref is not None else None
    baseline = online.greedy_rewards(s, g.indices) if alg.needs_greedy_baseline else None
    terms = {}
    if alg.takes_reward_terms:  # GDPO: each reward function's values
        terms = {"reward_terms": torch.stack(list(g.terms.values()), -1).view(*g.rewards.shape, -1),
                 "reward_weights": torch.tensor(s.work.reward_weights, dtype=torch.float64)}
    adv, returns = alg.advantages_and_returns(g.rewards, mask=comp.mask, logprobs=g.old_logprobs,
                                              ref_logprobs=ref, values=g.old_values, baseline=baseline, **terms)
    old = g.old_logprobs[:, :t] if g.old_logprobs is not None else out.logprobs
    loss, _ = alg.policy_loss(out.logprobs, old, adv[:, :t], batch.mask,
                              ref_logprobs=ref[:, :t] if alg.kl_placement == "loss" else None,
                              max_tokens=s.max_new_tokens)
    if value_head is not None:
        value_loss, _ = alg.value_loss(out.values, g.old_values[:, :t], returns[:, :t], batch.mask)
        loss = loss + s.config.optim.value_loss_coef * value_loss
    return loss


@pytest.mark.parametrize("name", [n for n in ONLINE if not ALGORITHMS[n].needs_teacher])  # distillation's: test_distillation
def test_each_online_preset_trains_on_exactly_the_functional_loss(name, tiny_model_dir, reward_file):
    overrides = {"num_epochs": 1, "mini_batches": 1}  # one update: the loss is the pre-update weights'
    if ALGORITHMS[name].binary_reward is not None:
        overrides["binary_reward"] = None  # the random model is never right: train on the dense reward
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, name, micro_batch_size=5, **overrides))
    assert has_packed_attention(s.policy)  # the step's passes are packed; recompute_loss's are padded
    policy, head = copy.deepcopy(s.policy), copy.deepcopy(s.value_head)
    metrics = train_step(s)
    expected = recompute_loss(s, policy, head)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert metrics["skipped_steps"] == 0
    changed = any(not torch.equal(a, b) for a, b in zip(policy.parameters(), s.policy.parameters()))
    assert changed == (metrics["grad_norm"] > 0)


def test_reference_model_is_never_updated(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo"))
    ref_before = copy.deepcopy(s.ref.state_dict())
    policy_before = copy.deepcopy(s.policy.state_dict())
    for _ in range(2):
        metrics = train_step(s)
        s.step += 1
    assert all(torch.equal(ref_before[k], v) for k, v in s.ref.state_dict().items())
    assert any(not torch.equal(policy_before[k], v) for k, v in s.policy.state_dict().items())
    assert metrics["kl"] > 0  # the policy moved away from the frozen reference


def test_reference_refresh_copies_the_policy(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", ref_refresh_every=2))
    for _ in range(2):
        train_step(s)
        s.step += 1
    assert all(torch.equal(s.ref.state_dict()[k], v) for k, v in s.policy.state_dict().items())


def test_ppo_value_loss_falls(tiny_model_dir, reward_file):
    # A constant reward of 1: the value head (initialised to 0) must learn to predict ~1.
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "ppo", reward="ones", learning_rate=1e-2))
    losses = []
    for _ in range(5):
        losses.append(train_step(s)["value_loss"])
        s.step += 1
    assert losses[0] > 0.1
    assert losses[-1] < 0.5 * losses[0]


def test_dapo_trains_only_groups_with_reward_variance(tiny_model_dir, reward_file):
    config = make_config(tiny_model_dir, reward_file, "dapo", reward="starts_even", binary_reward=None,
                         overlong_buffer_ratio=None, max_generation_rounds=4, mini_batches=1)
    s = OnlineSession.create(config)
    zero_variance = []
    for _ in range(3):
        metrics = train_step(s)
        s.step += 1
        assert has_signal(s.last_groups.rewards).all()
        assert metrics["groups_trained"] == len(s.last_groups.indices) <= 4
        zero_variance.append(metrics["zero_variance_groups"])
    assert max(zero_variance) > 0  # the filter had something to drop


def test_dapo_overlong_penalty_enters_the_reward(tiny_model_dir, reward_file):
    # Budget 12, buffer 0.5 * 12 = 6: a length-12 completion gets (6 - 12) / 6 = -1, length 8 gets -1/3.
    config = make_config(tiny_model_dir, reward_file, "dapo", reward="sevens", binary_reward=None,
                         overlong_buffer_ratio=0.5, dynamic_sampling=False)
    s = OnlineSession.create(config)
    train_step(s)
    g = s.last_groups
    lengths = g.completions.lengths.float()
    penalty = torch.where(lengths <= 6, torch.zeros_like(lengths), (6 - lengths) / 6)
    assert torch.allclose(g.rewards.view(-1), g.terms["sevens"] + penalty, atol=1e-6)


def test_group_length_penalty_enters_the_reward_of_any_preset():
    # The built-in model is right on some one-digit sums and wrong on others: both of Kimi k1.5's cases occur.
    config = Config.from_flat(dict(algorithm="grpo", model="tiny-addition", task="addition", prompts_per_step=8,
                                   group_size=4, max_steps=1, eval_size=0, progress=False, report_to="none",
                                   group_length_penalty=0.5))
    s = OnlineSession.create(config)
    metrics = train_step(s)
    g = s.last_groups
    lengths, correct = g.completions.lengths.float().view(-1, 4), g.correct.view(-1, 4)
    assert correct.any() and not correct.all()
    shortest, longest = lengths.min(1, keepdim=True).values, lengths.max(1, keepdim=True).values
    # lambda = 0.5 - (len - shortest) / (longest - shortest), 0 in a group of equal lengths
    lam = torch.where(longest > shortest, 0.5 - (lengths - shortest) / (longest - shortest).clamp(min=1), 0.0)
    penalty = torch.where(correct, lam, lam.clamp(max=0.0))  # min(0, lambda) for a wrong answer
    assert torch.allclose(g.rewards, g.terms["accuracy"].view(-1, 4) + 0.5 * penalty, atol=1e-6)
    assert metrics["reward/group_length_penalty"] == pytest.approx(penalty.mean().item(), abs=1e-6)


def test_group_length_penalty_waits_its_warm_up_steps():
    # Kimi k1.5's warm-up: after=2 trains steps 1 and 2 on the task's reward alone, then adds the penalty.
    config = Config.from_flat(dict(algorithm="grpo", model="tiny-addition", task="addition", prompts_per_step=8,
                                   group_size=4, max_steps=3, eval_size=0, progress=False, report_to="none",
                                   group_length_penalty=1.0, group_length_penalty_after=2))
    s = OnlineSession.create(config)
    shaped = []
    for _ in range(3):
        metrics = train_step(s)
        s.step += 1
        g = s.last_groups
        shaped.append(not torch.equal(g.rewards.view(-1), g.terms["accuracy"].view(-1)))
        assert ("reward/group_length_penalty" in metrics) == shaped[-1]
    assert shaped == [False, False, True]
    with pytest.raises(ConfigError, match="group_length_penalty_after: got -1; use a number of steps >= 0"):
        Config.from_flat(dict(group_length_penalty=1.0, group_length_penalty_after=-1))


def test_group_length_penalty_needs_a_task_that_checks_answers(tiny_model_dir, reward_file, tmp_path):
    from posttrain.config import ConfigError

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    config = make_config(tiny_model_dir, reward_file, task=None, dataset=str(data), prompts_per_step=2,
                         group_length_penalty=1.0)
    with pytest.raises(ConfigError, match=r"group_length_penalty: .* --reward 'length_penalty\(max_chars=N\)'"):
        OnlineSession.create(config)
    with pytest.raises(ConfigError, match="group_length_penalty: got -1.0; use a weight > 0"):
        make_config(tiny_model_dir, reward_file, group_length_penalty=-1.0)


def test_overlong_filter_takes_truncated_completions_out_of_the_loss(tiny_model_dir, reward_file):
    # A budget of 4 tokens: a random model rarely ends that early, so most completions are truncated.
    config = make_config(tiny_model_dir, reward_file, "dapo", binary_reward=None, dynamic_sampling=False,
                         overlong_filter=True, max_new_tokens=4, mini_batches=1)  # one update: pre-update loss
    s = OnlineSession.create(config)
    policy = copy.deepcopy(s.policy)
    metrics = train_step(s)
    g = s.last_groups
    truncated = g.completions.truncated
    assert truncated.any() and not truncated.all()  # some to drop, some to keep
    assert torch.all(g.completions.mask[truncated] == 0)
    # The step's loss is the policy loss of the completions that ended, alone (token mean over their
    # tokens), with the advantages of their groups, which count the truncated completions' rewards.
    kept = (~truncated).nonzero().squeeze(1)
    comp = g.completions
    batch = collate([g.prompt_ids[int(i)] for i in kept], comp.completion_ids[kept], comp.mask[kept], s.pad_id,
                    s.device)
    assert batch.mask.sum() > 0
    with torch.no_grad():
        logprobs = forward(policy, batch).logprobs
    advantages = s.alg.advantages(g.rewards, mask=torch.ones_like(comp.mask))[kept, :logprobs.shape[1]]
    expected, _ = s.alg.policy_loss(logprobs, logprobs, advantages, batch.mask, max_tokens=s.max_new_tokens)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)


def test_remax_decodes_greedily_once_per_prompt(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "remax"))
    generate, greedy_calls = s.generator.generate, []

    def recording(prompt_ids, *, num_samples, greedy=False, rows=None):
        if greedy:
            greedy_calls.append((len(prompt_ids), num_samples))
        return generate(prompt_ids, num_samples=num_samples, greedy=greedy, rows=rows)

    s.generator.generate = recording
    for _ in range(2):
        train_step(s)
        s.step += 1
    assert greedy_calls == [(4, 1), (4, 1)]  # each step: its 4 prompts, one greedy completion each


def test_best_of_n_trains_on_the_best_sample_of_each_group(tiny_model_dir, reward_file, monkeypatch):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "best_of_n", seed=3))
    sampled = []
    select = online.best_of_n
    monkeypatch.setattr(online, "best_of_n", lambda s, groups: sampled.append(groups) or select(s, groups))
    torch.manual_seed(3)
    metrics = train_step(s)
    g, rewards = s.last_groups, sampled[0].rewards  # [B, G] as sampled
    tied = rewards.amax(1) == rewards.amin(1)  # no sample better than another: skipped (skip_ties)
    assert 0 < tied.sum() < len(tied) and g.group_size == 1
    assert g.indices == [i for i, t in zip(sampled[0].indices, tied) if not t]
    # Every kept sample's reward is the maximum the policy sampled for that prompt this step.
    assert g.rewards.view(-1).tolist() == rewards.amax(1)[~tied].tolist()
    # ... and the step trains on them (the selected groups of one are not skipped again as ties)
    assert metrics["empty_batch"] == 0 and metrics["nll"] > 0 and metrics["grad_norm"] > 0


@pytest.mark.parametrize("name", ["grpo", "cispo", "dr_grpo"])  # the three aggregations
@pytest.mark.parametrize("passes", [{"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 60},
                                    {"share_prompts": False, "trim_padding": False}],
                         ids=["3-rows", "60-tokens", "padded"])
def test_micro_batching_gives_the_same_gradient(name, passes, tiny_model_dir, reward_file):
    """The normaliser is the optimizer step's: micro-batches of 3 rows, or of at most 60 tokens, accumulate
    the whole batch's gradient; one padded pass per micro-batch (no prompt sharing, no length groups) gives
    the gradient of the default passes."""
    grads = []
    for settings in ({"micro_batch_size": 64}, passes):
        s = OnlineSession.create(make_config(tiny_model_dir, reward_file, name, **settings))
        captured = []

        def capture(s=s, captured=captured):
            captured += [p.grad.clone() for p in s.policy.parameters()]
            s.optimizer.zero_grad()
            return 1.0

        s.optimizer_step = capture
        train_step(s)
        grads.append(captured)
    assert any(g.abs().max() > 0 for g in grads[0])
    for a, b in zip(*grads, strict=True):  # as many gradients captured either way: none compared vacuously
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-8)


def test_resumed_run_equals_uninterrupted(tiny_model_dir, reward_file, tmp_path):
    assert_online_resume_is_exact(lambda output: make_config(
        tiny_model_dir, reward_file, "dapo", reward="starts_even", binary_reward=None, max_steps=4, eval_every=2,
        save_every=2, log_samples_every=0, output=output), tmp_path)


def test_group_estimator_with_one_sample_is_rejected_before_loading(tiny_model_dir, reward_file):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="group_size"):
        OnlineSession.create(make_config("does-not-exist", reward_file, "grpo", group_size=1))


def test_gradient_checkpointing_changes_no_step(tiny_model_dir, reward_file):
    """--gradient-checkpointing recomputes each layer in the backward: two GRPO steps end at the same
    weights, bit for bit, as without it."""
    weights, metrics = [], []
    for checkpointing in (False, True):
        config = make_config(tiny_model_dir, reward_file, "grpo", gradient_checkpointing=checkpointing)
        s = OnlineSession.create(config)
        assert all(getattr(layer, "posttrain_checkpointed", False) == checkpointing for layer in s.policy.model.layers)
        assert not any(getattr(layer, "posttrain_checkpointed", False) for layer in s.ref.model.layers)
        for _ in range(2):
            metrics.append(train_step(s))
            s.step += 1
        weights.append(s.policy.state_dict())
    assert metrics[1]["grad_norm"] > 0 and metrics[1]["loss"] == metrics[3]["loss"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("name", ["grpo", "ppo"])  # PPO: a value head, and several optimizer steps per step
def test_offloading_changes_no_step(name, tiny_model_dir, reward_file):
    """--offload-reference and --offload-optimizer: the reference's weights and AdamW's moments are out
    of memory between uses, and two steps log the same metrics and end at the same weights, bit for
    bit, as with both resident."""
    weights, metrics = [], []
    for offloaded in (False, True):
        s = OnlineSession.create(make_config(tiny_model_dir, reward_file, name, offload_reference=offloaded,
                                             offload_optimizer=offloaded))
        for _ in range(2):
            metrics.append({k: v for k, v in train_step(s).items() if not k.startswith("time/")})
            s.step += 1
            assert all(p.numel() == 0 for p in s.ref.parameters()) == offloaded
            assert all(s.optimizer.state[p]["exp_avg"].numel() == 0 for p in s.policy.parameters()) == offloaded
        weights.append({**s.policy.state_dict(), **(s.value_head.state_dict() if s.value_head else {})})
    assert metrics[1]["kl"] > 0 and metrics[1]["grad_norm"] > 0 and metrics[:2] == metrics[2:]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_offloaded_reference_is_refreshed_saved_and_resumed(tiny_model_dir, reward_file, tmp_path):
    """ref_refresh_every rewrites the offloaded copy (after steps 2 and 4), the step-2 checkpoint holds the
    refreshed copy and the offloaded AdamW moments, and the resume restores both: an offloaded run,
    interrupted and resumed, equals a resident one."""
    common = dict(max_steps=4, eval_every=2, save_every=2, log_samples_every=0, ref_refresh_every=2)
    resident_run = make_config(tiny_model_dir, reward_file, "grpo", output=str(tmp_path / "resident"), **common)
    run_training(OnlineSession.create(resident_run), resident_run, train_step, evaluate)
    first = make_config(tiny_model_dir, reward_file, "grpo", offload_reference=True, offload_optimizer=True,
                        output=str(tmp_path / "split"), **common)
    run_interrupted(OnlineSession.create(first), first, train_step, evaluate, after=2)
    second = resumed(first, tmp_path / "split")
    run_training(OnlineSession.create(second), second, train_step, evaluate)
    assert_runs_identical(tmp_path / "resident", tmp_path / "split")


def test_mini_batches_split_every_row_once_reproducibly_and_never_empty():
    split = mini_batch_rows(10, 4, seed=0, step=3, epoch=0)
    assert [len(m) for m in split] == [3, 3, 2, 2]
    assert sorted(torch.cat(split).tolist()) == list(range(10))
    assert all(torch.equal(a, b) for a, b in zip(split, mini_batch_rows(10, 4, seed=0, step=3, epoch=0)))
    assert not all(torch.equal(a, b) for a, b in zip(split, mini_batch_rows(10, 4, seed=0, step=4, epoch=0)))
    assert not all(torch.equal(a, b) for a, b in zip(split, mini_batch_rows(10, 4, seed=0, step=3, epoch=1)))
    # fewer rows than mini-batches (dynamic sampling kept few): one row each, no step without data
    assert sorted(len(m) for m in mini_batch_rows(3, 16, seed=0, step=0, epoch=0)) == [1, 1, 1]
    assert [m.tolist() for m in mini_batch_rows(5, 1, seed=0, step=0, epoch=0)] == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("name, mini_batches", [("grpo", 1), ("gspo", 4), ("dapo", 16)])
def test_several_mini_batches_move_the_ratio_off_one_and_clip(name, mini_batches, tiny_model_dir, reward_file):
    """One update per rollout keeps the ratio at exactly 1, so no clip scheme acts; the papers'
    mini-batches make every update after the first off-policy."""
    overrides = {"binary_reward": None, "dynamic_sampling": False} if name == "dapo" else {}
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, name, learning_rate=1e-2, prompts_per_step=8,
                                         **overrides))
    assert s.alg.mini_batches == mini_batches  # the preset's own update structure
    metrics = train_step(s)
    if mini_batches == 1:
        assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    else:
        assert metrics["ratio_mean"] != 1.0 and metrics["clip_fraction"] > 0.0


def test_the_entropy_bonus_enters_the_loss_exactly(tiny_model_dir, reward_file):
    """A fixed entropy_coef adds -c * the aggregated token entropy (its gradient through the fused head)."""
    import posttrain.functional as F

    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", entropy_coef=0.05, micro_batch_size=5))
    policy, head = copy.deepcopy(s.policy), copy.deepcopy(s.value_head)
    metrics = train_step(s)
    comp = s.last_groups.completions
    batch = collate(s.last_groups.prompt_ids, comp.completion_ids, comp.mask, s.pad_id, s.device)
    with torch.no_grad():
        entropy = forward(policy, batch, with_entropy=True).entropy
    bonus = F.entropy_bonus(entropy, batch.mask, coef=0.05, aggregation="sequence_mean")
    assert metrics["loss"] == pytest.approx(float(recompute_loss(s, policy, head) + bonus), abs=1e-5)
    assert metrics["entropy_coef"] == 0.05 and bonus < 0


def test_adaptive_entropy_control_moves_its_coefficient_and_resumes_exactly(tiny_model_dir, reward_file, tmp_path):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "entropy_control", entropy_target=50.0,
                                         entropy_coef_step=0.01, max_steps=3))
    coefs = [train_step(s)["entropy_coef"] for _ in range(3)]
    assert coefs == pytest.approx([0.0, 0.01, 0.02])  # the entropy (a few nats) stays below the target: c rises
    assert s.trainer_state()["entropy_control"]["coef"] == pytest.approx(0.02)
    assert_online_resume_is_exact(lambda output: make_config(
        tiny_model_dir, reward_file, "entropy_control", entropy_target=50.0, entropy_coef_step=0.01, max_steps=4,
        eval_every=2, save_every=2, log_samples_every=0, output=output), tmp_path)


def test_gdpo_normalises_each_reward_function_within_its_group(tiny_model_dir, reward_file):
    """Two reward functions, weighted 1 and 3: the step's advantages are F.gdpo_advantages of their raw values."""
    import posttrain.functional as F

    config = make_config(tiny_model_dir, reward_file, "gdpo", reward_weights=[1.0, 3.0], group_size=6,
                         prompts_per_step=6, reward=None)
    s = OnlineSession.create(config)
    captured = {}
    original = online.step_advantages

    def capture(*args, **kwargs):
        captured["result"] = original(*args, **kwargs)
        return captured["result"]

    online.step_advantages = capture
    try:
        train_step(s)
    finally:
        online.step_advantages = original
    g = s.last_groups
    terms = torch.stack([g.terms["sevens"], g.terms["starts_even"]], -1).view(6, 6, 2)
    expected = F.gdpo_advantages(terms, torch.tensor([1.0, 3.0], dtype=torch.float64))
    advantages = captured["result"][0]
    mask = g.completions.mask.bool()
    torch.testing.assert_close(advantages.double(), torch.where(mask, expected.reshape(-1, 1), 0.0))
