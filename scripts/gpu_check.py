"""The figures of ``scripts/gpu_check.sh``, put into one JSON, and the two-process scenario it runs.

    python scripts/gpu_check.py report OUT              # OUT/gpu_check.json from what the steps left
    python scripts/gpu_check.py prepare DATA            # the two-process check's model, prompts, reward
    python scripts/gpu_check.py distributed DATA RUN    # that check's training (alone, or under torchrun)

Every step of the shell script leaves ``OUT/STEP.status`` (``{"exit_code": N, "seconds": S}``, or
``{"skipped": "why"}``), ``OUT/STEP.log`` and, when it trains, the run directory ``OUT/STEP/``. A step
that failed or was skipped is recorded as such, with the end of its log; the other steps' figures are
still reported. The steps:

- ``smollm2_bf16``: GRPO on SmolLM2-135M-Instruct in bfloat16 mixed precision, the Hugging Face sampler;
- ``packed_attention``: the packed training passes' GPU kernel (PyTorch's FlashAttention ``varlen_attn``
  over the layout's segments) against one SDPA call per group, outputs and gradients, bf16 and fp16;
- ``vllm``: the same with ``--backend vllm``; vLLM's log-probs of the sampled tokens against the
  trainer's are the ``mismatch/`` metrics the run logs (KL k1 and k3 per token, effective sample size);
- ``vllm_tests``: the tests that start real vLLM engines and ``posttrain serve`` processes (pytest -m vllm);
- ``nccl_one``, ``nccl_two``: the scenario of ``tests/test_distributed.py`` (a fixed generator, so
  that the processes' sampling streams do not matter) on the GPU, in one process and in two over NCCL;
  the report gives the largest difference of their losses and final weights (float32 sums in another
  order: equal up to rounding).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

STEPS = ("smollm2_bf16", "packed_attention", "vllm", "vllm_tests", "nccl_one", "nccl_two")
TOLERANCE = 1e-4
"""Largest difference of a weight or a loss for which one process and two count as equal."""
LOG_TAIL_LINES = 15


def read_status(out: Path, step: str) -> dict[str, Any]:
    """The step's status file, or ``{"skipped": "not run"}`` when the script never reached it."""
    path = out / f"{step}.status"
    return json.loads(path.read_text()) if path.is_file() else {"skipped": "not run"}


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log (where a failure says what went wrong)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def training_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` that a training step logged (they have a ``loss``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "loss" in row]


def run_figures(run_dir: Path) -> dict[str, Any]:
    """Per step: seconds, loss, mean reward; and the ``mismatch/`` and ``sync/`` metrics' means over the steps
    that have them (a run whose sampler returns log-probs; a sampler with weights of its own, whose probe
    log-probs after each weight sync are checked against the trainer's)."""
    rows = training_rows(run_dir)
    figures: dict[str, Any] = {
        "steps": len(rows),
        "seconds_per_step": [row.get("time/step") for row in rows],
        "loss": [row["loss"] for row in rows],
        "reward_mean": [row.get("reward/mean") for row in rows],
    }
    mismatch = sorted({key for row in rows for key in row if key.startswith(("mismatch/", "sync/"))})
    for key in mismatch:
        values = [row[key] for row in rows if key in row]
        figures[key] = sum(values) / len(values)
    return figures


def max_weight_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between two final models' weights (``inf`` when their tensors differ
    in names or shapes)."""
    from safetensors.torch import load_file

    wa, wb = (load_file(run / "final_model" / "model.safetensors") for run in (a, b))
    if wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
        return math.inf
    return max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)


def step_record(out: Path, step: str) -> dict[str, Any]:
    """``status`` (ok, failed, skipped), its seconds and exit code, and the run's figures when it ran; the end
    of its log when it failed."""
    status = read_status(out, step)
    if "skipped" in status:
        return {"status": "skipped", "reason": status["skipped"]}
    record = {"status": "ok" if status["exit_code"] == 0 else "failed", **status}
    run_dir = out / step
    if record["status"] == "ok" and (run_dir / "metrics.jsonl").is_file():
        record["figures"] = run_figures(run_dir)
    if record["status"] == "failed":
        record["log_tail"] = log_tail(out / f"{step}.log")
    return record


def nccl_comparison(out: Path, one: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    """One process against two: the largest loss and weight differences, and whether both are within
    :data:`TOLERANCE`; empty unless both runs succeeded."""
    if one["status"] != "ok" or two["status"] != "ok":
        return {}
    losses = zip(one["figures"]["loss"], two["figures"]["loss"], strict=True)
    loss_difference = max(abs(a - b) for a, b in losses)
    weight_difference = max_weight_difference(out / "nccl_one", out / "nccl_two")
    return {"max_abs_loss_difference": loss_difference, "max_abs_weight_difference": weight_difference,
            "equal": max(loss_difference, weight_difference) <= TOLERANCE, "tolerance": TOLERANCE}


def assemble(out: Path, environment: dict[str, Any]) -> dict[str, Any]:
    """The whole report: the machine, every step's record, and the one-against-two comparison."""
    records = {step: step_record(out, step) for step in STEPS}
    return {"environment": environment, "steps": records,
            "nccl_one_vs_two": nccl_comparison(out, records["nccl_one"], records["nccl_two"])}


def environment() -> dict[str, Any]:
    """Versions and devices of this machine."""
    import importlib.metadata

    import torch
    import transformers

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": version("vllm"),
            "cuda": torch.version.cuda, "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu": torch.cuda.get_device_name(0) if cuda else None}


def prepare(data: Path) -> None:
    """The tiny model and reward file the CPU tests use (tests/conftest.py), and the two-process test's
    prompts (tests/test_distributed.py), written once before the processes start."""
    from conftest import REWARDS
    from test_distributed import write_data

    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    data.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer("0123456789+=,|")
    model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(data / "model")
    tokenizer.save_pretrained(data / "model")
    (data / "rewards.py").write_text(REWARDS)
    write_data(data)


def distributed(data: Path, run_dir: Path) -> None:
    """GRPO for two steps on the GPU with the fixed generator of tests/test_distributed.py: the same
    completions whatever the process count, so one process and two must end with the same weights."""
    from test_distributed import fixed_session, online_config

    from posttrain.training.online import train_step
    from posttrain.training.runner import run_training
    from posttrain.training.session import evaluate

    config = online_config(data, data / "model", data / "rewards.py", "grpo", device="cuda", output=str(run_dir),
                           eval_size=0, log_samples_every=0)
    run_training(fixed_session(config), config, train_step, evaluate)


def main(argv: list[str]) -> int:
    command, *paths = argv
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU tests' scenario
    if command == "report":
        out = Path(paths[0])
        report = assemble(out, environment())
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"gpu_check: figures in {out / 'gpu_check.json'}")
        for step, record in report["steps"].items():
            print(f"  {step}: {record['status']}" + (f" ({record['reason']})" if "reason" in record else ""))
        return 0
    if command == "prepare":
        prepare(Path(paths[0]))
        return 0
    if command == "distributed":
        distributed(Path(paths[0]), Path(paths[1]))
        return 0
    print(f"gpu_check.py: unknown command {command!r}; use report, prepare or distributed", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
