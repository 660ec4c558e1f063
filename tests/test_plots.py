import math

import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from posttrain.tracking.metrics import MetricsLogger
from posttrain.tracking.plots import line_through, plot_run, smooth

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, rows):
    with MetricsLogger.open(run_dir, report_to="none") as logger:
        for step, metrics in rows:
            logger.log(step, metrics)


def test_main_curves_are_drawn_one_panel_per_logged_group(tmp_path, monkeypatch):
    rows = [
        (step, {
            "reward/mean": step / 20, "loss": math.nan if step == 7 else 1 / step, "entropy": 2.0 - step / 20,
            "completion_length/mean": 30.0 + step, "completion_length/correct": 25.0, "completion_length/incorrect": 40.0,
            "unplotted": 1.0,
        })
        for step in range(1, 21)
    ]
    rows.append((20, {"eval/accuracy": 0.5}))
    write_metrics(tmp_path, rows)
    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *a, **k: figures.append(figure) or savefig(figure, *a, **k))
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png" and out.read_bytes()[:8] == PNG_SIGNATURE
    # 5 panels (reward, eval accuracy, entropy, length, loss): 3 columns x 2 rows of 500 x 340 px at dpi 100
    assert imread(out).shape[:2] == (680, 1500)
    # the size alone holds for 4 to 6 panels: the panels themselves, in order, each with its logged keys
    # (a point series and its line per key); no KL or clip fraction panel, nothing for "unplotted"
    (figure,) = figures
    panels = {ax.get_title(): [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
              for ax in figure.axes if ax.get_visible()}
    assert panels == {
        "Reward: mean over sampled completions": ["reward/mean"],
        "Eval accuracy on held-out prompts": ["eval/accuracy"],
        "Policy entropy: mean token entropy (nats)": ["entropy"],
        "Completion length (tokens): mean, correct, incorrect":
            ["completion_length/mean", "completion_length/correct", "completion_length/incorrect"],
        "Training loss": ["loss"],
    }
    assert list(panels) == [ax.get_title() for ax in figure.axes[:5]]


def test_a_single_point_and_chosen_keys(tmp_path):
    write_metrics(tmp_path, [(1, {"kl": 0.01, "clip_fraction": 0.1})])
    out = plot_run(tmp_path, out_path=tmp_path / "kl.png", keys=["kl"])
    assert out == tmp_path / "kl.png" and imread(out).shape[:2] == (340, 500)  # one panel


def test_nothing_to_plot_is_an_error_for_the_caller(tmp_path):
    write_metrics(tmp_path, [(1, {"something_else": 1.0})])
    with pytest.raises(ValueError, match="has logged none of"):
        plot_run(tmp_path)


def test_smoothing_is_a_bias_corrected_moving_average():
    # w = 0.5: m1 = 0.5 * 1 = 0.5 -> 0.5 / (1 - 0.5) = 1; m2 = 0.5 * 0.5 + 0.5 * 3 = 1.75 -> 1.75 / 0.75 = 7/3
    assert smooth([1.0, 3.0], weight=0.5) == pytest.approx([1.0, 7 / 3])
    assert smooth([4.0] * 5) == pytest.approx([4.0] * 5)  # a constant stays constant from the first point


def test_only_dense_series_are_smoothed():
    noisy = [0.1, 0.9] * 10
    assert line_through(list(range(1, 21)), noisy) == pytest.approx(smooth(noisy))  # logged every step
    assert line_through(list(range(2, 41, 2)), noisy) == pytest.approx(smooth(noisy))  # every other step
    # held-out accuracy every 25 steps of the default run: drawn through its points, ending on the last
    accuracy = [0.416, 0.494, 0.606, 0.606, 0.646, 0.704, 0.694, 0.726, 0.728, 0.738, 0.748]
    assert line_through(list(range(0, 251, 25)), accuracy) == accuracy
    assert line_through([1, 2, 3], [0.1, 0.9, 0.1]) == [0.1, 0.9, 0.1]  # too few points to smooth


def test_eval_tasks_accuracies_join_the_held_out_accuracy_panel():
    from posttrain.tracking.plots import PANELS, with_eval_tasks

    rows = [{"eval/accuracy": 0.2, "eval/gsm_symbolic/accuracy": 0.1, "eval/gsm_symbolic/accuracy_low": 0.0,
             "eval/gsm_symbolic/completion_length": 90.0, "eval/accuracy_low": 0.1}]
    panels = dict(with_eval_tasks(PANELS, rows))
    assert panels["Eval accuracy on held-out prompts"] == ("eval/accuracy", "eval/gsm_symbolic/accuracy")
    assert panels["Policy entropy: mean token entropy (nats)"] == ("entropy",)


def test_a_task_asked_under_prompt_variants_is_drawn_as_its_mean_and_worst():
    from posttrain.tracking.plots import PANELS, with_eval_tasks

    rows = [{"eval/accuracy": 0.2, "eval/gsm@bare/accuracy": 0.3, "eval/gsm@boxed/accuracy": 0.1,
             "eval/gsm/variants_mean": 0.2, "eval/gsm/variants_worst": 0.1}]
    assert dict(with_eval_tasks(PANELS, rows))["Eval accuracy on held-out prompts"] == (
        "eval/accuracy", "eval/gsm/variants_mean", "eval/gsm/variants_worst")


def test_held_out_reward_is_drawn_only_where_there_is_no_held_out_accuracy():
    """A --dataset run logs eval/reward alone and gets its panel; a task run's reward panel would repeat
    its accuracy."""
    from posttrain.tracking.plots import PANELS, without_repeated_held_out_reward

    reward_panel = ("Eval reward on held-out prompts", ("eval/reward",))
    assert reward_panel in without_repeated_held_out_reward(PANELS, [{"eval/reward": 0.35}])
    task_run = [{"eval/reward": 0.4, "eval/accuracy": 0.4}]
    assert reward_panel not in without_repeated_held_out_reward(PANELS, task_run)
