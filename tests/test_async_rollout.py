"""Asynchronous rollouts: a rollout process samples up to ``max_staleness`` steps ahead of the trainer.

With K = 0 it makes the synchronous run's requests at the same points and draws from the same random
stream, so the run is the synchronous one, weights and metrics; with K > 0 every trained sample is at
most K versions stale, and its version tag says which weights sampled it.
"""

from __future__ import annotations

import pytest
import torch
from test_online import make_config

from posttrain.config import Config, ConfigError
from posttrain.models.loading import bf16_supported
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession


def train(config: Config, steps: int) -> tuple[OnlineSession, list[dict], list[torch.Tensor]]:
    """``steps`` steps: the session, each step's metrics and each step's trained versions."""
    s = OnlineSession.create(config)
    metrics, versions = [], []
    try:
        for _ in range(steps):
            metrics.append(train_step(s))
            versions.append(s.last_groups.completions.versions.clone())
            s.step += 1
    finally:
        s.close()
    return s, metrics, versions


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "sync/"))} for row in metrics]


@pytest.mark.parametrize("algorithm, flat", [
    ("grpo", {}),
    ("dapo", {"binary_reward": None}),  # dynamic sampling: refill rounds and surplus groups
    ("ppo", {}),  # mini-batches, several epochs, a value head
    ("grpo", {"sampler_noise": 0.05, "correction": "token-truncate"}),  # a sampling copy, its noise per step
    pytest.param("grpo", {"mixed_precision": "bf16"},  # a model whose decoder's forward is wrapped on the instance
                 marks=pytest.mark.skipif(not bf16_supported(torch.device("cpu")),
                                          reason="mixed_precision bf16 is refused on a CPU without AVX512-BF16 or AMX")),
])
def test_staleness_zero_is_the_synchronous_run(tiny_model_dir, reward_file, algorithm, flat):
    sync, sync_metrics, _ = train(make_config(tiny_model_dir, reward_file, algorithm, **flat), 3)
    asynchronous, async_metrics, versions = train(make_config(
        tiny_model_dir, reward_file, algorithm, async_rollout=True, max_staleness=0, **flat), 3)
    assert all(torch.equal(a, b) for a, b in zip(sync.policy.parameters(), asynchronous.policy.parameters()))
    assert comparable(async_metrics) == comparable(sync_metrics)
    assert all(row["staleness/max"] <= (1 if algorithm == "dapo" else 0) for row in async_metrics)
    assert async_metrics[0]["time/generation"] > 0  # the rollout process's own time, reported back


def test_samples_are_tagged_with_the_version_that_drew_them_and_never_older_than_the_bound(tiny_model_dir, reward_file):
    _, metrics, versions = train(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True,
                                             max_staleness=2), 5)
    # step t trains on the batch submitted at step max(0, t - 2), with that step's weights
    assert [v.unique().tolist() for v in versions] == [[0], [0], [0], [1], [2]]
    assert [row["staleness/max"] for row in metrics] == [0, 1, 2, 2, 2]
    # a stale sampler is a mismatched one: its log-probs differ from the trainer's once the policy moved
    assert metrics[0]["mismatch/kl_k3"] < 1e-10 < metrics[3]["mismatch/kl_k3"]


def test_dynamic_samplings_surplus_is_dropped_when_it_would_exceed_the_bound():
    from types import SimpleNamespace

    from posttrain.config import OffPolicyConfig
    from posttrain.rollout.completions import Completions
    from posttrain.training.groups import Groups
    from posttrain.training.rollouts import fresh_enough

    def surplus(versions):  # groups of two samples each, sampled by ``versions``
        n = 2 * len(versions)
        completions = Completions(torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3), torch.zeros(n, dtype=torch.bool),
                                  versions=torch.tensor(versions).repeat_interleave(2))
        return Groups(list(range(len(versions))), [torch.ones(2)] * n, completions, [""] * n,
                      torch.zeros(len(versions), 2), {}, None)

    def session(step, **off_policy):
        return SimpleNamespace(step=step, config=SimpleNamespace(off_policy=OffPolicyConfig(**off_policy)))

    # trained at step 5: 5 - 3 = 2 versions stale, 5 - 4 = 1
    kept = fresh_enough(session(4, async_rollout=True, max_staleness=1), surplus([3, 4]))
    assert kept.indices == [1]
    assert fresh_enough(session(4, async_rollout=True, max_staleness=2), surplus([3, 4])).indices == [0, 1]
    assert fresh_enough(session(4, async_rollout=True, max_staleness=1), surplus([2, 3])) is None
    # synchronous (and K = 0): this step's surplus trains at the next step, one version stale, as always
    assert fresh_enough(session(4), surplus([4])).indices == [0]


def test_an_asynchronous_dynamic_sampling_run_never_trains_beyond_the_bound(tiny_model_dir, reward_file):
    _, metrics, versions = train(make_config(tiny_model_dir, reward_file, "dapo", binary_reward=None,
                                             async_rollout=True, max_staleness=1, prompts_per_step=2,
                                             max_generation_rounds=3), 5)
    assert any(row["generation_rounds"] > 1 for row in metrics)  # refills answered after the rounds ahead
    assert all(row["staleness/max"] <= 1 for row in metrics)
    assert all(((t - v) <= 1).all() for t, v in enumerate(versions))


def test_an_asynchronous_run_resumed_equals_an_uninterrupted_one(tiny_model_dir, reward_file, tmp_path):
    """The checkpoint holds the batches sampled ahead and the rollout process's random generator."""
    from conftest import assert_online_resume_is_exact

    assert_online_resume_is_exact(lambda output: make_config(
        tiny_model_dir, reward_file, "dapo", binary_reward=None, async_rollout=True, max_staleness=2, max_steps=4,
        save_every=2, eval_every=2, output=output), tmp_path)


def test_a_multi_turn_run_samples_its_episodes_in_the_rollout_process(tmp_path, printable_model_dir):
    """Tools and an environment loaded from a file reach the rollout process; so do their counts."""
    import json

    files = tmp_path / "fns.py"
    files.write_text("from posttrain.data.environments import Step\n\n"
                     "def lengths(prompts, completions, **_):\n    return [len(c) / 64 for c in completions]\n\n"
                     "class Lengths:\n    def reset(self, row):\n        self.turns = 0\n\n"
                     "    def step(self, turn):\n        self.turns += 1\n"
                     "        return Step(f'={len(turn)};', 0.1, done=self.turns == 2)\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"[echo {a}]"}) for a in range(8)))

    def config(**flat):
        return Config.from_flat(dict(
            algorithm="grpo", model=str(printable_model_dir), dataset=str(data), reward=[f"{files}:lengths"],
            environment=f"{files}:Lengths", prompts_per_step=2, group_size=4, max_new_tokens=48, max_steps=2,
            eval_size=0, learning_rate=1e-2, progress=False, report_to="none", seed=3, **flat))

    _, sync_metrics, _ = train(config(), 2)
    _, async_metrics, _ = train(config(async_rollout=True, max_staleness=0), 2)
    assert comparable(async_metrics) == comparable(sync_metrics)
    assert sync_metrics[0]["episode/turns"] >= 1 and "reward/environment_reward" in sync_metrics[0]


def test_a_failure_in_the_rollout_process_stops_the_run_with_its_error(tmp_path, printable_model_dir):
    import json

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"[{a}]"}) for a in range(4)))
    files = tmp_path / "env.py"
    files.write_text("class Failing:\n    def reset(self, row):\n        raise RuntimeError('no such board')\n\n"
                     "    def step(self, turn):\n        pass\n\n"
                     "def zero(prompts, completions, **_):\n    return [0.0] * len(completions)\n")
    config = Config.from_flat(dict(
        algorithm="grpo", model=str(printable_model_dir), dataset=str(data), reward=[f"{files}:zero"],
        environment=f"{files}:Failing", tool_errors="error", prompts_per_step=2, group_size=2, max_new_tokens=8,
        async_rollout=True, eval_size=0, progress=False, report_to="none"))
    from posttrain.rollout.episodes import EnvironmentFault

    with pytest.raises(EnvironmentFault, match="no such board"):  # the rollout process's exception, as it was
        train(config, 1)


def test_what_cannot_reach_the_rollout_process_is_named(tiny_model_dir, reward_file):
    from posttrain.rollout.worker import RolloutWorkerError

    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True))
    s.generator.unpicklable = lambda: None  # a closure a user's generator might hold
    try:
        with pytest.raises(RolloutWorkerError, match="defined at a module's top level"):
            train_step(s)
    finally:
        s.close()


def test_asynchronous_rollout_settings_are_checked(tiny_model_dir, reward_file):
    with pytest.raises(ConfigError, match="max_staleness: got -1"):
        Config.from_flat({"async_rollout": True, "max_staleness": -1})
    with pytest.raises(ConfigError, match="rollout_threads: got 0"):
        Config.from_flat({"rollout_threads": 0})
    from posttrain.rollout import factory

    # combinations: the rollout factory's one check (OnlineSession.create runs it before any model loads)
    with pytest.raises(ConfigError, match="async_rollout: the rollout process samples with posttrain's decode loop"):
        factory.check(Config.from_flat({"async_rollout": True, "backend": "vllm"}), episodes=False)
    with pytest.raises(ConfigError, match="async_rollout: the rollout process holds a whole copy"):
        factory.check(Config.from_flat({"async_rollout": True, "fsdp": True}), episodes=False)


def test_a_checkpoint_with_batches_sampled_ahead_resumes_only_asynchronously(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True, max_staleness=2))
    try:
        train_step(s)
        s.step += 1
        extra = s.extra_state()
    finally:
        s.close()
    assert len(extra["rollouts"]["rounds"]) == 2  # steps 1 and 2's batches, sampled ahead
    sync = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo"))
    with pytest.raises(ConfigError, match="resume with --async-rollout and --max-staleness 2 or more"):
        sync.load_trainer_state(sync.trainer_state(), extra)
    smaller = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True, max_staleness=1))
    with pytest.raises(ConfigError, match="max_staleness: the checkpoint holds 2 batch"):
        smaller.load_trainer_state(smaller.trainer_state(), extra)


def test_with_staleness_the_trainer_and_the_rollout_process_share_the_threads(tiny_model_dir, reward_file):
    """They run at once: the rollout process takes ``rollout_threads``, the trainer the rest until the run ends."""
    before = torch.get_num_threads()
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True, max_staleness=1,
                                         rollout_threads=1))
    try:
        train_step(s)
        assert torch.get_num_threads() == max(1, before - 1)
    finally:
        s.close()
    assert torch.get_num_threads() == before


def test_a_rollout_process_that_dies_is_reported_not_waited_on(tiny_model_dir, reward_file):
    from posttrain.rollout.worker import RolloutWorkerError

    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True, max_staleness=1))
    try:
        train_step(s)
        s.step += 1
        s.rollouts.worker.process.kill()  # an out-of-memory kill, a segfault in a kernel
        with pytest.raises(RolloutWorkerError, match=r"the rollout process died \(exit code -9\)"):
            for _ in range(2):  # (the batch sampled ahead may have been answered before the kill)
                train_step(s)
                s.step += 1
    finally:
        s.close()
