"""``posttrain compare`` end to end on a tiny random model: every run trains in its own process,
a run killed mid-way is resumed from its checkpoint, the report's table equals the runs' logs,
and a repeated call redoes nothing; planning and run states on their own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_report import PNG_SIGNATURE, embedded_pngs, summary_table

from posttrain.cli import build_parser, main
from posttrain.report.compare import Job, check_same_config, flat_from_args, plan, run_state
from posttrain.config import Config, ConfigError, save_yaml
from posttrain.tracking.metrics import read_metrics
from posttrain.training.api import train


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """Eight addition prompts: a few rows load faster than the built-in task's split in every child."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a + 3}="}) + "\n" for a in range(10, 18)))
    return path


def compare_args(model_dir, reward_file, prompts_file, output):
    return ["compare", "--algorithms", "grpo,dapo", "--seeds", "1", "--jobs", "2", "--output", str(output),
            "--model", str(model_dir), "--dataset", str(prompts_file), "--eval-dataset", str(prompts_file),
            "--reward", f"{reward_file}:sevens", "--binary-reward", "none",  # DAPO's +-1 needs a right/wrong check
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "12", "--eval-size", "4",
            "--learning-rate", "1e-3", "--max-steps", "2", "--eval-every", "1", "--save-every", "1",
            "--report-to", "none"]


def run_files(output: Path) -> dict[str, int]:
    """Every file of the run directories with its modification time (the report is rewritten each call)."""
    return {str(p): p.stat().st_mtime_ns for name in ("grpo", "dapo") for p in (output / name).rglob("*")
            if p.is_file()}


def interrupted_run(args: list[str], algorithm: str) -> Path:
    """The run directory a comparison's ``algorithm`` run leaves when killed right after saving step 1:
    trained here, in this process, to step 1 (checkpoint included), without final model or resources."""
    parsed = build_parser().parse_args(args)
    [job] = [j for j in plan(parsed.algorithms, parsed.seeds, flat_from_args(parsed), Path(parsed.output))
             if j.algorithm == algorithm]
    train(Config.from_flat({**job.flat, "max_steps": 1}))
    shutil.rmtree(job.run_dir / "final_model")
    return job.run_dir


def test_compare_resumes_a_killed_run_reports_and_then_redoes_nothing(tiny_model_dir, reward_file, prompts_file,
                                                                      tmp_path):
    output = tmp_path / "lineage"
    args = compare_args(tiny_model_dir, reward_file, prompts_file, output)
    killed = interrupted_run(args, "dapo")
    kept_rows = read_metrics(killed)
    step1 = (killed / "checkpoints" / "step_000001" / "manifest.json").stat().st_mtime_ns
    assert main(args) == 0  # grpo from scratch, dapo resumed: each in its own process

    assert (killed / "checkpoints" / "step_000001" / "manifest.json").stat().st_mtime_ns == step1  # not restarted
    assert read_metrics(killed)[:2] == kept_rows and read_metrics(killed)[2]["step"] == 2
    assert json.loads((killed / "resources.json").read_text())["segments"][0]["resumed"] is True

    # The report embeds its figures and its table holds the runs' own numbers.
    page = (output / "report.html").read_text()
    pngs = embedded_pngs(page)
    assert len(pngs) == len(list((output / "figures").glob("*.png"))) >= 5
    assert all(png.startswith(PNG_SIGNATURE) for png in pngs)
    table = summary_table(page)
    assert list(table) == ["grpo", "dapo"]
    for name in ("grpo", "dapo"):
        run = output / name / "seed0"
        rows = read_metrics(run)
        resources = json.loads((run / "resources.json").read_text())
        assert [r["step"] for r in rows] == [0, 1, 2] and resources["max_steps"] == resources["steps"] == 2
        assert float(table[name]["final held-out reward"]["value"]) == rows[-1]["eval/reward"]
        assert float(table[name]["training time (s)"]["value"]) == pytest.approx(sum(r["time/step"] for r in rows[1:]))
        assert float(table[name]["peak RSS (MiB)"]["value"]) == resources["peak_rss_mib"] > 50
        assert (run / "final_model").is_dir() and (run / "train.log").exists()

    # The same call again: both runs are finished, nothing is trained or written.
    before = run_files(output)
    assert main(args) == 0
    assert run_files(output) == before


def test_every_run_is_validated_before_any_starts(tmp_path):
    with pytest.raises(ConfigError, match="unknown algorithm 'grpoo'"):
        plan(["grpo", "grpoo"], 2, {}, tmp_path)
    with pytest.raises(ConfigError, match="names a preset twice"):
        plan(["grpo", "grpo"], 1, {}, tmp_path)
    assert main(["compare", "--algorithms", "grpo", "--output", str(tmp_path), "--seed", "3"]) == 2
    assert not any(tmp_path.iterdir())


def test_a_run_directory_made_with_other_settings_is_not_reused(tmp_path):
    [job] = plan(["grpo"], 1, {"learning_rate": 1e-3, "max_steps": 5}, tmp_path)
    job.run_dir.mkdir(parents=True)
    save_yaml(Config.from_flat({**job.flat, "max_steps": 9}), job.run_dir / "config.yaml")
    check_same_config(job)  # only max_steps differs: the run is continued or extended
    [other] = plan(["grpo"], 1, {"learning_rate": 1e-4, "max_steps": 5}, tmp_path)
    with pytest.raises(ConfigError, match=r"learning_rate=0.001 \(now 0.0001\)"):
        check_same_config(other)


def test_run_state(tmp_path):
    [job] = plan(["grpo"], 1, {"max_steps": 4}, tmp_path)
    assert run_state(job) == "new"
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    assert run_state(job) == "new"  # killed before its first checkpoint: nothing to resume from
    (job.run_dir / "final_model").mkdir()
    (job.run_dir / "resources.json").write_text(json.dumps({"max_steps": 4}))
    assert run_state(job) == "done"
    longer = Job(job.algorithm, job.seed, job.run_dir, {**job.flat, "max_steps": 8})
    assert run_state(longer) == "new"  # asked for more steps, but no checkpoint to extend from


def test_seeds_are_a_count_or_a_list_that_adds_seeds_to_a_comparison(tmp_path, capsys):
    def seeds(*flags):
        parsed = build_parser().parse_args(["compare", "--algorithms", "grpo", "--output", str(tmp_path), *flags])
        return [job.seed for job in plan(parsed.algorithms, parsed.seeds, flat_from_args(parsed), tmp_path)]

    assert seeds() == [0, 1, 2]  # three by default: one seed cannot tell a difference from noise
    assert seeds("--seeds", "1") == [0]
    assert seeds("--seeds", "1,2") == [1, 2]  # seed 0 ran before: same directories, the same settings
    assert seeds("--seeds", "2,") == [2]  # a list of one
    with pytest.raises(ConfigError, match="seeds: got 1,1"):
        seeds("--seeds", "1,1")
    with pytest.raises(ConfigError, match="seeds: got 0; use 1 or more"):
        seeds("--seeds", "0")
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error, for this flag and this reason
        seeds("--seeds", "two")
    assert exit_info.value.code == 2
    assert "argument --seeds: 'two' is neither a count of seeds nor a list" in capsys.readouterr().err
