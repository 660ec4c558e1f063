"""A run as a cluster runs it: the same command line at the first submission and at every requeue, SIGTERM
from a scheduler, a second run on the same directory, a disk that fills up."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.config import Config
from posttrain.tracking.metrics import read_metrics
from posttrain.training import checkpoint
from posttrain.training.checkpoint import StorageError, latest_checkpoint
from posttrain.training.lifecycle import PREEMPTED_EXIT_CODE, RunLock, RunLocked
from posttrain.training.online import train_step
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession, evaluate

from test_online import make_config

# A reward that sends this process SIGTERM (twice with SIGNALS=2) on its SIGNAL_AT-th call: in the middle of
# a training step, after its completions are sampled and before its update.
SIGNALLING_REWARD = textwrap.dedent('''
    import os, signal
    calls = 0

    def sevens(prompts, completions, **columns):
        global calls
        calls += 1
        if calls == int(os.environ.get("SIGNAL_AT", "0")):
            for _ in range(int(os.environ.get("SIGNALS", "1"))):
                os.kill(os.getpid(), signal.SIGTERM)
        return [c.count("7") / max(len(c), 1) for c in completions]
''')

STEPS = 4


def _command(tiny_model_dir: Path, rewards: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "posttrain", "train", "--model", str(tiny_model_dir), "--task", "addition",
            "--reward", f"{rewards}:sevens", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens",
            "12", "--eval-size", "8", "--learning-rate", "1e-3", "--max-steps", str(STEPS), "--eval-every", "0",
            "--save-every", "0", "--log-samples-every", "0", "--report-to", "none", "--no-progress",
            "--output", str(output), "--auto-resume", *extra]


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final_model" / "model.safetensors")


@pytest.fixture(scope="module")
def signalling_reward(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("signalling") / "rewards.py"
    path.write_text(SIGNALLING_REWARD)
    return path


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, signalling_reward, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("whole") / "run"
    result = _run(_command(tiny_model_dir, signalling_reward, run))
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_sigterm_mid_step_checkpoints_that_step_and_the_same_command_resumes_to_the_same_weights(
        tiny_model_dir, signalling_reward, uninterrupted, tmp_path):
    """The signal arrives while step 3 scores its completions (the eval before training and steps 1-2 call the
    reward first): step 3 finishes, is checkpointed, and the run exits 75; the requeued command resumes there
    and ends bit for bit where the uninterrupted run ends."""
    run = tmp_path / "run"
    command = _command(tiny_model_dir, signalling_reward, run)
    stopped = _run(command, SIGNAL_AT="4")
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    assert "SIGTERM: finishing the current step" in stopped.stderr
    assert "stopped after step 3 and saved its checkpoint" in stopped.stderr
    assert latest_checkpoint(run).name == "step_000003"
    assert not (run / "final_model").exists()

    requeued = _run(command)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    whole, resumed = _weights(uninterrupted), _weights(run)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert [row["step"] for row in read_metrics(run)] == list(range(STEPS + 1))

    again = _run(command)  # a requeue of the finished job: done, not failed, and nothing changes
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"is complete: step {STEPS} of max_steps {STEPS}" in again.stderr
    assert f"--max-steps {STEPS + 1} or more" in again.stderr
    assert [row["step"] for row in read_metrics(run)] == list(range(STEPS + 1))


def test_an_asynchronous_run_saves_its_batches_ahead_and_stops_its_rollout_process(tiny_model_dir, signalling_reward,
                                                                                   tmp_path):
    """SIGTERM reaches the trainer mid-step (the reward is scored there) while the rollout process samples
    ahead: the checkpoint holds the batch sampled ahead, the trainer exits (it would wait on a rollout process
    still running: it is not a daemon), and the requeued command ends where an uninterrupted asynchronous run
    ends."""
    from posttrain.training.checkpoint import load_extra_state

    flags = ("--async-rollout", "--max-staleness", "1")
    whole = tmp_path / "whole"
    assert _run(_command(tiny_model_dir, signalling_reward, whole, *flags)).returncode == 0
    run = tmp_path / "run"
    command = _command(tiny_model_dir, signalling_reward, run, *flags)
    stopped = _run(command, SIGNAL_AT="4")
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]

    saved = load_extra_state(latest_checkpoint(run))
    assert len(saved["rollouts"]["rounds"]) == 1  # the next step's batch, sampled ahead
    assert _run(command).returncode == 0
    a, b = _weights(whole), _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_signal_stops_at_once_without_a_checkpoint(tiny_model_dir, signalling_reward, tmp_path):
    run = tmp_path / "run"
    result = _run(_command(tiny_model_dir, signalling_reward, run), SIGNAL_AT="4", SIGNALS="2")
    assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
    assert latest_checkpoint(run) is None


def test_resume_of_a_finished_run_exits_0_and_says_how_to_extend_it(tiny_model_dir, reward_file, tmp_path, capsys):
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, reward_file, max_steps=2, eval_every=0, log_samples_every=0, output=str(run))
    run_training(OnlineSession.create(config), config, train_step, evaluate)
    logged = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "is complete: step 2 of max_steps 2" in err and "--max-steps 3 or more" in err
    assert (run / "metrics.jsonl").read_text() == logged
    # the same from Python: the run's first and last held-out metrics, from its log
    from posttrain.training.api import run as api_run

    result = api_run(Config.from_flat({**config.to_flat(), "resume": str(run)}))
    rows = read_metrics(run)
    assert result["complete"] and result["after"]["eval/accuracy"] == rows[-1]["eval/accuracy"]
    assert result["before"]["eval/accuracy"] == rows[0]["eval/accuracy"]


def test_auto_resume_restarts_a_run_that_never_checkpointed(tiny_model_dir, reward_file, tmp_path):
    """Killed before its first checkpoint, a run has logs and nothing to resume: the requeue starts it again."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "marker": 1}\n{"step": 1, "marker": 1}\n')
    config = make_config(tiny_model_dir, reward_file, max_steps=1, eval_every=0, log_samples_every=0,
                         output=str(run), auto_resume=True)
    run_training(OnlineSession.create(config), config, train_step, evaluate)
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [0, 1] and not any("marker" in row for row in rows)
    assert latest_checkpoint(run).name == "step_000001"


def test_a_run_killed_while_saving_its_final_model_resumes_to_save_it(tiny_model_dir, reward_file, tmp_path):
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, reward_file, max_steps=2, eval_every=0, log_samples_every=0,
                         output=str(run))
    run_training(OnlineSession.create(config), config, train_step, evaluate)
    final = _weights(run)
    import shutil

    shutil.rmtree(run / "final_model")
    logged = read_metrics(run)
    resumed = Config.from_flat({**config.to_flat(), "auto_resume": True})
    result = run_training(OnlineSession.create(resumed), resumed, train_step, evaluate)
    assert all(torch.equal(final[k], v) for k, v in _weights(run).items())
    assert read_metrics(run) == logged  # its last evaluation was logged: not again
    assert result["after"]["eval/accuracy"] == logged[-1]["eval/accuracy"]


def test_auto_resume_needs_output():
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="auto_resume: needs output"):
        Config.from_flat({"auto_resume": True})


def test_trl_resume_from_checkpoint_true_is_auto_resume(tiny_model_dir, reward_file, tmp_path, capsys):
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, reward_file, max_steps=1, eval_every=0, log_samples_every=0, output=str(run))
    run_training(OnlineSession.create(config), config, train_step, evaluate)
    capsys.readouterr()
    assert main(["train", "--model", str(tiny_model_dir), "--reward", f"{reward_file}:sevens", "--max-steps", "1",
                 "--output_dir", str(run), "--resume_from_checkpoint", "true", "--no-progress"]) == 0
    assert "is complete: step 1 of max_steps 1" in capsys.readouterr().err


# --- one run per directory -------------------------------------------------------------------------------


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tiny_model_dir, reward_file, tmp_path,
                                                                         capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f'''
        import sys, time
        from posttrain.training.lifecycle import RunLock
        RunLock({str(run)!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    ''')], env={**os.environ, "PYTHONPATH": os.getcwd()}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", "--model", str(tiny_model_dir), "--reward", f"{reward_file}:sevens", "--max-steps",
                     "1", "--output", str(run), "--no-progress", "--report-to", "none"]) == 2
        err = capsys.readouterr().err
        assert f"output: {run} is in use by another run (pid {holder.pid} on" in err
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()  # as kill -9 would: the kernel drops its lock
        holder.wait()
    RunLock(run).acquire().release()


def test_the_lock_is_held_for_the_run_and_released_after(tiny_model_dir, reward_file, tmp_path):
    run = tmp_path / "run"
    seen = []

    def step_and_try_the_lock(session):
        with pytest.raises(RunLocked):
            RunLock(run).acquire()  # another descriptor, as another process would have
        seen.append(session.step)
        return train_step(session)

    config = make_config(tiny_model_dir, reward_file, max_steps=1, eval_every=0, log_samples_every=0, output=str(run))
    run_training(OnlineSession.create(config), config, step_and_try_the_lock, evaluate)
    assert seen == [0]
    RunLock(run).acquire().release()


# --- storage faults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_refused_checkpoint_write_keeps_the_previous_one_and_names_path_and_bytes(
        code, tiny_model_dir, reward_file, tmp_path, monkeypatch):
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, reward_file, max_steps=3, save_every=1, eval_every=0, log_samples_every=0,
                         output=str(run))
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if "step_000002" in str(path) and str(path).endswith("scheduler.pt"):
            raise OSError(code, os.strerror(code), str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    with pytest.raises(StorageError) as raised:
        run_training(OnlineSession.create(config), config, train_step, evaluate)
    message = str(raised.value)
    assert f"cannot write {run / 'checkpoints' / 'step_000002'}: {os.strerror(code)}" in message
    assert "(the size of step_000001)" in message and "free there" in message
    assert f"the previous checkpoint {run / 'checkpoints' / 'step_000001'} is whole" in message
    checkpoint.verify_checkpoint(run / "checkpoints" / "step_000001")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]  # no temporary left


def test_a_full_disk_stops_the_command_with_one_line(tiny_model_dir, reward_file, tmp_path, monkeypatch, capsys):
    """A real file system of 100 KiB (tmpfs; needs root): the logs fit, the checkpoint (170 KB) does not."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        code = main(["train", "--model", str(tiny_model_dir), "--reward", f"{reward_file}:sevens", "--max-steps",
                     "1", "--eval-size", "4", "--output", str(mount / "run"), "--no-progress", "--report-to", "none"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert "No space left on device" in err and str(mount / "run") in err and "Traceback" not in err
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)
