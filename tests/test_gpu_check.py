"""scripts/gpu_check.sh: its posttrain command lines parse with the CLI's own parser, it exits at once
without CUDA, and scripts/gpu_check.py turns what its steps leave into the JSON of figures."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from posttrain.cli import build_parser, resolve_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def command_arrays(out: str) -> dict[str, list[str]]:
    """The script's posttrain command lines (the bash arrays after "# The posttrain command lines"), as
    bash expands them with ``OUT=out``."""
    text = SCRIPT.read_text()
    block = text.split("# The posttrain command lines", 1)[1].split("\n\n", 1)[0].split("\n", 1)[1]
    names = re.findall(r"^([A-Z0-9_]+)=\(", block, re.MULTILINE)
    printing = "; ".join(f'printf "%s\\0" "{name}" "${{{name}[@]}}"; printf "\\0"' for name in names)
    expanded = subprocess.run(["bash", "-c", f"OUT={out}\n{block}\n{printing}"], capture_output=True, text=True,
                              check=True).stdout
    arrays = {}
    for chunk in expanded.split("\0\0"):
        if chunk:
            name, *tokens = chunk.split("\0")
            arrays[name] = tokens
    return arrays


def test_every_posttrain_command_line_of_the_script_parses(tmp_path):
    arrays = command_arrays(str(tmp_path))
    assert set(arrays) == {"SMOLLM2_BF16", "VLLM"}
    # every posttrain command the script runs is one of these arrays, so none escapes the check below
    calls = [line for line in SCRIPT.read_text().splitlines() if "posttrain.cli" in line]
    assert calls and all(re.search(r'posttrain\.cli "\$\{(\w+)\[@\]\}"$', line).group(1) in arrays for line in calls)
    configs = {}
    for name, tokens in arrays.items():
        args = build_parser().parse_args(tokens)  # an unknown flag (--no-tensorboard was one) exits here
        configs[name] = resolve_config(args)  # and a value the config refuses raises here
    smollm2, vllm = configs["SMOLLM2_BF16"], configs["VLLM"]
    assert (smollm2.model.model, smollm2.model.mixed_precision, smollm2.model.device) == ("smollm2-135m", "bf16", "cuda")
    assert (smollm2.algorithm, smollm2.run.max_steps, smollm2.rollout.backend) == ("grpo", 2, "hf")
    assert (vllm.rollout.backend, vllm.run.output, vllm.model.mixed_precision) == ("vllm", f"{tmp_path}/vllm", "bf16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_the_script_says_so_and_exits_0(tmp_path):
    started = time.perf_counter()
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")})
    assert done.returncode == 0, done.stderr
    assert "gpu_check: no CUDA device here" in done.stdout
    assert not (tmp_path / "out").exists() and time.perf_counter() - started < 60


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(out: Path, name: str, status: dict, rows: list[dict] = (), weights: dict | None = None, log: str = "") -> None:
    (out / f"{name}.status").write_text(json.dumps(status))
    (out / f"{name}.log").write_text(log)
    if rows:
        (out / name).mkdir()
        (out / name / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if weights is not None:
        (out / name / "final_model").mkdir()
        save_file(weights, str(out / name / "final_model" / "model.safetensors"))


def test_the_report_holds_every_steps_figures_and_the_one_against_two_comparison(gpu_check, tmp_path):
    step0 = {"step": 0, "eval/accuracy": 0.5}
    _step(tmp_path, "smollm2_bf16", {"exit_code": 0, "seconds": 41},
          [step0, {"step": 1, "loss": 0.25, "time/step": 3.0, "reward/mean": 0.5},
           {"step": 2, "loss": -0.5, "time/step": 1.0, "reward/mean": 0.75}])
    _step(tmp_path, "vllm", {"exit_code": 0, "seconds": 90},
          [{"step": 1, "loss": 0.1, "time/step": 2.0, "reward/mean": 0.5, "mismatch/kl_k1": 0.002, "mismatch/ess": 0.99},
           {"step": 2, "loss": 0.2, "time/step": 1.0, "reward/mean": 0.5, "mismatch/kl_k1": 0.004, "mismatch/ess": 0.97}])
    one = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    two = {"w": torch.tensor([1.0, 2.0 + 2**-16]), "b": torch.tensor([0.5])}  # 1.5e-5 apart: rounding
    _step(tmp_path, "nccl_one", {"exit_code": 0, "seconds": 9}, [{"step": 1, "loss": 0.125}, {"step": 2, "loss": 0.5}], one)
    _step(tmp_path, "nccl_two", {"exit_code": 0, "seconds": 12}, [{"step": 1, "loss": 0.125}, {"step": 2, "loss": 0.5}], two)
    report = gpu_check.assemble(tmp_path, {"gpu": "test"})
    steps = report["steps"]
    assert steps["smollm2_bf16"] == {"status": "ok", "exit_code": 0, "seconds": 41, "figures": {
        "steps": 2, "seconds_per_step": [3.0, 1.0], "loss": [0.25, -0.5], "reward_mean": [0.5, 0.75]}}
    vllm = steps["vllm"]["figures"]
    assert vllm["mismatch/kl_k1"] == pytest.approx(0.003) and vllm["mismatch/ess"] == pytest.approx(0.98)
    assert report["nccl_one_vs_two"] == {"max_abs_loss_difference": 0.0, "max_abs_weight_difference": 2**-16,
                                         "equal": True, "tolerance": 1e-4}
    assert report["environment"] == {"gpu": "test"}


def test_a_failed_or_skipped_step_is_recorded_and_the_rest_reported(gpu_check, tmp_path):
    _step(tmp_path, "smollm2_bf16", {"exit_code": 1, "seconds": 5},
          log="\n".join(f"line {i}" for i in range(30)) + "\nRuntimeError: CUDA out of memory")
    _step(tmp_path, "vllm", {"skipped": "vllm is not installed"})
    _step(tmp_path, "nccl_one", {"exit_code": 0, "seconds": 9}, [{"step": 1, "loss": 0.125}], {"w": torch.zeros(2)})
    _step(tmp_path, "nccl_two", {"exit_code": 0, "seconds": 9}, [{"step": 1, "loss": 0.375}], {"w": torch.ones(2)})
    report = gpu_check.assemble(tmp_path, {})
    failed = report["steps"]["smollm2_bf16"]
    assert (failed["status"], failed["exit_code"]) == ("failed", 1)
    assert failed["log_tail"].splitlines()[-1] == "RuntimeError: CUDA out of memory"
    assert len(failed["log_tail"].splitlines()) == gpu_check.LOG_TAIL_LINES
    assert report["steps"]["vllm"] == {"status": "skipped", "reason": "vllm is not installed"}
    assert report["nccl_one_vs_two"]["equal"] is False
    assert report["nccl_one_vs_two"]["max_abs_loss_difference"] == 0.25
    # a step the script never reached (killed before it) is said to be so
    (tmp_path / "nccl_two.status").unlink()
    assert report_steps(gpu_check, tmp_path)["nccl_two"] == {"status": "skipped", "reason": "not run"}
    assert gpu_check.assemble(tmp_path, {})["nccl_one_vs_two"] == {}


def report_steps(gpu_check, out: Path) -> dict:
    return gpu_check.assemble(out, {})["steps"]
