"""Real learning on the built-in task (slow: minutes per preset; `make test-slow`).

Every online preset, in its papers' update structure, starts from the built-in tiny-addition
model (about 40% held-out greedy accuracy) and must end well above it at the default budget
(GRPO also in mixed precision). Every preference preset, on pairs sampled from the policy and
labelled by the task's answer check, must raise both held-out greedy accuracy and held-out
pairwise accuracy. The figures these thresholds come from are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import pytest

from posttrain.algorithms.presets import ALGORITHMS, PreferenceAlgorithm
from posttrain.config import Config
from posttrain.training.preference import train_preference
from posttrain.training.api import train

pytestmark = pytest.mark.slow

ONLINE = [name for name, preset in ALGORITHMS.items() if not isinstance(preset, PreferenceAlgorithm)]
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
    assert after >= before + 0.20, f"{name}: held-out accuracy {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("name", PREFERENCE)
def test_preference_preset_on_policy_pairs_raises_task_and_pairwise_accuracy(name, tmp_path):
    """`posttrain train --algorithm NAME --pairs-from policy --rpo-alpha 1 --max-steps 60` (ORPO: its own
    NLL): a round of pairs from the policy every 10 steps."""
    nll = {} if name == "orpo" else {"rpo_alpha": 1.0}
    config = Config.from_flat({"algorithm": name, "pairs_from": "policy", "max_steps": 60,
                               "output": str(tmp_path / name), **nll, **QUIET})
    result = train_preference(config)
    before, after = result["before"], result["after"]
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.10, (name, before, after)
    assert after["eval/pairwise_accuracy"] > before["eval/pairwise_accuracy"], (name, before, after)
