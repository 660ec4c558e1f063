"""The walkthroughs of examples/ run as the README shows them.

Each walkthrough is a directory of examples/ with its data, its reward file where it has one, and a
README.md whose shell blocks hold its commands. README.md shows the same commands: a walkthrough's
commands are the `posttrain` lines of a document's shell blocks that name ``examples/NAME/``, read
with tests/test_docs.py's shell reader, and the two documents must give the same list, so they
cannot drift apart.

The commands run in-process through ``posttrain.cli.main``, in a scratch directory holding a copy of
examples/, in the order shown (a later command reads the run directory an earlier one wrote):

- by default on a small random model over the same characters (``--model`` replaced) for two
  steps (``--max-steps 2``): every file loads, the reward runs, the held-out evaluation is logged
  before and after, and the run directory is complete. Seconds each.
- marked slow (``smollm2`` for the walkthrough on SmolLM2), exactly as written, on the built-in
  model the command names: the held-out figure the walkthrough's README quotes moves as it says.
"""

from __future__ import annotations

import json
import shlex
import shutil
import string
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.tracking.metrics import read_metrics
from test_docs import ROOT, SHELL, code_blocks, logical_lines

EXAMPLES = ROOT / "examples"
WALKTHROUGHS = ("grpo_own_data", "dpo_own_pairs", "kto_labelled", "sft_chat", "agent_calculator", "mcp_calculator",
                "verifiers_sums", "vlm_own_images")
HELD_OUT_METRIC = {
    "grpo_own_data": "eval/reward",
    "dpo_own_pairs": "eval/pairwise_accuracy",
    "kto_labelled": "eval/pairwise_accuracy",
    "sft_chat": "eval/nll",
    "agent_calculator": "eval/accuracy",
    "mcp_calculator": "eval/reward",
    "verifiers_sums": "eval/reward",
    "vlm_own_images": {"grpo": "eval/reward", "dpo": "eval/pairwise_accuracy"},
}
"""The held-out figure each walkthrough's README quotes before and after training (by algorithm, for a
walkthrough of several runs)."""


def held_out_metric(example: str, argv: list[str]) -> str:
    """The figure a walkthrough's training command is judged by."""
    metric = HELD_OUT_METRIC[example]
    return metric if isinstance(metric, str) else metric[option(argv, "--algorithm") if "--algorithm" in argv
                                                         else "grpo"]

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A minimal chat template for the character-level stand-in of a chat model."""


def walkthrough_commands(doc: Path, example: str) -> list[str]:
    """The `posttrain` command lines of ``doc``'s shell blocks that name ``examples/EXAMPLE/`` or its run
    directory ``--output runs/EXAMPLE`` (a verifiers environment is named by its package, not its path), in order."""
    return [line for block in code_blocks(doc) if block.lang in SHELL
            for _, line in logical_lines(block)
            if line.lstrip().startswith("posttrain ") and (f"examples/{example}/" in line or f"--output runs/{example}" in line)]


def argv_of(command: str) -> list[str]:
    """The arguments of a `posttrain ...` command line, as a shell splits them (comments dropped)."""
    return shlex.split(command, comments=True)[1:]


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option``'s value replaced by ``value`` (appended when the option is absent)."""
    if option not in argv:
        return [*argv, option, value]
    at = argv.index(option) + 1
    return [*argv[:at], value, *argv[at + 1:]]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("example", WALKTHROUGHS)
def test_the_readme_shows_each_walkthrough_as_its_own_readme_does(example):
    own = walkthrough_commands(EXAMPLES / example / "README.md", example)
    assert own, f"examples/{example}/README.md shows no posttrain command that names examples/{example}/"
    assert walkthrough_commands(ROOT / "README.md", example) == own


def test_every_walkthrough_is_tested():
    found = {path.parent.name for path in EXAMPLES.glob("*/README.md")}
    assert found - {"trl"} == set(WALKTHROUGHS)


@pytest.fixture(scope="session")
def vlm_model_dir(tmp_path_factory) -> Path:
    """A tiny random LLaVA with its processor (tests/vlm_families.py): a stand-in vision-language model."""
    from vlm_families import build_llava

    return build_llava(tmp_path_factory.mktemp("vlm-model") / "llava")


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A 1-layer random Llama over printable characters, with a chat template: a stand-in chat model."""
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    path = tmp_path_factory.mktemp("chat-model")
    tokenizer = char_tokenizer("".join(dict.fromkeys(string.printable)))
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def installed(argv: list[str]) -> list[str]:
    """What the README's install lines and a shell give the commands: an MCP server's ``python`` is this
    interpreter (the one with ``mcp``)."""
    if "--mcp-server" in argv:
        command = option(argv, "--mcp-server")
        argv = with_option(argv, "--mcp-server", shlex.join([sys.executable, *shlex.split(command)[1:]])
                           if shlex.split(command)[0] == "python" else command)
    return argv


def run_walkthrough(example: str, workdir: Path, monkeypatch, adapt=lambda argv: argv) -> list[list[str]]:
    """Runs the README's commands of ``example`` (each adapted by ``adapt``) in ``workdir``, which gets a
    copy of examples/; returns the argument lists that ran. A walkthrough's ``pip install -e`` of its own
    package (verifiers_sums) is its directory on the Python path."""
    shutil.copytree(EXAMPLES, workdir / "examples")
    monkeypatch.chdir(workdir)
    if (EXAMPLES / example / "pyproject.toml").is_file():
        monkeypatch.syspath_prepend(str(workdir / "examples" / example))
    ran = []
    for command in walkthrough_commands(ROOT / "README.md", example):
        argv = installed(adapt(argv_of(command)))
        assert main(argv) == 0, f"{command}\nran as: posttrain {shlex.join(argv)}"
        ran.append(argv)
    return ran


def before_and_after(run_dir: Path, key: str) -> tuple[float, float]:
    """``key`` at the run's first and last held-out evaluations."""
    values = [row[key] for row in read_metrics(run_dir) if key in row]
    assert len(values) >= 2, f"{run_dir} logged {key} {len(values)} times"
    return values[0], values[-1]


@pytest.mark.parametrize("example", WALKTHROUGHS)
def test_walkthrough_runs_on_a_small_model(example, tmp_path, monkeypatch, tiny_model_dir, chat_model_dir, request):
    stand_in = {"sft_chat": chat_model_dir, "verifiers_sums": chat_model_dir, "agent_calculator": chat_model_dir,
                "mcp_calculator": chat_model_dir}.get(example, tiny_model_dir)  # tool calls need letters
    if example == "vlm_own_images":  # images need a vision-language model: a tiny random LLaVA
        stand_in = request.getfixturevalue("vlm_model_dir")

    def small(argv):
        if argv[0] != "train":
            return argv
        return with_option(with_option(argv, "--model", str(stand_in)), "--max-steps", "2")

    ran = run_walkthrough(example, tmp_path, monkeypatch, small)
    train = [argv for argv in ran if argv[0] == "train"]
    assert train, f"the {example} walkthrough trains nothing"
    for argv in train:
        run_dir = tmp_path / option(argv, "--output")
        assert (run_dir / "final_model" / "config.json").is_file()
        assert (run_dir / "curves.png").is_file()
        assert [row["step"] for row in read_metrics(run_dir) if held_out_metric(example, argv) in row] == [0, 2]
    for argv in ran:
        if argv[0] == "eval" and "--output" in argv:
            report = json.loads((tmp_path / option(argv, "--output")).read_text())
            assert report, f"posttrain {shlex.join(argv)} wrote an empty report"


LEARNS = {
    # GRPO: held-out reward (the share of the 40 held-out sums right) from 0.35; at least +0.10.
    "grpo_own_data": lambda before, after: after >= before + 0.10,
    # DPO and KTO: held-out pairwise accuracy from 0.5 (the policy is the reference); at least 0.6.
    "dpo_own_pairs": lambda before, after: before == 0.5 and after >= 0.6,
    "kto_labelled": lambda before, after: before == 0.5 and after >= 0.6,
    # SFT: held-out NLL per assistant token at most half of where it started.
    "sft_chat": lambda before, after: after <= before / 2,
    # the calculator through an agent and through an MCP server: at least +20 points held out.
    "agent_calculator": lambda before, after: after >= before + 0.20,
    "mcp_calculator": lambda before, after: after >= before + 0.20,
}
"""What each walkthrough's README claims; verifiers_sums claims a run, not a figure (on the stand-in above)."""


@pytest.mark.parametrize("example", [
    pytest.param(name, marks=pytest.mark.smollm2 if name == "sft_chat" else pytest.mark.slow)
    for name in LEARNS])
def test_walkthrough_as_written_learns(example, tmp_path, monkeypatch):
    """Exactly the README's commands, on the model they name: the held-out figure moves as the walkthrough says."""
    ran = run_walkthrough(example, tmp_path, monkeypatch)
    for train in [argv for argv in ran if argv[0] == "train"]:
        metric = held_out_metric(example, train)
        before, after = before_and_after(tmp_path / option(train, "--output"), metric)
        learns = LEARNS[example] if callable(LEARNS[example]) else LEARNS[example][metric]
        assert learns(before, after), f"{metric}: {before:.3f} -> {after:.3f}"
