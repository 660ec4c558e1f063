"""Real learning on the built-in task (slow: minutes per preset; `make test-slow`).

GRPO, DAPO and GSPO each start from the built-in tiny-addition model (about 40%
held-out greedy accuracy) and must end well above it with the default settings;
GRPO also in mixed precision.
"""

from __future__ import annotations

import pytest

from posttrain.config import Config
from posttrain.train import train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name, precision", [("grpo", "no"), ("dapo", "no"), ("gspo", "no"), ("grpo", "bf16")])
def test_online_preset_raises_held_out_accuracy(name, precision, tmp_path):
    """Also GRPO in mixed precision (the decoder under bfloat16 autocast), where the CPU has bfloat16."""
    from posttrain.modeling import resolve_device
    from posttrain.models.loading import bf16_supported

    if precision == "bf16" and not bf16_supported(resolve_device("auto")):
        pytest.skip("no native bfloat16 here (a CPU needs AVX512-BF16 or AMX)")
    config = Config.from_flat({"algorithm": name, "output": str(tmp_path / name), "progress": False,
                               "report_to": "none", "eval_every": 0, "save_every": 0,
                               "mixed_precision": precision})
    result = train(config)
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.15, f"{name}: held-out accuracy {before:.3f} -> {after:.3f}"
