"""Real learning on the built-in task (slow: minutes per preset; `make test-slow`).

GRPO, DAPO and GSPO each start from the built-in tiny-addition model (38.6%
held-out greedy accuracy) and must end well above it with the default settings.
"""

from __future__ import annotations

import pytest

from posttrain.config import Config
from posttrain.train import train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo"])
def test_online_preset_raises_held_out_accuracy(name, tmp_path):
    config = Config.from_flat({"algorithm": name, "output": str(tmp_path / name), "progress": False,
                               "tensorboard": False, "eval_every": 0, "save_every": 0})
    result = train(config)
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.15, f"{name}: held-out accuracy {before:.3f} -> {after:.3f}"
