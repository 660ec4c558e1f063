"""Multi-teacher on-policy distillation (``multi_teacher_distill``, MOPD of arXiv:2601.02780): a teacher per task
of a mixture (``--teachers TASK=MODEL``), and each sampled token's advantage is its own task's teacher's minus the
student's log-prob."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import posttrain.functional as F
from posttrain.config import ConfigError
from posttrain.data.prompts import DataError
from posttrain.data.row_tasks import row_tasks, task_of
from posttrain.data.tasks.addition import make_rows
from posttrain.models.modeling import collate, forward
from posttrain.training import online
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession
from test_online import make_config


def tiny_teacher(path, seed):
    """The tiny model's architecture and tokenizer with weights of its own, its logits scaled up: a freshly
    initialised model is near uniform, and two of them are too alike to tell apart by what a student learns."""
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    tokenizer = char_tokenizer("0123456789+=,|")
    model = build_tiny_model(tokenizer, seed=seed, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPNESS)  # the head is tied to the embeddings: scale the final norm
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


SHARPNESS = 4.0


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {"short": tiny_teacher(root / "short", seed=1), "long": tiny_teacher(root / "long", seed=2)}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """Eight addition rows in two tasks, alternating: the sum's digit count decides (short: 1-2, long: 3-4)."""
    rows, _ = make_rows(0, 64, 1)
    short = [r for r in rows if len(r["answer"]) <= 2][:4]
    long = [r for r in rows if len(r["answer"]) > 2][:4]
    path = tmp_path_factory.mktemp("mixture") / "rows.jsonl"
    with open(path, "w") as f:
        for a, b in zip(short, long):
            f.write(json.dumps({**a, "task": "short"}) + "\n" + json.dumps({**b, "task": "long"}) + "\n")
    return path


def mixture_config(model_dir, reward_file, mixture, teachers, algorithm="multi_teacher_distill", **flat):
    base = dict(dataset=str(mixture), teachers=[f"{task}={path}" for task, path in teachers.items()],
                prompts_per_step=8, micro_batch_size=5)
    return make_config(model_dir, reward_file, algorithm, **{**base, **flat})


# --- the row's task -------------------------------------------------------------------------------------


def test_a_row_s_task_is_its_reasoning_gym_family_or_its_task_column():
    from posttrain.config import DataConfig
    from posttrain.data.tasks.reasoning_gym import make_row

    entry = {"question": "1 + 2 = ?", "answer": "3", "metadata": {}}
    assert task_of(make_row("chain_sum", entry), None) == "chain_sum"
    assert task_of({"prompt": "1+2=", "task": "easy"}, None) == "easy"
    assert task_of({"prompt": "1+2=", "domain": 7}, "domain") == "7"  # compared as text
    assert task_of({"prompt": "1+2="}, None) is None
    rows = [{"prompt": "a", "task": "x"}, {"prompt": "b", "task": "y"}, {"prompt": "c", "task": "x"}]
    assert row_tasks(rows, DataConfig(), {"x", "y"}, "rows.jsonl") == ["x", "y", "x"]
    with pytest.raises(DataError, match="rows.jsonl: row 2 has no task in its column 'task'"):
        row_tasks([rows[0], {"prompt": "b"}], DataConfig(), {"x"}, "rows.jsonl")
    with pytest.raises(ConfigError, match=r"row 2's task 'y' has no teacher .*add --teachers y=MODEL"):
        row_tasks(rows, DataConfig(), {"x"}, "rows.jsonl")
    with pytest.raises(ConfigError, match="no row of rows.jsonl has the task 'z'"):
        row_tasks(rows, DataConfig(), {"x", "y", "z"}, "rows.jsonl")


def test_teacher_items_are_checked_where_the_config_is_built(tiny_model_dir, reward_file):
    with pytest.raises(ConfigError, match=r"teachers: got 'model_dir'; give TASK=MODEL"):
        make_config(tiny_model_dir, reward_file, "multi_teacher_distill", teachers=["model_dir"])
    with pytest.raises(ConfigError, match=r"teachers: got '=model'; give TASK=MODEL"):
        make_config(tiny_model_dir, reward_file, "multi_teacher_distill", teachers=["=model"])
    with pytest.raises(ConfigError, match="task 'a' is given two teachers"):
        make_config(tiny_model_dir, reward_file, "multi_teacher_distill", teachers=["a=x", "a=y"])
    config = make_config(tiny_model_dir, reward_file, "multi_teacher_distill", teachers=["a=x=1", "b=y"])
    assert config.model.teacher_by_task() == {"a": "x=1", "b": "y"}  # the first '=' ends the task


# --- each row is scored by its own teacher ------------------------------------------------------------


def test_each_row_gets_its_own_teacher_s_log_probs(tiny_model_dir, reward_file, mixture, teachers):
    s = OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers))
    groups, _ = online.collect_groups(s)
    got = online.teacher_logprobs(s, groups)
    batch = collate(groups.prompt_ids, groups.completions.completion_ids, groups.completions.mask, s.pad_id,
                    s.device, share_prompts=False, trim_padding=False)
    with torch.no_grad():
        manual = {task: forward(model, batch).logprobs for task, model in s.task_teachers.items()}
    t = manual["short"].shape[1]
    tasks = [s.row_tasks[i] for i in groups.indices for _ in range(groups.group_size)]
    assert set(tasks) == {"short", "long"}
    mask = batch.mask.bool()
    for row, task in enumerate(tasks):
        other = "long" if task == "short" else "short"
        own = manual[task][row][mask[row]]
        torch.testing.assert_close(got[row, :t][mask[row]], own, rtol=0, atol=1e-5)
        assert (own - manual[other][row][mask[row]]).abs().max() > 1e-2
    assert not got[:, t:].any() and not got[:, :t][~mask].any()  # padding stays 0


# --- the step -----------------------------------------------------------------------------------------


def test_two_steps_log_each_task_s_reverse_kl_to_its_teacher(tiny_model_dir, reward_file, mixture, teachers):
    s = OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers))
    for _ in range(2):
        student_model = copy.deepcopy(s.policy)
        metrics = train_step(s)
        g = s.last_groups
        batch = collate(g.prompt_ids, g.completions.completion_ids, g.completions.mask, s.pad_id, s.device,
                        share_prompts=False, trim_padding=False)
        tasks = [s.row_tasks[i] for i in g.indices for _ in range(g.group_size)]
        with torch.no_grad():
            student = forward(student_model, batch).logprobs
            own = torch.stack([forward(s.task_teachers[task], batch).logprobs[row]
                               for row, task in enumerate(tasks)])
        mask = batch.mask
        for task in ("short", "long"):
            rows = torch.tensor([t == task for t in tasks])
            kl = float(((student - own) * mask)[rows].sum() / mask[rows].sum())  # token mean over the task's rows
            assert metrics[f"distill/reverse_kl/{task}"] == pytest.approx(kl, abs=1e-5)
        assert metrics["distill/reverse_kl"] == pytest.approx(float(((student - own) * mask).sum() / mask.sum()),
                                                              abs=1e-5)
        advantages = F.distillation_advantages(student, own, mask)  # each row's own teacher minus the student
        expected, _ = F.policy_loss(student, student, advantages, mask, clip="none", eps_low=None, eps_high=None,
                                    aggregation="token_mean")
        assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)


def test_the_teachers_must_match_the_mixture_and_the_preset(tiny_model_dir, reward_file, mixture, teachers):
    with pytest.raises(ConfigError, match="no row of .* has the task 'medium'"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture,
                                            {**teachers, "medium": teachers["long"]}))
    with pytest.raises(ConfigError, match="row 1's task 'short' has no teacher"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, {"long": teachers["long"]}))
    with pytest.raises(ConfigError, match="teachers: multi_teacher_distill distils from a teacher per task: give"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, {}))
    with pytest.raises(ConfigError, match="give --teachers TASK=MODEL for each task instead of --teacher"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers, teacher=str(teachers["short"])))
    with pytest.raises(ConfigError, match="on_policy_distill takes no teacher per task"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers,
                                            algorithm="on_policy_distill"))
    with pytest.raises(ConfigError, match="task_column: only multi-teacher distillation"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", task_column="task"))
    with pytest.raises(DataError, match="row 1 has no task in its column 'kind'"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers, task_column="kind"))


def test_every_teacher_must_share_the_student_s_tokenizer(tiny_model_dir, reward_file, mixture, teachers, tmp_path):
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    other = tmp_path / "other"
    tokenizer = char_tokenizer("0123456789+-=,|")  # one more character: other ids
    build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2,
                     intermediate_size=64).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match="has another tokenizer than the student"):
        OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, {**teachers, "long": other}))


def test_offloaded_teachers_give_the_same_step(tiny_model_dir, reward_file, mixture, teachers):
    losses = []
    for offloaded in (False, True):
        s = OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers,
                                                offload_reference=offloaded))
        losses.append(train_step(s)["distill/reverse_kl/long"])
    assert losses[0] == losses[1]


def test_the_student_lowers_every_task_s_reverse_kl_at_once(tiny_model_dir, reward_file, mixture, teachers):
    """Distilled on both tasks at once, one student comes nearer each task's own teacher on that task's samples."""
    s = OnlineSession.create(mixture_config(tiny_model_dir, reward_file, mixture, teachers, max_steps=40,
                                            learning_rate=3e-3))
    kls = {task: [] for task in teachers}
    for _ in range(40):
        metrics = train_step(s)
        for task in teachers:
            kls[task].append(metrics[f"distill/reverse_kl/{task}"])
    for task, values in kls.items():
        assert sum(values[-5:]) / 5 < 0.5 * sum(values[:5]) / 5, (task, values)
