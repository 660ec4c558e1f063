"""verifiers tasksets as posttrain tasks (posttrain/data/tasks/verifiers.py, verifiers_play.py), with tasksets written here.

Three taskset modules are put on the path as verifiers finds installed ones: a single-turn one
(``vf_echo``: two weighted rewards), a multi-turn one (``vf_guess``: an ``Env`` whose ``run`` answers
each guess with a hint) and one with a tool (``vf_calc``: a ``Toolset``'s ``add``). For each: its rows
and columns, its rewards against verifiers' own ``Task.score`` on a trace verifiers' graph builds, an
episode played by a scripted policy whose ids are exactly the trained ones (the env's messages and the
tool's results inserted and masked), and a two-step GRPO run with a tiny model that logs the reward.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verifiers.v1")

from test_episodes import Script

from posttrain.config import ConfigError
from posttrain.data.prompts import encode_prompt
from posttrain.data.tasks import get_task
from posttrain.data.tasks import verifiers as adapter
from posttrain.models.tiny import build_tiny_model, char_tokenizer
from posttrain.rollout.episodes import EpisodeGenerator, JSONCalls, Tools, user_turn

ECHO = '''
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) < 5)


class EchoConfig(vf.TasksetConfig):
    n: int = 4


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        return [EchoTask(EchoData(prompt=f"say {i}", answer=str(i), system_prompt="be brief"), self.config.task)
                for i in range(self.config.n)]


__all__ = ["EchoTaskset"]
'''

GUESS = '''
import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))

    @vf.reward(weight=-0.1)
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        return [GuessTask(GuessData(prompt="Guess my number.", answer=n), self.config.task) for n in (3, 7, 5, 1)]


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated and segment.last_reply != str(task.data.answer):
                low = segment.last_reply.isdigit() and int(segment.last_reply) < task.data.answer
                segment = await interaction.turn("higher" if low else "lower")


__all__ = ["GuessTaskset", "GuessEnv"]
'''

CALC = '''
import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class CalcConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(config.tools)]

    def load(self):
        return [CalcTask(CalcData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
                for a, b in [(1, 2), (3, 4), (5, 6)]]


__all__ = ["CalcTaskset"]
'''

TOKENIZER = char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n")  # printable ASCII, one token each
EOS, PAD, E = TOKENIZER.eos_token_id, TOKENIZER.pad_token_id, TOKENIZER.eos_token
TOKENIZER.chat_template = ("{% for t in tools or [] %}<{{ t['function']['name'] }}>{% endfor %}"
                           "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}" + E + "{% endfor %}"
                           "{% if add_generation_prompt %}[assistant]{% endif %}")


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.fixture(autouse=True)
def tasksets(tmp_path, monkeypatch):
    """The three taskset modules on the path, each test loading them afresh."""
    for name, source in (("vf_echo", ECHO), ("vf_guess", GUESS), ("vf_calc", CALC)):
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    adapter.load.cache_clear()
    yield
    adapter.load.cache_clear()


def verifiers_score(task, messages: list[dict]) -> float:
    """verifiers' own scoring of a conversation: the trace its graph builds from the model calls (each
    assistant message the reply to the messages before it), scored by ``Task.score``."""
    import verifiers.v1 as vf
    from verifiers.v1.dialects import parse_message
    from verifiers.v1.graph import prepare_turn

    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    typed = [parse_message(m) for m in messages]
    for i, message in enumerate(typed):
        if message.role == "assistant":
            prepare_turn(trace, typed[:i]).commit(vf.Response(id=str(i), created=0, model="m", message=message,
                                                              finish_reason="stop"))
    asyncio.run(task.score(trace))
    return trace.reward


def play(task, turns, *, rows, tools=None, max_turns=4, max_new_tokens=60, num_samples=1):
    """The task's episodes of ``rows``, the policy's turns scripted."""
    script = Script(turns, num_samples)
    fmt = JSONCalls() if tools else None
    stop = [ids(fmt.call_end)[-1]] if tools else []
    episodes = EpisodeGenerator(script.make(stop), TOKENIZER, Tools(tools, timeout=0) if tools else None, fmt,
                                environment=task.environment, render=user_turn(TOKENIZER, E),
                                max_new_tokens=max_new_tokens, max_turns=max_turns, eos_ids=[EOS], pad_id=PAD)
    prompts = [encode_prompt(TOKENIZER, r["prompt"], tools=task.tools) for r in rows]
    return episodes.generate(prompts, num_samples=num_samples, rows=rows), script, prompts


def test_a_single_turn_taskset_is_plain_prompts_scored_by_the_tasks_rewards():
    task = get_task("verifiers:vf-echo(n=12)")  # the setting reaches the taskset's config: 12 tasks
    assert task.environment is None and task.tools == () and task.correct is None
    assert len(task.train) == 11 and len(task.test) == 1  # the last tenth is held out
    row = task.train[2]
    assert row["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 2"}]
    assert row["answer"] == "2" and row["idx"] == 2  # the taskset's own fields are columns
    replies = ["2", "two", "a long reply"]
    rewards = task.reward_funcs[0]([row["prompt"]] * 3, [[{"role": "assistant", "content": r}] for r in replies],
                                   verifiers_task=[row["verifiers_task"]] * 3, answer=["2"] * 3)
    assert rewards == [1.0 + 0.5, 0.0 + 0.5, 0.0]  # exact (weight 1) + short (weight 0.5)
    loaded = adapter.load("verifiers:vf-echo(n=12)")
    vf_task = loaded.task_of(row)
    assert rewards == [verifiers_score(vf_task, [*row["prompt"], {"role": "assistant", "content": r}]) for r in replies]


def test_a_name_that_does_not_resolve_is_an_error_naming_it_and_the_lookup():
    with pytest.raises(ConfigError, match=r"'vf-nope'.*__all__.*PYTHONPATH"):
        get_task("verifiers:vf-nope")
    with pytest.raises(ConfigError, match="close the settings"):
        get_task("verifiers:vf-echo(n=2")
    with pytest.raises(ConfigError, match=r"'vf-echo' rejects the settings \{'m': 2\}"):
        get_task("verifiers:vf-echo(m=2)")


def test_a_multi_turn_env_answers_each_guess_token_for_token():
    task = get_task("verifiers:vf-guess")
    assert task.tools == () and len(task.train) == 3 and len(task.test) == 1
    row = task.train[0]  # the secret is 3
    assert row["prompt"] == [{"role": "user", "content": "Guess my number."}] and row["answer"] == 3
    comp, script, prompts = play(task, {0: ["5" + E, "2" + E, "3" + E]}, rows=[row])
    lower, higher = "[user]lower" + E + "[assistant]", "[user]higher" + E + "[assistant]"
    expected = ids("5") + [EOS] + ids(lower) + ids("2") + [EOS] + ids(higher) + ids("3") + [EOS]
    policy = [1.0] * 2 + [0.0] * len(ids(lower)) + [1.0] * 2 + [0.0] * len(ids(higher)) + [1.0] * 2
    assert comp.completion_ids[0].tolist() == expected
    assert comp.mask[0].tolist() == policy and comp.inserted[0].tolist() == [m == 0.0 for m in policy]
    assert script.calls[2][1] == [prompts[0].tolist() + expected[: -2]]  # the third turn read all of it, exactly
    transcript = [*row["prompt"], {"role": "assistant", "content": "5"}, {"role": "user", "content": "lower"},
                  {"role": "assistant", "content": "2"}, {"role": "user", "content": "higher"}]
    vf_task = adapter.load("verifiers:vf-guess").task_of(row)
    solved = 1.0 - 0.1 * 3  # solved (weight 1), three guesses (weight -0.1 each)
    assert comp.rewards.tolist() == [pytest.approx(solved)]
    assert solved == pytest.approx(verifiers_score(vf_task, [*transcript, {"role": "assistant", "content": "3"}]))
    # max_turns cuts the game off after two guesses: its reward is the trace's score then, as a stopped run's
    comp, _, _ = play(task, {0: ["5" + E, "2" + E]}, rows=[row], max_turns=2)
    assert comp.rewards.tolist() == [pytest.approx(-0.1 * 2)]
    assert -0.1 * 2 == pytest.approx(verifiers_score(vf_task, transcript[:-1]))


def test_a_tool_taskset_gives_its_tools_to_posttrains_tool_loop():
    task = get_task("verifiers:vf-calc")
    assert [t.__name__ for t in task.tools] == ["calc_add"] and task.environment is not None
    row = task.train[0]  # 1+2=
    call = '<tool_call>{"name": "calc_add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    # the char-level script stops at every ">": the call comes in two pieces, the episode going on after the first
    turns = [call[: len("<tool_call>")], call[len("<tool_call>"):], "3" + E]
    comp, _, prompts = play(task, {0: turns}, rows=[row], tools=task.tools, max_new_tokens=120)
    result = JSONCalls().result("3")
    expected = ids(call) + ids(result) + ids("3") + [EOS]
    policy = [1.0] * len(ids(call)) + [0.0] * len(ids(result)) + [1.0] * 2
    assert comp.completion_ids[0].tolist() == expected
    assert comp.mask[0].tolist() == policy and comp.inserted[0].tolist() == [m == 0.0 for m in policy]
    assert prompts[0].tolist()[:10] == ids("<calc_add>")  # the chat template was given the tool's schema
    assert comp.rewards.tolist() == [1.0]  # the env read the reply after the tool's result: "3"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A 1-layer random Llama over printable ASCII with the chat template above."""
    path = tmp_path_factory.mktemp("chat-model")
    build_tiny_model(TOKENIZER, seed=0, hidden_size=32, num_layers=1, num_heads=2,
                     intermediate_size=64).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


@pytest.mark.parametrize("name,reward,low,high", [("vf-echo", "verifiers", 0.0, 1.5),
                                                  ("vf-guess", "environment_reward", -0.2, 0.9),
                                                  ("vf-calc", "environment_reward", 0.0, 1.0)])
def test_two_grpo_steps_on_a_verifiers_environment_log_its_reward(tmp_path, chat_model_dir, name, reward, low, high):
    import posttrain
    from posttrain.tracking.metrics import read_metrics

    result = posttrain.train(model=str(chat_model_dir), environment=f"verifiers:{name}", max_steps=2,
                             prompts_per_step=2, group_size=2, max_new_tokens=6, max_turns=2, eval_size=0,
                             report_to="none", progress=False, output=str(tmp_path / "run"), seed=1)
    steps = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert len(steps) == 2
    assert all(low <= row[f"reward/{reward}"] <= high for row in steps)
