"""Metrics and sample logging for a run directory.

``MetricsLogger.open(run_dir)`` writes

- ``run_dir/metrics.jsonl``: one JSON object per ``log`` call, ``{"step": N, "<name>": value, ...}``;
- ``run_dir/samples.jsonl``: one JSON object per sampled completion, ``{"step": N, "prompt": ..., ...}``;
- ``run_dir/tensorboard/``: every scalar, and the first rows of each sample batch as a markdown table;
- a Weights & Biases run, when a project is named (``pip install 'posttrain[wandb]'``).

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
   (``SummaryWriter(purge_step=N + 1)``). W&B cannot rewrite history: it ignores steps at or below
   the last one it received, so it keeps the crashed run's values for steps N+1 up to the crash.
4. A fresh run refuses a directory that already has ``metrics.jsonl`` rather than appending to or
   overwriting another run's log.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from torch import Tensor

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"

_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsLogger:
    """Appends metrics and samples to a run directory; build it with ``MetricsLogger.open``."""

    def __init__(
        self,
        metrics_file: IO[str],
        samples_file: IO[str],
        tb_writer: Any | None,
        wandb_run: Any | None,
        table_rows: int,
    ) -> None:
        self.metrics_file = metrics_file
        self.samples_file = samples_file
        self.tb_writer = tb_writer
        self.wandb_run = wandb_run
        self.table_rows = table_rows

    @classmethod
    def open(
        cls,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
        table_rows: int = 4,
    ) -> MetricsLogger:
        """Open the run's logs. ``resume_step=N`` continues a run from its checkpoint at step N,
        dropping everything logged after N; ``None`` starts a new run in a directory without logs.
        ``config`` goes to W&B and, as JSON text, to TensorBoard. ``table_rows`` is how many sample
        rows per ``log_samples`` call TensorBoard shows."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path, samples_path = run_dir / METRICS_FILE, run_dir / SAMPLES_FILE
        if resume_step is None and metrics_path.exists():
            raise FileExistsError(
                f"{metrics_path} already exists: resume that run (resume_step=<checkpoint step>) "
                "or log to a new run directory"
            )
        if resume_step is not None:
            _truncate_jsonl(metrics_path, resume_step)
            _truncate_jsonl(samples_path, resume_step)
        tb_writer = _open_tensorboard(run_dir, resume_step, config) if tensorboard else None
        wandb_run = None
        if wandb_project is not None:
            wandb_run = _open_wandb(run_dir, wandb_project, wandb_run_name, config, resume_step is not None)
        metrics_file = metrics_path.open("a", encoding="utf-8")
        samples_file = samples_path.open("a", encoding="utf-8")
        return cls(metrics_file, samples_file, tb_writer, wandb_run, table_rows)

    def log(self, step: int, metrics: Mapping[str, float | int | Tensor]) -> None:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl and every sink. Values must be
        numbers or 0-dim tensors; anything else raises instead of being dropped."""
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; it is the first argument of log()")
        values = {name: _to_number(name, value) for name, value in metrics.items()}
        _write_line(self.metrics_file, {"step": step, **values})
        if self.tb_writer is not None:
            for name, value in values.items():
                self.tb_writer.add_scalar(name, value, step)
            self.tb_writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append one line per row (prompt, completion, rewards, advantage, ...) to samples.jsonl;
        TensorBoard gets the first ``table_rows`` rows as a markdown table under ``samples``."""
        if any("step" in row for row in rows):
            raise ValueError("sample rows must not contain 'step'; it is the first argument of log_samples()")
        encoded = [{"step": step, **_to_json(dict(row))} for row in rows]
        for row in encoded:
            _write_line(self.samples_file, row)
        if self.tb_writer is not None and encoded:
            self.tb_writer.add_text("samples", markdown_table(encoded[: self.table_rows]), step)
            self.tb_writer.flush()

    def close(self) -> None:
        self.metrics_file.close()
        self.samples_file.close()
        if self.tb_writer is not None:
            self.tb_writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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


def _open_tensorboard(run_dir: Path, resume_step: int | None, config: Mapping[str, Any] | None) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    purge_step = None if resume_step is None else resume_step + 1
    writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)
    if config is not None and resume_step is None:
        writer.add_text("config", "```\n" + json.dumps(_to_json(config), indent=2) + "\n```", 0)
    return writer


def _open_wandb(
    run_dir: Path, project: str, name: str | None, config: Mapping[str, Any] | None, resume: bool
) -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "logging to Weights & Biases needs the wandb package: pip install 'posttrain[wandb]'"
        ) from error
    id_path = run_dir / WANDB_ID_FILE
    run_id = id_path.read_text().strip() if resume and id_path.exists() else None
    run = wandb.init(
        project=project, name=name, config=dict(config or {}), dir=str(run_dir), id=run_id, resume="allow"
    )
    id_path.write_text(run.id)
    return run
