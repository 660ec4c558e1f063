"""Metrics and sample logging for a run directory, and the experiment trackers that also get them.

``MetricsLogger.open(run_dir, report_to=...)`` writes

- ``run_dir/metrics.jsonl``: one JSON object per ``log`` call, ``{"step": N, "<name>": value, ...}``;
- ``run_dir/samples.jsonl``: one JSON object per sampled completion, ``{"step": N, "prompt": ..., ...}``;

and sends every scalar, and the first rows of each sample batch as a table, to the trackers that
``report_to`` names (``TRACKERS``; TRL's ``report_to`` names). Each logs locally, so nothing needs a network:

- ``tensorboard``: ``run_dir/tensorboard/`` (samples as a markdown table);
- ``wandb``: an offline W&B run in ``run_dir/wandb/`` (``wandb sync`` uploads it), unless ``WANDB_MODE``
  says otherwise (``pip install 'posttrain[wandb]'``);
- ``mlflow``: an MLflow run in ``run_dir/mlflow.db``, artifacts in ``run_dir/mlartifacts/``, unless
  ``MLFLOW_TRACKING_URI`` names a store; the config becomes the run's params (``posttrain[mlflow]``);
- ``trackio``: a run in trackio's local store, where ``trackio show`` looks (``posttrain[trackio]``).

``NullLogger`` has the same methods and writes nothing: with several processes only rank 0 logs.

Decisions:

1. Non-finite floats are written as the JSON strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
   Python's ``json`` would write them bare, which is not JSON (``jq``, browsers and most parsers
   reject the line). Metric values are always numbers, so a string in ``metrics.jsonl`` can only be
   one of these three, and ``read_metrics`` turns it back into the float: lossless, valid, and one
   value per key (no side list of "which keys were non-finite" to keep in sync).
2. Every line is flushed as it is written, so a crashed process loses nothing it logged. Lines are
   not fsynced: an OS crash may lose the tail, which the resumed run writes again anyway.
3. ``resume_step=N`` makes a resumed run's logs equal an uninterrupted run's: lines with step > N
   are dropped from both JSONL files, and TensorBoard purges its events after step N
   (``SummaryWriter(purge_step=N + 1)``). The other trackers continue the same run (its id or name is
   kept in the run directory) but cannot rewrite history. W&B online ignores steps at or below the
   last one it received, so it keeps the crashed run's values for steps N+1 up to the crash; offline,
   each session is its own ``wandb/offline-run-*`` directory with the same run id, synced in order.
   MLflow and trackio keep every value they received: steps N+1 up to the crash have two values,
   the crashed run's, then the resumed run's. The config W&B and trackio show is the latest
   session's; MLflow's params stay the first session's (MLflow refuses to change a param).
4. A fresh run refuses a directory that already has ``metrics.jsonl`` rather than appending to or
   overwriting another run's log.
5. MLflow's local store is SQLite, not a ``file:`` ``mlruns/`` directory: MLflow 3 refuses the file store
   (in "maintenance mode") unless ``MLFLOW_ALLOW_FILE_STORE`` is set, and SQLite is its own default.
   The ``mlflow`` extra is ``mlflow-skinny`` with SQLAlchemy and Alembic: the SQLite store without
   MLflow's server and model dependencies.
6. trackio's store is ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``), not the run directory:
   trackio reads ``TRACKIO_DIR`` once, when it is imported, so one process cannot give each run its own.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Protocol

from torch import Tensor

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS_DIR = "mlartifacts"
MLFLOW_ID_FILE = "mlflow_run_id"
TRACKIO_NAME_FILE = "trackio_run_name"
VARIANT_SEPARATOR = "@"
"""Between an eval task's label and a prompt variant's name in a metric (``eval/gsm_templates@boxed/accuracy``)."""

_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsLogger:
    """Appends metrics and samples to a run directory and its trackers; build it with ``MetricsLogger.open``."""

    def __init__(
        self, metrics_file: IO[str], samples_file: IO[str], trackers: Sequence[Tracker], table_rows: int
    ) -> None:
        self.metrics_file = metrics_file
        self.samples_file = samples_file
        self.trackers = list(trackers)
        self.table_rows = table_rows

    @classmethod
    def open(
        cls,
        run_dir: str | os.PathLike,
        *,
        report_to: str | Sequence[str] = ("tensorboard",),
        project: str = "posttrain",
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        table_rows: int = 4,
    ) -> MetricsLogger:
        """Open the run's logs. ``report_to`` names trackers of ``TRACKERS`` (``()`` or ``("none",)``: none);
        ``run_name`` defaults to the run directory's name. ``resume_step=N`` continues a run from its
        checkpoint at step N, dropping everything logged after N; ``None`` starts a new run in a directory
        without logs. ``config`` goes to every tracker. ``table_rows`` is how many sample rows per
        ``log_samples`` call the trackers get (samples.jsonl gets them all)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path, samples_path = run_dir / METRICS_FILE, run_dir / SAMPLES_FILE
        if resume_step is None and metrics_path.exists():
            raise FileExistsError(
                f"{metrics_path} already exists: resume that run (resume_step=<checkpoint step>) "
                "or log to a new run directory"
            )
        run = TrackedRun(run_dir, project, run_name or run_dir.resolve().name, dict(config or {}), resume_step)
        trackers = open_trackers(report_to, run)
        if resume_step is not None:
            _truncate_jsonl(metrics_path, resume_step)
            _truncate_jsonl(samples_path, resume_step)
        metrics_file = metrics_path.open("a", encoding="utf-8")
        samples_file = samples_path.open("a", encoding="utf-8")
        return cls(metrics_file, samples_file, trackers, table_rows)

    def log(self, step: int, metrics: Mapping[str, float | int | Tensor]) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl and every tracker. Values must be
        numbers or 0-dim tensors; anything else raises instead of being dropped."""
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; it is the first argument of log()")
        values = {name: _to_number(name, value) for name, value in metrics.items()}
        _write_line(self.metrics_file, {"step": step, **values})
        for tracker in self.trackers:
            tracker.log(step, values)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append one line per row (prompt, completion, rewards, advantage, ...) to samples.jsonl;
        the trackers get the first ``table_rows`` rows as a table under ``samples``."""
        if any("step" in row for row in rows):
            raise ValueError("sample rows must not contain 'step'; it is the first argument of log_samples()")
        encoded = [{"step": step, **_to_json(dict(row))} for row in rows]
        for row in encoded:
            _write_line(self.samples_file, row)
        if encoded:
            for tracker in self.trackers:
                tracker.log_table(step, encoded[: self.table_rows])

    def close(self) -> None:
        self.metrics_file.close()
        self.samples_file.close()
        for tracker in self.trackers:
            tracker.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Tracker(Protocol):
    """An experiment tracker's run, as ``MetricsLogger`` uses it. ``log_table`` rows are JSON-ready
    (``{"step": N, "prompt": ..., ...}``) and may hold lists and mappings."""

    def log(self, step: int, values: Mapping[str, float | int]) -> None: ...

    def log_table(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker opens its run from; ``resume_step`` is None for a new run."""

    run_dir: Path
    project: str
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    resume_step: int | None = None


class TensorBoardTracker:
    """Scalars and a markdown table of samples in ``RUN_DIR/tensorboard``; the config as text at step 0.
    A resumed run purges the events after its step."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, run: TrackedRun) -> TensorBoardTracker:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if run.resume_step is None else run.resume_step + 1
        writer = SummaryWriter(log_dir=str(run.run_dir / TENSORBOARD_DIR), purge_step=purge_step)
        if run.config and run.resume_step is None:
            writer.add_text("config", "```\n" + json.dumps(_to_json(run.config), indent=2) + "\n```", 0)
        return cls(writer)

    def log(self, step: int, values: Mapping[str, float | int]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_table(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self.writer.add_text("samples", markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run in ``RUN_DIR/wandb``, offline unless ``WANDB_MODE`` is set; its id is kept in
    ``RUN_DIR/wandb_run_id`` so that a resumed run continues it."""

    def __init__(self, wandb: ModuleType, run: Any) -> None:
        self.wandb = wandb
        self.run = run

    @classmethod
    def open(cls, run: TrackedRun) -> WandbTracker:
        wandb = import_tracker("wandb", extra="wandb")
        id_path = run.run_dir / WANDB_ID_FILE
        run_id = id_path.read_text().strip() if run.resume_step is not None and id_path.exists() else None
        wandb_run = wandb.init(
            project=run.project, name=run.name, config=dict(run.config), dir=str(run.run_dir), id=run_id,
            resume="allow", mode=None if "WANDB_MODE" in os.environ else "offline",
        )
        id_path.write_text(wandb_run.id)
        return cls(wandb, wandb_run)

    def log(self, step: int, values: Mapping[str, float | int]) -> None:
        self.run.log(dict(values), step=step)

    def log_table(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns, data = table_cells(rows)
        table = self.wandb.Table(columns=columns, data=data, allow_mixed_types=True)  # a NaN reward is "NaN"
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in the experiment named ``project``, in the SQLite store ``RUN_DIR/mlflow.db`` unless
    ``MLFLOW_TRACKING_URI`` is set; its id is kept in ``RUN_DIR/mlflow_run_id`` so that a resumed run
    continues it. The config becomes the new run's params; each step's samples are the table artifact
    ``samples/step_NNNNNN.json`` (one file per step: appending to one table would download it each time)."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    @classmethod
    def open(cls, run: TrackedRun) -> MlflowTracker:
        import_tracker("mlflow", extra="mlflow")
        from mlflow.tracking import MlflowClient

        local = "MLFLOW_TRACKING_URI" not in os.environ
        client = MlflowClient(f"sqlite:///{(run.run_dir / MLFLOW_DB).resolve()}" if local else None)
        id_path = run.run_dir / MLFLOW_ID_FILE
        if run.resume_step is not None and id_path.exists():
            run_id = id_path.read_text().strip()
            client.update_run(run_id, status="RUNNING")
        else:
            artifacts = (run.run_dir / MLFLOW_ARTIFACTS_DIR).resolve().as_uri() if local else None
            experiment = client.get_experiment_by_name(run.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(run.project, artifact_location=artifacts))
            run_id = client.create_run(experiment_id, run_name=run.name).info.run_id
            _log_mlflow_params(client, run_id, run.config)
            id_path.write_text(run_id)
        return cls(client, run_id)

    def log(self, step: int, values: Mapping[str, float | int]) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        metrics = [Metric(name, float(value), timestamp, step) for name, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_table(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns, data = table_cells(rows)
        table = {column: [row[i] for row in data] for i, column in enumerate(columns)}
        self.client.log_table(self.run_id, data=table, artifact_file=f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _log_mlflow_params(client: Any, run_id: str, config: Mapping[str, Any]) -> None:
    """The config as params: strings as they are, other values as JSON, cut to MLflow's length limit,
    in batches of MLflow's size limit."""
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    params = [Param(key, (value if isinstance(value, str) else json.dumps(_to_json(value)))[:MAX_PARAM_VAL_LENGTH])
              for key, value in config.items()]
    for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=params[start: start + MAX_PARAMS_TAGS_PER_BATCH])


class TrackioTracker:
    """A trackio run in the project ``project`` of trackio's local store; its name is kept in
    ``RUN_DIR/trackio_run_name`` so that a resumed run continues it."""

    def __init__(self, trackio: ModuleType) -> None:
        self.trackio = trackio

    @classmethod
    def open(cls, run: TrackedRun) -> TrackioTracker:
        trackio = import_tracker("trackio", extra="trackio")
        name_path = run.run_dir / TRACKIO_NAME_FILE
        resume = run.resume_step is not None and name_path.exists()
        trackio_run = trackio.init(
            project=run.project, name=name_path.read_text().strip() if resume else run.name,
            config=dict(run.config), resume="allow" if resume else "never",
        )
        name_path.write_text(trackio_run.name)
        return cls(trackio)

    def log(self, step: int, values: Mapping[str, float | int]) -> None:
        self.trackio.log(dict(values), step=step)

    def log_table(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        columns, data = table_cells(rows)
        self.trackio.log({"samples": self.trackio.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


TRACKERS: dict[str, Callable[[TrackedRun], Tracker]] = {
    "tensorboard": TensorBoardTracker.open,
    "wandb": WandbTracker.open,
    "mlflow": MlflowTracker.open,
    "trackio": TrackioTracker.open,
}
"""``report_to`` name -> the function that opens (or, with ``resume_step``, reopens) that tracker's run.
Public: a tracker added here is valid in ``report_to`` (RunConfig checks names against it)."""


def open_trackers(report_to: str | Sequence[str], run: TrackedRun) -> list[Tracker]:
    """The trackers ``report_to`` names (one name, or several), opened in order; ``none`` names no tracker.
    If one fails to open, the ones already open are closed before the error propagates."""
    names = [name for name in ([report_to] if isinstance(report_to, str) else report_to) if name != "none"]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {', '.join(unknown)}; use {', '.join(TRACKERS)} or none")
    trackers: list[Tracker] = []
    try:
        for name in names:
            trackers.append(TRACKERS[name](run))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


def import_tracker(module: str, *, extra: str) -> ModuleType:
    """``import module``, or an ImportError that names the pip extra installing it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"report_to {extra} needs the {module} package: pip install 'posttrain[{extra}]'"
        ) from error


def table_cells(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns (in order of first appearance) and one list of cells per row, for a tracker's table:
    strings, numbers, booleans and None as they are, lists and mappings as JSON text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    data = [[_table_cell(row.get(column)) for column in columns] for row in rows]
    return columns, data


def _table_cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, numbers.Real)) else json.dumps(value)


class NullLogger:
    """``MetricsLogger``'s interface, writing nothing: the logger of every process but rank 0."""

    def log(self, step: int, metrics: Mapping[str, float | int | Tensor]) -> None:
        pass

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` in order, non-finite values restored to floats.
    A last line without its newline (being written right now, or cut by a crash) is skipped."""
    rows = _read_jsonl(Path(run_dir) / METRICS_FILE)
    return [{key: _STR_TO_NONFINITE.get(value, value) if isinstance(value, str) else value
             for key, value in row.items()} for row in rows]


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table with one column per key (in order of first appearance)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_markdown_cell(row.get(column, "")) for column in columns) + " |")
    return "\n".join(lines)


def _markdown_cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _to_number(name: str, value: float | int | Tensor) -> float | int:
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"metric {name!r} is a tensor of shape {list(value.shape)}; log a 0-dim tensor")
        value = value.item()
    if isinstance(value, numbers.Integral):  # bool and numpy ints included
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {name!r} is a {type(value).__name__}; metrics must be numbers or 0-dim tensors")


def _to_json(value: Any) -> Any:
    """A JSON-ready copy of ``value``: tensors to lists/numbers, non-finite floats to strings."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {str(key): _to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(item) for item in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _encode_float(float(value))
    raise TypeError(f"cannot log a {type(value).__name__} in a sample row: {value!r}")


def _encode_float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _write_line(file: IO[str], row: Mapping[str, Any]) -> None:
    file.write(json.dumps(_to_json(row), allow_nan=False, ensure_ascii=False) + "\n")
    file.flush()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]  # drops "" after the final newline, or a torn last line
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not valid JSON: {error}") from error
    return rows


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep the lines with step <= max_step (and drop a torn last line), replacing the file atomically."""
    if not path.exists():
        return
    kept = [row for row in _read_jsonl(path) if row["step"] <= max_step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as file:
        file.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in kept)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
