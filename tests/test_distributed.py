"""Two processes (gloo, CPU) train exactly as one process does on the same global batch.

Sampling draws from a different random stream in every process, so the rollouts here come from
``FixedGenerator``: each completion is a fixed function of its prompt and sample index, and the
only difference between the runs is how the step's prompts are split over the processes.
One ``torch.multiprocessing.spawn`` of two workers runs every scenario (the interpreter start
dominates), once per test session even under pytest-xdist (a file lock); each worker saves what it
ends with, and the tests compare it with one-process runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_online import make_config

from posttrain.config import Config, ConfigError
from posttrain.parallel import distributed, fsdp
from posttrain.rollout.completions import POLICY_SAMPLER, Completions, completion_mask
from posttrain.tracking.metrics import read_metrics
from posttrain.training.online import train_step
from posttrain.training.preference import PreferenceSession
from posttrain.training.preference import train_step as preference_train_step
from posttrain.training.reward_model import RewardModelSession
from posttrain.training.reward_model import train_step as reward_model_train_step
from posttrain.training.sft import SFTSession
from posttrain.training.sft import train_step as sft_train_step
from posttrain.training.checkpoint import latest_checkpoint
from posttrain.training.lifecycle import Preempted
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession, evaluate

# Sequence mean with KL in the loss; token mean with dynamic sampling; batch whitening; constant.
PRESETS = {
    "grpo": {},
    "dapo": {"binary_reward": None},
    "reinforce_pp": {},
    "dr_grpo": {},
}
PREFERENCE = ("dpo", "kto")  # a mean over pairs; KTO's reference point from the whole step's batch
# Micro-batches of at most 40 tokens: each process places its own rows, so their numbers of passes may differ
BUDGETED = {"grpo-budget": "grpo", "dpo-budget": "dpo"}
# The offline trainers whose examples are split over the processes by length (distributed.balanced_shard)
OFFLINE = ("sft", "reward_model")
# Under FSDP: KL in the loss; a replicated value head beside the sharded policy and 4 updates per
# rollout; rank 1 without rows (dynamic sampling, see FixedGenerator); both preference shapes.
FSDP = ("grpo", "ppo", "dpo", "kto", *BUDGETED)
STEPS = 2
# Unclipped gradients (clipping would hide a wrong scale), on the CPU (gloo; one GPU cannot host two ranks).
COMMON = dict(prompts_per_step=4, group_size=4, micro_batch_size=2, max_steps=STEPS, max_grad_norm=0.0, device="cpu")


class FixedGenerator:
    """Completions that depend only on the prompt and the sample index, in any process.

    Sample 0 of a prompt has no 7 and every other sample starts with one, so under the
    ``sevens`` reward every group has reward variance (dynamic sampling keeps them all),
    except in process ``silent_rank``, where every sample is sample 0 (no group has any).
    """

    capabilities = POLICY_SAMPLER

    def __init__(self, tokenizer, eos_id: int, width: int, silent_rank: int | None = None):
        self.digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("012345689")))
        self.seven = tokenizer.convert_tokens_to_ids("7")
        self.eos_id, self.pad_id, self.width = eos_id, tokenizer.pad_token_id, width
        self.silent = silent_rank == distributed.rank()

    def generate(self, prompt_ids: list[torch.Tensor], *, num_samples: int, greedy: bool = False,
                 rows: object = None) -> Completions:
        samples = []
        for prompt in prompt_ids:
            key = sum((i + 1) * int(t) for i, t in enumerate(prompt))
            for j in range(num_samples):
                j = 0 if self.silent else j
                g = torch.Generator().manual_seed(key * 101 + j)
                tokens = self.digits[torch.randint(len(self.digits), (self.width,), generator=g)]
                if j:
                    tokens[0] = self.seven
                length = int(torch.randint(1, self.width + 1, (1,), generator=g))
                if length < self.width:
                    tokens[length] = self.eos_id
                samples.append(tokens)
        tokens = torch.stack(samples)
        mask, truncated = completion_mask(tokens, torch.tensor([self.eos_id]))
        # a sampler's log-probs, a fixed function of the token: the mismatch metrics (and, where a scenario
        # asks, the correction) see ratios far from 1
        sampler_logprobs = -3.5 - 0.3 * (tokens % 7).float()
        return Completions(tokens.masked_fill(mask == 0, self.pad_id), mask, truncated,
                           sampling_logprobs=sampler_logprobs * mask)


# An environment for multi-turn episodes: it answers each turn with the count of its sevens, rewards
# each seven, and ends the episode at the third turn or a turn without one.
ENVIRONMENT = """
from posttrain.data.environments import Step


class Sevens:
    def reset(self, row):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        sevens = turn.count("7")
        return Step(f"={sevens};", 0.5 * sevens, done=self.turns == 3 or not sevens)
"""
EPISODES = "grpo-episodes"  # GRPO whose rollouts are episodes in that environment
CORRECTED = "grpo-corrected"  # GRPO with truncated importance weights against FixedGenerator's log-probs
ASYNC = "grpo-async"  # GRPO whose batches a rollout process per process samples one step ahead


def write_data(folder: Path) -> None:
    """Sixteen prompts, sixteen preference pairs over them (small files: sessions build fast), and the
    environment."""
    (folder / "environment.py").write_text(ENVIRONMENT)
    sums = [(a, (3 * a + 1) % 10) for a in range(16)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a, b in sums))
    (folder / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n" for a, b in sums))
    (folder / "demonstrations.jsonl").write_text("".join(  # lengths that differ: a split by length is not contiguous
        json.dumps({"prompt": f"{a}+{b}=", "completion": f"{a + b}" + "|" * (a % 5)}) + "\n" for a, b in sums))


def online_config(data: Path, model_dir, reward_file, algorithm: str, **flat) -> Config:
    prompts = str(data / "prompts.jsonl")
    return make_config(model_dir, reward_file, algorithm, dataset=prompts, eval_dataset=prompts,
                       **{**COMMON, **PRESETS.get(algorithm, {}), **flat})


def fixed_session(config: Config, silent_rank: int | None = None) -> OnlineSession:
    s = OnlineSession.create(config)
    if s.episodes is not None:  # multi-turn: the environment's episodes, whose turns FixedGenerator writes
        turns = FixedGenerator(s.tokenizer, s.eos_ids[0], s.max_new_tokens // 3, silent_rank)
        s.episodes.turn_generator = lambda budget: turns
    else:
        s.generator = FixedGenerator(s.tokenizer, s.eos_ids[0], s.max_new_tokens, silent_rank)
    return s


def train(s, step_fn) -> dict:
    """``max_steps`` steps: the final weights, each step's metrics, and the first step's gradient as
    AdamW received it (summed over processes). AdamW hides a wrong overall gradient scale
    (its update is scale-invariant); the gradient and the logged loss do not."""
    grads = []  # (FSDP: every process gathers the full gradient and weights)
    s.optimizer.register_step_pre_hook(lambda optimizer, *_: grads.append(
        [fsdp.full_tensor(p.grad).clone() for p in s.policy.parameters()]) if not grads else None)
    metrics = []
    for _ in range(s.config.run.max_steps):
        metrics.append(step_fn(s))
        s.step += 1
    return {"weights": {k: v.detach().clone() for k, v in fsdp.full_state_dict(s.policy).items()},
            "gradient": grads[0], "metrics": metrics}


def trained(data: Path, model_dir, reward_file, name: str, **flat) -> dict:
    if name == EPISODES:
        config = online_config(data, model_dir, reward_file, "grpo", environment=f"{data / 'environment.py'}:Sevens",
                               max_turns=3, max_new_tokens=24, **flat)
        return train(fixed_session(config), train_step)
    if name == CORRECTED:
        config = online_config(data, model_dir, reward_file, "grpo", correction="token-truncate",
                               correction_high=1.5, **flat)
        return train(fixed_session(config), train_step)
    if name == ASYNC:
        config = online_config(data, model_dir, reward_file, "grpo", async_rollout=True, max_staleness=1, **flat)
        s = fixed_session(config)
        try:
            return train(s, train_step)
        finally:
            s.close()
    if name == "sft":
        config = offline_config(data, model_dir, name, dataset=str(data / "demonstrations.jsonl"), **flat)
        return train(SFTSession.create(config), sft_train_step)
    if name == "reward_model":
        return train(RewardModelSession.create(offline_config(data, model_dir, name, **flat)), reward_model_train_step)
    if name in BUDGETED:
        return trained(data, model_dir, reward_file, BUDGETED[name], max_tokens_per_micro_batch=40, **flat)
    if name not in PREFERENCE:
        return train(fixed_session(online_config(data, model_dir, reward_file, name, **flat)), train_step)
    return train(PreferenceSession.create(offline_config(data, model_dir, name, **flat)), preference_train_step)


def run_config(data: Path, model_dir, reward_file, output, **flat) -> Config:
    # a constant learning rate: the resume tests extend the run by a step, which a decay would notice
    return online_config(data, model_dir, reward_file, "dapo", output=str(output), eval_every=1, save_every=1,
                         log_samples_every=1, report_to="tensorboard", lr_schedule="constant", **flat)


def offline_config(data: Path, model_dir, algorithm: str, **flat) -> Config:
    return Config.from_flat({**dict(
        algorithm=algorithm, model=str(model_dir), dataset=str(data / "pairs.jsonl"), pairs_per_step=4,
        micro_batch_size=2, learning_rate=1e-3, max_steps=STEPS, max_grad_norm=0.0, device="cpu", progress=False,
        report_to="none", seed=0), **flat})


def test_balanced_partition_by_hand():
    # largest differencing, two ways: 8|7 -> spread 1; 6|5 -> 1; 4 with (8|7): 4+7 | 8 -> 3; with (6|5):
    # 11+5 | 8+6: {7, 4, 5} = 16 and {8, 6} = 14
    assert distributed.balanced_partition([8, 7, 6, 5, 4], 2) == [[0, 2], [1, 3, 4]]
    assert distributed.balanced_partition([1], 3) == [[0], [], []]
    assert distributed.balanced_partition([3, 1], 1) == [[0, 1]]


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_balanced_partition_covers_every_item_once_and_evens_the_load(parts):
    import random

    rng = random.Random(parts)
    for _ in range(20):
        costs = [rng.randint(1, 500) for _ in range(4 * parts)]
        sets = distributed.balanced_partition(costs, parts)
        assert len(sets) == parts and sorted(sum(sets, [])) == list(range(len(costs)))
        loads = [sum(costs[i] for i in rows) for rows in sets]
        assert max(loads) - min(loads) <= max(costs)  # never worse than one item's cost apart


def _writes_under(root: Path, record: list) -> None:
    """Record every file or directory this process creates, changes or removes under ``root`` (files that
    C++ or Rust code opens, as torch.save's and safetensors', are not seen; every save that writes them
    first makes its directory, which is)."""
    watched = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree"}

    def hook(event: str, args: tuple) -> None:
        if event not in watched or not args or not isinstance(args[0], (str, os.PathLike)):
            return
        if event == "open":
            mode, flags = args[1], args[2]
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else flags & (os.O_WRONLY | os.O_RDWR)
            if not writes:
                return
        if os.path.abspath(args[0]).startswith(str(root)):
            record.append(f"{event} {args[0]}")

    sys.addaudithook(hook)


def _worker(rank: int, world: int, port: int, model_dir: str, reward_file: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # posttrain's init then joins this group
    out = Path(out)
    for name in [*PRESETS, *PREFERENCE, EPISODES, CORRECTED, ASYNC, *BUDGETED, *OFFLINE]:
        torch.save(trained(out, model_dir, reward_file, name), out / f"{name}-rank{rank}.pt")
    for name in FSDP:
        torch.save(trained(out, model_dir, reward_file, name, fsdp=True), out / f"fsdp-{name}-rank{rank}.pt")
    torch.save(trained(out, model_dir, reward_file, "grpo", fsdp=True, gradient_checkpointing=True),
               out / f"fsdp-checkpointed-grpo-rank{rank}.pt")
    s = fixed_session(online_config(out, model_dir, reward_file, "dapo", max_generation_rounds=2, fsdp=True),
                      silent_rank=1)
    torch.save(train(s, train_step), out / f"fsdp-uneven-rank{rank}.pt")
    config = run_config(out, model_dir, reward_file, out / "run-fsdp", fsdp=True, max_grad_norm=0.5)
    run_training(fixed_session(config), config, train_step, evaluate)
    config = run_config(out, model_dir, reward_file, out / "run-async", **RUN_ASYNC)
    run_training(fixed_session(config), config, train_step, evaluate)
    # Dynamic sampling where rank 1's groups never carry signal: it trains on nothing, rank 0 refills.
    s = fixed_session(online_config(out, model_dir, reward_file, "dapo", max_generation_rounds=2), silent_rank=1)
    result = train(s, train_step)
    extra = s.extra_state()  # every process's surplus groups, as a checkpoint saves them
    s.load_trainer_state(s.trainer_state(), extra)  # ... and as a resumed run shares them out
    result.update(saved_surplus=len(extra["surplus"]["indices"]), surplus_after_load=len(s.surplus.indices))
    torch.save(result, out / f"uneven-rank{rank}.pt")
    writes: list[str] = []
    if rank:
        _writes_under((out / "run").resolve(), writes)
    config = run_config(out, model_dir, reward_file, out / "run")
    run_training(fixed_session(config), config, train_step, evaluate)
    (out / f"writes-rank{rank}.json").write_text(json.dumps(writes))
    try:  # a new run into the same directory: rank 0 refuses, and every process must hear of it
        run_training(fixed_session(config), config, train_step, evaluate)
    except FileExistsError as error:
        (out / f"error-rank{rank}.txt").write_text(str(error))
    # The plain run's checkpoint (fused AdamW's) resumed one step further under FSDP.
    distributed.on_main(shutil.copytree, out / "run", out / "run-then-fsdp")
    onward = Config.from_flat({**run_config(out, model_dir, reward_file, out / "run-then-fsdp", fsdp=True).to_flat(),
                               "max_steps": STEPS + 1, "resume": str(out / "run-then-fsdp")})
    run_training(fixed_session(onward), onward, train_step, evaluate)
    # SIGTERM to rank 1 alone, in the middle of step 2: both processes stop after step 2, checkpointed once.
    config = Config.from_flat({**run_config(out, model_dir, reward_file, out / "run-preempted").to_flat(),
                               "max_steps": STEPS + 2, "save_every": 0})

    def signalled_step(session):
        if rank == 1 and session.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(session)

    try:
        run_training(fixed_session(config), config, signalled_step, evaluate)
    except Preempted as stopped:
        (out / f"preempted-rank{rank}.txt").write_text(f"{stopped.signal_name} {stopped.step}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def two_processes(tiny_model_dir, reward_file, tmp_path_factory) -> tuple[Path, Path]:
    """Every scenario run by two processes: (the folder of what they saved, read-only; the model they
    started from, which a resumed run must name)."""
    import torch.multiprocessing as mp
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above every worker's
    out = shared / "two-processes"
    with FileLock(str(shared / "two-processes.lock")):
        if not (out / "model_dir").exists():
            out.mkdir()
            write_data(out)
            mp.spawn(_worker, args=(2, _free_port(), str(tiny_model_dir), str(reward_file), str(out)), nprocs=2)
            (out / "model_dir").write_text(str(tiny_model_dir))
    return out, Path((out / "model_dir").read_text())


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=atol), (key, (a[key] - b[key]).abs().max())


@pytest.mark.parametrize("engine, name", [*(("replicated", n) for n in [*PRESETS, *PREFERENCE, EPISODES, CORRECTED,
                                                                         ASYNC, *BUDGETED, *OFFLINE]),
                                          *(("fsdp", n) for n in FSDP), ("fsdp-checkpointed", "grpo")])
def test_two_processes_train_as_one_on_the_same_global_batch(engine, name, two_processes, reward_file):
    """Plain data parallelism, and FSDP (each process holds half of every parameter and of AdamW's
    state between steps): both make the one-process update; so do multi-turn episodes and the rollout
    correction."""
    out, tiny_model_dir = two_processes
    prefix = "" if engine == "replicated" else f"{engine}-"  # fsdp-checkpointed: and gradient checkpointing
    rank0, rank1 = (torch.load(out / f"{prefix}{name}-rank{r}.pt") for r in (0, 1))
    one = trained(out, tiny_model_dir, reward_file, name)
    # Every process holds the same weights: the summed gradient is the same on every process.
    assert_same_weights(rank0["weights"], rank1["weights"], atol=0)
    # The gradient is the one-process gradient of the whole batch (the normaliser is global) ...
    assert any(g.abs().max() > 1e-4 for g in one["gradient"])
    # Under FSDP the model runs its own forward (the folded LM head of modeling.split_head would bypass
    # the root module's hooks); one process folds the head: equal to float32 rounding, not bit for bit.
    # So does a split by length (OFFLINE): the processes' micro-batches group the examples differently.
    atol = 1e-8 if engine == "replicated" and name not in OFFLINE else 1e-7
    for a, b in zip(rank0["gradient"], one["gradient"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=atol), (a - b).abs().max()
    # ... so the weights are the one-process weights, and every logged metric is the whole batch's.
    assert_same_weights(rank0["weights"], one["weights"], atol=1e-6)
    for two, single in zip(rank0["metrics"], one["metrics"]):
        assert two.keys() == single.keys()
        for key in (k for k in single if not k.startswith("time/")):
            # a clip fraction counts tokens past a threshold: a 1e-7 difference may move one of ~500
            tolerance = 0.005 if key.endswith(("clip_fraction", "zero_gradient_fraction")) else 1e-6
            assert two[key] == pytest.approx(single[key], rel=1e-5, abs=tolerance), key
    assert rank0["metrics"] == rank1["metrics"]  # (times too: the slowest process's)
    first = one["metrics"][0]
    if name == EPISODES:  # the episodes had several turns, inserted tokens and environment rewards
        assert first["episode/turns"] > 1 and first["episode/inserted_tokens"] > 0
        assert first["reward/environment_reward"] > 0
    if name == CORRECTED:  # the correction acted: some weights were truncated
        assert first["mismatch/truncated_fraction"] > 0 and first["mismatch/kl_k3"] > 0
    if name == ASYNC:  # the second step trained on the batch sampled with the first step's weights
        assert [row["staleness/max"] for row in one["metrics"]] == [0, 1]


def test_a_process_without_groups_joins_the_step(two_processes):
    """Dynamic sampling with no group with signal on rank 1 (``silent_rank``): rank 0 refills in a
    second round and trains on its two groups, rank 1 on none; they still take the same steps."""
    out, _ = two_processes
    rank0, rank1 = (torch.load(out / f"uneven-rank{r}.pt") for r in (0, 1))
    assert_same_weights(rank0["weights"], rank1["weights"], atol=0)
    assert rank0["metrics"] == rank1["metrics"]
    first = rank0["metrics"][0]
    assert first["generation_rounds"] == 2  # rank 1 was short after round 1, so both generated again
    assert first["zero_variance_groups"] == 4 / 8  # rank 1's 2 + 2 groups of the 8 generated
    assert first["groups_trained"] == 2 and first["surplus_groups"] == 2  # rank 0's second round waits
    assert first["loss"] != 0 and first["grad_norm"] > 0
    assert rank0["saved_surplus"] == rank1["saved_surplus"] == 2  # the checkpoint holds rank 0's two
    assert rank0["surplus_after_load"] == rank1["surplus_after_load"] == 1  # loaded, one per process


def test_only_rank_0_writes_the_run_directory(two_processes):
    out, _ = two_processes
    run = out / "run"
    assert json.loads((out / "writes-rank1.json").read_text()) == []
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == list(range(STEPS + 1))  # one line per step: one writer
    assert all("eval/reward" in row for row in rows)  # rank 0 evaluated at every step
    assert rows[-1]["groups_trained"] == 4  # both processes' groups, counted once each
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == STEPS * 8  # rank 0's two groups of four completions per step
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert (run / "final_model" / "model.safetensors").is_file()


def test_an_error_on_rank_0_is_raised_on_every_process(two_processes):
    out, _ = two_processes
    for rank in (0, 1):
        assert "already holds a run" in (out / f"error-rank{rank}.txt").read_text()


def resume_in_one_process_matches(out: Path, reward_file, tmp_path: Path, run: str, **flat) -> None:
    """Two processes' run ``out/run``, resumed for one more step in this process, ends where a
    one-process run of ``STEPS + 1`` steps does."""
    tiny_model_dir = Path((out / "model_dir").read_text())
    shutil.copytree(out / run, tmp_path / "run")
    resumed = Config.from_flat({**run_config(out, tiny_model_dir, reward_file, tmp_path / "run", **flat).to_flat(),
                                "max_steps": STEPS + 1, "resume": str(tmp_path / "run")})
    run_training(fixed_session(resumed), resumed, train_step, evaluate)
    whole = run_config(out, tiny_model_dir, reward_file, tmp_path / "whole", max_steps=STEPS + 1, **flat)
    run_training(fixed_session(whole), whole, train_step, evaluate)
    a = load_file(tmp_path / "run" / "final_model" / "model.safetensors")
    b = load_file(tmp_path / "whole" / "final_model" / "model.safetensors")
    assert_same_weights(a, b, atol=1e-6)


def test_a_two_process_run_resumes_in_one_process(two_processes, reward_file, tmp_path):
    resume_in_one_process_matches(two_processes[0], reward_file, tmp_path, "run")


RUN_ASYNC = dict(async_rollout=True, max_staleness=2)


def test_a_two_process_asynchronous_run_resumes_in_one_process(two_processes, reward_file, tmp_path):
    """Its checkpoint holds both processes' batches sampled ahead, whole: one process takes all of them."""
    resume_in_one_process_matches(two_processes[0], reward_file, tmp_path, "run-async", **RUN_ASYNC)


def test_prompts_per_step_must_split_evenly_over_the_processes(tiny_model_dir, reward_file, tmp_path, monkeypatch):
    write_data(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "3")  # rejected before any process group or model
    with pytest.raises(ConfigError, match=r"prompts_per_step: 4 prompts do not split evenly over 3 processes"):
        OnlineSession.create(online_config(tmp_path, tiny_model_dir, reward_file, "grpo"))
    with pytest.raises(ConfigError, match=r"pairs_per_step: 4 examples do not split evenly over 3 processes"):
        PreferenceSession.create(offline_config(tmp_path, tiny_model_dir, "dpo"))


def test_fsdp_process_without_rows_joins_the_step(two_processes):
    """Rank 1 trains on nothing (dynamic sampling, as above): it still takes part in every
    reduce-scatter, and the update is the data-parallel one."""
    out, _ = two_processes
    sharded, replicated = torch.load(out / "fsdp-uneven-rank0.pt"), torch.load(out / "uneven-rank0.pt")
    assert sharded["metrics"][0]["groups_trained"] == 2
    # reduce-scatter and all-reduce sum in different orders: on a CPU with AVX2 only (no AVX-512) the weights
    # after the run's updates differed by 1.04e-6 (atol was 1e-6, met on AVX-512 machines)
    assert_same_weights(sharded["weights"], replicated["weights"], atol=2e-6)


def test_an_fsdp_run_writes_full_tensors_and_resumes_in_one_process(two_processes, reward_file, tmp_path):
    """An FSDP checkpoint holds the same files as a one-process run's (full weights, tied ones once,
    full AdamW moments); resumed without FSDP in one process it ends where a one-process run does
    (gradient clipping on: the global norm over shards)."""
    out, tiny_model_dir = two_processes
    checkpoint = out / "run-fsdp" / "checkpoints" / f"step_{STEPS:06d}"
    start = load_file(tiny_model_dir / "model.safetensors")
    assert load_file(checkpoint / "model.safetensors").keys() == start.keys()
    moments = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"][0]  # the embedding's
    assert type(moments["exp_avg"]) is torch.Tensor and moments["exp_avg"].shape == start["model.embed_tokens.weight"].shape
    resume_in_one_process_matches(out, reward_file, tmp_path, "run-fsdp", fsdp=False, max_grad_norm=0.5)


def test_a_plain_checkpoint_resumes_under_fsdp(two_processes, reward_file, tmp_path):
    out, tiny_model_dir = two_processes
    whole = run_config(out, tiny_model_dir, reward_file, tmp_path / "whole", max_steps=STEPS + 1)
    run_training(fixed_session(whole), whole, train_step, evaluate)
    a = load_file(out / "run-then-fsdp" / "final_model" / "model.safetensors")
    b = load_file(tmp_path / "whole" / "final_model" / "model.safetensors")
    assert_same_weights(a, b, atol=1e-6)


def test_fsdp_refuses_what_it_does_not_do(tiny_model_dir, reward_file, tmp_path, monkeypatch):
    write_data(tmp_path)
    with pytest.raises(ConfigError, match="fsdp: LoRA with FSDP is not supported"):
        OnlineSession.create(online_config(tmp_path, tiny_model_dir, reward_file, "grpo", fsdp=True, lora_r=4))
    with pytest.raises(ConfigError, match="fsdp: the vllm backend"):
        fsdp.check(online_config(tmp_path, tiny_model_dir, reward_file, "grpo", fsdp=True, backend="vllm"))
    with pytest.raises(ConfigError, match="fsdp: offload_optimizer is not supported with FSDP"):
        fsdp.check(online_config(tmp_path, tiny_model_dir, reward_file, "grpo", fsdp=True, offload_optimizer=True))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets for an FSDP config
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ConfigError, match="fsdp: CPU offload"):
        PreferenceSession.create(offline_config(tmp_path, tiny_model_dir, "dpo"))


def test_fsdp_in_one_process_is_the_plain_run(tiny_model_dir, reward_file, tmp_path):
    write_data(tmp_path)
    plain = trained(tmp_path, tiny_model_dir, reward_file, "grpo")
    sharded = trained(tmp_path, tiny_model_dir, reward_file, "grpo", fsdp=True)
    assert_same_weights(plain["weights"], sharded["weights"], atol=0)


def test_a_signal_to_one_process_stops_every_process_after_the_same_step(two_processes):
    out, _ = two_processes
    stopped = [(out / f"preempted-rank{rank}.txt").read_text() for rank in (0, 1)]
    assert stopped == [f"a signal on another process {STEPS}", f"SIGTERM {STEPS}"]
    assert latest_checkpoint(out / "run-preempted").name == f"step_{STEPS:06d}"
