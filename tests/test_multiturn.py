"""Multi-turn completions: tokens a tool or environment inserted are context, never trained on.

A completion is the policy's tokens with the inserted ones between its turns; ``Completions.mask``
marks the policy's, ``Completions.inserted`` the others. The training forward attends to both and
scores only the policy's, so the loss, the KL and every token count see the policy's tokens alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import posttrain
from posttrain.models.modeling import collate, forward
from posttrain.rollout.completions import Completions
from posttrain.tracking.stats import wilson_interval

PAD = 0


class Unfused(LlamaForCausalLM):
    """A subclass: the training forward takes the model's own forward and its [n, T, V] logits."""


def transcript():
    """Two rows after a prompt each: policy tokens (p), inserted tokens (i), padding (-).
    row 0: p p i i i p p      row 1: p i i p -  -  -"""
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7])]
    ids = torch.tensor([[1, 2, 8, 9, 10, 11, 12], [5, 6, 7, 8, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0, 0]], dtype=torch.float)
    inserted = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    return prompts, Completions(ids, mask, torch.tensor([False, False]), inserted=inserted)


def unpadded_logprobs(model, prompt, completion_ids, length):
    """log p(token_t | everything before it) from one forward of the row alone, no padding."""
    ids = torch.cat([prompt, completion_ids[:length]])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, completion_ids[:length, None])[:, 0]


@pytest.mark.parametrize("fused_head", [True, False])
def test_inserted_tokens_are_attended_and_never_scored(tiny_model_dir, fused_head):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    if not fused_head:
        model.__class__ = Unfused
    prompts, comp = transcript()
    batch = collate(prompts, comp.completion_ids, comp.mask, PAD, torch.device("cpu"), comp.present)
    with torch.no_grad():
        out = forward(model, batch)
    for row, length in enumerate(comp.present.sum(-1).long().tolist()):
        expected = unpadded_logprobs(model, prompts[row], comp.completion_ids[row], length)
        scored = comp.mask[row, :length].bool()
        assert torch.allclose(out.logprobs[row, :length][scored], expected[scored], atol=1e-5)
        assert torch.all(out.logprobs[row][~comp.mask[row].bool()] == 0)  # inserted and padding: 0


def test_the_gradient_of_every_inserted_tokens_logits_is_exactly_zero(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.__class__ = Unfused  # its [n, T, V] logits exist, so their gradient can be read
    captured = {}
    model.lm_head.register_forward_hook(lambda module, args, logits: captured.update(logits=logits) or
                                        logits.retain_grad())
    prompts, comp = transcript()
    batch = collate(prompts, comp.completion_ids, comp.mask, PAD, torch.device("cpu"), comp.present)
    out = forward(model, batch)
    preset = posttrain.algorithm("grpo")
    advantages = torch.tensor([[1.5], [-0.5]]).expand_as(comp.mask)
    ref = out.logprobs.detach() - 0.1  # a KL term too
    loss, _ = preset.policy_loss(out.logprobs, out.logprobs.detach(), advantages, batch.mask, ref_logprobs=ref)
    loss.backward()
    grad = captured["logits"].grad  # [n, T, V]: position P + t - 1 predicts completion token t
    predicts = comp.inserted[:, : grad.shape[1]]
    assert grad[predicts].abs().max() == 0  # exactly: the inserted tokens' predictions get no gradient
    assert grad[comp.mask[:, : grad.shape[1]].bool()].abs().sum(-1).min() > 0  # every policy token's does


def test_the_loss_of_a_multi_turn_batch_is_the_functional_loss_on_the_masked_tensors(tiny_model_dir):
    import posttrain.functional as F

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts, comp = transcript()
    batch = collate(prompts, comp.completion_ids, comp.mask, PAD, torch.device("cpu"), comp.present)
    with torch.no_grad():
        logprobs = forward(model, batch).logprobs
    t = logprobs.shape[1]
    manual = torch.zeros_like(logprobs)
    for row, length in enumerate(comp.present.sum(-1).long().tolist()):
        manual[row, :length] = unpadded_logprobs(model, prompts[row], comp.completion_ids[row], length)
    mask = comp.mask[:, :t]
    old = manual - 0.05 * mask  # a policy one update later: the ratio acts
    advantages = torch.tensor([1.0, -2.0])
    loss, _ = posttrain.algorithm("dapo").policy_loss(logprobs, old, advantages, mask)
    expected, _ = F.policy_loss(manual * mask, old, advantages, mask, eps_low=0.2, eps_high=0.28,
                                aggregation="token_mean")
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert int(mask.sum()) == 2 + 2 + 1 + 1  # the token mean counts the policy's tokens alone


def test_rows_and_cat_carry_the_inserted_tokens():
    _, comp = transcript()
    single = Completions(torch.tensor([[4, 5, PAD]]), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([True]))
    both = Completions.cat([comp, single])
    assert both.inserted.shape == (3, 7) and not both.inserted[2].any()
    assert torch.equal(both.rows(torch.tensor([1])).inserted, comp.inserted[1:])
    assert both.lengths.tolist() == [4, 2, 2]  # the policy's tokens
    assert both.present.sum(-1).tolist() == [7, 4, 2]
    assert Completions.cat([single, single]).inserted is None


def test_an_online_step_on_episodes_trains_on_the_policys_tokens_alone(tmp_path, printable_model_dir):
    """A GRPO step whose rollouts are scripted episodes (one calls the calculator, one answers at once):
    the step logs the episodes and its loss is the functional loss on the policy's tokens."""
    import copy
    import json

    from test_episodes import Script, calculate

    from posttrain.config import Config
    from posttrain.rollout.episodes import EpisodeGenerator, InlineCalls, Tools
    from posttrain.training.online import train_step
    from posttrain.training.session import OnlineSession

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a, b in [(12, 30), (7, 5)]))
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def right(prompts, completions, answer, **_):\n"
                       "    return [float(c.rstrip().endswith(a)) for c, a in zip(completions, answer)]\n")
    tool_file = tmp_path / "tools.py"
    tool_file.write_text("def calculate(argument: str) -> str:\n    return argument\n")
    config = Config.from_flat(dict(algorithm="grpo", model=str(printable_model_dir), dataset=str(data),
                                   reward=[f"{rewards}:right"], tools=[f"{tool_file}:calculate"], tool_format="inline",
                                   prompts_per_step=2, group_size=2, max_new_tokens=40, micro_batch_size=3, seed=0,
                                   learning_rate=1e-2, eval_size=0, progress=False, report_to="none"))
    s = OnlineSession.create(config)
    assert isinstance(s.generator, EpisodeGenerator) and s.episodes is s.generator
    eos = s.tokenizer.eos_token
    script = Script({0: ["[calculate 12+30]", "42" + eos], 1: ["41" + eos], 2: ["[calculate 7+5]", "12" + eos],
                     3: ["[calculate 7*5]", "35" + eos]}, num_samples=2)
    stop = s.tokenizer.encode("]", add_special_tokens=False)[-1]
    s.generator = s.episodes = EpisodeGenerator(script.make([stop]), s.tokenizer, Tools([calculate]), InlineCalls(),
                                                max_new_tokens=40, max_turns=3, eos_ids=s.eos_ids, pad_id=s.pad_id)
    s.sampler.next = lambda b: [0, 1]  # the script's rows: prompt 0's two samples, then prompt 1's
    policy = copy.deepcopy(s.policy)
    metrics = train_step(s)
    assert metrics["episode/tool_calls"] == 3 / 4 and metrics["episode/turns"] == 7 / 4
    assert metrics["episode/inserted_tokens"] == (4 + 4 + 4) / 4 and metrics["episode/tool_errors"] == 0
    g = s.last_groups
    assert g.completions.inserted.sum() == 12 and g.rewards.view(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    # the loss: the preset's on the policy's tokens, from one forward of the pre-update weights
    comp = g.completions
    batch = collate(g.prompt_ids, comp.completion_ids, comp.mask, s.pad_id, s.device, comp.present)
    with torch.no_grad():
        logprobs = forward(policy, batch, temperature=1.0).logprobs
    ref = logprobs  # the reference is the starting policy: the KL term is 0 at the first step
    advantages = s.alg.advantages(g.rewards, mask=comp.mask[:, : logprobs.shape[1]])
    expected, _ = s.alg.policy_loss(logprobs, logprobs, advantages, batch.mask, ref_logprobs=ref)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert metrics["completion_length/mean"] == comp.mask.sum().item() / 4  # the policy's tokens


def test_posttrain_train_with_tools_runs_episodes_on_the_model_and_records_the_tools(tmp_path, printable_model_dir):
    """The real decode loop stops turns where a call closes; a tool defined in a file is named in config.yaml."""
    from test_episodes import calculate

    from posttrain.config import load_yaml
    from posttrain.tracking.metrics import read_metrics

    rows = [{"prompt": f"[calculate {a}+{b}]", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    result = posttrain.train(model=str(printable_model_dir), train_dataset=rows, tools=[calculate],
                             tool_format="inline", reward_funcs=lambda prompts, completions, **_: [
                                 float("=" in c) for c in completions],
                             max_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=24, eval_size=0,
                             report_to="none", progress=False, output=str(tmp_path / "run"), seed=1)
    saved = load_yaml(result["run_dir"] / "config.yaml")
    assert len(saved["tools"]) == 1 and saved["tools"][0].endswith("tests/test_episodes.py:calculate")
    steps = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert len(steps) == 2 and all("episode/turns" in row for row in steps)
    assert all(1.0 <= row["episode/turns"] <= 4.0 for row in steps)


def test_tools_settings_are_checked():
    from posttrain.config import Config, ConfigError

    with pytest.raises(ConfigError, match="tool_format: got 'xml'; use auto, hermes, llama3, mistral, json, inline"):
        Config.from_flat({"tool_format": "xml"})
    with pytest.raises(ConfigError, match="tools: 'nowhere.py:f' is not FILE.py:FUNCTION of an existing file"):
        Config.from_flat({"tools": ["nowhere.py:f"]})
    with pytest.raises(ConfigError, match="max_turns: got 0"):
        Config.from_flat({"max_turns": 0})


@pytest.mark.parametrize("episodes", ["tools", "environment"])
def test_a_multi_turn_run_resumed_equals_an_uninterrupted_one(tmp_path, printable_model_dir, episodes):
    """Episodes hold no state across steps (an environment is reset from its row): the checkpoint's
    generators, data order and weights resume them."""
    import json

    from conftest import assert_online_resume_is_exact

    from posttrain.config import Config
    from posttrain.tracking.metrics import read_metrics

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"[echo {a}]", "answer": str(a)}) for a in range(8)))
    files = tmp_path / "fns.py"
    files.write_text("from posttrain.data.environments import Step\n\n"
                     "def echo(argument: str) -> str:\n    return argument\n\n"
                     "def brackets(prompts, completions, **_):\n    return [c.count('[') / 4 for c in completions]\n\n"
                     "class Lengths:\n    def reset(self, row):\n        self.turns = 0\n\n"
                     "    def step(self, turn):\n        self.turns += 1\n"
                     "        return Step(f'={len(turn)};', 0.1, done=self.turns == 2)\n")
    multi_turn = ({"tools": [f"{files}:echo"], "tool_format": "inline"} if episodes == "tools"
                  else {"environment": f"{files}:Lengths"})

    assert_online_resume_is_exact(lambda output: Config.from_flat(dict(
        algorithm="grpo", model=str(printable_model_dir), dataset=str(data), reward=[f"{files}:brackets"],
        prompts_per_step=2, group_size=4, max_new_tokens=64, **multi_turn,
        max_steps=4, eval_every=2, save_every=2, log_samples_every=0, eval_size=0, learning_rate=1e-2,
        output=output, progress=False, report_to="none", seed=3)), tmp_path)
    steps = [row for row in read_metrics(tmp_path / "whole") if "loss" in row]
    if episodes == "environment":  # some turns ended with EOS and the environment answered them
        assert any(row["reward/environment_reward"] > 0 for row in steps)
    else:
        assert any(row["episode/tool_calls"] > 0 for row in steps)


@pytest.mark.slow
def test_the_calculator_task_learns_to_use_its_tool(tmp_path):
    """`posttrain train --task calculator`: the warm-started tiny-calculator calls its tool in about 30% of
    samples and answers 3-digit sums right about 10% of the time; RL must find that the tool pays."""
    from posttrain.config import Config
    from posttrain.tracking.metrics import read_metrics

    config = Config.from_flat({"task": "calculator", "max_steps": 40, "eval_every": 0, "eval_size": 200,
                               "output": str(tmp_path / "run"), "progress": False, "report_to": "none"})
    result = posttrain.train(config)
    before, after = result["before"]["eval/accuracy"], result["after"]["eval/accuracy"]
    assert after >= before + 0.20, (before, after)
    steps = [row for row in read_metrics(tmp_path / "run") if "episode/tool_calls" in row]
    assert steps[-1]["episode/tool_calls"] > steps[0]["episode/tool_calls"] + 0.3


def test_posttrain_eval_scores_a_task_with_tools_on_its_episodes(printable_model_dir, monkeypatch):
    """A task's tools run during evaluation too: the scripted policy calls echo, reads its result, answers."""
    from test_episodes import Script

    import posttrain.rollout.episodes as episodes
    from posttrain.data import tasks
    from posttrain.data.tasks.task import Task
    from posttrain.training.evaluation import EvalSpec, evaluate_model

    def echo(argument: str) -> str:
        return argument

    rows = [{"prompt": f"say {i}", "answer": str(i)} for i in range(3)]
    task = Task(name="echoes", description="echo", train=rows, test=rows, reward_funcs=(
        lambda prompts, completions, **_: [0.0] * len(completions),), reward_weights=(1.0,),
        correct=lambda prompts, completions, answer, **_: [c == f"[echo {a}]={a};{a}" for c, a in zip(completions, answer)],
        max_new_tokens=24, default_model=str(printable_model_dir), tools=(echo,), tool_format="inline", tool_timeout=0)
    monkeypatch.setitem(tasks.TASKS, "echoes", lambda seed: task)
    eos = "<eos>"
    script = Script({0: ["[echo 0]", "0" + eos], 1: ["[echo 1]", "1" + eos], 2: ["2" + eos]}, num_samples=1)
    monkeypatch.setattr(episodes, "make_generator", lambda backend, model, tokenizer, params, eos_ids, **_: (
        script.make(eos_ids[1:])(params.max_new_tokens)))
    _, [result] = evaluate_model(None, EvalSpec(tasks=["echoes"], eval_size=3), device="cpu")
    assert [row["completion"] for row in result.greedy] == ["[echo 0]=0;0", "[echo 1]=1;1", "2"]
    assert [row["correct"] for row in result.greedy] == [True, True, False]
    # two of three episodes call the tool, once each: the rate, its Wilson interval and calls per episode
    assert [row["tool_calls"] for row in result.greedy] == [1, 1, 0]
    assert result.metrics["tool_call_rate"] == pytest.approx(2 / 3) and result.metrics["tool_calls"] == pytest.approx(2 / 3)
    assert (result.metrics["tool_call_rate_low"], result.metrics["tool_call_rate_high"]) == pytest.approx(
        wilson_interval(2, 3))


def test_tool_calls_are_the_spans_of_inserted_tokens():
    from posttrain.training.evaluation import tool_calls_of

    inserted = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    completions = Completions(torch.zeros(3, 6, dtype=torch.long), torch.ones(3, 6), torch.zeros(3, dtype=torch.bool),
                              inserted=inserted)
    assert tool_calls_of(completions) == [2, 0, 2]
