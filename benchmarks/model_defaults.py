"""A real model at default settings: what the run chooses, how much memory and time a step takes, and whether
the model gets worse.

    .venv/bin/python benchmarks/model_defaults.py                         # SmolLM2, full and LoRA, seeds 0-2
    .venv/bin/python benchmarks/model_defaults.py --lora 16 --seeds 0 --steps 5

Runs ``posttrain train --model smollm2-135m --task gsm --seed S --max-steps N --eval-size E`` (and the same with
``--lora-r 16``), nothing else set, one process at a time, and prints per run: the defaults line the run
printed (posttrain.training.defaults), the estimated peak, the measured peak resident memory of the process
(``ru_maxrss``), the median seconds per step (``time/step``), and held-out greedy accuracy before and after.
Needs the SmolLM2 GGUF (``make test-smollm2``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(lora: int, seed: int, steps: int, eval_size: int, out: Path) -> dict:
    output = out / f"lora{lora}-seed{seed}"
    argv = ["posttrain", "train", "--model", "smollm2-135m", "--task", "gsm", "--seed", str(seed), "--max-steps",
            str(steps), "--eval-size", str(eval_size), "--output", str(output), "--report-to", "none", "--no-progress",
            *(["--lora-r", str(lora)] if lora else [])]
    # the child reports its own peak resident memory as it exits (ru_maxrss of the children would be the
    # largest of every run so far)
    child = (f"import atexit, resource, runpy, sys; sys.argv = {argv!r}; atexit.register(lambda: print("
             "'PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
             "runpy.run_module('posttrain.cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, check=True, capture_output=True, text=True)
    peak_kib = int(next(line for line in done.stderr.splitlines() if line.startswith("PEAK_KIB")).split()[1])
    defaults = next((line for line in done.stderr.splitlines() if "defaults for" in line), "")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    return {"defaults": defaults.split("] ", 1)[-1], "peak_gib": peak_kib / 2**20,
            "step_s": statistics.median(row["time/step"] for row in rows if "time/step" in row),
            "before": accuracy[0], "after": accuracy[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora", type=int, nargs="+", default=[0, 16], help="LoRA ranks (0: full fine-tuning)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for lora in args.lora:
            for seed in args.seeds:
                r = one_run(lora, seed, args.steps, args.eval_size, Path(scratch))
                print(f"{'LoRA r' + str(lora) if lora else 'full':8s} seed {seed}: peak {r['peak_gib']:.1f} GiB, "
                      f"{r['step_s']:.0f} s/step, held-out {r['before']:.3f} -> {r['after']:.3f}\n    {r['defaults']}",
                      flush=True)


if __name__ == "__main__":
    main()
