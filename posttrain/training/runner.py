"""The run around the loop: run directory, evaluation, logging, checkpoints, progress.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``samples.jsonl``, ``tensorboard/`` (and the local stores of the other
``report_to`` trackers), ``checkpoints/step_N/``, ``final_model/`` and
``curves.png``. ``--resume RUN_DIR`` restores the latest complete checkpoint
(weights, optimizer, scheduler, RNG, data order, dynamic-sampling surplus) so
the resumed run logs the same metrics as an uninterrupted one.

With several processes (``posttrain.parallel.distributed``) every process runs this loop;
only rank 0 writes the run directory and evaluates, the others wait for it and
log nothing. A checkpoint holds the model once, every process's surplus groups
and rank 0's random generators, so a run resumes with any process count (the
other processes' generators are re-seeded from the seed, the step and their rank).

The run directory is locked for the run's life, and a cluster's requeue, SIGTERM and a finished run's
resume are handled as :mod:`posttrain.training.lifecycle` describes. Where the reward is a proxy of a
check the run can evaluate, every evaluation goes through the reward-hacking guard
(``guards.DivergenceWatch``): its streak is logged, the best model by the check is kept in
``best_model/``, and with ``stop_on_divergence`` it stops the run as a callback would.

A Python caller watches the run, and may stop it, with :class:`Callback` objects
(``posttrain.train(..., callbacks=[...])``): they see every step's logged metrics and every
evaluation's. A run a callback stops ends as one that reached ``max_steps`` does: evaluated on every
held-out prompt, checkpointed, its final model saved; ``--resume`` continues it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import torch

from posttrain.config import Config, ConfigError, save_yaml
from posttrain.models.lora import merged_for_saving
from posttrain.parallel import distributed, fsdp, offload
from posttrain.parallel.distributed import say as _say
from posttrain.tracking.metrics import MetricsLogger, NullLogger, read_metrics
from posttrain.tracking.plots import plot_run
from posttrain.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_extra_state,
    save_checkpoint,
    save_final_model,
)
from posttrain.training.guards import DivergenceWatch
from posttrain.training.lifecycle import Preempted, RunLock, StopSignals, completed_run, resume_dir
from posttrain.training.setup import Trainer

BEST_MODEL_DIR = "best_model"

T = TypeVar("T", bound=Trainer)


@runtime_checkable
class Callback(Protocol):
    """Watches a run from Python, and may stop it (TRL's ``TrainerCallback``, reduced to what is needed).

    Subclass it for no-op defaults and override what you need, or write any object with these three
    methods. The metrics are those ``metrics.jsonl`` logs at that step (names such as ``loss``,
    ``reward/mean``, ``eval/accuracy``), as numbers; a callback gets a copy, so changing it changes no log.
    In a run of several processes every process calls its own callbacks, and a stop asked on any process
    stops them all.
    """

    def on_step(self, step: int, metrics: dict[str, float]) -> bool | None:
        """After optimizer step ``step`` (1, 2, ...) is logged, checkpointed when due, with what it logged
        (an evaluation's metrics too at an evaluation step). Return True to stop the run after this step:
        it ends as at ``max_steps``, with an evaluation on every held-out prompt, a checkpoint and the
        final model."""
        return None

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """After each held-out evaluation: at step 0 (before training; not on a resume), every
        ``eval_every`` steps, and the last one. A run without a held-out set has none."""

    def on_train_end(self, result: dict[str, Any]) -> None:
        """After the final model is saved, with what :func:`posttrain.train` returns: ``run_dir``,
        ``before`` and ``after`` (the held-out metrics)."""


def open_run_dir(config: Config) -> tuple[Path, RunLock]:
    """The run's directory, locked for this process (:class:`RunLock`): the resumed run's (its config.yaml
    rewritten once the resume is known to work), or a new one. Paths in the saved config are absolute, so the
    run resumes from any directory."""
    resumed = resume_dir(config.run)
    run_dir = resumed or planned_run_dir(config)
    lock = RunLock(run_dir).acquire()
    try:
        if resumed:
            check_resumable(run_dir)
        else:
            start_run_dir(run_dir, replace_unfinished=config.run.auto_resume)
        save_yaml(config.with_absolute_paths(), run_dir / "config.yaml")
    except BaseException:
        lock.release()
        raise
    return run_dir, lock


def check_resumable(run_dir: Path) -> None:
    """Raise CheckpointError unless ``run_dir`` has a complete checkpoint."""
    if latest_checkpoint(run_dir) is None:
        raise CheckpointError(f"resume: {run_dir} has no complete checkpoint to resume from")


def planned_run_dir(config: Config) -> Path:
    """``output``, or ``runs/<algorithm>-<time>``."""
    return Path(config.run.output or Path("runs") / f"{config.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}")


def start_run_dir(path: Path, replace_unfinished: bool = False) -> None:
    """Make ``path`` ready for a new run: refused when it holds a run's logs, unless ``replace_unfinished``
    (auto_resume) and that run never wrote a checkpoint (killed before its first one): its logs go."""
    if (path / "metrics.jsonl").exists():
        if not replace_unfinished:
            raise FileExistsError(f"output: {path} already holds a run; use --resume {path} (or --auto-resume) "
                                  "or a new --output")
        _say(f"{path} holds a run that saved no checkpoint: starting it again")
        for name in ("metrics.jsonl", "samples.jsonl"):
            (path / name).unlink(missing_ok=True)
        shutil.rmtree(path / "tensorboard", ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def completed(config: Config) -> dict[str, Any] | None:
    """What a run returns when the run it resumes already reached ``max_steps`` and saved its final model: its
    first and last held-out metrics, read from its log; None when there is something to train. A requeued job
    (``--auto-resume``) or a repeated ``--resume`` of a finished run ends here, as the first job ended: done."""
    found = completed_run(config.run)
    if found is None:
        return None
    run_dir, step = found
    _say(f"the run in {run_dir} is complete: step {step} of max_steps {config.run.max_steps}, its final model in "
         f"{run_dir / 'final_model'}; to train it further, resume with --max-steps {step + 1} or more")
    evaluations = [row for row in read_metrics(run_dir) if any(key.startswith("eval/") for key in row)]

    def held_out(row: dict[str, Any]) -> dict[str, float]:
        return {key: value for key, value in row.items() if key.startswith("eval/")}

    before = held_out(evaluations[0]) if evaluations and evaluations[0]["step"] == 0 else {}
    return {"run_dir": run_dir, "before": before, "after": held_out(evaluations[-1]) if evaluations else {},
            "complete": True}


def save(session: Trainer, run_dir: Path, watch: DivergenceWatch | None = None) -> Path:
    """Rank 0 writes the checkpoint; every process calls this (it gathers their surplus groups). The
    reward-hacking guard's state goes with it, so a resumed run's guard is the uninterrupted run's."""
    extra_state = session.extra_state()
    sharded = fsdp.is_sharded(session.policy)  # FSDP: every process gathers the full tensors for rank 0
    modules = session.checkpoint_modules()
    # an offloaded reference (or sdft's teacher): its weights, for the file
    with offload.resident(modules.get("reference")), offload.resident(modules.get("teacher")):
        return distributed.on_main(
            save_checkpoint, run_dir, session.step, model=session.policy, tokenizer=session.tokenizer,
            optimizer=session.optimizer, scheduler=session.scheduler,
            trainer_state={"step": session.step, "fingerprint": session.fingerprint, **session.trainer_state(),
                           **({"divergence": {"check": watch.check, **watch.state_dict()}} if watch else {})},
            extra_modules=modules, extra_state=extra_state,
            model_state=fsdp.full_state_dict(session.policy) if sharded else None,
            optimizer_state=fsdp.full_optimizer_state(session.optimizer) if sharded else None,
        )


def evaluate_on_main(evaluate: Callable[[T, int | None], dict[str, float]], session: T,
                     limit: int | None = None) -> dict[str, float]:
    """Rank 0 evaluates (under FSDP with the full parameters, gathered by every process) the first
    ``limit`` held-out prompts (None: all); every process gets its metrics."""
    with fsdp.full_parameters(session.policy):
        return distributed.on_main(evaluate, session, limit)


HELDOUT_SAMPLES_FILE = "heldout_samples.jsonl"
HELDOUT_IMAGES_DIR = "heldout_images"


def write_heldout_samples(session: Any, run_dir: Path, step: int) -> None:
    """Append the last evaluation's few held-out image rows, with their greedy answers, to
    ``heldout_samples.jsonl`` (images once, under ``heldout_images/``): what ``posttrain report`` draws, before and
    after. Nothing for a task without images."""
    samples = getattr(session, "heldout_samples", None)
    if not samples:
        return
    images = run_dir / HELDOUT_IMAGES_DIR
    images.mkdir(exist_ok=True)
    with open(run_dir / HELDOUT_SAMPLES_FILE, "a", encoding="utf-8") as out:
        for sample in samples:
            names = []
            for k, image in enumerate(sample["images"]):
                name = f"{HELDOUT_IMAGES_DIR}/row{sample['row']}_{k}.png"
                if not (run_dir / name).exists():
                    image.save(run_dir / name)
                names.append(name)
            record = {"step": step, **{key: value for key, value in sample.items() if key != "images"}, "images": names}
            out.write(json.dumps(record, default=str) + "\n")
    session.heldout_samples = []


def _evaluate_and_tell(evaluate: Callable[[T, int | None], dict[str, float]], callbacks: Sequence[Callback],
                       session: T, limit: int | None = None) -> dict[str, float]:
    """:func:`evaluate_on_main`, its metrics (when there is a held-out set) handed to every callback."""
    metrics = evaluate_on_main(evaluate, session, limit)
    for callback in callbacks if metrics else ():
        callback.on_evaluate(session.step, dict(metrics))
    return metrics


def _asks_to_stop(callbacks: Sequence[Callback], step: int, metrics: dict[str, float]) -> bool:
    """Every callback's ``on_step`` (each one sees the step, whatever the others answer); whether any
    callback on any process asked to stop."""
    answers = [callback.on_step(step, dict(metrics)) for callback in callbacks]
    return distributed.any_true(any(answer is True for answer in answers))


def restore(session: Trainer, run_dir: Path) -> tuple[int, dict[str, Any] | None]:
    """Load the latest intact checkpoint of ``run_dir`` into the session; return its step and the reward-hacking
    guard's saved state (None: the run had no guard). A checkpoint whose files fail their sha256 (a disk error,
    a copy cut short) is skipped with a warning for the one before it."""
    path = latest_checkpoint(run_dir, verify=True)
    if path is None:
        raise CheckpointError(f"resume: {run_dir} has no complete checkpoint to resume from")
    modules = session.checkpoint_modules()
    # an offloaded reference (or sdft's teacher) keeps what is loaded
    with offload.resident(modules.get("reference"), write=True), offload.resident(modules.get("teacher"), write=True):
        state = load_checkpoint(path, model=session.policy, optimizer=session.optimizer, scheduler=session.scheduler,
                                extra_modules=modules, expected_fingerprint=session.fingerprint,
                                verify=False)  # latest_checkpoint has just checked every file's hash
    session.step = state["step"]
    session.load_trainer_state(state, load_extra_state(path))
    if not distributed.is_main():  # the checkpoint holds rank 0's generators: the others start new streams
        distributed.seed(session.config.run.seed + 1_000_003 * session.step)
    return session.step, state.get("divergence")


def run_training(session: T, config: Config, train_step: Callable[[T], dict[str, float]],
                 evaluate: Callable[[T, int | None], dict[str, float]],
                 callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Drive ``train_step(session)`` to ``max_steps`` with ``evaluate(session, limit)`` every ``eval_every``
    steps (the first ``limit`` held-out prompts; None: all), logging and checkpoints; ``callbacks`` watch
    it and may stop it (:class:`Callback`). A run that resumes a completed one returns its result at once
    (:func:`completed`); SIGTERM or SIGINT ends it after a checkpoint with :class:`Preempted`."""
    locks: list[RunLock] = []
    try:
        result = distributed.on_main(completed, config) or _run(session, config, train_step, evaluate, callbacks, locks)
    finally:
        session.close()  # stops a rollout process
        for lock in locks:
            lock.release()
    for callback in callbacks:
        callback.on_train_end(dict(result))
    return result


def _run(session: T, config: Config, train_step: Callable[[T], dict[str, float]],
         evaluate: Callable[[T, int | None], dict[str, float]], callbacks: Sequence[Callback],
         locks: list[RunLock]) -> dict[str, Any]:
    """Open (and lock) the run directory, restore a resumed run, log the first evaluation, train, save the
    final model; ``locks`` gets rank 0's lock, for the caller to release."""
    run = config.run

    def open_locked() -> tuple[Path, bool]:
        resuming = resume_dir(run) is not None
        run_dir, lock = open_run_dir(config)
        locks.append(lock)
        return run_dir, resuming

    run_dir, resuming = distributed.on_main(open_locked)
    start, guard_state = restore(session, run_dir) if resuming else (0, None)
    logger = NullLogger()
    if distributed.is_main():
        logger = MetricsLogger.open(run_dir, report_to=run.report_to, project=run.project,
                                    config=config.to_flat(), resume_step=start if resuming else None)
    evaluate = partial(_evaluate_and_tell, evaluate, callbacks)
    first: dict[str, float] = {}
    with logger, StopSignals() as signals:
        if not resuming:
            first = evaluate(session)
        watch = distributed.on_main(divergence_watch, config, first, guard_state) if first or guard_state else None
        if not resuming:
            if watch is not None:
                _watch(watch, session, run_dir, 0, first)
            logger.log(0, first)
            distributed.on_main(write_heldout_samples, session, run_dir, 0)
            _say(f"before training: {_summary(first)}")
        evaluated_at = None if resuming else 0
        if resuming and start >= run.max_steps:  # stopped while saving the final model: its evaluation is logged
            evaluated_at = start
        last_eval = _train(session, config, train_step, evaluate, callbacks, logger, signals, run_dir, watch,
                           evaluated_at=evaluated_at, saved_at=start)
        if evaluated_at == start and start >= run.max_steps:
            last_eval = _logged_evaluation(run_dir, start)
    state = fsdp.full_state_dict(session.policy) if fsdp.is_sharded(session.policy) else None
    final_dir = distributed.on_main(lambda: save_final_model(run_dir, merged_for_saving(session.policy),
                                                             session.tokenizer, state))
    plot = distributed.on_main(plot_run, run_dir)
    _say(f"after {session.step} steps: {_summary(last_eval)}")
    _say(f"run directory: {run_dir}  (model: {final_dir.name}/, curves: {plot.name})")
    return {"run_dir": run_dir, "before": first, "after": last_eval}


def _train(session: T, config: Config, train_step: Callable[[T], dict[str, float]],
           evaluate: Callable[..., dict[str, float]], callbacks: Sequence[Callback], logger: Any,
           signals: StopSignals, run_dir: Path, watch: DivergenceWatch | None, *, evaluated_at: int | None,
           saved_at: int) -> dict[str, float]:
    """The steps, up to ``max_steps`` or a stop (max_minutes, a callback, a signal, the reward-hacking guard);
    the last full evaluation. A signal's stop checkpoints the step it stopped after and raises
    :class:`Preempted`."""
    run = config.run
    last_eval: dict[str, float] = {}
    progress = _progress(run, session.step)
    started = time.perf_counter()
    while session.step < run.max_steps:
        # one all-reduce: every process stops after the same step, whichever of them was signalled
        out_of_time, signalled = distributed.all_sum(torch.tensor(
            [float(bool(run.max_minutes) and time.perf_counter() - started > 60 * run.max_minutes),
             float(signals.received is not None)])).tolist()
        if signalled:
            progress.close()
            if saved_at != session.step:
                save(session, run_dir, watch)
            raise Preempted(signals.received or "a signal on another process", session.step, run_dir)
        if out_of_time:
            _say(f"stopping at step {session.step}: max_minutes={run.max_minutes} reached")
            break
        t0, diverged = time.perf_counter(), False
        metrics = train_step(session)
        session.step += 1
        step = session.step
        metrics["time/step"] = time.perf_counter() - t0
        if (run.eval_every and step % run.eval_every == 0) or step == run.max_steps:
            subset = config.data.eval_subset or None if step < run.max_steps else None  # the last: all prompts
            last_eval, evaluated_at = evaluate(session, limit=subset), (step if subset is None else None)
            metrics.update(last_eval)
            distributed.on_main(write_heldout_samples, session, run_dir, step)
            diverged = watch is not None and _watch(watch, session, run_dir, step, metrics)
        logger.log(step, metrics)
        if run.log_samples_every and step % run.log_samples_every == 0:
            logger.log_samples(step, session.sample_rows())
        if (run.save_every and step % run.save_every == 0) or step == run.max_steps:
            save(session, run_dir, watch)
            saved_at = step
        progress.update(1)
        progress.set_postfix(_postfix(metrics), refresh=False)
        if _asks_to_stop(callbacks, step, metrics) and step < run.max_steps:
            _say(f"stopping at step {step}: a callback asked to")
            break
        if diverged and run.stop_on_divergence and step < run.max_steps:
            _say(f"stopping at step {step}: stop_on_divergence; the best model by {watch.check} is in "
                 f"{run_dir / BEST_MODEL_DIR if watch.best and watch.best['step'] else 'the model the run started from'}")
            break
    progress.close()
    if evaluated_at != session.step:  # stopped by max_minutes or a callback (its last evaluation, if any,
        # scored the subset), or resumed at max_steps: the result is every held-out prompt, logged like any other
        last_eval = evaluate(session)
        distributed.on_main(write_heldout_samples, session, run_dir, session.step)
        if last_eval:
            logger.log(session.step, last_eval)
    if saved_at != session.step:  # ... and it can be resumed from where it stopped
        save(session, run_dir, watch)
    return last_eval


def divergence_watch(config: Config, first: dict[str, float], saved: dict[str, Any] | None = None) -> DivergenceWatch | None:
    """The reward-hacking guard of this run (``guards.DivergenceWatch``), or None where it has nothing to
    compare: ``divergence_check`` none, no held-out evaluation, or (auto) a reward that is the task's own check
    (held-out reward equal to held-out accuracy). A resumed run takes the state its checkpoint ``saved``."""
    run = config.run
    if run.divergence_check == "none":
        return None
    if saved is not None:  # a resume: the guard as the run had it at its checkpoint
        watch = DivergenceWatch(saved["check"], limit=run.divergence_evals)
        watch.load_state_dict(saved)
        return watch
    if not first:
        return None
    if run.divergence_check == "auto":
        if "eval/accuracy" not in first or first.get("eval/reward") == first["eval/accuracy"]:
            return None
        check = "eval/accuracy"
    else:
        check = run.divergence_check if run.divergence_check.startswith("eval/") else f"eval/reward/{run.divergence_check}"
        if check not in first:
            logged = ", ".join(sorted(key for key in first if not key.endswith(("_low", "_high"))))
            raise ConfigError(f"divergence_check: {check} is not logged at the evaluations (they log {logged}); "
                              "name one of them, or a reward function of the run")
    return DivergenceWatch(check, limit=run.divergence_evals)


def _watch(watch: DivergenceWatch, session: Trainer, run_dir: Path, step: int, metrics: dict[str, float]) -> bool:
    """Give the guard one evaluation: log its streak into ``metrics``, keep a new best model, warn when it fires;
    whether it fired."""
    found = watch.update(step, metrics)
    if found is None:
        return False
    metrics["eval/divergence_streak"] = found.streak
    if found.new_best:
        state = fsdp.full_state_dict(session.policy) if fsdp.is_sharded(session.policy) else None
        distributed.on_main(lambda: save_final_model(run_dir, merged_for_saving(session.policy), session.tokenizer,
                                                     state, name=BEST_MODEL_DIR))
    if found.fired:
        metrics["eval/diverged"] = 1.0
        _say(f"warning: {watch.warning(step, metrics)}; the best model by {watch.check} so far is "
             + (f"in {run_dir / BEST_MODEL_DIR} (step {watch.best['step']})" if watch.best and watch.best["step"]
                else "the one the run started from")
             + ("" if session.config.run.stop_on_divergence else " (stop_on_divergence stops the run here)"))
    return found.fired


def _logged_evaluation(run_dir: Path, step: int) -> dict[str, float]:
    """The held-out metrics logged at ``step`` (rank 0 reads them; every process gets them)."""
    def read() -> dict[str, float]:
        rows = [row for row in read_metrics(run_dir) if row["step"] == step]
        return {key: value for row in rows for key, value in row.items() if key.startswith("eval/")}
    return distributed.on_main(read)


def _progress(run: Any, start: int):
    from tqdm.auto import tqdm

    return tqdm(total=run.max_steps, initial=start, desc="train", unit="step",
                disable=not run.progress or not distributed.is_main(), dynamic_ncols=True, file=sys.stderr)


def _postfix(metrics: dict[str, float]) -> dict[str, str]:
    keys = {"reward/mean": "reward", "accuracy": "acc", "eval/accuracy": "eval_acc", "loss": "loss"}
    return {short: f"{metrics[k]:.3f}" for k, short in keys.items() if k in metrics}


def _summary(metrics: dict[str, float]) -> str:
    """``accuracy 0.510 (95% CI 0.412-0.607), completion_length 37.000, ...``: a metric's interval
    (``NAME_low``/``NAME_high``) next to it."""
    if not metrics:
        return "(no held-out set)"
    parts = []
    for key, value in sorted(metrics.items()):
        if key.endswith(("_low", "_high")):
            continue
        text = f"{key.removeprefix('eval/')} {value:.3f}"
        if f"{key}_low" in metrics and f"{key}_high" in metrics:
            text += f" (95% CI {metrics[key + '_low']:.3f}-{metrics[key + '_high']:.3f})"
        parts.append(text)
    return ", ".join(parts)
