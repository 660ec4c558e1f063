"""``posttrain compare``: several presets on one task, model, data order and budget, K seeds each.

    posttrain compare --algorithms grpo,dapo,dr_grpo --task addition --max-steps 100 --seeds 3 \\
        --output runs/lineage [--jobs 2] [--target 0.5] [--FIELD VALUE ...]
    posttrain report RUN_DIR... [--output DIR] [--target 0.5]

``DIR/<algorithm>/seed<k>/`` is an ordinary run directory (``posttrain train``'s layout) for seed k
of 0..K-1, with two more files: ``train.log`` (the run's stdout and stderr) and ``resources.json``.
Every other flag is a config or preset field passed to every run. When all runs are done the
report (``posttrain.report.html``) is written to ``DIR/report.html`` and ``DIR/figures/``.

Decisions:

1. **Each run trains in its own child process** (``python -m posttrain.report.compare SPEC``), ``--jobs``
   of them at a time with ``cpu_count // jobs`` torch threads each. The child measures itself:
   its peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``) is that run's alone, not the
   largest of all runs of the comparison, and a crashed or killed run loses only itself.
2. **``resources.json`` is written by the training process after ``train()`` returns**, after
   ``final_model/`` and the last metrics line: ``{"max_steps", "steps", "wall_seconds",
   "peak_rss_mib", "peak_cuda_mib", "threads", "segments"}``. ``wall_seconds`` is the child's
   whole life (model loading and evaluations included) summed over the segments that finished;
   a segment killed mid-way leaves no record. Curves against time use the logged ``time/step``
   instead (``posttrain.report.runs``), which a resume keeps exact.
3. **Resumable**: a run is *finished* when ``final_model/`` and ``resources.json`` exist and the
   latter's ``max_steps`` is at least the requested one (a run that ``max_minutes`` stopped early
   is finished too); it is skipped. A run with ``metrics.jsonl`` and a complete checkpoint is
   resumed from it (``resume``), also when a finished run is asked for more steps. Anything else
   (nothing yet, or killed before its first checkpoint) starts afresh in an emptied directory.
4. **Same flags or a new directory**: a run directory whose ``config.yaml`` differs from the
   requested config in any field but ``output``, ``resume``, ``max_steps`` and ``progress`` is an
   error, so a finished run is never silently reused under other settings.
5. Runs are validated (``Config.from_flat``) all at once before the first one starts; a failed run
   does not stop the others, the report shows what exists, and the command exits 1 naming the
   failed runs' logs. Children log to files, so progress bars are off unless ``--progress``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from posttrain.config import Config, ConfigError, load_yaml

RESOURCES_FILE = "resources.json"
LOG_FILE = "train.log"
MAY_DIFFER = frozenset({"output", "resume", "max_steps", "progress"})  # decision 4
_OWN_ARGS = ("command", "algorithms", "seeds", "output", "jobs", "target", "config", "runs")


@dataclass(frozen=True)
class Job:
    """One (algorithm, seed) run of a comparison."""

    algorithm: str
    seed: int
    run_dir: Path
    flat: dict[str, Any]  # the run's whole config, Config.to_flat()

    @property
    def label(self) -> str:
        return f"{self.algorithm}/seed{self.seed}"


# ---------------------------------------------------------------------------------------
# Planning: which runs, in which state
# ---------------------------------------------------------------------------------------


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    """``K`` -> seeds 0..K-1; a sequence -> those seeds (to add seeds to a comparison run before)."""
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"seeds: got {seeds}; use 1 or more")
        return list(range(seeds))
    if not seeds or any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: got {','.join(map(str, seeds))}; name distinct seeds >= 0, e.g. 1,2")
    return list(seeds)


def parse_seeds(text: str) -> int | list[int]:
    """``--seeds``: a count (``3``: seeds 0, 1, 2) or a comma-separated list (``1,2``; one seed: ``1,``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()] if "," in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count of seeds nor a list such as 1,2") from None


def plan(algorithms: list[str], seeds: int | Sequence[int], flat: dict[str, Any], output: Path) -> list[Job]:
    """One job per (algorithm, seed), each config validated before anything runs."""
    if not algorithms:
        raise ConfigError("algorithms: name at least one preset, e.g. --algorithms grpo,dapo")
    if len(set(algorithms)) != len(algorithms):
        raise ConfigError(f"algorithms: {','.join(algorithms)} names a preset twice")
    jobs = []
    for name in algorithms:
        for seed in seed_list(seeds):
            run_dir = output / name / f"seed{seed}"
            try:
                config = Config.from_flat({**flat, "algorithm": name, "seed": seed, "output": str(run_dir)})
            except ConfigError:
                raise
            except ValueError as error:  # an unknown preset or a value it rejects
                raise ConfigError(str(error)) from error
            jobs.append(Job(name, seed, run_dir, config.to_flat()))
    return jobs


def read_resources(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RESOURCES_FILE
    return json.loads(path.read_text()) if path.exists() else None


def run_state(job: Job) -> str:
    """``done``, ``resume`` or ``new`` (decision 3)."""
    from posttrain.tracking.metrics import METRICS_FILE
    from posttrain.training.checkpoint import FINAL_MODEL_DIR, latest_checkpoint

    resources = read_resources(job.run_dir)
    if (resources is not None and (job.run_dir / FINAL_MODEL_DIR).is_dir()
            and resources["max_steps"] >= job.flat["max_steps"]):
        return "done"
    if (job.run_dir / METRICS_FILE).exists() and latest_checkpoint(job.run_dir) is not None:
        return "resume"
    return "new"


def check_same_config(job: Job) -> None:
    """A run directory made with other settings is an error, not a silent reuse (decision 4)."""
    path = job.run_dir / "config.yaml"
    if not path.exists():
        return
    stored = load_yaml(path)
    wanted = yaml.safe_load(yaml.safe_dump(job.flat))  # the same YAML round trip as the stored file
    # fields on one side only come from another posttrain version: their defaults are what ran
    differ = sorted(k for k in stored.keys() & wanted.keys() if k not in MAY_DIFFER and stored[k] != wanted[k])
    if differ:
        shown = ", ".join(f"{k}={stored[k]!r} (now {wanted[k]!r})" for k in differ)
        raise ConfigError(f"output: {job.run_dir} was run with {shown}; "
                          "repeat its flags to continue it, or compare into a new --output")


# ---------------------------------------------------------------------------------------
# Running: child processes, J at a time
# ---------------------------------------------------------------------------------------


def launch(job: Job, state: str, threads: int) -> subprocess.Popen:
    """Start the job's training process; its output goes to ``train.log``."""
    flat = dict(job.flat)
    if state == "resume":
        flat["resume"] = str(job.run_dir)
    elif job.run_dir.exists():
        shutil.rmtree(job.run_dir)  # a run killed before its first checkpoint: nothing to resume from
    job.run_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"config": flat, "threads": threads})
    with (job.run_dir / LOG_FILE).open("a") as log:
        return subprocess.Popen([sys.executable, "-m", "posttrain.report.compare", spec], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def run_jobs(jobs: list[Job], parallel: int) -> list[Job]:
    """Run the unfinished jobs, ``parallel`` at a time; return the ones that failed."""
    todo = []
    for job in jobs:
        check_same_config(job)
        state = run_state(job)
        if state == "done":
            _say(f"{job.label}: finished before, skipped")
        else:
            todo.append((job, state))
    threads = max(1, (os.cpu_count() or 1) // parallel)
    running: dict[subprocess.Popen, tuple[Job, float]] = {}
    failed = []
    try:
        while todo or running:
            while todo and len(running) < parallel:
                job, state = todo.pop(0)
                _say(f"{job.label}: {'resuming' if state == 'resume' else 'starting'} (log: {job.run_dir / LOG_FILE})")
                running[launch(job, state, threads)] = (job, time.perf_counter())
            time.sleep(0.2)
            for process in [p for p in running if p.poll() is not None]:
                job, started = running.pop(process)
                seconds = time.perf_counter() - started
                if process.returncode == 0:
                    peak = read_resources(job.run_dir)["peak_rss_mib"]
                    _say(f"{job.label}: done in {seconds:.0f} s, peak memory {peak:.0f} MiB")
                else:
                    failed.append(job)
                    _say(f"{job.label}: FAILED (exit {process.returncode}); see {job.run_dir / LOG_FILE}")
    finally:
        for process in running:  # interrupted: stop our children; the next call resumes them
            process.terminate()
            process.wait()
    return failed


def compare(algorithms: list[str], *, seeds: int | Sequence[int], output: str | Path, flat: dict[str, Any],
            jobs: int = 1, target: float | None = None) -> dict[str, Any]:
    """Run every (algorithm, seed) not finished yet and write the report; returns its path,
    the run directories and the failed ones."""
    from posttrain.report.html import build_report

    if jobs < 1:
        raise ConfigError(f"jobs: got {jobs}; use 1 or more parallel runs")
    output = Path(output)
    planned = plan(algorithms, seeds, flat, output)
    failed = run_jobs(planned, jobs)
    existing = [job.run_dir for job in planned if (job.run_dir / "config.yaml").exists()]
    report = build_report(existing, output, target=target, order=algorithms) if existing else None
    _say(f"report: {report}" if report else "no run got as far as its run directory: no report")
    return {"report": report, "run_dirs": [job.run_dir for job in planned], "failed": [j.run_dir for j in failed]}


# ---------------------------------------------------------------------------------------
# The child: train one run and measure it
# ---------------------------------------------------------------------------------------


def train_and_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["config"]`` (a flat config) in this process and write its ``resources.json``."""
    import torch

    from posttrain.tracking.metrics import read_metrics
    from posttrain.training.api import run

    torch.set_num_threads(spec["threads"])
    config = Config.from_flat(spec["config"])
    started = time.perf_counter()
    run_dir = Path(run(config)["run_dir"])
    segment = {
        "wall_seconds": time.perf_counter() - started,
        "peak_rss_mib": peak_rss_mib(),
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "resumed": config.run.resume is not None,
    }
    previous = read_resources(run_dir) if config.run.resume else None
    segments = (previous["segments"] if previous else []) + [segment]
    cuda = [s["peak_cuda_mib"] for s in segments if s["peak_cuda_mib"] is not None]
    resources = {
        "max_steps": config.run.max_steps,
        "steps": read_metrics(run_dir)[-1]["step"],
        "wall_seconds": sum(s["wall_seconds"] for s in segments),
        "peak_rss_mib": max(s["peak_rss_mib"] for s in segments),
        "peak_cuda_mib": max(cuda) if cuda else None,
        "threads": spec["threads"],
        "segments": segments,
    }
    tmp = run_dir / (RESOURCES_FILE + ".tmp")
    tmp.write_text(json.dumps(resources, indent=2) + "\n")
    os.replace(tmp, run_dir / RESOURCES_FILE)  # the completion marker appears whole or not at all
    return resources


def peak_rss_mib() -> float:
    """This process's peak resident set size; ``ru_maxrss`` is in KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


TARGET_HELP = ("held-out accuracy that 'steps/time to target' count up to "
               "[default: halfway between the start and the best final value]")


def names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def flat_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields every run gets: defaults < ``--config`` YAML < flags."""
    flags = {k: v for k, v in vars(args).items() if k not in _OWN_ARGS}
    for name, hint in (("seed", "compare runs seeds 0..K-1; use --seeds K"),
                       ("resume", "compare resumes its interrupted runs itself; repeat the same command")):
        if name in flags:
            raise ConfigError(f"{name}: {hint}")
    flat = load_yaml(args.config) if args.config else {}
    flat.pop("algorithm", None)
    flat.setdefault("progress", False)  # children write to log files (decision 5)
    return {**flat, **flags}


def compare_command(args: argparse.Namespace) -> int:
    result = compare(args.algorithms, seeds=args.seeds, output=args.output, flat=flat_from_args(args),
                     jobs=args.jobs, target=args.target)
    if result["failed"]:
        logs = ", ".join(str(Path(d) / LOG_FILE) for d in result["failed"])
        print(f"posttrain: error: {len(result['failed'])} run(s) failed; see {logs}", file=sys.stderr)
        return 1
    return 0


def report_command(args: argparse.Namespace) -> int:
    from posttrain.report.html import build_report
    from posttrain.report.runs import find_runs

    runs = find_runs(args.runs)
    output = Path(args.output) if args.output else Path(os.path.commonpath([d.resolve() for d in runs]))
    print(build_report(runs, output, target=args.target))
    return 0


def _say(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # the child process of decision 1
    train_and_measure(json.loads(sys.argv[1]))
