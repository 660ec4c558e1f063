"""Real learning on the built-in task (slow: minutes per preset; `make test-slow`).

Every preset's default run must make the built-in tiny-addition model better at its task
(about 40-50% held-out greedy accuracy to start, depending on the CPU):

- every online preset, in its papers' update structure, at the default budget (GRPO also in
  mixed precision), and the default run with a mixture-of-experts body and a hybrid body;
- every preference preset's default run (pairs sampled from the policy and labelled by the
  task's answer check) on a reduced budget: held-out greedy and pairwise accuracy both rise;
- SFT's default run on the task's reference solutions, and the reward model's default run on
  the starting model's own right and wrong samples, on reduced budgets.

The figures these thresholds come from are in docs/results.md. The preference, SFT and reward-model tests
were deleted by mistake in a commit about distillation (1d45f07) while benchmarks/RESULTS.md still cited them,
and are restored as they were; tests/test_docs.py now checks that every `-k` selection the docs cite selects
tests.
"""

from __future__ import annotations

import pytest

from posttrain.algorithms.presets import AFTER_THE_SEED, ALGORITHMS, OnlineAlgorithm, PreferenceAlgorithm
from posttrain.config import Config
from posttrain.training.api import train

pytestmark = pytest.mark.slow

ONLINE = [name for name, preset in ALGORITHMS.items()
          if isinstance(preset, OnlineAlgorithm) and not preset.needs_teacher]  # distillation: below
PREFERENCE = [name for name, preset in ALGORITHMS.items() if isinstance(preset, PreferenceAlgorithm)]
QUIET = {"progress": False, "report_to": "none", "eval_every": 0, "save_every": 0, "log_samples_every": 0}


@pytest.mark.parametrize("name, precision", [*((n, "no") for n in ONLINE), ("grpo", "bf16")])
def test_online_preset_raises_held_out_accuracy(name, precision, tmp_path):
    """`posttrain train --algorithm NAME`: 250 steps of 32 prompts x 8 samples. Also GRPO in mixed
    precision (the decoder under bfloat16 autocast), where the CPU has bfloat16."""
    from posttrain.models.modeling import resolve_device
    from posttrain.models.loading import bf16_supported

    if precision == "bf16" and not bf16_supported(resolve_device("auto")):
        pytest.skip("no native bfloat16 here (a CPU needs AVX512-BF16 or AMX)")
    config = Config.from_flat({"algorithm": name, "output": str(tmp_path / name), "mixed_precision": precision,
                               **QUIET})
    result = train(config)
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    gain = 0.25 if name in AFTER_THE_SEED else 0.20  # the presets after the seed's lineage: +25 points
    assert after >= before + gain, f"{name}: held-out accuracy {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("model", ["tiny-addition-moe", "tiny-addition-hybrid"])
def test_other_bodies_raise_held_out_accuracy(model, tmp_path):
    """`posttrain train --model tiny-addition-moe` (a Qwen3-MoE body: 4 experts, 2 per token) and
    `--model tiny-addition-hybrid` (an LFM2 body: short convolutions around one attention layer, trained on
    padded rows): the default run, warm-started like the default model, gains 20 points or more."""
    config = Config.from_flat({"model": model, "output": str(tmp_path / model), **QUIET})
    result = train(config)
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.20, f"{model}: held-out accuracy {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("name", PREFERENCE)
def test_preference_presets_default_run_raises_task_and_pairwise_accuracy(name, tmp_path):
    """`posttrain train --algorithm NAME --max-steps 100`: the default data (a round of pairs from the policy
    every 10 steps) and loss (the paper's, plus RPO's NLL where the loss takes it), on 100 of the default
    250 steps."""
    config = Config.from_flat({"algorithm": name, "max_steps": 100, "output": str(tmp_path / name), **QUIET})
    result = train(config)
    before, after = result["before"], result["after"]
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.10, (name, before, after)
    assert after["eval/pairwise_accuracy"] > before["eval/pairwise_accuracy"], (name, before, after)


def test_sft_default_run_raises_held_out_accuracy(tmp_path):
    """`posttrain train --algorithm sft --max-steps 50`: the task's reference solutions (the default run's
    evaluation at step 50: 0.504 -> 0.86 on the Intel machine)."""
    config = Config.from_flat({"algorithm": "sft", "max_steps": 50, "output": str(tmp_path / "sft"), **QUIET})
    result = train(config)
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.10, (before, after)


def test_reward_model_default_run_ranks_held_out_pairs(tmp_path):
    """`posttrain train --algorithm reward_model --max-steps 150`: the starting model's own right and wrong
    samples; held-out pairs of its samples on prompts it never trained on (the default run's evaluation at
    step 150: 0.516 -> 0.79 on the Intel machine; 0.86-0.88 at the full 250 steps)."""
    config = Config.from_flat({"algorithm": "reward_model", "max_steps": 150, "output": str(tmp_path / "rm"),
                               **QUIET})
    result = train(config)
    before, after = result["before"], result["after"]
    assert after["eval/pairwise_accuracy_low"] > 0.5 and after["eval/pairwise_accuracy"] >= 0.72, (before, after)


@pytest.fixture(scope="module")
def teacher_and_student(tmp_path_factory):
    """A teacher (the default GRPO run) and a student below the default model (`tiny-addition-base` after 240
    steps of SFT at 1e-3: 33% held-out accuracy), as in docs/results.md's distillation table."""
    root = tmp_path_factory.mktemp("distillation")
    teacher = train(Config.from_flat({"output": str(root / "teacher"), **QUIET}))
    train(Config.from_flat({"algorithm": "sft", "model": "tiny-addition-base", "learning_rate": 1e-3,
                            "lr_schedule": "linear", "max_steps": 240, "output": str(root / "student"), **QUIET}))
    TEACHER_ACCURACY.append(teacher["after"]["eval/accuracy"])
    return root / "teacher" / "final_model", root / "student" / "final_model"


TEACHER_ACCURACY: list[float] = []  # the teacher's held-out accuracy, once the fixture has trained it


def test_on_policy_distillation_lifts_a_weak_student(teacher_and_student, tmp_path):
    """`posttrain train --algorithm on_policy_distill --model STUDENT --teacher TEACHER`: +25 points at the default
    budget (measured: 0.326 -> 0.746), where GRPO from the same student gains 2."""
    teacher, student = teacher_and_student
    result = train(Config.from_flat({"algorithm": "on_policy_distill", "model": str(student), "teacher": str(teacher),
                                     "output": str(tmp_path / "opd"), **QUIET}))
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.25, (before, after)


def test_on_policy_distillation_reaches_the_teacher_in_four_times_the_default_budget(teacher_and_student, tmp_path):
    """1,000 steps (docs/results.md: the student reaches the teacher's 0.872 first at step 650, and ends at 0.890)."""
    teacher, student = teacher_and_student
    result = train(Config.from_flat({"algorithm": "on_policy_distill", "model": str(student), "teacher": str(teacher),
                                     "max_steps": 1000, "output": str(tmp_path / "opd"), **QUIET}))
    after = result["after"]["eval/accuracy"]
    assert after >= TEACHER_ACCURACY[0] - 0.01, (after, TEACHER_ACCURACY)


def test_gkd_lifts_a_weak_student(teacher_and_student, tmp_path):
    """`posttrain train --algorithm gkd --model STUDENT --teacher TEACHER --task addition --no-packing`: +15 points
    at the default budget (measured on 3 seeds: 0.326 -> 0.526-0.560)."""
    teacher, student = teacher_and_student
    result = train(Config.from_flat({"algorithm": "gkd", "model": str(student), "teacher": str(teacher),
                                     "task": "addition", "packing": False, "output": str(tmp_path / "gkd"), **QUIET}))
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.15, (before, after)
