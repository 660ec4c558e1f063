"""The reward-model trainer on tiny models: it scores exactly what RewardModel scores (same rendering,
same last token under either padding), trains on exactly the Bradley-Terry loss with the margin column,
micro-batching and resuming change nothing, final_model/ loads with from_pretrained and RewardModel,
bad data and configs say what is wrong, and a short run on the addition pairs learns."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
from conftest import assert_runs_identical, resumed, run_interrupted
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

import posttrain.training.reward_model as reward_model
from posttrain.config import Config, ConfigError
from posttrain.data.preference import preference_task
from posttrain.data.prompts import DataError
from posttrain.data.rewards import RewardModel, reward_model_text
from posttrain.data.tasks.addition import make_rows
from posttrain.data.tasks.addition_pairs import pair_row
from posttrain.models.batching import item_micro_batches
from posttrain.models.modeling import right_pad
from posttrain.models.packing import has_packed_attention
from posttrain.models.reward_head import sequence_scores
from posttrain.models.tiny import char_tokenizer
from posttrain.tracking.metrics import read_metrics
from posttrain.training.api import run
from posttrain.training.reward_model import (
    RewardModelSession,
    encode_pairs,
    evaluate,
    pair_scores,
    scored_text,
    train_step,
)
from posttrain.training.runner import run_training
from posttrain.training.setup import Inputs

LORA = dict(lora_r=4, lora_alpha=8.0)
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    """32 training pairs with a margin column (0, 0.5, 1, 1.5, ...), 8 held-out pairs without one."""
    train, test = make_rows(seed=1, n_train=32, n_test=8)
    root = tmp_path_factory.mktemp("reward-pairs")
    train_rows = [{**pair_row(r), "margin": 0.5 * (i % 4)} for i, r in enumerate(train)]
    return write_jsonl(root / "train.jsonl", train_rows), write_jsonl(root / "test.jsonl", [pair_row(r) for r in test])


def make_config(model_dir, pair_files, **flat) -> Config:
    base = dict(algorithm="reward_model", model=str(model_dir), dataset=str(pair_files[0]),
                eval_dataset=str(pair_files[1]), pairs_per_step=4, micro_batch_size=64, learning_rate=1e-3,
                max_steps=2, eval_size=8, progress=False, report_to="none", seed=0)
    base.update(flat)
    return Config.from_flat(base)


def unpadded_score(model, ids: torch.Tensor) -> float:
    """The score head on the last hidden state of one unpadded sequence, by hand."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids[None]).last_hidden_state
        return float(hidden[0, -1] @ model.score.weight[0])


# --- what is scored ------------------------------------------------------------------------------


def test_scored_text_is_reward_models_rendering():
    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz:;0123456789+=,|")
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    chat = [{"role": "user", "content": "1+2"}]
    cases = [("1+2=", "1+2=3|3"), (chat, [{"role": "assistant", "content": "3"}]), (chat, "3")]
    for prompt, completion in cases:  # RewardModel renders with reward_model_text
        assert scored_text(tok, prompt, completion) == reward_model_text(tok, prompt, completion)
    assert scored_text(tok, "1+2=", "3|3") == "1+2=3|3"
    assert scored_text(tok, chat, "3") == "u:1+2;a:3;"
    # tokenized as RewardModel tokenizes: the tokenizer's special tokens (BOS here), nothing appended
    pairs = encode_pairs([{"prompt": "1+2=", "chosen": "3", "rejected": "4"}], tok, max_length=64, source="s")
    assert tok.decode(pairs.chosen_ids[0]) == "<bos>1+2=3" and tok.decode(pairs.rejected_ids[0]) == "<bos>1+2=4"


def _tiny_classifier_config(tok):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)


@pytest.mark.parametrize("trim_padding", [True, False], ids=["packed", "padded"])
def test_the_score_is_read_at_the_last_real_token_under_either_padding(tiny_model_dir, pair_files, trim_padding):
    """Scores of sequences of unequal lengths packed into one row (the default) or right-padded, against each
    sequence alone by hand and left-padded through transformers' own forward."""
    s = RewardModelSession.create(make_config(tiny_model_dir, pair_files, trim_padding=trim_padding))
    assert s.policy.config.pad_token_id == s.tokenizer.pad_token_id == 0
    assert has_packed_attention(s.policy.model) is trim_padding
    sequences = [s.train.chosen_ids[i] for i in range(5)] + [torch.tensor([1, 5, 6])]  # unequal lengths
    by_hand = torch.tensor([unpadded_score(s.policy, ids) for ids in sequences])
    with torch.no_grad():
        right = sequence_scores(s.policy, sequences, s.pad_id)
        ids, attention = right_pad([seq.flip(0) for seq in sequences], s.pad_id)  # left padding: flip twice
        left = s.policy(input_ids=ids.flip(1), attention_mask=attention.flip(1)).logits[:, 0]
    assert ids.flip(1)[-1, :1].tolist() == [0]  # the short row really is padded on the left
    assert torch.allclose(right, by_hand, atol=1e-5) and torch.allclose(left, by_hand, atol=1e-5)


@pytest.mark.parametrize("extra", [{}, pytest.param(LORA, marks=needs_peft, id="lora")])
def test_a_packed_pass_scores_where_transformers_does_and_gives_the_padded_gradient(extra, tiny_model_dir, pair_files):
    """A text ending in the pad id is scored at its last other token, as transformers' classifier reads it;
    the packed pass's scores and gradients equal the padded pass's (full fine-tuning and LoRA)."""
    sessions = [RewardModelSession.create(make_config(tiny_model_dir, pair_files, trim_padding=trim, **extra))
                for trim in (True, False)]
    sequences = list(sessions[0].train.chosen_ids[:3]) + [torch.tensor([1, 5, 6, 0, 0]), torch.tensor([1, 7])]
    outcomes = []
    for s in sessions:
        s.policy.zero_grad()
        scores = sequence_scores(s.policy, sequences, s.pad_id)
        (scores * torch.arange(1.0, 6.0)).sum().backward()
        outcomes.append((scores.detach(), [p.grad.clone() for p in s.policy.parameters() if p.requires_grad]))
    (packed, packed_grads), (padded, padded_grads) = outcomes
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # transformers' own forward over the text without its trailing pad ids
        alone = sequence_scores(sessions[1].policy, [torch.tensor([1, 5, 6])], sessions[1].pad_id)
    assert packed[3] == pytest.approx(float(alone), abs=1e-5)
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loading_writes_the_pad_id_the_head_finds_the_last_token_by(tiny_model_dir, tmp_path):
    """A causal LM whose config has no pad id: the loaded reward model's config gets the tokenizer's, without
    which transformers cannot score a padded batch."""
    from posttrain.models.reward_head import load_reward_model

    causal = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    causal.config.pad_token_id = None
    causal.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    model, tokenizer = load_reward_model(str(tmp_path), device="cpu")
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id == 0
    assert torch.equal(model.model.embed_tokens.weight, causal.model.embed_tokens.weight)  # the decoder is the LM's


@needs_peft
def test_lora_trains_the_adapters_and_the_whole_head(tiny_model_dir, pair_files):
    s = RewardModelSession.create(make_config(tiny_model_dir, pair_files, **LORA))
    trainable = {name: p.detach().clone() for name, p in s.policy.named_parameters() if p.requires_grad}
    frozen = {name: p.detach().clone() for name, p in s.policy.named_parameters() if not p.requires_grad}
    assert all("lora_" in name or ".score." in name for name in trainable)
    assert any(".score." in name for name in trainable) and any("lora_B" in name for name in trainable)
    train_step(s)
    params = dict(s.policy.named_parameters())
    assert all(torch.equal(params[name], before) for name, before in frozen.items())
    assert all(not torch.equal(params[name], before) for name, before in trainable.items() if ".score." in name)


# --- the loss ------------------------------------------------------------------------------------


def test_step_loss_is_bradley_terry_with_each_pairs_margin(tiny_model_dir, pair_files):
    """The logged loss is mean(log(1 + exp(-(r_w - r_l - m)))) over the step's pairs, m the margin column,
    plus c * mean((r_w + r_l)^2) with the preset's centring; without the column m = 0."""
    s = RewardModelSession.create(make_config(tiny_model_dir, pair_files, center_rewards_coefficient=0.1))
    idx = copy.deepcopy(s.sampler).next(4)
    with torch.no_grad():
        chosen, rejected = pair_scores(s.policy, s.train, idx, s.pad_id).tolist()
    margins = [s.train.rows[i]["margin"] for i in idx]
    assert sorted(set(margins)) != [0.0]  # the step's pairs have margins that matter
    bt = sum(math.log1p(math.exp(-(c - r - m))) for c, r, m in zip(chosen, rejected, margins)) / 4
    centring = 0.1 * sum((c + r) ** 2 for c, r in zip(chosen, rejected)) / 4
    metrics = train_step(s)
    assert metrics["loss"] == pytest.approx(bt + centring, rel=1e-5)
    assert metrics["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 4, rel=1e-5)
    assert metrics["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 4
    assert {"rewards/chosen", "rewards/rejected", "grad_norm", "lr"} <= metrics.keys()
    without_margin = sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / 4
    assert without_margin != pytest.approx(bt, rel=1e-3)
    s2 = RewardModelSession.create(make_config(tiny_model_dir, pair_files, center_rewards_coefficient=0.1))
    s2.train.margins = None  # the same pairs and weights without the column: the margin-free loss
    assert train_step(s2)["loss"] == pytest.approx(without_margin + centring, rel=1e-5)


def test_micro_batching_gives_the_same_gradient(tiny_model_dir, pair_files, monkeypatch):
    """Micro-batches of one pair (2 or 3 sequences) and of a token budget (pairs placed out of order, which
    the margins would notice) accumulate the whole batch's gradient, margin and centring included, and log
    its loss; packed passes give the padded pass's."""
    grads = []

    def capture(optimizer, scheduler, optim, bad_steps):
        grads[-1] += [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
        optimizer.zero_grad()
        return 1.0, 0

    def session(**settings):
        return RewardModelSession.create(make_config(tiny_model_dir, pair_files, **{"micro_batch_size": 64, **settings},
                                                     pairs_per_step=5, center_rewards_coefficient=0.1))

    monkeypatch.setattr(reward_model, "apply_gradients", capture)
    padded = session(trim_padding=False)
    costs = [len(padded.train.chosen_ids[i]) + len(padded.train.rejected_ids[i])
             for i in copy.deepcopy(padded.sampler).next(5)]
    budget = max(costs) + min(costs)  # the longest pair and the shortest fit: several passes, not in order
    micros = item_micro_batches(costs, per_pass=0, budget=budget)
    assert 1 < len(micros) < 5 and sum(micros, []) != list(range(5))
    losses = []
    for s in (padded, session(), session(micro_batch_size=2), session(micro_batch_size=3),
              session(max_tokens_per_micro_batch=budget)):
        s.update_check.done = True  # the captured step applies nothing, on purpose
        grads.append([])
        losses.append(train_step(s)["loss"])
    assert any(g.abs().max() > 0 for g in grads[0])
    for other, loss in zip(grads[1:], losses[1:]):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for a, b in zip(grads[0], other, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


# --- the run: resume, saving, loading ---------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, pytest.param(LORA, marks=needs_peft, id="lora")])
def test_resumed_run_equals_uninterrupted(extra, tiny_model_dir, pair_files, tmp_path):
    common = dict(max_steps=4, eval_every=2, save_every=2, log_samples_every=2, **extra)
    whole = make_config(tiny_model_dir, pair_files, output=str(tmp_path / "whole"), **common)
    run_training(RewardModelSession.create(whole), whole, train_step, evaluate)
    first = make_config(tiny_model_dir, pair_files, output=str(tmp_path / "split"), **common)
    run_interrupted(RewardModelSession.create(first), first, train_step, evaluate, after=2)
    second = resumed(first, tmp_path / "split")
    run_training(RewardModelSession.create(second), second, train_step, evaluate)
    assert_runs_identical(tmp_path / "whole", tmp_path / "split")
    assert len(read_metrics(tmp_path / "whole")) == 5  # step 0 evaluation + 4 steps


@pytest.mark.parametrize("extra", [{}, pytest.param(LORA, marks=needs_peft, id="lora")])
def test_final_model_loads_and_scores_as_the_trained_model(extra, tiny_model_dir, pair_files, tmp_path, monkeypatch):
    """``posttrain.training.api.run`` routes the preset here; final_model/ (under LoRA: merged, head
    included) gives the trained model's scores through from_pretrained and through RewardModel."""
    sessions = []
    create = RewardModelSession.create
    monkeypatch.setattr(RewardModelSession, "create", lambda *a, **k: sessions.append(create(*a, **k)) or sessions[-1])
    config = make_config(tiny_model_dir, pair_files, output=str(tmp_path / "run"), **extra)
    final = run(config)["run_dir"] / "final_model"
    s = sessions[0]
    idx = list(range(8))
    with torch.no_grad():
        trained = pair_scores(s.policy, s.train, idx, s.pad_id)
        start = pair_scores(AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                                              pad_token_id=0), s.train, idx, s.pad_id)
        loaded = pair_scores(AutoModelForSequenceClassification.from_pretrained(final), s.train, idx, s.pad_id)
    assert not torch.allclose(trained, start, atol=1e-3)  # it trained: the comparison below is not vacuous
    assert torch.allclose(loaded, trained, atol=1e-5)
    rows = [s.train.rows[i] for i in idx]
    scorer = RewardModel(final, batch_size=3)  # its own (left) padding, in batches of unequal lengths
    for k, column in enumerate(("chosen", "rejected")):
        scores = scorer([r["prompt"] for r in rows], [r[column] for r in rows])
        assert scores == pytest.approx(trained[k].tolist(), abs=1e-5)


def test_run_logs_held_out_metrics_and_samples(tiny_model_dir, pair_files, tmp_path):
    config = make_config(tiny_model_dir, pair_files, output=str(tmp_path / "run"), log_samples_every=1)
    result = run_training(RewardModelSession.create(config), config, train_step, evaluate)
    after = result["after"]
    assert 0 <= after["eval/pairwise_accuracy_low"] <= after["eval/pairwise_accuracy"] <= after["eval/pairwise_accuracy_high"] <= 1
    assert after["eval/margin"] == pytest.approx(after["eval/rewards_chosen"] - after["eval/rewards_rejected"], abs=1e-6)
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert {"prompt", "chosen", "rejected", "reward_chosen", "reward_rejected"} <= sample.keys()


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("margin, shown", [("big", "'big'"), (float("nan"), "nan"), (True, "True"), (None, "None")])
def test_a_bad_margin_names_the_source_row_and_field(margin, shown, tmp_path):
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": 1.0},
            {"prompt": "1+3=", "chosen": "4", "rejected": "5", "margin": margin}]
    if margin is None:
        del rows[1]["margin"]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    tok = char_tokenizer("0123456789+=,|")
    with pytest.raises(DataError, match=rf"bad\.jsonl: row 2: 'margin' must be a finite number .*got {shown}"):
        encode_pairs(reward_model.load_rows(str(path), None, None, paired=True, needs_scores=False)[0], tok,
                     max_length=64, source=str(path))


def test_bad_pairs_and_configs_say_what_to_change(tiny_model_dir, pair_files, tmp_path):
    unpaired = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "1+2=", "completion": "3", "label": True}])
    with pytest.raises(DataError, match=r"kto\.jsonl: row 1 has no 'chosen'"):
        RewardModelSession.create(make_config(tiny_model_dir, (unpaired, pair_files[1])))
    with pytest.raises(DataError, match="every pair is longer than max_length 8 tokens"):
        RewardModelSession.create(make_config(tiny_model_dir, pair_files, max_length=8, max_prompt_length=4))
    with pytest.raises(ConfigError, match="pairs_per_step: 33 is more than the 32 training pairs; use --pairs-per-step 32 or fewer"):
        RewardModelSession.create(make_config(tiny_model_dir, pair_files, pairs_per_step=33))
    with pytest.raises(ConfigError, match="reward: a reward model learns from chosen/rejected pairs"):
        RewardModelSession.create(make_config(tiny_model_dir, pair_files, reward_model=str(tiny_model_dir)))
    with pytest.raises(ConfigError, match="algorithm: dpo is not a reward-model preset"):
        RewardModelSession.create(make_config(tiny_model_dir, pair_files, algorithm="dpo"))
    causal, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="model: a reward model object must be a sequence-classification model"):
        RewardModelSession.create(make_config(tiny_model_dir, pair_files), Inputs(model=causal, tokenizer=tok))
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, pad_token_id=None)
    s = RewardModelSession.create(make_config(tiny_model_dir, pair_files), Inputs(model=classifier, tokenizer=tok))
    assert s.policy is classifier and classifier.config.pad_token_id == tok.pad_token_id  # trained as given


@pytest.fixture
def labelled_by_length(monkeypatch):
    """The built-in addition task, small, with an answer check that a random model passes about half the
    time: a completion is "correct" when its text has an even number of characters. Returns the builder."""
    import dataclasses

    from posttrain.data import preference as preference_data
    from posttrain.data.tasks import addition_pairs

    def make(seed):
        task = addition_pairs.make_task(seed, n_train=64, n_test=4)
        source = dataclasses.replace(task.source, correct=lambda prompts, texts, **_: [len(t) % 2 == 0 for t in texts])
        return dataclasses.replace(task, source=source)

    monkeypatch.setitem(preference_data.PREFERENCE_TASKS, "addition", make)
    return make


def sampled_pairs_config(model_dir, **flat) -> Config:
    base = dict(algorithm="reward_model", model=str(model_dir), task="addition", prompts_per_step=4, resample_every=1,
                group_size=4, max_new_tokens=6, pairs_per_step=2, max_steps=3, eval_size=100, progress=False,
                report_to="none", seed=0)
    return Config.from_flat({**base, **flat})


def test_a_built_in_task_samples_the_starting_models_own_pairs(tiny_model_dir, labelled_by_length):
    """No --dataset: the pairs are the starting model's samples, labelled by the task's check, from training
    prompts until max_steps x pairs_per_step pairs, and from every held-out prompt; pairs_from dataset keeps
    the fixed ones."""
    s = RewardModelSession.create(sampled_pairs_config(tiny_model_dir))
    train, test = s.train.rows, s.test.rows
    assert 6 <= len(train) and len({r["prompt"] for r in train}) <= 8  # two chunks of 4 prompts gave 6 or more
    assert all(len(r["chosen"]) % 2 == 0 and len(r["rejected"]) % 2 == 1 for r in train + test)
    held_out = {r["prompt"] for r in labelled_by_length(0).source.test}
    assert {r["prompt"] for r in test} <= held_out and not {r["prompt"] for r in train} & held_out
    fixed = RewardModelSession.create(sampled_pairs_config(tiny_model_dir, pairs_from="dataset"))
    assert [r["chosen"] for r in fixed.train.rows] == [r["chosen"] for r in labelled_by_length(0).train]


def test_sampled_pairs_need_one_process_and_a_model_by_name(tiny_model_dir, labelled_by_length, pair_files,
                                                             monkeypatch):
    with pytest.raises(ConfigError, match="pairs_from: the reward model samples pairs from a built-in task's model"):
        RewardModelSession.create(make_config(tiny_model_dir, pair_files, pairs_from="policy"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="pairs_from: pairs of the starting model's samples are drawn in one process"):
        RewardModelSession.create(sampled_pairs_config(tiny_model_dir))


def test_a_resumed_run_on_sampled_pairs_draws_the_same_pairs(tiny_model_dir, labelled_by_length, tmp_path):
    common = dict(max_steps=4, eval_every=2, save_every=2, log_samples_every=2)
    whole = sampled_pairs_config(tiny_model_dir, output=str(tmp_path / "whole"), **common)
    run_training(RewardModelSession.create(whole), whole, train_step, evaluate)
    first = sampled_pairs_config(tiny_model_dir, output=str(tmp_path / "split"), **common)
    run_interrupted(RewardModelSession.create(first), first, train_step, evaluate, after=2)
    second = resumed(first, tmp_path / "split")
    run_training(RewardModelSession.create(second), second, train_step, evaluate)
    assert_runs_identical(tmp_path / "whole", tmp_path / "split")


def test_too_long_pairs_are_left_out_and_counted():
    tok = char_tokenizer("0123456789+=,|")
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"},  # 6 tokens each with BOS
            {"prompt": "1+2=", "chosen": "3", "rejected": "44444"}]  # the rejected has 10
    pairs = encode_pairs(rows, tok, max_length=9, source="s")
    assert len(pairs) == 1 and pairs.too_long == 1 and pairs.rows == rows[:1]


# --- learning ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_short_run_on_the_addition_pairs_learns(tmp_path):
    """`posttrain train --algorithm reward_model --model tiny-addition --task addition --pairs-from dataset
    --max-steps 40 --pairs-per-step 32 --learning-rate 1e-3 --eval-size 200` (the fixed slip pairs): held-out pairwise accuracy 0.435 -> 0.635
    (Wilson 95% interval 0.566-0.699, clear of chance). What it learns is the dropped carry (a column written
    without its "+1"): 13 -> 45 of the 46 such held-out pairs ranked right, scored through
    RewardModel(final_model/). A column sum one off ("7+5=13") stays near chance, here and after 600 steps at
    learning rate 3e-4 (0.638 of all 500 held-out pairs): this 0.6M-parameter model does not learn to check
    a sum from one score of the whole text."""
    config = Config.from_flat(dict(algorithm="reward_model", model="tiny-addition", task="addition",
                                   pairs_from="dataset", pairs_per_step=32, learning_rate=1e-3, max_steps=40, eval_every=0, save_every=0,
                                   log_samples_every=0, eval_size=200, output=str(tmp_path / "run"), progress=False,
                                   report_to="none", seed=0))
    result = run(config)
    before, after = result["before"], result["after"]
    assert before["eval/pairwise_accuracy_low"] < 0.5 < after["eval/pairwise_accuracy_low"], (before, after)
    rows = preference_task("addition").test[:200]
    scorer = RewardModel(result["run_dir"] / "final_model", batch_size=64)
    chosen = scorer([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    dropped = [c > r for row, c, r in zip(rows, chosen, rejected) if row["chosen"].count("+1") > row["rejected"].count("+1")]
    assert len(dropped) >= 30 and sum(dropped) / len(dropped) >= 0.9, dropped
