"""Tools from MCP servers (``--mcp-server``): a real server over stdio, written with the SDK (tests/fixtures/mcp_server.py).

Its tools are listed with their schemas and told to a chat template as Python tools are; an episode calls
one by name and reads its answer; a call that hangs times out, one that raises is the tool's error, a
server that dies makes its calls crashes, and each fault is counted while the run goes on. A server that
cannot start stops the run at its start, quoting its stderr, and closing the run stops (or kills) it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from test_episodes import TOKENIZER, Script, ids

from posttrain.config import Config, ConfigError
from posttrain.data.isolation import CallFailed
from posttrain.data.prompts import encode_prompt, tool_schema
from posttrain.rollout.completions import Completions, completion_mask
from posttrain.rollout.episodes import (
    EpisodeGenerator,
    InlineCalls,
    JSONCalls,
    ToolError,
    Tools,
)
from posttrain.rollout.mcp_tools import McpTool, stop_mcp_servers, with_mcp_tools

pytest.importorskip("mcp", reason="needs the mcp extra")

SERVER = Path(__file__).parent / "fixtures" / "mcp_server.py"
EOS = TOKENIZER.eos_token
FORMAT = JSONCalls(response_start="<tool_response>", response_end="</tool_response>")
"""JSON calls, answered without the newlines that the scripted policy's tokenizer does not have."""


def command(*flags: str) -> str:
    return " ".join([sys.executable, str(SERVER), *flags])


def start(*flags: str, python_tools=()) -> dict[str, McpTool]:
    """The server's tools by name (a run's config with one --mcp-server)."""
    tools = with_mcp_tools(Config.from_flat({"mcp_server": [command(*flags)]}), python_tools)
    return {tool.__name__: tool for tool in tools}


def alive(pid_file: Path, within: float = 3.0) -> bool:
    """Whether the server's process is still there ``within`` seconds (the event loop reaps a dead one soon)."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(int(pid_file.read_text()), 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    calls = tmp_path_factory.mktemp("mcp") / "calls.txt"
    tools = start("--calls-file", str(calls))
    yield tools
    stop_mcp_servers(list(tools.values()))


def episodes(turns: dict[int, list[str]], tools: Tools, fmt=FORMAT, max_new_tokens=400, num_samples=2):
    """Episodes of a scripted policy (tests/test_episodes.py's) after the prompt ``12+30=``."""
    script = Script(turns, num_samples)
    generator = EpisodeGenerator(script.make([ids(fmt.call_end)[-1]]), TOKENIZER, tools, fmt,
                                 max_new_tokens=max_new_tokens, max_turns=4, eos_ids=[TOKENIZER.eos_token_id],
                                 pad_id=TOKENIZER.pad_token_id)
    completions = generator.generate([torch.tensor(ids("12+30="))], num_samples=num_samples)
    return completions, generator.stats


def inserted(completions: Completions, row: int) -> str:
    return TOKENIZER.decode(completions.completion_ids[row][completions.inserted[row]].tolist())


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def calling(name: str, **arguments) -> list[str]:
    """A call as the scripted policy's turns write it: a turn stops at every ``>`` (the last token of
    ``</tool_call>``, one character here), and goes on where that was not the call's end."""
    return re.findall(r"[^>]*>", call(name, **arguments))


def test_the_servers_tools_are_listed_with_their_schemas_and_answer(server):
    assert list(server) == ["add", "lookup", "fail", "quit", "freeze"]
    assert server["add"].schema == {"type": "function", "function": {
        "name": "add", "description": "Add two whole numbers.\n\nArgs:\n    a: the first number\n    b: the second number",
        "parameters": {"type": "object", "title": "addArguments", "required": ["a", "b"], "properties": {
            "a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}}}}
    assert server["add"](a=2, b=3) == "5"
    assert server["lookup"].call(("pi",), {}, timeout=5) == "3.14159"  # a positional argument: the first parameter
    with pytest.raises(CallFailed, match="Error executing tool fail: boom") as failed:
        server["fail"](reason="boom")
    assert failed.value.kind == "error"


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


SIGNATURES = ("{% for t in tools %}{{ t.function.name }}({% for name, p in t.function.parameters.properties.items() %}"
              "{{ name }}: {{ p.type }}{{ ', ' if not loop.last }}{% endfor %}) requires "
              "{{ t.function.parameters.required | join(',') }}\n{% endfor %}"
              "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}")


def test_a_server_tool_is_told_to_the_chat_template_as_a_python_tool_is(server):
    """The template gets {"type": "function", "function": {name, description, parameters}} for both, the
    server's tool with the server's schema: a template that renders the signature renders the same text; one
    that does not render tools gets the same system message's example call."""
    from test_tool_formats import family_tokenizer

    messages = [{"role": "user", "content": "2+3?"}]
    assert set(tool_schema(server["add"])) == set(tool_schema(add)) == {"type", "function"}
    assert set(tool_schema(server["add"])["function"]) <= set(tool_schema(add)["function"])
    qwen = family_tokenizer("qwen2.5.jinja")  # renders each tool as its JSON
    assert qwen.decode(encode_prompt(qwen, messages, tools=[server["add"]])) == qwen.apply_chat_template(
        messages, tools=[server["add"].schema], tokenize=False, add_generation_prompt=True)
    assert json.dumps(server["add"].schema) in qwen.decode(encode_prompt(qwen, messages, tools=[server["add"]]))
    # a Python tool renders as transformers renders the function itself
    assert qwen.decode(encode_prompt(qwen, messages, tools=[add])) == qwen.apply_chat_template(
        messages, tools=[add], tokenize=False, add_generation_prompt=True)

    chat = family_tokenizer("qwen2.5.jinja")
    chat.chat_template = SIGNATURES
    assert chat.decode(encode_prompt(chat, messages, tools=[server["add"]])) == chat.decode(
        encode_prompt(chat, messages, tools=[add])) == "add(a: integer, b: integer) requires a,b\n[user]2+3?\n"

    chat.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"  # no tools
    system = chat.decode(encode_prompt(chat, messages, tools=[server["add"], server["lookup"]]))
    assert json.dumps(server["lookup"].schema) in system
    assert system.split("\n[user]")[0].endswith(
        '<tool_call>{"name": "add", "arguments": {"a": "...", "b": "..."}}</tool_call>')
    assert chat.decode(encode_prompt(chat, messages, tools=[add])).split("\n[user]")[0].endswith(
        '<tool_call>{"name": "add", "arguments": {"a": "...", "b": "..."}}</tool_call>')


def test_an_episode_calls_a_server_tool_and_reads_its_answer(server):
    comp, stats = episodes({0: [*calling("add", a=12, b=30), "42" + EOS], 1: ["41" + EOS]}, Tools(server.values()))
    assert inserted(comp, 0) == FORMAT.result("42")
    assert TOKENIZER.decode(comp.completion_ids[0], skip_special_tokens=True) == (
        call("add", a=12, b=30) + FORMAT.result("42") + "42")
    assert stats.tool_calls == 1 and stats.turns == [2, 1] and sum(stats.errors.values()) == 0
    # the inline format's one argument is the tool's first parameter
    comp, stats = episodes({0: ["[lookup pi]", "3" + EOS], 1: ["[lookup answer]", "4" + EOS]},
                           Tools(server.values()), fmt=InlineCalls())
    assert [inserted(comp, row) for row in (0, 1)] == ["=3.14159;", "=42;"] and stats.tool_calls == 2


def test_a_tool_that_raises_is_the_tools_error_counted(server):
    comp, stats = episodes({0: [*calling("fail", reason="boom"), "0" + EOS], 1: [*calling("add", a=1, b="x"), "1" + EOS]},
                           Tools(server.values()))
    assert inserted(comp, 0) == FORMAT.result("error: fail failed: Error executing tool fail: boom")
    assert inserted(comp, 1).startswith("<tool_response>error: add failed: Error executing tool add: 1 validation")
    assert stats.errors["error"] == 2 and stats.tool_calls == 2 and stats.turns == [2, 2]
    with pytest.raises(ToolError, match="fail failed: Error executing tool fail: boom"):
        episodes({0: [*calling("fail", reason="boom"), "0" + EOS], 1: ["1" + EOS]},
                 Tools(server.values(), on_error="raise"))


def test_a_hung_server_times_out_each_call_counted_and_is_killed_at_the_end(tmp_path):
    """``freeze`` blocks the server's event loop, and it ignores SIGTERM: its calls time out at the limit, the
    next one too (it answers nothing), and stopping it (stdin closed, SIGTERM, then SIGKILL) kills it."""
    pid = tmp_path / "pid"
    tools = start("--pid-file", str(pid), "--ignore-sigterm")
    started = time.perf_counter()
    comp, stats = episodes({0: [*calling("freeze", seconds=60), "0" + EOS], 1: [*calling("add", a=1, b=2), "3" + EOS]},
                           Tools(tools.values(), timeout=0.5))
    assert time.perf_counter() - started < 4  # two calls, half a second each
    assert inserted(comp, 0) == FORMAT.result("error: freeze failed: timed out after 0.5 s (tool_timeout)")
    assert stats.errors["timeout"] == 2 and stats.turns == [2, 2]
    assert alive(pid, within=0)
    started = time.perf_counter()
    stop_mcp_servers(list(tools.values()))
    assert time.perf_counter() - started < 8  # 2 s to exit after its stdin closed, 2 s after SIGTERM, then SIGKILL
    assert not alive(pid)
    with pytest.raises(CallFailed, match="the MCP server was stopped"):
        tools["add"](a=1, b=2)


def test_a_server_that_dies_mid_run_makes_its_calls_counted_crashes(tmp_path, capfd):
    pid = tmp_path / "pid"
    tools = start("--pid-file", str(pid))
    comp, stats = episodes({0: [*calling("quit"), *calling("add", a=1, b=2), "3" + EOS], 1: ["[no call]" + EOS]},
                           Tools(tools.values(), timeout=5.0))
    assert inserted(comp, 0) == (FORMAT.result("error: quit failed: the MCP server has exited")
                                 + FORMAT.result("error: add failed: the MCP server has exited"))
    assert stats.errors["crash"] == 2 and stats.turns == [3, 1]  # the episode went on to its answer
    assert not alive(pid)
    said = capfd.readouterr().err
    assert "exited during the run" in said and "mcp_server: quitting in the middle of a call" in said
    stop_mcp_servers(list(tools.values()))


def test_a_server_that_cannot_start_is_an_error_at_the_start_naming_it():
    with pytest.raises(ConfigError, match=re.escape(
            "mcp_server: 'no-such-server --x' could not start: [Errno 2] No such file or directory")):
        with_mcp_tools(Config.from_flat({"mcp_server": ["no-such-server --x"]}), ())
    with pytest.raises(ConfigError) as failed:
        start("--exit-at-start")
    assert str(failed.value).startswith(f"mcp_server: {command('--exit-at-start')!r} stopped before it listed its tools")
    assert str(failed.value).endswith("its stderr ended with:\n  mcp_server: cannot start: the database is missing")


def test_two_tools_of_one_name_are_an_error_naming_both_and_the_servers_stop(tmp_path):
    pid = tmp_path / "pid"
    with pytest.raises(ConfigError, match=re.escape(
            f"tools: two tools are named 'add': the Python function add ({__file__}) and the MCP server "
            f"{command('--pid-file', str(pid))!r}")):
        start("--pid-file", str(pid), python_tools=(add,))
    assert not alive(pid)


def test_the_config_checks_a_command_line_and_what_runs_episodes():
    with pytest.raises(ConfigError, match="mcp_server: 'python \"server.py' is not a command line"):
        Config.from_flat({"mcp_server": ['python "server.py']})
    with pytest.raises(ConfigError, match="mcp_server: the tools of MCP servers need no --rollout-server"):
        with_mcp_tools(Config.from_flat({"mcp_server": [command()], "rollout_server": ["http://127.0.0.1:8000"]}), ())


def test_a_tool_pickles_as_its_servers_command_and_unpickles_onto_a_server_of_its_own(server):
    """As asynchronous rollouts send the episode generator to their process: the copy starts its own server."""
    copied = pickle.loads(pickle.dumps([server["add"], server["lookup"]]))
    try:
        assert copied[0].server is copied[1].server and copied[0].server is not server["add"].server
        assert copied[0](a=20, b=22) == "42" and copied[1](key="answer") == "42"
    finally:
        stop_mcp_servers(copied)


class AddingPolicy:
    """The policy of a calculator-like task: the even samples of a prompt ``A+B=`` call ``add`` and answer with
    the result they read, the odd ones answer 0 at once. It reads what it wrote from its context, so it goes
    on with a call that a ``>`` inside it stopped."""

    def __init__(self, tokenizer, stop_ids, budget):
        self.tokenizer, self.stop_ids, self.budget = tokenizer, stop_ids, budget

    def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
        turns = []
        for prompt in prompt_ids:
            text = self.tokenizer.decode(prompt, skip_special_tokens=True)
            question, written = text.split("=", 1)
            for sample in range(num_samples):
                if "</tool_response>" in written:
                    turns.append(re.findall(r"<tool_response>\n(\d+)", written)[-1] + self.tokenizer.eos_token)
                elif sample % 2 == 0 or written:
                    a, b = question.split("+")
                    turns.append(call("add", a=int(a), b=int(b))[len(written):])
                else:
                    turns.append("0" + self.tokenizer.eos_token)
        out = [self.tokenizer.encode(turn, add_special_tokens=False)[: self.budget] for turn in turns]
        width = max(len(o) for o in out)
        tokens = torch.tensor([o + [self.tokenizer.pad_token_id] * (width - len(o)) for o in out])
        mask, truncated = completion_mask(tokens, torch.tensor(self.stop_ids))
        present = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in out])
        return Completions(tokens, mask * present, truncated)


def test_a_grpo_run_with_an_mcp_server_calls_its_tool(tmp_path, monkeypatch):
    """posttrain.train(mcp_server=...): two GRPO steps of episodes whose calls the server answered (its calls
    file lists them), and the end of the run stops the server."""
    import posttrain
    import posttrain.rollout.episodes as episode_module
    from posttrain.models.tiny import build_tiny_model, char_tokenizer
    from posttrain.tracking.metrics import read_metrics

    model_dir = tmp_path / "model"  # printable ASCII and the newline of the json format's answers
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")
    build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).save_pretrained(
        model_dir)
    tokenizer.save_pretrained(model_dir)

    monkeypatch.setattr(episode_module, "make_generator", lambda backend, model, tokenizer, params, stop_ids, **_:
                        AddingPolicy(tokenizer, stop_ids, params.max_new_tokens))
    calls, pid = tmp_path / "calls.txt", tmp_path / "pid"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(12, 30), (7, 5), (100, 23), (8, 8)]]
    result = posttrain.train(
        model=str(model_dir), train_dataset=rows, mcp_server=[command("--calls-file", str(calls),
                                                                                "--pid-file", str(pid))],
        tool_format="json", reward_funcs=lambda prompts, completions, answer, **_: [
            float(c.endswith(a)) for c, a in zip(completions, answer)],
        max_steps=2, prompts_per_step=2, group_size=2, max_new_tokens=120, eval_size=0, report_to="none",
        progress=False, output=str(tmp_path / "run"), seed=0)
    steps = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert len(steps) == 2
    assert all(row["episode/tool_calls"] == 0.5 and row["episode/tool_errors"] == 0 for row in steps)
    assert all(row["reward/mean"] == 0.5 for row in steps)  # the samples that called it answered right
    assert calls.read_text().split() == ["add"] * 4  # one call per prompt per step
    assert not alive(pid)  # the run's end stopped it
