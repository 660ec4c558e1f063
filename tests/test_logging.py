import json
import math
import sys
import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from posttrain.logging import MetricsLogger, markdown_table, read_metrics


def _strict_json(line: str) -> dict:
    """json.loads that, unlike Python's default, rejects the non-JSON constants NaN/Infinity."""
    def reject(constant: str) -> None:
        raise ValueError(f"non-JSON constant {constant}")
    return json.loads(line, parse_constant=reject)


def test_each_log_call_is_one_flushed_line_with_step_first(tmp_path):
    logger = MetricsLogger.open(tmp_path, tensorboard=False)
    logger.log(1, {"loss": torch.tensor(0.5), "tokens": torch.tensor(12), "lr": 1e-4, "skipped": True})
    # read back while the logger is still open: the line must already be on disk
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5, "tokens": 12, "lr": 0.0001, "skipped": 1}\n'
    logger.log(2, {"loss": 0.25})
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 0.5, "tokens": 12, "lr": 1e-4, "skipped": 1},
        {"step": 2, "loss": 0.25},
    ]
    row = read_metrics(tmp_path)[0]
    assert list(row) == ["step", "loss", "tokens", "lr", "skipped"]
    assert type(row["tokens"]) is int  # an integer tensor stays an integer
    logger.close()


def test_non_finite_values_are_valid_json_and_round_trip(tmp_path):
    with MetricsLogger.open(tmp_path, tensorboard=False) as logger:
        logger.log(3, {"a": math.nan, "b": torch.tensor(math.inf), "c": -math.inf, "d": 1e308})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert _strict_json(line) == {"step": 3, "a": "NaN", "b": "Infinity", "c": "-Infinity", "d": 1e308}
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["a"]) and row["b"] == math.inf and row["c"] == -math.inf and row["d"] == 1e308


def test_bad_metrics_raise_instead_of_being_dropped(tmp_path):
    with MetricsLogger.open(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match=r"'kl' is a tensor of shape \[2\]"):
            logger.log(1, {"kl": torch.zeros(2)})
        with pytest.raises(TypeError, match="'name' is a str"):
            logger.log(1, {"name": "grpo"})
        with pytest.raises(ValueError, match="must not contain 'step'"):
            logger.log(1, {"step": 1})
    assert read_metrics(tmp_path) == []


def test_fresh_run_refuses_a_directory_with_logs(tmp_path):
    MetricsLogger.open(tmp_path, tensorboard=False).close()
    with pytest.raises(FileExistsError, match="resume_step"):
        MetricsLogger.open(tmp_path, tensorboard=False)


def test_resume_keeps_exactly_the_lines_up_to_the_checkpoint_step(tmp_path):
    with MetricsLogger.open(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
            logger.log_samples(step, [{"completion": f"c{step}"}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')  # a line cut by the crash

    with MetricsLogger.open(tmp_path, tensorboard=False, resume_step=3) as logger:
        assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
        logger.log(4, {"loss": 40.0})
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.0}, {"step": 4, "loss": 40.0}
    ]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": s, "completion": f"c{s}"} for s in (1, 2, 3)]


def _scalars(run_dir, tag):
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_gets_each_scalar_and_forgets_steps_after_the_resume_point(tmp_path):
    with MetricsLogger.open(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": step / 4})
    assert _scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]

    with MetricsLogger.open(tmp_path, resume_step=2) as logger:
        logger.log(3, {"reward/mean": 0.125})
    assert _scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.125)]


def test_samples_go_to_jsonl_and_a_tensorboard_table(tmp_path):
    rows = [
        {"prompt": "1+1=", "completion": "2", "reward": 1.0, "rewards": {"exact": 1.0}, "correct": True},
        {"prompt": "a|b\nc", "completion": "x", "reward": math.nan, "advantage": torch.tensor(-0.5)},
    ]
    with MetricsLogger.open(tmp_path, table_rows=1) as logger:
        logger.log_samples(7, rows)
    lines = [_strict_json(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 7, "prompt": "1+1=", "completion": "2", "reward": 1.0, "rewards": {"exact": 1.0}, "correct": True},
        {"step": 7, "prompt": "a|b\nc", "completion": "x", "reward": "NaN", "advantage": -0.5},
    ]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    (event,) = accumulator.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 7 and "1+1=" in text and "a\\|b" not in text  # only table_rows=1 row


def test_markdown_table_escapes_cells():
    table = markdown_table([{"prompt": "a|b\nc", "reward": 0.123456}, {"length": 3}])
    assert table.splitlines() == [
        "| prompt | reward | length |",
        "|---|---|---|",
        "| a\\|b<br>c | 0.1235 |  |",
        "|  |  | 3 |",
    ]


def test_wandb_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[wandb\]'"):
        MetricsLogger.open(tmp_path, tensorboard=False, wandb_project="p")


def test_wandb_receives_metrics_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    inits, logged = [], []

    class FakeRun:
        id = "run-abc"

        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            logged.append("finished")

    def init(**kwargs):
        inits.append(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger.open(tmp_path, tensorboard=False, wandb_project="p", wandb_run_name="n", config={"lr": 1}) as lg:
        lg.log(1, {"loss": torch.tensor(2.0)})
    with MetricsLogger.open(tmp_path, tensorboard=False, wandb_project="p", resume_step=1):
        pass
    assert logged == [(1, {"loss": 2.0}), "finished", "finished"]
    assert inits[0]["project"] == "p" and inits[0]["name"] == "n" and inits[0]["config"] == {"lr": 1}
    assert inits[0]["id"] is None and inits[1]["id"] == "run-abc"
