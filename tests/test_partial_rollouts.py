"""Partial rollouts: a generation interrupted at a weight update goes on under the new weights, each token
tagged with the version that sampled it.

Resumed with the same weights, an interrupted greedy decode is the uninterrupted one; after a switch, the
tokens are the new model's continuation of prompt + prefix, and each token's sampler log-prob is its own
version's (what the rollout correction needs). The rollout process loads weights that arrive while it samples,
answers their request after the one in flight with the probe of those weights, and a run with
``--partial-rollouts`` logs the tokens' staleness and resumes from its checkpoint.
"""

from __future__ import annotations

import queue

import pytest
import torch
from test_online import make_config
from test_rollout import BUDGET, PAD, generators, prompts, tiny_llama

from posttrain.config import Config, ConfigError
from posttrain.models.logprobs import batched_logprobs, probe_logprobs
from posttrain.rollout import partial
from posttrain.rollout.worker import Inbox, Request, RolloutWorker, Sampler, _generate
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession, evaluate


def every(k: int):
    """An ``interrupted`` that says yes at its k-th, 2k-th, ... call (once per decode step)."""
    calls = [0]

    def interrupted() -> bool:
        calls[0] += 1
        return calls[0] % k == 0

    return interrupted


def counting():
    """A ``load_newer`` that loads nothing and returns versions 1, 2, ..."""
    version = [0]

    def load_newer() -> int:
        version[0] += 1
        return version[0]

    return load_newer


def swapping_to(model: torch.nn.Module, new: torch.nn.Module):
    """A ``load_newer`` that copies ``new``'s weights into ``model`` (version 1)."""
    def load_newer() -> int:
        model.load_state_dict(new.state_dict())
        return 1

    return load_newer


@pytest.mark.parametrize("k", [1, 2, 5])
def test_an_interrupted_greedy_decode_resumed_with_the_same_weights_is_the_uninterrupted_one(k):
    _, fast = generators(tiny_llama())
    whole = fast.generate(prompts(), num_samples=2, greedy=True)
    assert whole.lengths.min() < BUDGET and whole.truncated.any()  # rows end at different steps, some never
    got = partial.generate(fast, prompts(), num_samples=2, greedy=True, version=0, interrupted=every(k),
                           load_newer=counting())
    assert torch.equal(got.completion_ids, whole.completion_ids)
    assert torch.equal(got.mask, whole.mask)
    assert torch.equal(got.truncated, whole.truncated)
    # interrupted every k steps, each time continued under the next version: token t is version t // k
    t = torch.arange(got.completion_ids.shape[1])
    assert torch.equal(got.token_versions, (t // k).expand_as(got.mask) * got.mask.long())


def test_after_a_weight_switch_greedy_tokens_continue_the_prefix_under_the_new_weights():
    k = 4
    model, new = tiny_llama(0), tiny_llama(1)
    old_whole = generators(tiny_llama(0))[1].generate(prompts(), num_samples=1, greedy=True)
    hf_new, _ = generators(new)  # transformers' generate: a reference outside the decode loop
    _, fast = generators(model)
    got = partial.generate(fast, prompts(), num_samples=1, greedy=True, version=0, interrupted=every(k),
                           load_newer=swapping_to(model, new))
    unfinished = (old_whole.lengths > k).nonzero().squeeze(1)
    assert 0 < len(unfinished) < len(prompts())  # some rows ended before the switch, the others go on
    for row in range(len(prompts())):
        if row not in unfinished:  # ended before the switch: the old model's whole completion
            assert torch.equal(got.completion_ids[row, : old_whole.lengths[row]],
                               old_whole.completion_ids[row, : old_whole.lengths[row]])
            assert (got.token_versions[row] == 0).all()
            continue
        prefix = old_whole.completion_ids[row, :k]
        assert torch.equal(got.completion_ids[row, :k], prefix)
        expected = hf_new.generate([torch.cat([prompts()[row], prefix])], num_samples=1, greedy=True,
                                   max_new_tokens=BUDGET - k)
        n = int(expected.lengths[0])
        assert torch.equal(got.completion_ids[row, k : k + n], expected.completion_ids[0, :n])
        assert int(got.lengths[row]) == k + n and bool(got.truncated[row]) == bool(expected.truncated[0])
        assert got.token_versions[row, :k].tolist() == [0] * k and got.token_versions[row, k : k + n].tolist() == [1] * n


def test_each_sampled_token_carries_the_log_prob_of_the_version_that_drew_it():
    k, g = 3, 2
    model, old, new = tiny_llama(0), tiny_llama(0), tiny_llama(1)
    _, fast = generators(model)  # temperature 1, no filter: the sampler's distribution is the model's
    torch.manual_seed(0)
    got = partial.generate(fast, prompts(), num_samples=g, greedy=False, version=0, interrupted=every(k),
                           load_newer=swapping_to(model, new))
    mask, versions = got.mask, got.token_versions
    assert (versions[:, :k] == 0).all() and (versions[:, k:] == mask[:, k:].long()).all()  # old, then new
    assert (versions == 1).any()  # rows went on after the switch
    expanded = [p for p in prompts() for _ in range(g)]
    old_lp, _ = batched_logprobs(old, expanded, got.completion_ids, mask, pad_id=PAD, micro_batch_size=64)
    new_lp, _ = batched_logprobs(new, expanded, got.completion_ids, mask, pad_id=PAD, micro_batch_size=64)
    expected = torch.where(versions == 0, old_lp, new_lp) * mask
    assert torch.allclose(got.sampling_logprobs, expected, atol=1e-5)
    assert not torch.allclose(got.sampling_logprobs, old_lp * mask, atol=1e-3)  # the switch shows


def test_stitching_appends_each_continued_rows_tokens_after_its_own():
    head = partial.Completions(torch.tensor([[5, 2, 0], [6, 7, 8]]), torch.tensor([[1.0, 1, 0], [1, 1, 1]]),
                               torch.tensor([False, True]), torch.tensor([[-1.0, -2, 0], [-3, -4, -5]]),
                               token_versions=torch.tensor([[3, 3, 0], [3, 3, 3]]))
    tail = partial.Completions(torch.tensor([[9, 2]]), torch.tensor([[1.0, 1]]), torch.tensor([False]),
                               torch.tensor([[-6.0, -7]]), token_versions=torch.tensor([[4, 4]]))
    out = partial.stitched(head, torch.tensor([1]), tail, pad_id=0)
    assert out.completion_ids.tolist() == [[5, 2, 0, 0, 0], [6, 7, 8, 9, 2]]
    assert out.mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert out.truncated.tolist() == [False, False]
    assert out.sampling_logprobs.tolist() == [[-1, -2, 0, 0, 0], [-3, -4, -5, -6, -7]]
    assert out.token_versions.tolist() == [[3, 3, 0, 0, 0], [3, 3, 3, 4, 4]]
    assert partial.unfinished_rows(out, budget=6).tolist() == []  # every row ended


class Arriving:
    """A request queue on which ``messages`` arrive together at the ``after``-th look without waiting."""

    def __init__(self, messages: list, after: int):
        self.messages, self.after, self.looks = list(messages), after, 0

    def get_nowait(self):
        self.looks += 1
        if self.looks < self.after or not self.messages:
            raise queue.Empty
        return self.messages.pop(0)

    def get(self, timeout: float):
        return self.get_nowait()


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_weights_that_arrive_mid_request_are_loaded_at_once_and_their_request_answered_after():
    """Request A is in flight when B (version 1) and C (version 2) arrive with their weights: A continues under
    C's, the newest; B's turn comes after C's weights were loaded, so C's weights sample it, while B's probe
    was computed with B's own weights, which the trainer checks against its copy of them."""
    model, v1, v2 = tiny_llama(0), tiny_llama(1), tiny_llama(2)
    probe = prompts()[1]
    sampler = Sampler(generators(model)[1], model)
    a = Request(0, 0, prompts(), num_samples=2, greedy=True)
    b = Request(1, 1, prompts()[:2], num_samples=1, greedy=True, weights=weights_of(v1), probe_ids=probe)
    c = Request(2, 2, prompts()[2:4], num_samples=1, greedy=True, weights=weights_of(v2), probe_ids=probe)
    inbox = Inbox(Arriving([b, c], after=3))
    answer_a = _generate(sampler, a, inbox)
    assert answer_a.probe_logprobs is None
    versions = answer_a.completions.token_versions
    assert versions[:, :3].unique().tolist() == [0] and versions[:, 3:].unique().tolist() == [0, 2]  # 0 = padding
    answer_b, answer_c = _generate(sampler, inbox.next(), inbox), _generate(sampler, inbox.next(), inbox)
    assert [answer_b.request_id, answer_c.request_id] == [1, 2]
    assert torch.equal(answer_b.probe_logprobs, probe_logprobs(v1, probe))
    assert torch.equal(answer_c.probe_logprobs, probe_logprobs(v2, probe))
    newest = generators(v2)[1]
    assert torch.equal(answer_b.completions.completion_ids,
                       newest.generate(prompts()[:2], num_samples=1, greedy=True).completion_ids)
    assert torch.equal(answer_c.completions.completion_ids,
                       newest.generate(prompts()[2:4], num_samples=1, greedy=True).completion_ids)
    assert (answer_b.completions.token_versions[answer_b.completions.mask > 0] == 2).all()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), v2.parameters()))  # never reloaded older ones


def test_the_rollout_process_continues_a_request_under_weights_sent_after_it():
    """Both requests are queued before the spawned process has started, so it reads B at its first look
    during A, whose rows never end (no EOS token exists) and run the whole budget."""
    model, new = tiny_llama(0), tiny_llama(1)
    _, fast = generators(model, eos=[-1])
    probe = prompts()[0]
    worker = RolloutWorker(fast, model, threads=1, rng_state=torch.get_rng_state(), partial=True)
    try:
        worker.submit(Request(0, 0, prompts(), num_samples=1, greedy=True))
        worker.submit(Request(1, 1, prompts()[:2], num_samples=1, greedy=True, weights=weights_of(new),
                              probe_ids=probe))
        a, b = worker.receive(), worker.receive()
    finally:
        worker.close()
    versions = a.completions.token_versions
    assert versions[:, 0].tolist() == [0] * len(prompts()) and versions[:, -1].tolist() == [1] * len(prompts())
    assert a.completions.lengths.tolist() == [BUDGET] * len(prompts())
    assert torch.equal(b.probe_logprobs, probe_logprobs(new, probe))
    assert torch.equal(b.completions.completion_ids,
                       generators(new, eos=[-1])[1].generate(prompts()[:2], num_samples=1, greedy=True).completion_ids)
    assert (b.completions.token_versions == 1).all()


def test_partial_rollouts_are_refused_where_they_cannot_work():
    with pytest.raises(ConfigError, match="partial_rollouts: it interrupts the requests of the rollout process; "
                                          "add --async-rollout"):
        Config.from_flat({"partial_rollouts": True})
    with pytest.raises(ConfigError, match="partial_rollouts: with max_staleness 0"):
        Config.from_flat({"partial_rollouts": True, "async_rollout": True, "max_staleness": 0})
    with pytest.raises(ConfigError, match="partial_rollouts: a continued row's experts"):
        Config.from_flat({"partial_rollouts": True, "async_rollout": True, "routing_replay": True})
    from posttrain.rollout import factory

    def problems(episodes=False, agent=False, **flat):
        config = Config.from_flat({"partial_rollouts": True, "async_rollout": True, **flat})
        return factory.problems(config, episodes=episodes, on_gpu=False, agent=agent, installed=False)

    assert problems() == []
    assert any(p.startswith("partial_rollouts: a request is interrupted between the decode steps of posttrain's "
                            "own sampler, which the rollout servers are not; partial rollouts need it for now")
               for p in problems(rollout_server=["http://127.0.0.1:9"]))
    assert any(p.startswith("partial_rollouts: a request is interrupted") and "the vllm backend is not" in p
               for p in problems(backend="vllm"))
    assert problems(episodes=True) == ["partial_rollouts: multi-turn episodes (tools, environments) are not "
                                       "continued under newer weights; drop --partial-rollouts or the tools and "
                                       "environment"]
    assert problems(agent=True) == ["partial_rollouts: an agent's episodes are sampled whole, not continued under "
                                    "newer weights; drop --partial-rollouts"]


def test_a_run_with_partial_rollouts_logs_its_tokens_staleness_and_resumes_from_its_checkpoint(tiny_model_dir, reward_file, tmp_path):
    from conftest import resumed, run_interrupted

    from posttrain.rollout.completions import Completions
    from posttrain.tracking.metrics import read_metrics
    from posttrain.training.checkpoint import latest_checkpoint, load_extra_state
    from posttrain.training.runner import run_training

    def config(output):
        return make_config(tiny_model_dir, reward_file, "grpo", async_rollout=True, max_staleness=1,
                           partial_rollouts=True, correction="token-truncate", max_steps=3, save_every=2,
                           eval_every=2, output=str(output))

    first = config(tmp_path / "run")
    run_interrupted(OnlineSession.create(first), first, train_step, evaluate, after=2)
    # the checkpoint holds step 3's batch, sampled ahead, with its tokens' versions
    (ahead,) = load_extra_state(latest_checkpoint(tmp_path / "run"))["rollouts"]["rounds"]
    saved = Completions(**ahead["completions"])
    assert saved.token_versions is not None and saved.token_versions.shape == saved.mask.shape
    assert torch.equal(saved.versions, saved.token_versions.masked_fill(saved.mask == 0, 99).amin(1))
    second = resumed(first, tmp_path / "run")
    run_training(OnlineSession.create(second), second, train_step, evaluate)
    steps = [row for row in read_metrics(tmp_path / "run") if "staleness/mean" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]  # two before the interruption, one resumed
    assert (tmp_path / "run" / "final_model").is_dir()
    for row in steps:
        shares = row["staleness/token_share/0"] + row["staleness/token_share/1"]
        assert shares == pytest.approx(1.0)
        assert row["staleness/token_mean"] == pytest.approx(row["staleness/token_share/1"])  # ages 0 and 1 only
        assert row["staleness/token_mean"] <= row["staleness/mean"] + 1e-12  # a row counts its oldest token
        assert 0.0 <= row["staleness/resumed_rows"] <= 1.0 and row["staleness/max"] <= 1


def test_token_staleness_counts_by_hand():
    from posttrain.training.online import token_staleness_counts

    # row 0: tokens of ages 1, 1, 0 (resumed), then padding; row 1: ages 1, 1 (one version)
    age = torch.tensor([[1, 1, 0, 5], [1, 1, 7, 7]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    assert token_staleness_counts(age, mask, bound=2) == {"tokens": 5.0, "age_sum": 4.0, "resumed_rows": 1.0,
                                                          "0": 1.0, "1": 4.0, "2": 0.0}
