"""Where a GRPO step's peak memory goes, and how low each memory setting takes it.

    .venv/bin/python benchmarks/memory.py                 # SmolLM2-135M-Instruct, benchmarks/run.py's grpo-smollm2
    .venv/bin/python benchmarks/memory.py --model tiny    # the 3.2M-parameter benchmark model
    .venv/bin/python benchmarks/memory.py --trl           # and TRL's peak on the same work, for the ratio

Runs benchmarks/run.py's GRPO configuration (4 prompts x 4 samples x 32 tokens, fp32 full fine-tune,
k3 KL to a reference model with beta 0.04) through posttrain with one memory setting per child
process, so each peak RSS (``ru_maxrss``) is that setting's:

- ``default``: as benchmarks/run.py runs it (one micro-batch of all 16 rows);
- ``reference offload``: and ``offload_reference`` (the reference's weights in a file between passes);
- ``both offloads``: and ``offload_optimizer`` (AdamW's moments in a file between steps);
- ``micro-batch 4``: the default with one group per forward/backward pass (the same gradient);
- ``+ checkpointing``: and ``gradient_checkpointing`` (each decoder layer recomputed in the backward);
- ``+ both offloads``: and both offloads: all four memory options;
- ``+ glibc malloc``: and ``POSTTRAIN_MALLOC=default`` (freed memory goes back to the kernel);
- ``no reference (bound)``: all four options' row without a reference at all (``beta 0``). That is
  another algorithm (no KL term); it is the floor for any way of keeping the reference out of memory.

Beside the measured peaks it prints the floor that the state of an fp32 AdamW full fine-tune puts
under any of them: the process's RSS after importing torch, transformers' model code and posttrain,
plus 4 bytes per parameter for each of the weights, their gradient and AdamW's two moments (the
gradient and the moments coexist at the optimizer step), plus the reference copy's weights; and
the floor with both offloaded: the imports, the weights and the gradient.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402  (benchmarks/run.py: the shared configuration and its runners)

OFFLOADS = {"offload_reference": True, "offload_optimizer": True}
SMALL = {"micro_batch_size": 4, "gradient_checkpointing": True}
VARIANTS: dict[str, tuple[dict, dict]] = {  # name: (config overrides, environment)
    "default": ({}, {}),
    "reference offload": ({"offload_reference": True}, {}),
    "both offloads": (OFFLOADS, {}),
    "micro-batch 4": ({"micro_batch_size": 4}, {}),
    "+ checkpointing": (SMALL, {}),
    "+ both offloads": ({**SMALL, **OFFLOADS}, {}),
    "+ glibc malloc": ({**SMALL, **OFFLOADS}, {"POSTTRAIN_MALLOC": "default"}),
    "no reference (bound)": ({**SMALL, "offload_optimizer": True, "beta": 0.0}, {}),
}


def rss_gb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 2**20


def child(model: str, variant: str, total: int, result: Path) -> None:
    import posttrain.training.online  # noqa: F401  (the imports every run pays, before any model exists)
    import posttrain.training.session  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    imports_gb = rss_gb()
    overrides, _ = VARIANTS[variant]
    b = bench.BENCHES[f"grpo-{model}"]
    path = bench.model_dir(b.model)
    with tempfile.TemporaryDirectory(prefix="posttrain-memory-") as data:
        records = bench.posttrain_grpo(b, path, Path(data), total, **overrides)
    result.write_text(json.dumps({
        "imports_gb": imports_gb, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "s_per_step": statistics.median(r["seconds"] for r in records[1:]), "parameters": parameter_count(path),
    }))


def parameter_count(model_dir: Path) -> int:
    """Parameters stored in a model directory's safetensors files (tied weights are stored once)."""
    count = 0
    for file in model_dir.glob("*.safetensors"):
        with file.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count += math.prod(entry["shape"])
    return count


def run_child(args: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="posttrain-memory-") as folder:
        result, log = Path(folder) / "result.json", Path(folder) / "log"
        with log.open("w") as handle:
            code = subprocess.call([sys.executable, *args, "--result", str(result)], stdout=handle, stderr=handle,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})
        if code != 0:
            tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
            raise SystemExit(f"{' '.join(args)} failed (exit {code}):\n{tail}")
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is not timed (default 3)")
    parser.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer on the same work")
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.steps, args.result)
        return
    if args.steps < 2:
        raise SystemExit("--steps: use 2 or more (the first step is not timed)")

    bench.model_dir(args.model)  # build or convert once, before any measured run
    rows = []
    for name in args.only or list(VARIANTS):
        run = run_child([__file__, "--child", args.model, name, "--steps", str(args.steps)], VARIANTS[name][1])
        rows.append((name, run))
        print(f"{name:22s} peak {run['peak_gb']:.2f} GB  {run['s_per_step']:.2f} s/step", flush=True)
    trl = None
    if args.trl:
        with tempfile.TemporaryDirectory(prefix="posttrain-memory-trl-") as logs:
            trl = bench.run_child(f"grpo-{args.model}", "trl", 1, args.steps - 1, None, Path(logs))
        trl = {"peak_gb": trl["peak_rss_gb"], "s_per_step": statistics.median(s["seconds"] for s in trl["steps"])}
        print(f"{'TRL GRPOTrainer':22s} peak {trl['peak_gb']:.2f} GB  {trl['s_per_step']:.2f} s/step", flush=True)

    first = rows[0][1]
    state_gb = first["parameters"] * 4 / 2**30
    floor = first["imports_gb"] + 4 * state_gb
    print(f"\n{bench.BENCHES[f'grpo-{args.model}'].describe()}; {first['parameters'] / 1e6:.1f}M parameters; "
          f"{args.steps} steps, the first untimed; load average {os.getloadavg()[0]:.2f}\n")
    print("| setting | peak RSS GB | s/step |" + (" peak / TRL's | s/step / TRL's |" if trl else ""))
    print("|---|---|---|" + ("---|---|" if trl else ""))
    for name, run in rows:
        line = f"| {name} | {run['peak_gb']:.2f} | {run['s_per_step']:.2f} |"
        if trl:
            line += f" {run['peak_gb'] / trl['peak_gb']:.2f} | {run['s_per_step'] / trl['s_per_step']:.2f} |"
        print(line)
    if trl:
        print(f"| TRL GRPOTrainer | {trl['peak_gb']:.2f} | {trl['s_per_step']:.2f} | 1 | 1 |")
    print(f"\nfloor of an fp32 AdamW full fine-tune: imports {first['imports_gb']:.2f} GB + weights, gradient and two "
          f"moments 4 x {state_gb:.2f} GB = {floor:.2f} GB; with the reference copy {floor + state_gb:.2f} GB; "
          f"with the reference and the moments offloaded {first['imports_gb'] + 2 * state_gb:.2f} GB"
          + (f"; 0.6 x TRL's peak = {0.6 * trl['peak_gb']:.2f} GB" if trl else ""))


if __name__ == "__main__":
    main()
