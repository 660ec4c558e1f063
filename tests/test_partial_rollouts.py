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
import time

import pytest
import torch
from test_online import make_config
from test_rollout import BUDGET, EOS, PAD, generators, prompts, tiny_llama

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


def test_a_budget_per_prompt_cuts_each_row_at_its_own():
    """The decode loop given one budget per prompt runs to the longest and cuts each row at its own: each row is
    what that prompt alone, with its budget, gives (truncated where no EOS came within it)."""
    _, fast = generators(tiny_llama())
    budgets = [2, BUDGET, 5, 1, 9, 3]
    got = fast.generate(prompts(), num_samples=2, greedy=True, max_new_tokens=budgets)
    for i, (prompt, budget) in enumerate(zip(prompts(), budgets)):
        alone = fast.generate([prompt], num_samples=2, greedy=True, max_new_tokens=budget)
        for j in range(2):
            n = int(alone.lengths[j])
            assert int(got.lengths[2 * i + j]) == n and bool(got.truncated[2 * i + j]) == bool(alone.truncated[j])
            assert torch.equal(got.completion_ids[2 * i + j, :n], alone.completion_ids[j, :n])
            assert (got.completion_ids[2 * i + j, n:] == PAD).all()
    assert got.truncated.any() and not got.truncated.all()
    with pytest.raises(ValueError, match="max_new_tokens: 2 budgets for 6 prompts"):
        fast.generate(prompts(), num_samples=1, max_new_tokens=[1, 2])


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
    assert problems(rollout_server=["http://127.0.0.1:9"]) == []  # servers abort their requests
    assert any(p.startswith("partial_rollouts: a request is interrupted") and "the vllm backend cannot be" in p
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
    from posttrain.training.rollouts import token_staleness_counts

    # row 0: tokens of ages 1, 1, 0 (resumed), then padding; row 1: ages 1, 1 (one version)
    age = torch.tensor([[1, 1, 0, 5], [1, 1, 7, 7]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    assert token_staleness_counts(age, mask, bound=2) == {"tokens": 5.0, "age_sum": 4.0, "resumed_rows": 1.0,
                                                          "0": 1.0, "1": 4.0, "2": 0.0}


# -- on rollout servers: requests aborted when newer weights wait, their rows continued under them ------------


def greedy_tokens(model: torch.nn.Module, ids: list[int], budget: int, stop: list[int],
                  aborted=lambda: False) -> tuple[list[int], list[float], str]:
    """Greedy tokens after ``ids`` by whole forwards (no cache), with their log-probs and finish reason: what
    the stand-in server answers, and the tests' reference."""
    tokens, logprobs = [], []
    for _ in range(budget):
        if aborted():
            return tokens, logprobs, "abort"
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        if token in stop:
            return tokens, logprobs, "stop"
    return tokens, logprobs, "length"


class DecodingStandIn:
    """A server that decodes greedily with the weights it loaded, token by token, its requests one sample after
    another, and aborts the requests in flight at ``/abort_requests`` (each answering with the tokens it had,
    ``finish_reason`` "abort"), as a vLLM server does. ``hold_after``: after that many tokens, its first
    request waits for an abort, so the abort lands at a known token."""

    def __init__(self, model: torch.nn.Module, hold_after: int):
        import json
        import threading
        from http.server import ThreadingHTTPServer

        from test_remote_generator import JsonHandler, StandInWorker

        self.model, self.worker, self.hold_after = model, StandInWorker(model), hold_after
        self.decoded, self.epoch, self.calls = 0, 0, []
        self.abort_seen, self.lock = threading.Event(), threading.Lock()
        stand_in = self

        class Handler(JsonHandler):
            def do_GET(self):
                self.reply({})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                path = self.path.split("?")[0]
                stand_in.calls.append(path)
                if path == "/abort_requests":
                    stand_in.epoch += 1
                    stand_in.abort_seen.set()
                    self.reply({"status": "aborted"})
                elif path == "/collective_rpc":
                    self.reply({"results": [getattr(stand_in.worker, body["method"])(*body["args"])]})
                elif path == "/v1/completions":
                    self.reply({"choices": stand_in.complete(body)})
                else:
                    self.reply({})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> list[dict]:
        epoch, choices = self.epoch, []

        def aborted() -> bool:
            if self.decoded == self.hold_after:  # the first request waits here for the abort
                self.abort_seen.wait(timeout=10)
            self.decoded += 1
            return self.epoch != epoch

        for i, prompt in enumerate(body["prompt"]):
            for j in range(body["n"]):
                with self.lock:
                    tokens, logprobs, finish = greedy_tokens(self.model, prompt, body["max_tokens"],
                                                             body["stop_token_ids"], aborted)
                choices.append({"index": i * body["n"] + j, "token_ids": tokens, "finish_reason": finish,
                                "logprobs": {"token_logprobs": logprobs}})
        return choices

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def remote(model: torch.nn.Module, server: DecodingStandIn, weights, pad_id: int = PAD):
    from types import SimpleNamespace

    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.remote import FilesystemWeights, RemoteGenerator

    return RemoteGenerator(model, SimpleNamespace(pad_token_id=pad_id), SamplingParams(BUDGET), EOS, [server.url],
                           FilesystemWeights(weights), timeout_s=30)


def assert_continued_under_new_weights(completions, old, new, rows_prompts, old_tokens: list[int]):
    """Row r: its first ``old_tokens[r]`` tokens are the old model's greedy ones (version 0), the rest the new
    model's greedy continuation of prompt + those tokens (version 1), each row within the budget."""
    for r, (prompt, n) in enumerate(zip(rows_prompts, old_tokens)):
        length = int(completions.lengths[r])
        got = completions.completion_ids[r, :length].tolist()
        prefix, _, _ = greedy_tokens(old, prompt.tolist(), n, EOS)
        rest, _, finish = greedy_tokens(new, prompt.tolist() + prefix, BUDGET - n, EOS)
        assert got == prefix + rest, r
        assert completions.token_versions[r, :length].tolist() == [0] * n + [1] * len(rest), r
        assert bool(completions.truncated[r]) == (finish == "length"), r


@pytest.mark.parametrize("pad_id", [PAD, EOS[0]])  # the second: an aborted row's padding is not its EOS
def test_a_server_request_aborted_mid_row_continues_each_row_from_its_own_tokens(tmp_path, pad_id):
    """Six prompts x 2 samples in one request; the server is aborted after 3 tokens of its first row, so that
    row holds 3 tokens and the other eleven none: continued together under the new weights, with two budgets."""
    old, new = tiny_llama(0), tiny_llama(1)
    server_model, trainer_model = tiny_llama(0), tiny_llama(0)
    server = DecodingStandIn(server_model, hold_after=3)
    loaded = [False]
    try:
        generator = remote(trainer_model, server, tmp_path / "weights", pad_id)
        got = partial.generate(generator, prompts(), num_samples=2, greedy=True, version=0,
                               interrupted=lambda: server.decoded >= 3 and not loaded[0],
                               load_newer=lambda: (loaded.__setitem__(0, True), swapping_to(trainer_model, new)())[1])
    finally:
        server.stop()
    assert server.calls.count("/abort_requests") >= 1
    assert_continued_under_new_weights(got, old, new, [p for p in prompts() for _ in range(2)], [3] + [0] * 11)
    assert got.sampling_logprobs is not None and (got.sampling_logprobs[got.mask > 0] < 0).all()


def test_the_thread_worker_aborts_its_servers_request_when_newer_weights_are_sent(tmp_path):
    """Asynchronous rollouts on servers with ``partial``: request A is in flight (held after 3 tokens) when B
    brings version 1's weights; the worker aborts A, publishes B's weights, continues A's rows under them, then
    samples B with them."""
    from posttrain.rollout.worker import ThreadRolloutWorker

    old, new = tiny_llama(0), tiny_llama(1)
    server = DecodingStandIn(tiny_llama(0), hold_after=3)
    copy = tiny_llama(0)
    worker = ThreadRolloutWorker(remote(copy, server, tmp_path / "weights"), copy, rng_state=torch.get_rng_state(),
                                 partial=True)
    try:
        worker.submit(Request(0, 0, prompts()[:3], num_samples=1, greedy=True))
        deadline = time.monotonic() + 10
        while server.decoded < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.submit(Request(1, 1, prompts()[3:], num_samples=1, greedy=True, weights=weights_of(new)))
        a, b = worker.receive(), worker.receive()
    finally:
        worker.close()
        server.stop()
    assert_continued_under_new_weights(a.completions, old, new, prompts()[:3], [3, 0, 0])
    assert_continued_under_new_weights(b.completions, old, new, prompts()[3:], [0, 0, 0])
