"""Routing replay against a mixture of experts' sampler-trainer mismatch: a bf16 sampler, a float32 trainer.

    .venv/bin/python benchmarks/routing_replay.py                     # 60 steps, seeds 0 and 1
    .venv/bin/python benchmarks/routing_replay.py --steps 250 --seeds 0 1 2

Runs ``posttrain train --model tiny-addition-moe`` (a Qwen3-MoE body: 4 experts, 2 per token; the default
task and settings) three ways, one process at a time:

- ``fp32 sampler``: the policy samples itself (the mismatch floor: the decode loop against the packed pass);
- ``bf16 sampler``: a bfloat16 copy samples (``--sampler-dtype bfloat16``), the float32 policy trains, its
  routers choosing again for every token;
- ``bf16 sampler + replay``: the same with ``--routing-replay``: the training passes take the experts the bf16
  sampler chose.

Per run it prints the mean over steps of the sampler-trainer KL on the sampled tokens (``mismatch/kl_k3`` and
``kl_k1``), the importance weights' effective sample size (``mismatch/ess``), the step time, and the held-out
accuracy before and after. A bf16 router rounds its logits, so near-ties go to other experts than the float32
router picks: those tokens are computed by different experts in the two engines, and replay removes exactly
that part of the mismatch, leaving bf16's rounding of the experts' own arithmetic.
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
SETTINGS = {
    "fp32 sampler": [],
    "bf16 sampler": ["--sampler-dtype", "bfloat16"],
    "bf16 sampler + replay": ["--sampler-dtype", "bfloat16", "--routing-replay"],
}


def run(name: str, seed: int, steps: int, out: Path) -> dict[str, float]:
    """One training run in its own process; the means of its logged mismatch over steps."""
    output = out / f"{name.replace(' ', '-').replace('+', 'and')}-{seed}"
    command = [sys.executable, "-m", "posttrain.cli", "train", "--model", "tiny-addition-moe", "--seed", str(seed),
               "--max-steps", str(steps), "--output", str(output), "--report-to", "none", "--no-progress",
               "--eval-every", "0", *SETTINGS[name]]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps_ = [row for row in rows if "mismatch/kl_k3" in row]
    evals = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    mean = lambda key: statistics.fmean(row[key] for row in steps_)  # noqa: E731
    return {"kl_k3": mean("mismatch/kl_k3"), "kl_k1": mean("mismatch/kl_k1"), "ess": mean("mismatch/ess"),
            "step_s": mean("time/step"), "before": evals[0], "after": evals[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        print(f"{'setting':24s} {'seed':>4s} {'kl_k3':>10s} {'kl_k1':>10s} {'ess':>8s} {'s/step':>7s} "
              f"{'held-out before -> after':>26s}")
        for seed in args.seeds:
            for name in SETTINGS:
                r = run(name, seed, args.steps, Path(scratch))
                print(f"{name:24s} {seed:4d} {r['kl_k3']:10.2e} {r['kl_k1']:10.2e} {r['ess']:8.4f} {r['step_s']:7.2f} "
                      f"{r['before']:13.3f} -> {r['after']:.3f}", flush=True)


if __name__ == "__main__":
    main()
