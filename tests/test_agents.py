"""The user's agent behind posttrain's OpenAI-compatible endpoint: each call recorded token for token.

A scripted sampler answers each call from its context, so every token of an episode is known: the tests check
that the recorded episode is exactly the prompt the first call rendered, the sampler's ids (trained on, with
their log-probs) and the rendering of what the agent sent between calls (inserted), and that what cannot be
one sequence is dropped and counted rather than recorded wrong. That an agent learns is the slow walkthrough test
(tests/test_examples.py, agent_calculator).
"""

from __future__ import annotations

import json
import time

import openai
import pytest
import torch
from test_tool_formats import CALC, FIXTURES, conversation, family_tokenizer, turn_end_ids

from posttrain.models.tiny import char_tokenizer
from posttrain.rollout.agents import Agent, AgentGenerator
from posttrain.rollout.completions import POLICY_SAMPLER, Completions, SamplingParams
from posttrain.rollout.episodes import FORMATS, InlineCalls
from posttrain.rollout.openai_api import RequestError, parse_request

TOKENIZER = char_tokenizer("".join(chr(c) for c in range(32, 127)))
EOS = TOKENIZER.eos_token
ADD = {"type": "function", "function": {"name": "calc", "description": "A+B", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def logprob_of(position: int) -> float:
    """The scripted sampler's log-prob of the token at ``position`` of the context it continues."""
    return -0.01 * (position + 1)


class Scripted:
    """A sampler that answers each context with ``answer(context ids)`` (ids), cut at ``stops``; every token's
    log-prob is :func:`logprob_of` its position. Records the contexts it was given."""

    capabilities = POLICY_SAMPLER

    def __init__(self, answer, stops: list[int], pad: int):
        self.answer, self.stops, self.pad, self.contexts = answer, set(stops), pad, []

    def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
        outs, logprobs = [], []
        for prompt in prompt_ids:
            self.contexts.append(prompt.tolist())
            for _ in range(num_samples):
                ids = list(self.answer(prompt.tolist()))
                cut = next((i + 1 for i, t in enumerate(ids) if t in self.stops), len(ids))
                outs.append(ids[:cut])
                logprobs.append([logprob_of(len(prompt) + k) for k in range(cut)])
        width = max(1, max(len(o) for o in outs))
        ids = torch.tensor([o + [self.pad] * (width - len(o)) for o in outs])
        mask = torch.tensor([[1.0] * len(o) + [0.0] * (width - len(o)) for o in outs])
        lp = torch.tensor([p + [0.0] * (width - len(p)) for p in logprobs])
        return Completions(ids, mask, torch.tensor([False] * len(outs)), sampling_logprobs=lp)


def text_answers(script: dict[str, str]):
    """Answers by the end of the context's text: the first key it ends with."""
    def answer(context: list[int]) -> list[int]:
        text = TOKENIZER.decode(context)
        for end, reply in script.items():
            if text.endswith(end):
                return TOKENIZER.encode(reply, add_special_tokens=False)
        raise AssertionError(f"no scripted answer for {text!r}")
    return answer


CALCULATOR = {"12+30=": "[calc 12+30]", "=42;": f"42{EOS}", "7+5=": f"12{EOS}"}


def calculator_agents(fn, script=CALCULATOR, *, max_new_tokens=40, timeout=30.0, fmt=InlineCalls()):
    stop = TOKENIZER.encode(fmt.call_end, add_special_tokens=False)[-1]
    eos = TOKENIZER.eos_token_id
    sampler = Scripted(text_answers(script), [eos, stop], TOKENIZER.pad_token_id)
    return AgentGenerator(Agent(fn), sampler, TOKENIZER, fmt, SamplingParams(max_new_tokens), eos_ids=[eos],
                          pad_id=TOKENIZER.pad_token_id, timeout=timeout), sampler


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def run_calculator(client, row, seen=None):
    """A tool loop written against the openai client, as a user writes one."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        reply = client.chat.completions.create(model="any-name", messages=messages, tools=[ADD]).choices[0].message
        if seen is not None:
            seen.append(reply)
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float(reply.content == row["answer"])
        for call in reply.tool_calls:
            a, b = json.loads(call.function.arguments)["expression"].split("+")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) + int(b))})
    return 0.0


def test_an_agent_on_the_openai_client_is_recorded_token_for_token():
    seen = []
    agents, sampler = calculator_agents(lambda client, row: run_calculator(client, row, seen))
    rows = [{"prompt": "12+30=", "answer": "42"}, {"prompt": "7+5=", "answer": "12"}]
    out = agents.generate([torch.tensor(ids("ignored"))] * 2, num_samples=2, rows=rows)
    agents.close()
    # the call the policy wrote reaches the agent as a tool call, its one argument under the schema's name
    calls = [m.tool_calls[0] for m in seen if m.tool_calls]
    assert len(calls) == 2 and all(c.function.name == "calc" and json.loads(c.function.arguments) ==
                                   {"expression": "12+30"} for c in calls)
    assert all(m.content == "" for m in seen if m.tool_calls)
    assert out.rewards.tolist() == [1.0, 1.0, 1.0, 1.0] and not out.dropped.any()
    for row, (prompt, completion, inserted) in enumerate([("12+30=", "[calc 12+30]=42;42", "=42;")] * 2 +
                                                         [("7+5=", "12", "")] * 2):
        assert out.prompt_ids[row].tolist() == TOKENIZER(prompt)["input_ids"]  # the first call, as a prompt is
        n = len(ids(completion)) + 1
        assert out.completion_ids[row, :n].tolist() == ids(completion) + [TOKENIZER.eos_token_id]
        flags = out.inserted[row, :n].tolist()
        start = completion.find(inserted) if inserted else n
        assert flags == [start <= i < start + len(inserted) for i in range(n)]
        assert out.mask[row].sum() == n - len(inserted) and not out.mask[row, n:].any()
        # the sampler's log-probs of the policy's tokens, as it drew them (positions in the whole sequence)
        policy = out.mask[row].bool()
        positions = [len(out.prompt_ids[row]) + i for i in range(n) if not flags[i]]
        assert out.sampling_logprobs[row][policy].tolist() == pytest.approx([logprob_of(p) for p in positions])
    # the second call read the first call's ids and the tool's result, never re-tokenized text
    assert TOKENIZER("12+30=")["input_ids"] + ids("[calc 12+30]=42;") in sampler.contexts
    assert agents.stats.counts()["tool_calls"] == 2 and agents.stats.turns == [2, 2, 1, 1]


def test_the_openai_agents_sdk_runs_a_tool_using_agent_on_the_endpoint():
    agents_sdk = pytest.importorskip("agents")
    agents_sdk.set_tracing_disabled(True)
    used = []

    @agents_sdk.function_tool
    def calc(expression: str) -> str:
        """A+B."""
        used.append(expression)
        a, b = expression.split("+")
        return str(int(a) + int(b))

    async def sdk_agent(client, row):
        model = agents_sdk.OpenAIChatCompletionsModel(model="policy", openai_client=client)
        result = await agents_sdk.Runner.run(agents_sdk.Agent(name="adder", tools=[calc], model=model),
                                             row["prompt"], max_turns=4)
        return float(result.final_output == row["answer"])

    agents, _ = calculator_agents(sdk_agent)
    out = agents.generate([torch.tensor(ids("12+30="))], num_samples=3, rows=[{"prompt": "12+30=", "answer": "42"}])
    agents.close()
    assert used == ["12+30"] * 3 and out.rewards.tolist() == [1.0] * 3 and not out.dropped.any()
    expected = ids("[calc 12+30]=42;42") + [TOKENIZER.eos_token_id]
    assert all(out.completion_ids[row, :len(expected)].tolist() == expected for row in range(3))
    assert out.inserted.sum(-1).tolist() == [4] * 3


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_a_chat_template_episode_is_the_templates_own_transcript(fixture):
    """For each family's real template: an agent asks, the policy calls calc, the agent sends the result and
    the policy answers. The recorded sequence is the template's rendering of the whole conversation, token for
    token, though the agent only ever sent messages."""
    tokenizer = family_tokenizer(fixture)
    family = FIXTURES[fixture][0]
    whole = conversation()
    expected = tokenizer.apply_chat_template(whole, tools=[CALC], tokenize=True, return_dict=False)
    ends = turn_end_ids(fixture, tokenizer)

    def replay(context: list[int]) -> list[int]:
        assert context == expected[:len(context)], "the context drifted from the template's transcript"
        end = next(i for i in range(len(context), len(expected)) if expected[i] in ends)
        return expected[len(context):end + 1]

    def agent(client, row):
        messages = [{"role": "user", "content": "What is 12*7?"}]
        call = client.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0]
        assert call.finish_reason == "tool_calls"
        (tool_call,) = call.message.tool_calls
        assert tool_call.function.name == "calc" and json.loads(tool_call.function.arguments) == {"expression": "12*7"}
        messages += [call.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tool_call.id, "name": "calc", "content": "84"}]
        answer = client.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0]
        assert answer.finish_reason == "stop" and answer.message.content == "The answer is 84."
        return 1.0

    pad = tokenizer.pad_token_id
    agents = AgentGenerator(Agent(agent), Scripted(replay, ends, pad), tokenizer, FORMATS[family](),
                            SamplingParams(400), eos_ids=ends, pad_id=pad, timeout=30)
    out = agents.generate([torch.tensor([0])], num_samples=1, rows=[{"prompt": "-"}])
    agents.close()
    assert not out.dropped.any() and out.rewards.tolist() == [1.0]
    prompt = out.prompt_ids[0].tolist()
    n = int(out.present[0].sum())
    assert prompt + out.completion_ids[0, :n].tolist() == expected[:len(prompt) + n]
    assert len(prompt) + n in (len(expected), len(expected) - 1)  # a template may write a newline after the end
    # trained on: exactly the two answers the sampler wrote
    policy = out.mask[0, :n].bool()
    assert int(policy.sum()) == len(expected[:len(prompt) + n]) - len(prompt) - int(out.inserted[0].sum())


def test_what_cannot_be_one_sequence_is_dropped_and_counted():
    def rewrites_history(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="m", messages=messages, tools=[ADD]).choices[0].message
        messages = [{"role": "user", "content": "7+5="}]  # a second conversation in the same episode
        client.chat.completions.create(model="m", messages=messages, tools=[ADD])
        return 1.0 if reply.tool_calls else 0.0

    def raises(client, row):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7+5="}])
        raise KeyError("no such column")

    def never_calls(client, row):
        return 1.0

    def returns_text(client, row):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7+5="}])
        return "good"

    def too_slow(client, row):
        time.sleep(3)
        return 1.0

    row = {"prompt": "12+30=", "answer": "42"}
    for fn, kind in [(rewrites_history, "not_one_sequence"), (raises, "agent_error"), (never_calls, "no_model_call"),
                     (returns_text, "agent_error"), (too_slow, "timeout")]:
        agents, _ = calculator_agents(fn, timeout=1.0)
        out = agents.generate([torch.tensor(ids("12+30="))], num_samples=2, rows=[row])
        agents.close()
        assert out.dropped.tolist() == [True, True], kind
        assert agents.stats.dropped[kind] == 2 and sum(agents.stats.dropped.values()) == 2, kind
        assert out.mask.sum() == 0  # nothing of a dropped episode is trained on


def test_the_run_samples_at_its_own_settings_and_stop_strings_end_an_answer(capsys):
    """A call's stop string ends the answer where it appears (the ids up to the one completing it recorded);
    with n choices the episode goes on from the one the agent sends back; a call's temperature is said once."""
    script = {"12+30=": f"4;2{EOS}", "12+30=4; ok?": f"ok{EOS}"}

    def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        first = client.chat.completions.create(model="m", messages=messages, stop=[";"], n=2, temperature=0.2)
        assert [c.message.content for c in first.choices] == ["4", "4"]
        assert [c.finish_reason for c in first.choices] == ["stop", "stop"]
        messages += [first.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": " ok?"}]
        last = client.chat.completions.create(model="m", messages=messages).choices[0].message
        return float(last.content == "ok")

    agents, sampler = calculator_agents(agent, script)
    out = agents.generate([torch.tensor(ids("12+30="))], num_samples=1, rows=[{"prompt": "12+30="}])
    agents.close()
    assert out.rewards.tolist() == [1.0]
    n = int(out.present[0].sum())
    assert out.completion_ids[0, :n].tolist() == ids("4; ok?ok") + [TOKENIZER.eos_token_id]
    assert out.inserted[0, :n].tolist() == [False] * 2 + [True] * 4 + [False] * 3
    assert "temperature 0.2; the run samples at 1" in capsys.readouterr().err


def test_malformed_and_unsupported_requests_name_the_field():
    cases = [(b"{", 400, "not JSON"), (b"[]", 400, "not an object"), (b"{}", 400, "messages: a non-empty list"),
             (b'{"messages": [{"role": "robot", "content": "x"}]}', 400, r"messages\[0\].role"),
             (b'{"messages": [{"role": "user", "content": "x"}], "stream": true}', 422, "stream"),
             (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', 422, "tool_choice"),
             (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n: 0 is outside"),
             (b'{"messages": [{"role": "tool", "content": "x"}]}', 400, r"messages\[0\].tool_call_id"),
             (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 422, r"messages\[0\].content\[0\]"),
             (b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}',
              400, r"messages\[0\].tool_calls\[0\].function.arguments: not JSON")]
    for body, status, message in cases:
        with pytest.raises(RequestError, match=message) as error:
            parse_request(body)
        assert error.value.status == status, body

    # over HTTP: the openai client raises the status with the message; an unknown episode is 410
    def agent(client, row):
        with pytest.raises(openai.UnprocessableEntityError, match="tool_choice"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                           tool_choice="required")
        other = openai.OpenAI(base_url=str(client.base_url).replace("/episodes/", "/episodes/0"), api_key="-",
                              max_retries=0)
        with pytest.raises(openai.APIStatusError, match="is over") as gone:
            other.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert gone.value.status_code == 410
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0

    agents, _ = calculator_agents(agent)
    out = agents.generate([torch.tensor(ids("7+5="))], num_samples=1, rows=[{"prompt": "7+5="}])
    agents.close()
    assert out.rewards.tolist() == [1.0] and not out.dropped.any()


def sum_agent(client, row):
    """An agent defined at a module's top level: a run records it as FILE.py:sum_agent."""
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return float(reply.choices[0].message.content.strip() == row["answer"])


def silent_agent(client, row):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return None


def test_posttrain_train_runs_an_agent_and_records_it(tmp_path, printable_model_dir):
    from posttrain.config import load_yaml
    from posttrain.tracking.metrics import read_metrics

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]]
    result = posttrain_train(agent=sum_agent, model=str(printable_model_dir), train_dataset=rows, max_steps=2,
                             prompts_per_step=2, group_size=4, max_new_tokens=8, eval_size=0, report_to="none",
                             progress=False, output=str(tmp_path / "run"), seed=1)
    saved = load_yaml(result["run_dir"] / "config.yaml")
    assert saved["agent"].endswith("tests/test_agents.py:sum_agent")
    steps = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert len(steps) == 2 and all(row["episode/turns"] == 1.0 and "reward/agent" in row for row in steps)
    assert all(row["mismatch/kl_k3"] < 1e-6 for row in steps)  # the trainer's log-probs are the sampler's


def test_an_agent_that_returns_none_needs_rewards_and_a_task_or_reward_scores_it(tmp_path, printable_model_dir):
    from posttrain.config import ConfigError
    from posttrain.data.scoring import RewardError

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    common = dict(model=str(printable_model_dir), train_dataset=rows, max_steps=1, prompts_per_step=2, group_size=2,
                  max_new_tokens=8, eval_size=0, report_to="none", progress=False)
    with pytest.raises(RewardError, match="the agent returned None and the run has no reward function"):
        posttrain_train(agent=silent_agent, output=str(tmp_path / "a"), **common)
    # with a reward function, it scores every episode; the agent's number reaches it as a column
    seen = []

    def length(prompts, completions, agent_reward, **_):
        seen.extend(agent_reward)
        return [len(c) / 8 for c in completions]

    posttrain_train(agent=silent_agent, reward_funcs=length, output=str(tmp_path / "b"), **common)
    assert seen == [None] * 4
    with pytest.raises(ConfigError, match="agent: the agent calls its own tools"):
        posttrain_train(agent=silent_agent, tools=[sum_agent], output=str(tmp_path / "c"), **common)
    with pytest.raises(ConfigError, match="agent: 'nowhere.py:f' is not FILE.py:FUNCTION"):
        posttrain_train(agent="nowhere.py:f", output=str(tmp_path / "d"), **common)


def posttrain_train(**kwargs):
    import posttrain

    return posttrain.train(**kwargs)


def test_offline_trainers_refuse_an_agent_mcp_servers_and_reward_services(tmp_path, printable_model_dir):
    """Settings only online runs use are errors in the other trainers, never silently ignored."""
    import posttrain
    from posttrain.config import ConfigError

    pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 4
    for algorithm, settings, field in [("dpo", {"agent": sum_agent}, "agent"),
                                       ("dpo", {"mcp_server": ["python server.py"]}, "mcp_server"),
                                       ("sft", {"agent": sum_agent}, "agent"),
                                       ("sft", {"reward_url": ["http://127.0.0.1:9/score"]}, "reward"),
                                       ("reward_model", {"reward_url": ["http://127.0.0.1:9/score"]}, "reward"),
                                       ("reward_model", {"mcp_server": ["python server.py"]}, "tools")]:
        data = ([{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}] * 4
                if algorithm == "sft" else pairs)
        with pytest.raises(ConfigError, match=f"^{field}: "):
            posttrain.train(algorithm=algorithm, model=str(printable_model_dir), train_dataset=data, max_steps=1,
                            output=str(tmp_path / f"{algorithm}-{field}"), report_to="none", progress=False,
                            **settings)
