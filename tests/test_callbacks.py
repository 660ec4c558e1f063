"""Callbacks from Python (``posttrain.train(..., callbacks=[...])``): they see every step's and every
evaluation's metrics as logged, and one that asks to stop ends the run as max_steps would, resumable."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import posttrain
from posttrain.config import Config, ConfigError
from posttrain.tracking.metrics import read_metrics
from posttrain.training.checkpoint import latest_checkpoint

from test_online import make_config


class Recorder(posttrain.Callback):
    """Records what it is told; asks to stop after step ``stop_at``."""

    def __init__(self, stop_at: int | None = None):
        self.stop_at = stop_at
        self.steps: list[tuple[int, dict]] = []
        self.evaluations: list[tuple[int, dict]] = []
        self.results: list[dict] = []

    def on_step(self, step, metrics):
        self.steps.append((step, metrics))
        return step == self.stop_at

    def on_evaluate(self, step, metrics):
        self.evaluations.append((step, metrics))

    def on_train_end(self, result):
        self.results.append(result)


def _logged(run) -> dict[int, list[dict]]:
    """The rows of metrics.jsonl by step, without the step itself."""
    rows: dict[int, list[dict]] = {}
    for row in read_metrics(run):
        rows.setdefault(row["step"], []).append({k: v for k, v in row.items() if k != "step"})
    return rows


def test_a_callback_sees_every_step_and_evaluation_as_logged(tiny_model_dir, reward_file, tmp_path):
    recorder, quiet = Recorder(), Recorder()
    config = make_config(tiny_model_dir, reward_file, max_steps=4, eval_every=2, save_every=0, output=str(tmp_path))
    result = posttrain.train(config, callbacks=[recorder, quiet])
    logged = _logged(tmp_path)
    assert [step for step, _ in recorder.steps] == [1, 2, 3, 4]
    for step, metrics in recorder.steps:  # an evaluation step's row holds the evaluation too
        assert logged[step] == [metrics]
    assert {"loss", "reward/mean", "time/step"} <= set(recorder.steps[0][1])
    assert "eval/accuracy" in recorder.steps[1][1] and "eval/accuracy" not in recorder.steps[0][1]
    assert [step for step, _ in recorder.evaluations] == [0, 2, 4]
    for step, metrics in recorder.evaluations:
        assert metrics == {k: v for k, v in logged[step][0].items() if k.startswith("eval/")}
    assert recorder.results == [result] and result["after"] == recorder.evaluations[-1][1]
    assert quiet.steps == recorder.steps  # every callback is told, whatever the others answer


def test_a_callback_stops_the_run_which_then_ends_as_at_max_steps_and_resumes(tiny_model_dir, reward_file, tmp_path):
    common = dict(max_steps=5, eval_every=0, save_every=0, log_samples_every=0)
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    recorder = Recorder(stop_at=3)
    config = make_config(tiny_model_dir, reward_file, output=str(stopped), **common)
    result = posttrain.train(config, callbacks=[recorder])
    assert [step for step, _ in recorder.steps] == [1, 2, 3]
    # as at max_steps: every held-out prompt scored and logged at the last step, a checkpoint, the final model
    assert [step for step, _ in recorder.evaluations] == [0, 3]
    assert _logged(stopped)[3][-1] == recorder.evaluations[-1][1] == result["after"]
    assert latest_checkpoint(stopped).name == "step_000003"
    assert (stopped / "final_model" / "model.safetensors").is_file()
    assert recorder.results == [result]

    posttrain.train(Config.from_flat({**config.to_flat(), "resume": str(stopped)}))
    posttrain.train(make_config(tiny_model_dir, reward_file, output=str(whole), **common))
    # the resumed run's steps are the uninterrupted run's (timings aside), and so are its final weights
    def steps(run):
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run) if "loss" in row]

    assert [row["step"] for row in steps(stopped)] == [1, 2, 3, 4, 5]
    assert steps(stopped) == steps(whole)
    a, b = (load_file(run / "final_model" / "model.safetensors") for run in (stopped, whole))
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_callback_without_the_methods_is_named(tiny_model_dir, reward_file, tmp_path):
    config = make_config(tiny_model_dir, reward_file, output=str(tmp_path))

    class OnlyStep:
        def on_step(self, step, metrics):
            return None

    with pytest.raises(ConfigError, match=r"callbacks: callback 2 \(OnlyStep\) has no on_evaluate, on_train_end; "
                                          "subclass posttrain.Callback"):
        posttrain.train(config, callbacks=[Recorder(), OnlyStep()])
    with pytest.raises(ConfigError, match=r"callbacks: give a list of callbacks"):
        posttrain.train(config, callbacks=Recorder())
