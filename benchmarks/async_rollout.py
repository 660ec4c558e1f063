"""Synchronous against asynchronous rollouts on the default run: throughput and held-out accuracy.

    python benchmarks/async_rollout.py --output runs/async [--only sync,k1] [--seeds 0,1] [--max-steps 250]
    python benchmarks/async_rollout.py --output runs/async --report-only [--figure docs/figures/async_rollout.png]

Each setting is the default run (``posttrain train``: GRPO on ``tiny-addition``) with the flags below,
trained one at a time (a figure that matters gets the machine alone). An asynchronous run gives the
trainer and the rollout process one torch thread each (``OMP_NUM_THREADS=1``): on 2 cores that beats
two threads each, which oversubscribes them. A finished run (``final_model/`` present) is not run again.
The report prints, per setting: wall time, the trainer's and the sampler's seconds per step, samples per
second, the mean staleness and mismatch KL, and held-out accuracy at every evaluation; with partial rollouts
also the tokens' staleness: its mean, the share of completions continued under newer weights, and the share
of trained tokens at each age (the distribution). ``--figure`` draws held-out accuracy against steps and
against training time. A request is interrupted only when it is still being sampled as the next weights
arrive: in the default run the sampler is faster than the trainer, so the ``-fp16`` settings make it slower
(a float16 sampling copy) to compare partial rollouts where sampling is the bottleneck.

The ``server-`` settings sample on a ``posttrain serve`` process (vLLM's CPU build, ``make vllm``) that the
script starts for each run, with the run's seed, in float32, and stops after it: the server and the trainer get
one torch thread each. With partial rollouts the server's requests are aborted when newer weights wait.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

SERVER = "{server}"
"""In a setting's flags: the URL of the rollout server the script starts for the run."""
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "sync": ([], {}),
    # one core's worth of trainer, sampling included: what K=1 becomes when its sampler has a core (a device)
    # of its own, as it does beside the one-thread trainer of the asynchronous settings
    "sync-1t": ([], {"OMP_NUM_THREADS": "1"}),
    "k1": (["--async-rollout", "--max-staleness", "1"], {"OMP_NUM_THREADS": "1"}),
    "k2": (["--async-rollout", "--max-staleness", "2"], {"OMP_NUM_THREADS": "1"}),
    "k1-tis": (["--async-rollout", "--max-staleness", "1", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k2-tis": (["--async-rollout", "--max-staleness", "2", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k8": (["--async-rollout", "--max-staleness", "8"], {"OMP_NUM_THREADS": "1"}),
    "k8-tis": (["--async-rollout", "--max-staleness", "8", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    # partial rollouts: a request still sampled when the next weights arrive continues under them
    "k1-partial-tis": (["--async-rollout", "--max-staleness", "1", "--partial-rollouts", "--correction",
                        "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k2-partial-tis": (["--async-rollout", "--max-staleness", "2", "--partial-rollouts", "--correction",
                        "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    # a sampler slower than the trainer: a float16 copy of the policy (no float16 arithmetic on these CPUs),
    # corrected for its precision as for its staleness; the synchronous run samples from the same copy
    "sync-fp16-tis": (["--sampler-dtype", "float16", "--correction", "token-truncate"], {}),
    "k1-fp16-tis": (["--async-rollout", "--max-staleness", "1", "--sampler-dtype", "float16", "--correction",
                     "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k1-partial-fp16-tis": (["--async-rollout", "--max-staleness", "1", "--partial-rollouts", "--sampler-dtype",
                             "float16", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k2-partial-fp16-tis": (["--async-rollout", "--max-staleness", "2", "--partial-rollouts", "--sampler-dtype",
                             "float16", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    # a rollout server (vLLM) on a core of its own, the trainer on the other
    "server-sync": (["--rollout-server", SERVER], ONE_THREAD),
    "server-k1-tis": (["--rollout-server", SERVER, "--async-rollout", "--max-staleness", "1", "--correction",
                       "token-truncate"], ONE_THREAD),
    "server-k1-partial-tis": (["--rollout-server", SERVER, "--async-rollout", "--max-staleness", "1",
                               "--partial-rollouts", "--correction", "token-truncate"], ONE_THREAD),
}


@contextmanager
def rollout_server(seed: int, log: Path):
    """A ``posttrain serve`` process of the default model on a free port, one thread, until the block ends."""
    import signal
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "--model", "tiny-addition", "--port",
                                str(port), "--dtype", "float32", "--seed", str(seed)],
                               env={**os.environ, **ONE_THREAD}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the rollout server did not start; its log: {log}") from None
                time.sleep(1)
        yield url
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:  # vLLM's engine and worker are the group's too
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_name(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}-seed{seed}"


def run(output: Path, name: str, seed: int, max_steps: int | None, extra: list[str]) -> None:
    flags, env = SETTINGS[name]
    run_dir = output / run_name(name, seed)
    if (run_dir / "final_model").exists():
        print(f"{name}: done already ({run_dir})", file=sys.stderr)
        return
    command = [sys.executable, "-m", "posttrain", "train", *flags, *extra, "--seed", str(seed), "--no-progress",
               "--output", str(run_dir)]
    if max_steps:
        command += ["--max-steps", str(max_steps)]
    output.mkdir(parents=True, exist_ok=True)
    with (rollout_server(seed, output / f"{run_dir.name}.server.log") if SERVER in flags else nullcontext()) as url:
        command = [url if flag == SERVER else flag for flag in command]
        start = time.perf_counter()
        with open(output / f"{run_dir.name}.log", "w") as log:
            subprocess.run(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, check=True)
    (run_dir / "wall_seconds").write_text(f"{time.perf_counter() - start:.1f}\n")
    print(f"{run_dir.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    config = {}
    for line in (run_dir / "config.yaml").read_text().splitlines():
        key, _, value = line.partition(":")
        config[key.strip()] = value.strip()
    samples = int(config.get("prompts_per_step", 0) or 0) * int(config.get("group_size", 0) or 0)

    def mean(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return sum(values) / len(values) if values else float("nan")

    ages = sorted({int(key.rsplit("/", 1)[1]) for r in steps for key in r if key.startswith("staleness/token_share/")})
    elapsed, curve = 0.0, []
    for r in rows:
        elapsed += r.get("time/step", 0.0)
        if "eval/accuracy" in r:
            curve.append((r["step"], elapsed, r["eval/accuracy"]))
    wall = run_dir / "wall_seconds"
    return {"steps": len(steps), "wall": float(wall.read_text()) if wall.exists() else float("nan"),
            "step_s": mean("time/step"), "generation_s": mean("time/generation"), "wait_s": mean("time/rollout_wait"),
            "training_s": mean("time/training"), "samples_per_s": samples / mean("time/step"),
            "staleness": mean("staleness/mean"), "kl_k3": mean("mismatch/kl_k3"), "curve": curve,
            "token_staleness": mean("staleness/token_mean"), "resumed_rows": mean("staleness/resumed_rows"),
            "token_shares": {age: mean(f"staleness/token_share/{age}") for age in ages}}


def report(output: Path, names: list[str], figure: Path | None) -> None:
    found = {name: summary(output / name) for name in names if (output / name / "metrics.jsonl").exists()}
    for name, s in found.items():
        after = [acc for step, _, acc in s["curve"] if step > 0]
        s["mean"] = sum(after) / len(after) if after else float("nan")
    print("| setting | wall | s/step | sampling s/step | trainer waits s/step | training s/step | samples/s "
          "| staleness | mismatch k3 KL | held-out accuracy (step: %) | mean after step 0 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in found.items():
        curve = ", ".join(f"{step}: {100 * acc:.1f}" for step, _, acc in s["curve"])
        print(f"| {name} | {s['wall']:.0f} s | {s['step_s']:.3f} | {s['generation_s']:.3f} | {s['wait_s']:.3f} "
              f"| {s['training_s']:.3f} | {s['samples_per_s']:.0f} | {s['staleness']:.2f} | {s['kl_k3']:.1e} | {curve} "
              f"| {100 * s['mean']:.1f} |")
    partial = {name: s for name, s in found.items() if s["token_shares"]}
    if partial:
        print("\n| setting | token staleness | completions continued under newer weights "
              "| trained tokens by age (versions behind: share) |")
        print("|---|---|---|---|")
        for name, s in partial.items():
            shares = ", ".join(f"{age}: {100 * share:.1f}%" for age, share in s["token_shares"].items())
            print(f"| {name} | {s['token_staleness']:.3f} | {100 * s['resumed_rows']:.1f}% | {shares} |")
    if figure is not None and found:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        colours = {"sync": "black", "k1": "tab:blue", "k2": "tab:green", "k8": "tab:red", "server": "tab:purple"}
        for name, s in found.items():
            steps, seconds, accuracy = zip(*s["curve"])
            base = name.split("-")[0]  # a setting's correction: the same colour, dashed
            style = dict(marker="o", markersize=3, label=name, color=colours.get(base),
                         linestyle=":" if "-partial" in name else "--" if "-tis" in name else "-")
            axes[0].plot(steps, [100 * a for a in accuracy], **style)
            axes[1].plot([t / 60 for t in seconds], [100 * a for a in accuracy], **style)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel("training time (min, evaluation excluded)")
        axes[0].set_ylabel("held-out accuracy (%)")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[1].legend()
        fig.tight_layout()
        figure.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(figure, dpi=100)
        print(f"figure: {figure}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("runs/async"))
    parser.add_argument("--only", default=",".join(SETTINGS), help="settings to run and report, comma-separated")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seeds", default="0", help="seeds to run each setting with, comma-separated (seed k > 0 "
                        "writes NAME-seedk)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--figure", type=Path, default=None)
    args, extra = parser.parse_known_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--only: unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if not args.report_only:
        for seed in seeds:
            for name in names:
                run(args.output, name, seed, args.max_steps, extra)
    report(args.output, [run_name(name, seed) for name in names for seed in seeds], args.figure)


if __name__ == "__main__":
    main()
