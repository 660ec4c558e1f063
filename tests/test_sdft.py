"""Self-distillation (``sdft``, arXiv:2601.19897): the student samples from the row's prompt; the teacher is the
policy itself (a moving average of its weights) reading the prompt with the row's privileged context, and each
token's advantage is the teacher's minus the student's log-prob of the student's own token."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import posttrain.functional as F
from posttrain import algorithm
from posttrain.config import ConfigError
from posttrain.data.privileged import teacher_prompt
from posttrain.data.prompts import DataError
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession
from test_online import make_config


def sdft_config(model_dir, reward_file, **flat):
    return make_config(model_dir, reward_file, "sdft", **{"self_teacher_ema": 0.5, **flat})


# --- the math ---------------------------------------------------------------------------------------


def test_ema_weights_by_hand():
    teacher, policy = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    # 1 + 0.25 * (3 - 1) = 1.5;  2 + 0.25 * (-2 - 2) = 1.0
    torch.testing.assert_close(F.ema_weights(teacher, policy, rate=0.25), torch.tensor([1.5, 1.0]))
    odd = torch.tensor([0.1, 1e-8, -7.3])  # rate 0 and 1 give each end exactly, with no rounding
    assert torch.equal(F.ema_weights(odd, -3 * odd, rate=0.0), odd)
    assert torch.equal(F.ema_weights(odd, -3 * odd, rate=1.0), -3 * odd)
    half = F.ema_weights(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0]), rate=0.5)
    assert half.dtype == torch.bfloat16 and half.item() == 1.5
    with pytest.raises(ValueError, match="rate=1.5 must lie in"):
        F.ema_weights(teacher, policy, rate=1.5)


def test_the_preset_s_loss_is_the_per_sequence_mean_reverse_kl_by_hand():
    """Two completions of 2 and 1 tokens: each token's advantage is teacher - student, and the loss (ratio 1)
    is the mean over sequences of each one's mean of student - teacher (the paper's (1/T) sum_t)."""
    import math

    preset = algorithm("sdft")
    student = torch.log(torch.tensor([[0.5, 0.25], [0.8, 0.3]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5], [0.4, 0.9]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = preset.advantages(torch.zeros(1, 2), mask=mask, logprobs=student, teacher_logprobs=teacher)
    ln2 = math.log(2)
    torch.testing.assert_close(advantages, torch.tensor([[-ln2, ln2], [-ln2, 0.0]]))
    loss, _ = preset.policy_loss(student, student, advantages, mask)
    # sequence 1: (ln2 + -ln2) / 2 = 0; sequence 2: ln2 / 1; mean over the two: ln2 / 2
    assert loss.item() == pytest.approx(ln2 / 2)


def test_the_per_token_reverse_kl_and_its_gradient_are_trls_sampled_token_sdft():
    """TRL's SDFT with ``distillation_mode='sampled_token'`` on the same logits and tokens: its per-token loss is
    the detached log-ratio log s - log t times log s, so its value is our reverse-KL estimate times log s, and
    its loss (per sequence mean, then batch mean) has our preset's gradient. The values of the two losses differ
    (TRL's is sum r log s; ours is the reverse KL itself): only the gradient is the algorithm."""
    loss_utils = pytest.importorskip("trl.experimental.sdft.loss_utils")
    g = torch.Generator().manual_seed(0)
    student_logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    theirs_BT = loss_utils.compute_sampled_token_self_distillation_loss(
        student_logits, teacher_logits, tokens, distillation_alpha=1.0)
    student = F.selective_log_softmax(student_logits, tokens)
    teacher = F.selective_log_softmax(teacher_logits, tokens)
    preset = algorithm("sdft")
    advantages = preset.advantages(torch.zeros(1, 3), mask=mask, logprobs=student.detach(), teacher_logprobs=teacher)
    reverse_kl = -advantages  # log s - log t on each realised token
    torch.testing.assert_close(theirs_BT * mask, reverse_kl * student.detach() * mask, rtol=0, atol=1e-6)
    theirs = ((theirs_BT * mask).sum(-1) / mask.sum(-1)).mean()  # SDFTTrainer._compute_self_distillation_loss
    ours, _ = preset.policy_loss(student, student.detach(), advantages, mask)
    grad_theirs, = torch.autograd.grad(theirs, student_logits, retain_graph=True)
    grad_ours, = torch.autograd.grad(ours, student_logits)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=0, atol=1e-6)
    assert grad_ours.abs().max() > 1e-2  # not two zeros


# --- the teacher's prompt -------------------------------------------------------------------------


def test_the_teacher_prompt_fills_the_template_and_a_chat_prompt_s_last_user_message():
    row = {"prompt": "2+3=", "solution": "2+3=5|5"}
    assert teacher_prompt(row, "solution", "{prompt}\n\n{privileged_context}") == "2+3=\n\n2+3=5|5"
    chat = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}],
            "privileged_context": [{"role": "assistant", "content": "2 + 3 = 5"}, {"role": "assistant", "content": "5"}]}
    assert teacher_prompt(chat, "privileged_context", "{prompt} Example: {privileged_context}") == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3. Example: 2 + 3 = 5\n5"}]


def test_sdft_refuses_a_teacher_a_missing_privileged_column_and_the_settings_elsewhere(tiny_model_dir, reward_file,
                                                                                        tmp_path):
    with pytest.raises(ConfigError, match="teacher: sdft's teacher is the policy itself"):
        OnlineSession.create(sdft_config(tiny_model_dir, reward_file, teacher=str(tiny_model_dir)))
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in [{"prompt": "1+2=", "privileged_context": "1+2=3|3"},
                                                           {"prompt": "2+2=", "hint": "4"}]))
    with pytest.raises(DataError, match=r"row 2 has no 'privileged_context' column.*columns: prompt, hint"):
        OnlineSession.create(sdft_config(tiny_model_dir, reward_file, dataset=str(data), prompts_per_step=2))
    with pytest.raises(DataError, match="row 1 has no 'worked' column"):
        OnlineSession.create(sdft_config(tiny_model_dir, reward_file, privileged_column="worked"))
    with pytest.raises(ConfigError, match="privileged_column: only a self-distilling teacher"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", privileged_column="solution"))


# --- the step ----------------------------------------------------------------------------------------


def manual_logprobs(model, tokenizer, prompt: str, completion_ids: torch.Tensor) -> torch.Tensor:
    """[T] ``model``'s plain forward over the prompt's tokens and the completion's: each completion token's
    log-prob (no packing, no shared prompt, no folded head)."""
    prompt_ids = torch.tensor(tokenizer(prompt)["input_ids"])
    ids = torch.cat([prompt_ids, completion_ids])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, completion_ids[:, None])[:, 0]


def test_two_steps_score_the_student_s_tokens_after_the_privileged_prompt_and_move_the_teacher(
        tiny_model_dir, reward_file):
    """Step 1's teacher is the starting policy reading "prompt\\n\\nsolution": the reverse KL and the loss the step
    logs are those of a manual forward of the starting weights over that text and the same completion tokens
    (the student's prompt alone would give another number). After each step the teacher's weights are
    (1 - rate) teacher + rate policy."""
    s = OnlineSession.create(sdft_config(tiny_model_dir, reward_file, max_new_tokens=12))
    start = copy.deepcopy(s.policy)
    metrics = train_step(s)
    g, tokenizer = s.last_groups, s.tokenizer
    mask = g.completions.mask
    rows = [s.train_rows[i] for i in g.indices for _ in range(g.group_size)]
    student, teacher, alone = (torch.zeros(mask.shape) for _ in range(3))
    for n, row in enumerate(rows):
        tokens = g.completions.completion_ids[n, :int(mask[n].sum())]
        student[n, :len(tokens)] = manual_logprobs(start, tokenizer, row["prompt"], tokens)
        teacher[n, :len(tokens)] = manual_logprobs(start, tokenizer, f"{row['prompt']}\n\n{row['solution']}", tokens)
        alone[n, :len(tokens)] = manual_logprobs(start, tokenizer, row["prompt"], tokens)
    tokens_total = mask.sum()
    kl = float(((student - teacher) * mask).sum() / tokens_total)
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, abs=1e-5)
    # the student's prompt alone would have given another number, far outside the tolerance
    assert abs(kl - float(((student - alone) * mask).sum() / tokens_total)) > 1e-3
    per_sequence = ((student - teacher) * mask).sum(-1) / mask.sum(-1)  # ratio 1: the loss is the reverse KL
    assert metrics["loss"] == pytest.approx(float(per_sequence.mean()), abs=1e-5)

    after_one = copy.deepcopy(s.policy)
    for mine, a, b in zip(s.teacher.parameters(), start.parameters(), after_one.parameters()):
        torch.testing.assert_close(mine, 0.5 * a + 0.5 * b)
    teacher_before = copy.deepcopy(s.teacher)
    train_step(s)
    for mine, a, b in zip(s.teacher.parameters(), teacher_before.parameters(), s.policy.parameters()):
        torch.testing.assert_close(mine, 0.5 * a + 0.5 * b)


def test_a_rate_of_0_keeps_the_starting_weights_and_no_teacher_is_loaded(tiny_model_dir, reward_file, monkeypatch):
    import posttrain.training.session as session

    monkeypatch.setattr(session, "load_teacher", lambda *a, **k: pytest.fail("sdft loaded a teacher model"))
    s = OnlineSession.create(sdft_config(tiny_model_dir, reward_file, self_teacher_ema=0.0))
    start = copy.deepcopy(s.policy)
    for _ in range(2):
        train_step(s)
    assert all(torch.equal(a, b) for a, b in zip(s.teacher.parameters(), start.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(s.policy.parameters(), start.parameters()))


def test_a_resumed_sdft_run_with_an_offloaded_teacher_equals_an_uninterrupted_one(tiny_model_dir, reward_file,
                                                                                 tmp_path):
    """The moving teacher is in the checkpoint (offloaded: loaded back into its store)."""
    from conftest import assert_online_resume_is_exact

    assert_online_resume_is_exact(lambda output: sdft_config(
        tiny_model_dir, reward_file, offload_reference=True, max_steps=4, save_every=2, eval_every=2,
        output=output), tmp_path)


def test_the_run_says_whether_the_teacher_reads_its_privileged_context(tiny_model_dir, reward_file, capsys):
    """At the start the run scores the first rows' privileged contexts as completions, after the student's prompt
    and after the teacher's: its line carries the two mean log-probs of a manual forward, and a warning when the
    teacher gives the context no more likelihood than the student (a model that does not learn in context)."""
    from posttrain.training.guards import SELF_TEACHER_PROBE_ROWS, SelfTeacherProbe

    s = OnlineSession.create(sdft_config(tiny_model_dir, reward_file, max_new_tokens=12))
    said = capsys.readouterr().err
    rows = s.train_rows[:SELF_TEACHER_PROBE_ROWS]
    student, teacher, tokens = 0.0, 0.0, 0
    for row in rows:
        context = torch.tensor(s.tokenizer(row["solution"], add_special_tokens=False)["input_ids"])
        student += float(manual_logprobs(s.policy, s.tokenizer, row["prompt"], context).sum())
        teacher += float(manual_logprobs(s.policy, s.tokenizer, f"{row['prompt']}\n\n{row['solution']}", context).sum())
        tokens += len(context)
    probe = SelfTeacherProbe(student / tokens, teacher / tokens)
    line = next(line for line in said.splitlines() if "self-distillation probe" in line)
    assert f"{probe.student:.3f} nats per token after the prompt, {probe.teacher:.3f} after" in line
    assert ("warning: " in line) != probe.reads_context
    # both verdicts, by hand
    assert SelfTeacherProbe(-0.21, -4.2).line().startswith("warning: self-distillation probe")
    assert SelfTeacherProbe(-2.0, -0.5).line().endswith("the teacher reads its context")
