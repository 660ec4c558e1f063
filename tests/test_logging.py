import json
import math
import struct
import sys
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from posttrain.cli import build_parser, main, resolve_config
from posttrain.config import Config, ConfigError, RunConfig
from posttrain.tracking.metrics import TRACKERS, MetricsLogger, TrackedRun, markdown_table, read_metrics, table_cells


def _strict_json(line: str) -> dict:
    """json.loads that, unlike Python's default, rejects the non-JSON constants NaN/Infinity."""
    def reject(constant: str) -> None:
        raise ValueError(f"non-JSON constant {constant}")
    return json.loads(line, parse_constant=reject)


def test_each_log_call_is_one_flushed_line_with_step_first(tmp_path):
    logger = MetricsLogger.open(tmp_path, report_to="none")
    logger.log(1, {"loss": torch.tensor(0.5), "tokens": torch.tensor(12), "lr": 1e-4, "skipped": True})
    # read back while the logger is still open: the line must already be on disk
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 0.5, "tokens": 12, "lr": 0.0001, "skipped": 1}\n'
    logger.log(2, {"loss": 0.25})
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 0.5, "tokens": 12, "lr": 1e-4, "skipped": 1},
        {"step": 2, "loss": 0.25},
    ]
    row = read_metrics(tmp_path)[0]
    assert list(row) == ["step", "loss", "tokens", "lr", "skipped"]
    assert type(row["tokens"]) is int  # an integer tensor stays an integer
    logger.close()


def test_non_finite_values_are_valid_json_and_round_trip(tmp_path):
    with MetricsLogger.open(tmp_path, report_to="none") as logger:
        logger.log(3, {"a": math.nan, "b": torch.tensor(math.inf), "c": -math.inf, "d": 1e308})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert _strict_json(line) == {"step": 3, "a": "NaN", "b": "Infinity", "c": "-Infinity", "d": 1e308}
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["a"]) and row["b"] == math.inf and row["c"] == -math.inf and row["d"] == 1e308


def test_bad_metrics_raise_instead_of_being_dropped(tmp_path):
    with MetricsLogger.open(tmp_path, report_to="none") as logger:
        with pytest.raises(ValueError, match=r"'kl' is a tensor of shape \[2\]"):
            logger.log(1, {"kl": torch.zeros(2)})
        with pytest.raises(TypeError, match="'name' is a str"):
            logger.log(1, {"name": "grpo"})
        with pytest.raises(ValueError, match="must not contain 'step'"):
            logger.log(1, {"step": 1})
    assert read_metrics(tmp_path) == []


def test_fresh_run_refuses_a_directory_with_logs(tmp_path):
    MetricsLogger.open(tmp_path, report_to="none").close()
    with pytest.raises(FileExistsError, match="resume_step"):
        MetricsLogger.open(tmp_path, report_to="none")


def test_resume_keeps_exactly_the_lines_up_to_the_checkpoint_step(tmp_path):
    with MetricsLogger.open(tmp_path, report_to="none") as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
            logger.log_samples(step, [{"completion": f"c{step}"}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')  # a line cut by the crash

    with MetricsLogger.open(tmp_path, report_to="none", resume_step=3) as logger:
        assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
        logger.log(4, {"loss": 40.0})
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.0}, {"step": 4, "loss": 40.0}
    ]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": s, "completion": f"c{s}"} for s in (1, 2, 3)]


def _scalars(run_dir, tag):
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_gets_each_scalar_and_forgets_steps_after_the_resume_point(tmp_path, monkeypatch):
    # TensorBoard reads a run's event files in name order, and a name is the second it was opened, then the
    # host, the process and a count of the writers that process has opened: both files here open in the same
    # second, so that count orders them, and an xdist worker that had opened 9 writers before named the resumed
    # file ".10", which sorts before the first file's ".9" (the purge then never applied). A fresh count keeps
    # the two in the order they were opened, as two processes' files are by their seconds.
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))
    with MetricsLogger.open(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": step / 4})
    assert _scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]

    with MetricsLogger.open(tmp_path, resume_step=2) as logger:
        logger.log(3, {"reward/mean": 0.125})
    assert _scalars(tmp_path, "reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.125)]


def test_samples_go_to_jsonl_and_a_tensorboard_table(tmp_path):
    rows = [
        {"prompt": "1+1=", "completion": "2", "reward": 1.0, "rewards": {"exact": 1.0}, "correct": True},
        {"prompt": "a|b\nc", "completion": "x", "reward": math.nan, "advantage": torch.tensor(-0.5)},
    ]
    with MetricsLogger.open(tmp_path, table_rows=1) as logger:
        logger.log_samples(7, rows)
    lines = [_strict_json(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 7, "prompt": "1+1=", "completion": "2", "reward": 1.0, "rewards": {"exact": 1.0}, "correct": True},
        {"step": 7, "prompt": "a|b\nc", "completion": "x", "reward": "NaN", "advantage": -0.5},
    ]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    (event,) = accumulator.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 7 and "1+1=" in text and "a\\|b" not in text  # only table_rows=1 row


def test_markdown_table_escapes_cells():
    table = markdown_table([{"prompt": "a|b\nc", "reward": 0.123456}, {"length": 3}])
    assert table.splitlines() == [
        "| prompt | reward | length |",
        "|---|---|---|",
        "| a\\|b<br>c | 0.1235 |  |",
        "|  |  | 3 |",
    ]


def test_report_to_is_checked_where_the_config_is_built():
    assert RunConfig(report_to=("wandb", "mlflow")).report_to == ("wandb", "mlflow")
    assert Config.from_flat({"report_to": "none"}).run.report_to == ("none",)  # YAML's scalar: one name
    valid = "use one or more of tensorboard, wandb, mlflow, trackio, or none alone"
    with pytest.raises(ConfigError, match=f"report_to: got 'comet'; {valid}"):
        RunConfig(report_to=("tensorboard", "comet"))
    with pytest.raises(ConfigError, match="report_to: got none, wandb: none means no tracker"):
        RunConfig(report_to=("none", "wandb"))
    with pytest.raises(ConfigError, match=r"report_to: got 'wandb'; .*as a tuple"):
        RunConfig(report_to="wandb")


def test_the_former_tracker_fields_are_refused_with_their_new_names(capsys):
    with pytest.raises(ConfigError, match=r"'tensorboard' \(renamed; now report_to \(.*report_to none turns it off"):
        Config.from_flat({"tensorboard": False})
    with pytest.raises(ConfigError, match=r"'wandb_project' \(renamed; now project, with report_to wandb\)"):
        Config.from_flat({"wandb_project": "p"})
    with pytest.raises(SystemExit):
        main(["train", "--no-tensorboard"])
    assert "--no-tensorboard (renamed; now report_to none)" in capsys.readouterr().err


def test_report_to_is_a_repeatable_flag():
    def report_to(*argv: str) -> tuple[str, ...]:
        return resolve_config(build_parser().parse_args(["train", *argv])).run.report_to

    assert report_to() == ("tensorboard",)
    assert report_to("--report-to", "none") == ("none",)
    assert report_to("--report-to", "wandb", "--report-to", "mlflow") == ("wandb", "mlflow")


class ListTracker:
    """A tracker that keeps what it gets, as a user might write their own."""

    def __init__(self, run: TrackedRun) -> None:
        self.run = run
        self.calls: list[tuple] = []

    def log(self, step, values):
        self.calls.append(("log", step, dict(values)))

    def log_table(self, step, rows):
        self.calls.append(("table", step, [dict(row) for row in rows]))

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def list_trackers(monkeypatch) -> list[ListTracker]:
    """Registers ListTracker as ``report_to`` ``list``; the list of those opened."""
    opened: list[ListTracker] = []

    def open_list_tracker(run: TrackedRun) -> ListTracker:
        opened.append(ListTracker(run))
        return opened[-1]

    monkeypatch.setitem(TRACKERS, "list", open_list_tracker)
    return opened


def test_a_tracker_added_to_the_registry_is_a_valid_report_to_and_gets_every_call(tmp_path, list_trackers):
    assert RunConfig(report_to=("list",)).report_to == ("list",)
    with MetricsLogger.open(tmp_path / "run", report_to=("list", "none"), config={"lr": 0.5}, table_rows=1) as lg:
        lg.log(1, {"loss": torch.tensor(0.5)})
        lg.log_samples(1, [{"completion": "a", "rewards": {"exact": 1.0}}, {"completion": "b"}])
    (tracker,) = list_trackers
    assert tracker.run == TrackedRun(tmp_path / "run", "posttrain", "run", {"lr": 0.5}, None)
    assert tracker.calls == [
        ("log", 1, {"loss": 0.5}),
        ("table", 1, [{"step": 1, "completion": "a", "rewards": {"exact": 1.0}}]),  # table_rows=1
        ("close",),
    ]


def test_table_cells_keep_scalars_and_write_lists_and_mappings_as_json():
    columns, data = table_cells([{"step": 1, "rewards": {"exact": 1.0}, "ok": True}, {"step": 1, "reward": "NaN"}])
    assert columns == ["step", "rewards", "ok", "reward"]
    assert data == [[1, '{"exact": 1.0}', True, None], [1, None, None, "NaN"]]


@pytest.mark.parametrize("module, extra", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_a_missing_tracker_package_names_the_pip_extra(tmp_path, monkeypatch, list_trackers, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=rf"report_to {extra} needs the {module} package: "
                                          rf"pip install 'posttrain\[{extra}\]'"):
        MetricsLogger.open(tmp_path, report_to=("list", extra))
    assert list_trackers[0].calls == [("close",)]  # the tracker opened before the failing one is closed
    assert not (tmp_path / "metrics.jsonl").exists()  # installing the package and running again just works


def _log_two_steps_then_resume_at_one(run_dir, report_to, **kwargs):
    """Steps 1 and 2 (with samples at 2), a crash, then a resumed run from step 1 that logs step 2 again;
    the resumed run's config, as a resume with --max-steps would give it, has one more step."""
    config = {"lr": 0.5, "reward": ["f.py:g"], "max_steps": 2}
    with MetricsLogger.open(run_dir, report_to=report_to, config=config, **kwargs) as lg:
        lg.log(1, {"loss": 0.5, "reward/mean": 1})
        lg.log(2, {"loss": 0.25})
        lg.log_samples(2, [{"prompt": "1+1=", "reward": math.nan, "rewards": {"exact": 0.0}}])
    with MetricsLogger.open(run_dir, report_to=report_to, config=config | {"max_steps": 3}, resume_step=1,
                            **kwargs) as lg:
        lg.log(2, {"loss": 9.0})


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # posttrain's default then applies: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))


def _wandb_sessions(run_dir):
    """Per offline session (oldest first), its run record and history rows ``{"_step": 1, "loss": 0.5, ...}``,
    read from the session's ``run-ID.wandb`` file of ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    sessions = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for _ in range(100):  # W&B's service process writes the file; under load it can finish after finish()
            records = [wandb_internal_pb2.Record.FromString(data) for data in _leveldb_log(path.read_bytes())]
            if any(record.WhichOneof("record_type") == "exit" for record in records):
                break
            time.sleep(0.1)
        (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
        history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                   for record in records if record.WhichOneof("record_type") == "history"]
        sessions.append((run, history))
    return sessions


def _leveldb_log(data: bytes) -> list[bytes]:
    """The records of W&B's LevelDB-style log: a 7-byte file header, then 32 KiB blocks of chunks, each with a
    7-byte header (CRC, length, type: 1 a whole record, 2/3/4 its first/middle/last part); a block's tail too
    short for a header is padding."""
    block, header, pos, records, pending = 32768, 7, 7, [], b""
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + header])
        pending += data[pos + header: pos + header + length]
        pos += header + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def test_wandb_logs_offline_to_the_run_dir_and_a_resume_continues_the_same_run(tmp_path, wandb_offline):
    _log_two_steps_then_resume_at_one(tmp_path, "wandb", project="p", run_name="n")
    run_id = (tmp_path / "wandb_run_id").read_text()
    (first, first_history), (resumed, resumed_history) = _wandb_sessions(tmp_path)
    assert first.run_id == resumed.run_id == run_id
    assert first.project == "p" and first.display_name == "n"
    assert {item.key: json.loads(item.value_json) for item in first.config.update}["max_steps"] == 2
    assert {item.key: json.loads(item.value_json) for item in resumed.config.update}["max_steps"] == 3
    assert [(row["_step"], row["loss"]) for row in first_history] == [(1, 0.5), (2, 0.25)]
    assert first_history[0]["reward/mean"] == 1
    assert first_history[1]["samples/_type"] == "table-file" and first_history[1]["samples/nrows"] == 1
    (table_path,) = tmp_path.glob(f"wandb/offline-run-*-{run_id}/files/{first_history[1]['samples/path']}")
    table = json.loads(table_path.read_text())
    assert table["columns"] == ["step", "prompt", "reward", "rewards"]
    assert table["data"] == [[2, "1+1=", "NaN", '{"exact": 0.0}']]
    assert [(row["_step"], row["loss"]) for row in resumed_history] == [(2, 9.0)]


def test_mlflow_logs_to_a_store_in_the_run_dir_and_a_resume_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_two_steps_then_resume_at_one(tmp_path, "mlflow", project="p", run_name="n")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (tmp_path / "mlflow_run_id").read_text()
    (run,) = client.search_runs([client.get_experiment_by_name("p").experiment_id])  # one run, not two
    assert run.info.run_id == run_id and run.info.run_name == "n" and run.info.status == "FINISHED"
    # the resumed run's step 2 follows the crashed run's: MLflow keeps every value it received
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25), (2, 9.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(1, 1.0)]
    assert run.data.params == {"lr": "0.5", "reward": '["f.py:g"]', "max_steps": "2"}  # the first session's
    table = json.loads((tmp_path / "mlartifacts" / run_id / "artifacts" / "samples" / "step_000002.json").read_text())
    assert table["columns"] == ["step", "prompt", "reward", "rewards"]
    assert table["data"] == [[2, "1+1=", "NaN", '{"exact": 0.0}']]


def test_mlflow_params_are_text_cut_to_mlflows_limit(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = {f"field_{i}": i for i in range(MAX_PARAMS_TAGS_PER_BATCH + 1)}  # more than one batch holds
    config |= {"dataset": "x" * (MAX_PARAM_VAL_LENGTH + 1), "model": None, "bf16": True, "eps": 1e-8}
    MetricsLogger.open(tmp_path, report_to="mlflow", config=config).close()
    params = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run((tmp_path / "mlflow_run_id").read_text()).data.params
    assert len(params) == len(config) and params["field_100"] == "100"
    assert params["dataset"] == "x" * MAX_PARAM_VAL_LENGTH
    assert (params["model"], params["bf16"], params["eps"]) == ("null", "true", "1e-08")


@pytest.fixture
def trackio_store(tmp_path, monkeypatch):
    """trackio's local store in tmp_path. trackio reads TRACKIO_DIR once, when imported, so the two modules
    that keep its value are patched too."""
    store = tmp_path / "trackio_store"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    pytest.importorskip("trackio")
    import trackio.sqlite_storage
    import trackio.utils

    for module in (trackio.utils, trackio.sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", store)
    return store


def test_trackio_logs_locally_and_a_resume_continues_the_same_run(tmp_path, trackio_store):
    from trackio.sqlite_storage import SQLiteStorage

    _log_two_steps_then_resume_at_one(tmp_path / "run", "trackio", project="p", run_name="n")
    assert (trackio_store / "p.db").exists() and (tmp_path / "run" / "trackio_run_name").read_text() == "n"
    assert [run["name"] for run in SQLiteStorage.get_run_records("p")] == ["n"]  # one run, not two
    logs = SQLiteStorage.get_logs("p", "n")
    # the resumed run's step 2 follows the crashed run's: trackio keeps every value it received
    assert [(row["step"], row["loss"]) for row in logs if "loss" in row] == [(1, 0.5), (2, 0.25), (2, 9.0)]
    (samples,) = [row["samples"] for row in logs if "samples" in row]
    assert samples["_value"] == [{"step": 2, "prompt": "1+1=", "reward": "NaN", "rewards": '{"exact": 0.0}'}]
    assert SQLiteStorage.get_run_config("p", "n")["max_steps"] == 3  # the latest session's config
