"""The docs run: every code block of README.md and docs/*.md is executed or checked, and every relative link.

```python blocks run. Each runs in a fresh namespace, as if pasted into a new Python
session, so blocks never rely on one another. Its line numbers are those of the
Markdown file, so a traceback points at the failing line of the doc.

Shell blocks (```bash, ```sh, ```shell, ```console and plain ```) are read as a shell
reads them (continuation lines, comments, quotes, `$ ` prompts, `FOO=1` prefixes,
`&&`, `;` and `|`, `$(...)`), and every command is checked without running it:
`posttrain ...` (also `.venv/bin/posttrain`, `python -m posttrain`, and `-m posttrain.cli`
under torchrun or accelerate launch, whose own options their parsers check) is parsed by
the CLI's parser, and `train` and `compare` build their configs as the CLI does, so an
unknown flag, a misspelled preset or an invalid value fails, naming the file and line.
A doc's commands are checked in order in a scratch directory holding the repository's
files: a `train` or `compare` leaves the run directories it would write (their
config.yaml), so `--resume` and `posttrain report` find them; a file the reader brings
(`--dataset prompts.jsonl`, `--reward my_rewards.py:f`, `--config run.yaml`) is a
placeholder, while a path into the repository (`recipes/...`) must exist. `make`
targets must exist, a script's flags must appear in its `--help`, and `pip install`
of posttrain's extras must name extras of pyproject.toml. Any other program is an
error unless UNCHECKED_PROGRAMS says why it is not checked.

```yaml blocks are validated: posttrain run configs by `Config.from_flat`, accelerate
configs by accelerate's own loader.

A block of any other language, or one that cannot be checked here (a GPU, a real
model, minutes of training), is marked `<!-- not run: why -->` on the line above its
fence and listed in NOT_RUN.

docs/functional.md's loop is also held to its claim: with the step's
normaliser, its micro-batch gradients add up to one call on the whole step.

posttrain's sources are held to the files they name: every repository path in a
docstring or comment (`docs/decisions.md`, `benchmarks/run.py`, `FACTS.md`) exists.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.optim.optimizer import register_optimizer_step_pre_hook

import posttrain.functional as F

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN_MARK = re.compile(r"<!-- not run: (.+?) -->")

NOT_RUN: set[tuple[str, str]] = {
    ("README.md", "sample completions of the model before and after training, not code"),
    ("README.md", "it trains a model; tests/test_api.py runs the same calls on a tiny one"),
    ("README.md", "each command trains on the one before's final_model/; tests/test_rlhf_pipeline.py runs the "
                  "sequence on a small budget"),
}
"""Blocks shown but not run: (file, the reason their `<!-- not run: ... -->` mark gives); by reason, not by
line, so that editing a doc above a block does not move its entry."""

SHELL = {"bash", "sh", "shell", "console", ""}  # "": a plain ``` fence
YAML = {"yaml", "yml"}
CHECKED = {"python", *SHELL, *YAML}
"""Languages whose blocks the tests run or check; a block of any other needs a `<!-- not run: ... -->` mark."""


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason of a `<!-- not run: ... -->` mark right above the fence
    lang: str = "python"  # the fence's language, "" for a plain fence

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


FENCE = re.compile(r"(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`{]*)")


def code_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file (or of ``text``, read as that file), in order."""
    lines = (path.read_text() if text is None else text).splitlines()
    name = str(path.relative_to(ROOT)) if path.is_absolute() else str(path)
    blocks, opening = [], None
    for index, line in enumerate(lines):
        if opening is None:
            opening = FENCE.match(line)
            start = index
        elif line.strip().startswith(opening["fence"]) and not line.strip().strip(opening["fence"][0]):
            mark = NOT_RUN_MARK.fullmatch(lines[start - 1].strip()) if start > 0 else None
            code = "\n".join(row[len(opening["indent"]):] if row.startswith(opening["indent"]) else row.lstrip()
                             for row in lines[start + 1:index])
            blocks.append(Block(name, start + 1, code + "\n", mark and mark.group(1), opening["lang"].lower()))
            opening = None
    return blocks


ALL_BLOCKS = [block for path in DOCS for block in code_blocks(path)]
BLOCKS = [block for block in ALL_BLOCKS if block.lang == "python"]
SHELL_BLOCKS = [block for block in ALL_BLOCKS if block.lang in SHELL]
YAML_BLOCKS = [block for block in ALL_BLOCKS if block.lang in YAML]


@functools.cache
def run(block: Block) -> tuple[dict, list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]]]:
    """Executes a block once per test process; returns its namespace and, for each optimizer step
    it took, (parameter, its value, its gradient) just before the update."""
    steps = []

    def record(optimizer, args, kwargs) -> None:
        steps.append([(p, p.detach().clone(), None if p.grad is None else p.grad.clone())
                      for group in optimizer.param_groups for p in group["params"]])

    # Leading newlines give the code its line numbers in the Markdown file.
    code = compile("\n" * block.line + block.code, str(ROOT / block.path), "exec")
    namespace = {"__name__": "__main__"}
    hook = register_optimizer_step_pre_hook(record)
    try:
        with torch.random.fork_rng():  # a fixed seed for reproducible failures, without leaking it
            torch.manual_seed(0)
            exec(code, namespace)
    finally:
        hook.remove()
    return namespace, steps


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_block_runs(block: Block):
    if block.not_run:
        pytest.skip(f"marked not run: {block.not_run}")
    with registries_restored():  # a block may register pieces or presets: they do not outlive it
        run(block)


@contextlib.contextmanager
def registries_restored():
    from posttrain.algorithms import presets, registry

    tables = (registry.ADVANTAGES, registry.POLICY_LOSSES, registry.PREFERENCE_LOSSES, presets.ALGORITHMS)
    saved = [dict(table) for table in tables]
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)


def test_not_run_blocks_are_listed():
    """A skip is visible here, not only in the Markdown source."""
    assert {(block.path, block.not_run) for block in ALL_BLOCKS if block.not_run} == NOT_RUN


def test_every_block_is_checked_or_marked():
    """A block is run (python), checked (shell, yaml) or marked `<!-- not run: why -->`: none is silently left out."""
    unchecked = [f"{block.id}: a ```{block.lang or '(plain)'} block" for block in ALL_BLOCKS
                 if block.lang not in CHECKED and not block.not_run]
    assert not unchecked, ("blocks no test checks; put `<!-- not run: why -->` on the line above each fence, "
                           "or teach tests/test_docs.py their language:\n" + "\n".join(unchecked))


def test_functional_loop_micro_batches_give_the_whole_step_gradient():
    [block] = [b for b in BLOCKS if b.path == "docs/functional.md" and "normalizer=normalizer" in b.code]
    namespace, steps = run(block)
    assert len(steps) == len(namespace["loader"])
    policy, tokens, mask = namespace["policy"], namespace["tokens"], namespace["mask"]
    assert namespace["micro_batch_size"] < len(tokens), "one micro-batch would show nothing"

    # The namespace holds the last step's batch: take its gradient again, in one call, at the
    # weights the step saw, with the call's own normaliser (normalizer=None).
    last_step = steps[-1]
    with torch.no_grad():
        for parameter, weight, _ in last_step:
            parameter.copy_(weight)
    policy.zero_grad()
    loss, _ = F.policy_loss(namespace["logprobs"](policy, tokens), namespace["old_logp"], namespace["adv"], mask,
                            eps_low=0.2, eps_high=0.28, aggregation="token_mean",
                            ref_logprobs=namespace["ref_logp"], kl_coef=0.04)
    loss.backward()
    for parameter, _, accumulated in last_step:
        torch.testing.assert_close(accumulated, parameter.grad, rtol=1e-5, atol=1e-7)
    assert any(grad.abs().sum() > 0 for _, _, grad in last_step)


FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of [text](target) and ![alt](target)
EXTERNAL = re.compile(r"[a-z][a-z0-9+.-]*:|#")  # https:, mailto:, or an anchor in the same file


@pytest.mark.parametrize("path", DOCS, ids=[str(path.relative_to(ROOT)) for path in DOCS])
def test_relative_links_point_to_files(path: Path):
    targets = LINK.findall(FENCED.sub("", path.read_text()))  # code blocks hold code, not links
    missing = [t for t in targets if not EXTERNAL.match(t) and not (path.parent / t.split("#")[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"


# ---------------------------------------------------------------------------------------
# Shell blocks: every command checked, none run
# ---------------------------------------------------------------------------------------


def _repository_files() -> list[str]:
    """The repository's files: git's list, or without git every file but the ignored kinds."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
        return [name for name in listing.stdout.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        ignored = {"runs", "build", "dist", "__pycache__"}
        files = [f.relative_to(ROOT) for f in ROOT.rglob("*") if f.is_file()]
        return [str(f) for f in files if not any(
            part.startswith(".") or part in ignored or part.endswith(".egg-info") for part in f.parts)]


REPOSITORY_FILES = _repository_files()
REPO_ENTRIES = sorted({Path(name).parts[0] for name in REPOSITORY_FILES})
"""The repository's top-level files and directories: a path that starts with one of them is the repository's
(it must exist); any other relative path is the reader's own file."""

UNCHECKED_PROGRAMS: dict[str, str] = {
    "git": "version control: nothing of posttrain's to check",
    "cd": "moves the reader's shell",
    "ls": "lists files",
    "cat": "shows a file",
    "tee": "copies output to a file",
    "mkdir": "makes a directory",
    "export": "sets a variable of the reader's shell",
    "nvidia-smi": "shows the GPUs",
    "tensorboard": "TensorBoard's viewer of a run's logs",
    "wandb": "W&B's own command (wandb sync uploads an offline run)",
    "mlflow": "MLflow's own command (mlflow ui shows a run)",
    "trackio": "trackio's own command (trackio show)",
}
"""Programs a doc may show without their commands being checked, each with the reason. A command of any
program neither checked below nor listed here fails, so that no documented line is silently ignored."""

PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
POSTTRAINS = {"posttrain", ".venv/bin/posttrain"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
CONTROL_OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {"&>", ">>", ">&", "<&", ">", "<"}
OPERATORS = ("&&", "||", "<<", "&>", ">>", ">&", "<&", ";", "|", "&", ">", "<")  # the longest first


class Problem(Exception):
    """What is wrong with a documented command, or why the checker cannot read it."""


class Op(str):
    """A shell operator (``&&``, ``|``, ``>`` ...) among a command line's words."""


@dataclass(frozen=True)
class Outcome:
    where: str  # path:line of the command in the doc
    command: str
    status: str  # "checked", "unchecked" (a program of UNCHECKED_PROGRAMS) or "problem"
    detail: str  # what was checked, why not, or what is wrong


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """(line in the doc, text) of each command line of a shell block: continuation lines joined, a `$ `
    prompt dropped, and in a ```console block the output lines (those without a prompt) left out."""
    lines, pending, first = [], None, 0
    for offset, row in enumerate(block.code.splitlines()):
        if pending is None:
            stripped = row.lstrip()
            if stripped == "$" or stripped.startswith("$ "):
                row = stripped[2:]
            elif block.lang == "console":
                continue
            first, pending = block.line + 1 + offset, ""
        if row.endswith("\\") and not row.endswith("\\\\"):
            pending += row[:-1]
            continue
        lines.append((first, pending + row))
        pending = None
    if pending is not None:
        lines.append((first, pending))
    return lines


def lex(text: str, substitute: Callable[[str], str]) -> list[str]:
    """The words (quotes removed, each ``$(...)`` replaced by ``substitute(...)``) and operators (as Op) of one
    command line, up to its comment. Variables are not expanded: a doc's command must hold its values."""
    tokens: list[str] = []
    word: list[str] | None = None  # the pieces of the word being read; None between words
    i = 0

    def close() -> None:
        nonlocal word
        if word is not None:
            tokens.append("".join(word))
            word = None

    while i < len(text):
        c = text[i]
        if c in " \t\n":
            close()
            i += 1
        elif c == "#" and word is None:
            break
        elif c == "\\":
            word = (word or []) + [text[i + 1:i + 2]]
            i += 2
        elif c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise Problem("cannot read it: a ' is never closed")
            word = (word or []) + [text[i + 1:end]]
            i = end + 1
        elif c == '"':
            piece, i = _double_quoted(text, i + 1, substitute)
            word = (word or []) + [piece]
        elif text.startswith("$(", i):
            inner, i = _substitution(text, i)
            for k, part in enumerate(substitute(inner).split()):  # unquoted: split into words
                if k:
                    close()
                word = (word or []) + [part]
        elif c == "`" or (c == "$" and text[i + 1:i + 2].strip()):
            raise Problem(f"cannot read it: {text[i:i + 12]!r}: the checker expands no variables and no `...`; "
                          "write the value, or $(...)")
        elif op := next((o for o in OPERATORS if text.startswith(o, i)), None):
            if op == "<<":
                raise Problem("cannot read it: a here-document (the checker reads a line at a time)")
            if op in REDIRECTIONS and word is not None and "".join(word).isdigit():
                word = None  # the file descriptor of 2>
            close()
            tokens.append(Op(op))
            i += len(op)
        else:
            word = (word or []) + [c]
            i += 1
    close()
    return tokens


def _double_quoted(text: str, i: int, substitute: Callable[[str], str]) -> tuple[str, int]:
    """The value of the double-quoted string from ``text[i]`` (after its opening quote), and where it ends."""
    out = []
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(out), i + 1
        if c == "\\" and text[i + 1:i + 2] in ('"', "\\", "$", "`"):
            out.append(text[i + 1])
            i += 2
        elif text.startswith("$(", i):
            inner, i = _substitution(text, i)
            out.append(substitute(inner))
        elif c == "`" or (c == "$" and text[i + 1:i + 2].strip() and text[i + 1] != '"'):
            raise Problem(f"cannot read it: {text[i:i + 12]!r}: the checker expands no variables and no `...`")
        else:
            out.append(c)
            i += 1
    raise Problem('cannot read it: a " is never closed')


def _substitution(text: str, i: int) -> tuple[str, int]:
    """The command of the ``$(...)`` at ``text[i]``, and where it ends."""
    depth, j = 1, i + 2
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c in "'\"":
            end = text.find(c, j + 1)
            if end < 0:
                break
            j = end + 1
            continue
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return text[i + 2:j], j + 1
        j += 1
    raise Problem("cannot read it: a $( is never closed")


def simple_commands(tokens: list[str]) -> list[list[str]]:
    """The commands of a line split at ``&&``, ``||``, ``;``, ``|`` and ``&``, without their redirections."""
    commands, current, i = [], [], 0
    while i < len(tokens):
        token = tokens[i]
        if isinstance(token, Op) and token in CONTROL_OPERATORS:
            commands.append(current)
            current = []
        elif isinstance(token, Op):  # a redirection: its file is the reader's, not checked
            if i + 1 == len(tokens) or isinstance(tokens[i + 1], Op):
                raise Problem(f"cannot read it: {token} has no file")
            i += 1
        else:
            current.append(token)
        i += 1
    return [command for command in [*commands, current] if command]


class Workspace:
    """A scratch directory that stands for the repository root while a doc's commands are checked: links to the
    repository's files, placeholders for the reader's own (``prompts.jsonl``), and the run directories (their
    config.yaml) that the commands above would have written. Nothing is written into the repository.

    A ``--plugin FILE.py`` the reader brings holds ``plugin_source``: the doc's Python blocks that register
    pieces (``posttrain.register_advantage``...), which is what the doc tells the reader to put there."""

    def __init__(self, root: Path, plugin_source: str = ""):
        self.root = root
        self.plugin_source = plugin_source
        for entry in REPO_ENTRIES:
            if (ROOT / entry).exists() and not (root / entry).exists():
                (root / entry).symlink_to(ROOT / entry)

    def cwd(self) -> contextlib.chdir:
        return contextlib.chdir(self.root)

    def own(self, path: str) -> Path | None:
        """Where ``path`` lies in the scratch directory; None for a path into the repository or out of the directory."""
        parts = Path(path).parts
        if not parts or Path(path).is_absolute() or parts[0] in REPO_ENTRIES:
            return None
        target = (self.root / path).resolve()
        return target if target.is_relative_to(self.root.resolve()) else None

    def provide(self, path: Any, content: str = "") -> str | None:
        """A placeholder for a file the reader brings, where it is missing; returns its path if made."""
        if not isinstance(path, str) or path.startswith("hf:"):
            return None
        own = self.own(path)
        if own is None or own.exists():
            return None
        own.parent.mkdir(parents=True, exist_ok=True)
        own.write_text(content)
        return path

    def provide_inputs(self, flat: dict[str, Any]) -> list[str]:
        """Placeholders for the files a config (a flat mapping, or the CLI's parsed arguments) reads: its --config,
        dataset, eval_dataset, reward and tool files and plugins."""
        flat = {key.replace("-", "_"): value for key, value in flat.items()}
        made = [self.provide(flat.get("config"), "{}\n")]
        with self.cwd():
            config = flat.get("config")
            if isinstance(config, str) and Path(config).is_file():
                loaded = yaml.safe_load(Path(config).read_text())
                flat = {**(loaded if isinstance(loaded, dict) else {}), **flat}

        def listed(value: Any) -> list[Any]:
            return list(value) if isinstance(value, (list, tuple)) else [value]

        made += [self.provide(flat.get(key)) for key in ("dataset", "eval_dataset")]
        made += [self.provide(spec.rpartition(":")[0]) for key in ("reward", "tools", "environment")
                 for spec in listed(flat.get(key)) if isinstance(spec, str)]
        made += [self.provide(path, self.plugin_source) for path in listed(flat.get("plugin"))]
        return [path for path in made if path]

    def record_run(self, config: Any) -> None:
        """The run directory a run of ``config`` writes, as far as later commands read it: config.yaml, final_model/."""
        own = self.own(config.run.output) if config.run.output else None
        if own is None:
            return
        from posttrain.config import save_yaml

        (own / "final_model").mkdir(parents=True, exist_ok=True)
        with self.cwd():
            save_yaml(config.with_absolute_paths(), own / "config.yaml")

    def substitute(self, command: str) -> str:
        """The output of a doc's ``$(command)``, run in the scratch directory (it reads the repository's files)."""
        done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=self.root, capture_output=True,
                              text=True, timeout=60)
        if done.returncode or done.stderr.strip():
            raise Problem(f"$({command}) fails (exit {done.returncode}): {done.stderr.strip()[-300:]}")
        if not done.stdout.strip():
            raise Problem(f"$({command}) prints nothing")
        return done.stdout.rstrip("\n")


def parse(parser: argparse.ArgumentParser, args: list[str], known: bool = False) -> tuple[Any, list[str]]:
    """``parser``'s namespace (None for --help) and unknown arguments; a Problem with argparse's complaint."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parser.parse_known_args(args) if known else (parser.parse_args(args), [])
    except SystemExit as exit:
        if exit.code == 0:
            return None, []
        complaint = err.getvalue().strip().splitlines()
        raise Problem(complaint[-1] if complaint else f"{parser.prog} exits with {exit.code}") from None


def built(make: Callable[[], Any]) -> Any:
    """``make()``, any error it raises a Problem (a documented value the code refuses)."""
    try:
        return make()
    except Problem:
        raise
    except Exception as error:
        raise Problem(f"{type(error).__name__}: {error}") from error


@functools.cache
def posttrain_parser() -> argparse.ArgumentParser:
    from posttrain.cli import build_parser

    return build_parser()


def placeholders(made: list[str]) -> str:
    return f" (placeholders for the reader's {', '.join(made)})" if made else ""


def check_train(args: argparse.Namespace, workspace: Workspace) -> str:
    from posttrain.cli import resolve_config

    made = workspace.provide_inputs(vars(args))
    with workspace.cwd():
        config = built(lambda: resolve_config(args))
    workspace.record_run(config)
    return f"its config (algorithm {config.algorithm}) builds{placeholders(made)}"


def check_compare(args: argparse.Namespace, workspace: Workspace) -> str:
    from posttrain.config import Config
    from posttrain.report.compare import flat_from_args, plan

    made = workspace.provide_inputs(vars(args))
    if args.jobs < 1:  # what compare() refuses before it plans
        raise Problem(f"jobs: got {args.jobs}; use 1 or more parallel runs")
    with workspace.cwd():  # plan() builds every run's Config.from_flat, as compare does before it runs any
        jobs = built(lambda: plan(args.algorithms, args.seeds, flat_from_args(args), Path(args.output)))
        configs = [Config.from_flat(job.flat) for job in jobs]
    for config in configs:
        workspace.record_run(config)
    return f"the configs of its {len(jobs)} runs build{placeholders(made)}"


def check_report(args: argparse.Namespace, workspace: Workspace) -> str:
    from posttrain.report.runs import find_runs

    with workspace.cwd():
        runs = built(lambda: find_runs(args.runs))
    return f"its {len(runs)} run directories are written by the commands above it"


def check_eval(args: argparse.Namespace, workspace: Workspace) -> str:
    return "parsed (eval reads its model, tasks and data only when it runs)"


def check_algorithms(args: argparse.Namespace, workspace: Workspace) -> str:
    from posttrain.algorithms.tables import format_presets_table, format_side_by_side

    built(lambda: format_side_by_side(args.names) if args.names else format_presets_table())
    return "its table builds"


POSTTRAIN_COMMANDS: dict[str, Callable[[argparse.Namespace, Workspace], str]] = {
    "train": check_train, "compare": check_compare, "report": check_report, "eval": check_eval,
    "algorithms": check_algorithms,
}
"""The check of each posttrain subcommand; a subcommand without one fails in the docs until it has one."""


def check_posttrain(args: list[str], workspace: Workspace) -> tuple[str, str]:
    """A ``posttrain`` command line as ``posttrain.cli.main`` reads it, up to the config it would train."""
    from posttrain.cli import _hyphenated, _unrecognized

    elided = bool(args) and args[-1] == "..."  # `... train --algorithm grpo ...`: flags the reader adds
    if elided:
        args = args[:-1]
    namespace, unknown = parse(posttrain_parser(), _hyphenated(args), known=True)
    if namespace is None:
        return "checked", "prints its help"
    if unknown:
        raise Problem(_unrecognized(unknown))
    check = POSTTRAIN_COMMANDS.get(namespace.command)
    if check is None:
        raise Problem(f"posttrain {namespace.command}: tests/test_docs.py has no check for it; add one to "
                      "POSTTRAIN_COMMANDS")
    return "checked", check(namespace, workspace) + ("; its trailing ... left out" if elided else "")


def check_launcher(program: str, parser: argparse.ArgumentParser, args: list[str],
                   workspace: Workspace) -> tuple[str, str]:
    """torchrun or accelerate launch: their own options by their parser, then the program they start."""
    parser.prog = program
    namespace, _ = parse(parser, args)
    if namespace is None:
        return "checked", "prints its help"
    if namespace.module and namespace.training_script in ("posttrain", "posttrain.cli"):
        status, detail = check_posttrain(namespace.training_script_args, workspace)
        return status, f"{program}'s options parse; {detail}"
    if namespace.module:
        raise Problem(f"{program} -m {namespace.training_script}: not posttrain's command; check it in "
                      "tests/test_docs.py")
    return check_script(namespace.training_script, namespace.training_script_args)


@functools.cache
def script_help(script: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def check_script(script: str, args: list[str]) -> tuple[str, str]:
    """A repository script: it exists, and each option the doc passes is one its --help lists."""
    if Path(script).is_absolute() or not (ROOT / script).is_file():
        raise Problem(f"{script} does not exist")
    code, help_text = script_help(script)
    if code:
        raise Problem(f"{script} --help fails (exit {code}): {help_text.strip()[-300:]}")
    options = []
    for arg in args:
        if arg == "--":
            break
        if re.match(r"--?[A-Za-z]", arg):
            options.append(arg.partition("=")[0])
    missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", help_text)]
    if missing:
        raise Problem(f"{script} has no option {', '.join(missing)} (its --help does not list it)")
    return "checked", f"{script} lists {', '.join(options) or 'no option'} in its --help"


def check_python(args: list[str], workspace: Workspace) -> tuple[str, str]:
    if args[:2] in (["-m", "posttrain"], ["-m", "posttrain.cli"]):
        return check_posttrain(args[2:], workspace)
    if args[:2] == ["-m", "pip"]:
        return check_pip(args[2:])
    if args[:1] == ["-m"] and len(args) > 1:
        if importlib.util.find_spec(args[1]) is None:
            raise Problem(f"no module {args[1]!r}")
        return "checked", f"module {args[1]} exists (its arguments are not checked)"
    if args and args[0].endswith(".py"):
        return check_script(args[0], args[1:])
    raise Problem("a python command tests/test_docs.py cannot check (it checks -m MODULE and SCRIPT.py)")


def check_make(args: list[str]) -> tuple[str, str]:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", makefile, re.MULTILINE)) - {".PHONY"}
    named = [arg for arg in args if not arg.startswith("-") and "=" not in arg]
    variables = [arg.partition("=")[0] for arg in args if ASSIGNMENT.match(arg)]
    missing = [name for name in named if name not in targets]
    unused = [name for name in variables if not re.search(rf"\$[({{]{name}[)}}]", makefile)]
    if missing or unused:
        raise Problem("; ".join([*(f"the Makefile has no target {name!r}" for name in missing),
                                 *(f"the Makefile does not use the variable {name}" for name in unused)])
                      + f" (targets: {', '.join(sorted(targets))})")
    return "checked", f"Makefile target(s) {', '.join(named) or '(the first)'} exist"


def _extra_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_pip(args: list[str]) -> tuple[str, str]:
    """``pip install`` of posttrain (``posttrain[extras]``, ``.[extras]``): its extras exist in pyproject.toml."""
    if args[:1] != ["install"]:
        return "unchecked", "a pip command other than install"
    ours = [arg for arg in args[1:] if re.fullmatch(r"(posttrain|\.)(\[[^\]]*\])?", arg)]
    if not ours:
        return "unchecked", "installs third-party packages"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {_extra_name(name) for name in project.get("optional-dependencies", {})}
    named = [extra.strip() for arg in ours for extra in arg.partition("[")[2].rstrip("]").split(",") if extra.strip()]
    unknown = [extra for extra in named if _extra_name(extra) not in extras]
    if unknown:
        raise Problem(f"posttrain has no extra {', '.join(unknown)} (pyproject.toml: {', '.join(sorted(extras))})")
    return "checked", f"posttrain's extras {', '.join(named) or '(none)'} exist"


def check_command(words: list[str], workspace: Workspace) -> tuple[str, str]:
    """(status, detail) of one simple command; a Problem when it would fail."""
    while words and ASSIGNMENT.match(words[0]):  # FOO=1 posttrain ...: the environment is not checked
        words = words[1:]
    if not words:
        return "unchecked", "sets a variable"
    program, args = words[0], words[1:]
    if program in POSTTRAINS:
        return check_posttrain(args, workspace)
    if program in PYTHONS:
        return check_python(args, workspace)
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        return check_launcher("torchrun", get_args_parser(), args, workspace)
    if program == "accelerate" and args[:1] == ["launch"]:
        from accelerate.commands.launch import launch_command_parser

        return check_launcher("accelerate launch", launch_command_parser(), args[1:], workspace)
    if program == "make":
        return check_make(args)
    if program in ("pip", "pip3", ".venv/bin/pip"):
        return check_pip(args)
    if program in UNCHECKED_PROGRAMS:
        return "unchecked", UNCHECKED_PROGRAMS[program]
    raise Problem(f"{program!r}: a program tests/test_docs.py does not know; check its commands there, or list it "
                  "in UNCHECKED_PROGRAMS with the reason they are not checked")


def check_shell_block(block: Block, workspace: Workspace) -> list[Outcome]:
    outcomes = []
    for line, text in logical_lines(block):
        where = f"{block.path}:{line}"
        try:
            commands = simple_commands(lex(text, workspace.substitute))
        except Problem as problem:
            outcomes.append(Outcome(where, text.strip(), "problem", str(problem)))
            continue
        for words in commands:
            try:
                status, detail = check_command(words, workspace)
            except Problem as problem:
                status, detail = "problem", str(problem)
            except Exception as error:  # a bug of the checker, shown at the line that met it
                status, detail = "problem", f"the check itself failed: {type(error).__name__}: {error}"
            outcomes.append(Outcome(where, " ".join(words), status, detail))
    return outcomes


@pytest.fixture(scope="session")
def doc_outcomes(tmp_path_factory) -> Callable[[str], dict[str, list[Outcome]]]:
    """doc path -> block id -> the outcomes of its commands: a doc's shell blocks are checked once, in order, in
    one workspace, so that a command finds the run directories the commands above it write."""

    @functools.cache
    def outcomes(path: str) -> dict[str, list[Outcome]]:
        plugin_source = "\n\n".join(block.code for block in BLOCKS if block.path == path and not block.not_run
                                    and "posttrain.register_" in block.code)
        workspace = Workspace(tmp_path_factory.mktemp("workspace"), plugin_source)
        with registries_restored():  # a --plugin the commands import registers pieces: they do not outlive the check
            return {block.id: check_shell_block(block, workspace) for block in SHELL_BLOCKS
                    if block.path == path and not block.not_run}

    return outcomes


def problems(outcomes: list[Outcome]) -> str:
    return "\n".join(f"{o.where}: {o.command}\n    {o.detail}" for o in outcomes if o.status == "problem")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[block.id for block in SHELL_BLOCKS])
def test_shell_block_commands_are_valid(block: Block, doc_outcomes):
    if block.not_run:
        pytest.skip(f"marked not run: {block.not_run}")
    outcomes = doc_outcomes(block.path)[block.id]
    assert outcomes, f"{block.id}: a shell block without a command; mark it <!-- not run: why --> if it shows no code"
    found = problems(outcomes)
    assert not found, f"documented commands that would fail:\n{found}"


# ---------------------------------------------------------------------------------------
# YAML blocks: posttrain run configs and accelerate configs
# ---------------------------------------------------------------------------------------


ACCELERATE_KEYS = {"compute_environment", "distributed_type"}
"""Keys that make a YAML block an accelerate config (`accelerate launch --config_file`), not a posttrain one."""


def check_accelerate_config(data: dict[str, Any], workspace: Workspace) -> None:
    """accelerate's own loader (unknown keys, invalid values), and every key of a section such as fsdp_config an
    option of accelerate launch: it copies them onto its arguments and ignores the ones it has no option for."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    path = workspace.root / "accelerate_config.yaml"
    path.write_text(yaml.safe_dump(data))
    ClusterConfig.from_yaml_file(str(path))
    options = {action.dest for action in launch_command_parser()._actions}
    prefixes = {"fsdp_config": "fsdp", "fp8_config": "fp8", "dynamo_config": "dynamo_"}  # accelerate's rule
    ignored = []
    for section, values in data.items():
        for key in values if isinstance(values, dict) else ():
            prefix = prefixes.get(section, "")
            option = key if key.startswith(prefix) else f"{prefix.rstrip('_')}_{key}"
            if option not in options:
                ignored.append(f"{section}.{key}")
    if ignored:
        raise Problem(f"accelerate launch has no option for {', '.join(ignored)}: it would ignore them")


def _key_line(block: Block, message: str) -> int:
    """The doc line of the top-level key an error names, else of the one whose value it quotes, else the fence's."""
    message = message.partition(": ")[2]  # after the exception's type
    keys = [(block.line + 1 + offset, match[1], match[2]) for offset, row in enumerate(block.code.splitlines())
            if (match := re.match(r"([A-Za-z_][\w-]*)\s*:\s*([^#]*?)\s*(?:#.*)?$", row))]
    for line, key, _ in keys:
        if message.startswith(f"{key}:") or f"'{key}'" in message or f" {key}:" in message:
            return line
    for line, _, value in keys:
        if value and f"'{value.strip(chr(34))}'" in message:
            return line
    return block.line


def check_yaml_block(block: Block, workspace: Workspace) -> list[str]:
    """Problems of a YAML block, each as 'path:line: what'."""
    from posttrain.config import Config

    try:
        data = yaml.safe_load(block.code)
    except yaml.YAMLError as error:
        return [f"{block.id}: not valid YAML: {error}"]
    if not isinstance(data, dict):
        return [f"{block.id}: a {type(data).__name__}, not a mapping of field: value; mark it "
                "<!-- not run: why --> if it is no config"]
    try:
        if ACCELERATE_KEYS & data.keys():
            built(lambda: check_accelerate_config(data, workspace))
        else:
            workspace.provide_inputs(data)
            with workspace.cwd():
                built(lambda: Config.from_flat(data))
    except Problem as problem:
        return [f"{block.path}:{_key_line(block, str(problem))}: {problem}"]
    return []


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[block.id for block in YAML_BLOCKS])
def test_yaml_block_is_valid(block: Block, tmp_path):
    if block.not_run:
        pytest.skip(f"marked not run: {block.not_run}")
    found = check_yaml_block(block, Workspace(tmp_path))
    assert not found, "invalid documented configs:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------
# The checks can fail: commands and configs they must refuse
# ---------------------------------------------------------------------------------------


def check_markdown(markdown: str, workspace: Workspace) -> list[Outcome]:
    """The outcomes of the shell blocks of a Markdown text, checked as the docs' are."""
    return [outcome for block in code_blocks(Path("selftest.md"), markdown) if block.lang in SHELL
            for outcome in check_shell_block(block, workspace)]


def test_shell_blocks_are_read_as_a_shell_reads_them(tmp_path):
    markdown = "\n".join([
        "```console",
        "$ posttrain algorithms grpo   # a comment",
        "some output the console shows",
        "$ FOO=1 BAR='a b' posttrain train --algorithm dapo \\",
        "    --max-steps 3 --output runs/a && posttrain train --resume runs/a --max-steps 4",
        "```",
        "```bash",
        "# a whole-line comment",
        "",
        'posttrain eval --task "$(echo addi)tion" --samples 2 > eval.txt 2>&1 | tee log; git status',
        "```",
    ])
    outcomes = [(o.where, o.command, o.status) for o in check_markdown(markdown, Workspace(tmp_path))]
    assert outcomes == [
        ("selftest.md:2", "posttrain algorithms grpo", "checked"),
        ("selftest.md:4", "FOO=1 BAR=a b posttrain train --algorithm dapo --max-steps 3 --output runs/a", "checked"),
        ("selftest.md:4", "posttrain train --resume runs/a --max-steps 4", "checked"),
        ("selftest.md:10", "posttrain eval --task addition --samples 2", "checked"),
        ("selftest.md:10", "tee log", "unchecked"),
        ("selftest.md:10", "git status", "unchecked"),
    ]
    assert (tmp_path / "runs/a/config.yaml").is_file(), "the run directory later commands (--resume) read"
    assert lex("a \"b c\" d\\ e 'f g' \"$(x)\" $(y) 2>&1", {"x": "1 2", "y": "3 4"}.get) == \
        ["a", "b c", "d e", "f g", "1 2", "3", "4", ">&", "1"]


@pytest.mark.parametrize("command, complaint", [
    ("posttrain train --no-such-flag 1", "unrecognized arguments: --no-such-flag 1"),
    ("posttrain train --lr 1e-4", "did you mean 'learning_rate'"),
    ("posttrain train --algorithm grpoo", "unknown algorithm 'grpoo'"),
    ("posttrain train --max-steps many", "argument --max-steps: invalid int value: 'many'"),
    ("posttrain train --max-steps 0", "max_steps"),
    ("posttrain train --algorithm dpo --eps-high 0.3", "eps_high"),
    ("posttrain train --resume runs/never-written --max-steps 400", "resume"),
    ("posttrain train --config recipes/no-such-recipe.yaml", "does not exist"),
    ("posttrain train --dataset docs/no-such-prompts.jsonl", "does not exist"),
    ("posttrain train --plugin mine.py --advantage no_such_estimator", "no_such_estimator"),
    ("posttrain compare --algorithms grpo,grpoo --output runs/c", "grpoo"),
    ("posttrain compare --algorithms grpo --output runs/c --jobs 0", "jobs"),
    ("posttrain compare --algorithms grpo --output runs/c --seed 1", "--seeds"),
    ("posttrain report runs/never-written", "runs/never-written"),
    ("posttrain algorithms grpo grpoo", "grpoo"),
    ("posttrain evaluate --model x", "invalid choice: 'evaluate'"),
    ("python -m posttrain eval --samples many", "invalid int value"),
    ("torchrun --nproc-per-node 2 --no-such 1 -m posttrain.cli train", "--no-such"),
    ("torchrun --nproc-per-node 2 -m posttrain.cli train --no-such-flag 1", "--no-such-flag"),
    ("accelerate launch --num_processes 2 -m posttrain.cli train --algorithm grpoo", "grpoo"),
    ("make no-such-target", "no target 'no-such-target'"),
    ("make train NO_SUCH_VARIABLE=1", "NO_SUCH_VARIABLE"),
    (".venv/bin/python benchmarks/run.py --no-such-flag", "no option --no-such-flag"),
    (".venv/bin/python benchmarks/no_such_script.py", "does not exist"),
    ("pip install 'posttrain[no-such-extra]'", "no extra no-such-extra"),
    ("frobnicate --all", "UNCHECKED_PROGRAMS"),
    ('posttrain eval --task "$(false)"', "fails"),
    ("posttrain train --model $MODEL", "expands no variables"),
    ('posttrain train --algorithm "dapo', "never closed"),
])
def test_a_bad_command_is_caught(command, complaint, tmp_path):
    markdown = f"Some text.\n\n```bash\nposttrain algorithms\n{command}\n```\n"
    outcomes = check_markdown(markdown, Workspace(tmp_path))
    assert [o.status for o in outcomes[:1]] == ["checked"]
    bad = [o for o in outcomes if o.status == "problem"]
    assert bad and bad[0].where == "selftest.md:5", outcomes
    assert complaint in bad[0].detail, bad[0].detail


@pytest.mark.parametrize("config, line, complaint", [
    ("algorithm: dapo\nlearning_rat: 1.0e-4\n", 3, "learning_rat"),
    ("algorithm: dapo\nmax_steps: 0\n", 3, "max_steps"),
    ("algorithm: dpo\ngroup_size: 8\neps_high: 0.3\n", 4, "eps_high"),
    ("algorithm: grpoo\n", 2, "grpoo"),
    ("- algorithm: dapo\n", 1, "not a mapping"),
    ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPUS\n", 3, "MULTI_GPUS"),
    ("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_ofload_params: false\n", 1,
     "fsdp_config.fsdp_ofload_params"),
])
def test_a_bad_yaml_config_is_caught(config, line, complaint, tmp_path):
    [block] = code_blocks(Path("selftest.md"), f"```yaml\n{config}```\n")
    [problem] = check_yaml_block(block, Workspace(tmp_path))
    assert problem.startswith(f"selftest.md:{line}: ") and complaint in problem, problem


def test_a_block_of_another_language_needs_a_mark():
    markdown = "```text\noutput\n```\n\n<!-- not run: sample output -->\n```json\n{}\n```\n"
    blocks = code_blocks(Path("selftest.md"), markdown)
    assert [(b.id, b.lang, b.not_run) for b in blocks] == [
        ("selftest.md:1", "text", None), ("selftest.md:6", "json", "sample output")]
    assert [b.id for b in blocks if b.lang not in CHECKED and not b.not_run] == ["selftest.md:1"]


# ---------------------------------------------------------------------------------------
# posttrain's sources name files that exist
# ---------------------------------------------------------------------------------------


REPO_DIRECTORIES = [entry for entry in REPO_ENTRIES if (ROOT / entry).is_dir()]
REPO_PATH = re.compile(r"(?<![\w./-])(?:%s)/[\w./-]*?\w\.(?:md|py|ya?ml|jsonl?|sh|toml|html|txt|png|svg|csv)(?![\w/])"
                       % "|".join(map(re.escape, REPO_DIRECTORIES)))
BARE_DOC = re.compile(r"(?<![\w./-])[A-Z][A-Z0-9_]*\.md(?![\w/])")  # FACTS.md, RESULTS.md: the repository's notes


def dangling_references(text: str) -> list[tuple[int, str]]:
    """(line, path) of each repository file ``text`` names that does not exist: a path under one of the
    repository's directories (``docs/decisions.md``), or a bare notes file (``FACTS.md``) no file is called."""
    names = {Path(name).name for name in REPOSITORY_FILES} | {p.name for p in ROOT.iterdir()}
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        matches = [*REPO_PATH.finditer(line), *BARE_DOC.finditer(line)]
        for match in sorted(matches, key=lambda m: m.start()):
            missing = match[0] not in names if match.re is BARE_DOC else not (ROOT / match[0]).exists()
            if missing:
                found.append((number, match[0]))
    return found


def test_files_named_in_posttrain_exist():
    """Docstrings and comments point at the notes and code that back them: each must exist."""
    found = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sorted((ROOT / "posttrain").rglob("*.py"))
             for line, name in dangling_references(path.read_text())]
    assert not found, "posttrain's sources name files that do not exist:\n" + "\n".join(found)


def test_a_dangling_reference_is_caught():
    text = "See FACTS.md and docs/no-such.md,\nbut docs/decisions.md, benchmarks/run.py and README.md exist."
    assert dangling_references(text) == [(1, "FACTS.md"), (1, "docs/no-such.md")]
