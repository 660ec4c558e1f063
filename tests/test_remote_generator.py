"""RemoteGenerator's protocol without vLLM: stand-in servers on loopback that speak the endpoints a ``posttrain
serve`` server answers (tests/test_rollout_server.py runs real ones, with vLLM). What runs here, in the
default suite: the publish-pause-load-resume sequence and its version check, prompts shared across servers
in order, a dead server's prompts re-sent to another, and the errors when none is left or none starts."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.logprobs import probe_logprobs
from posttrain.rollout.completions import SamplingParams
from posttrain.rollout.remote import CollectiveWeights, FilesystemWeights, RemoteGenerator, RolloutServerError
from posttrain.rollout.vllm_worker import WEIGHTS_FILE, WeightSync


class StandInWorker(WeightSync):
    """posttrain's worker extension on a transformers model: its runner's reload loads a state dict."""

    def __init__(self, model):
        class Runner:
            def get_model(self):
                return model

            def reload_weights(self, weights_iterator, is_checkpoint_format):
                model.load_state_dict(dict(weights_iterator), strict=False)

        self.model_runner = Runner()


class JsonHandler(BaseHTTPRequestHandler):
    """A stand-in server's handler: it answers JSON and logs nothing."""

    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class StandIn:
    """A server that answers each prompt's sample ``j`` with the tokens ``[first prompt token, j, EOS]``, and
    records what it was asked; ``loads`` the version it reports (``wrong_version``: one off).

    Given ``model``, it loads each published version into it and answers log-probs as a server does: the
    sampled tokens' under the loaded weights, and ``prompt_logprobs`` (the trainer's sync check)."""

    def __init__(self, eos: int, wrong_version: bool = False, failing: bool = False, model=None,
                 without_logprobs: bool = False):
        self.eos, self.wrong_version, self.failing, self.calls, self.prompts = eos, wrong_version, failing, [], []
        self.without_logprobs = without_logprobs  # a server that omits the sampled tokens' log-probs
        self.version, self.model, self.loaded = -1, model, []
        self.worker = StandInWorker(model)
        stand_in = self

        def logprobs(ids):  # [T] -> the log-probs of tokens 1.. under the loaded weights
            with torch.no_grad():
                return probe_logprobs(stand_in.model, torch.tensor(ids)).tolist()

        class Handler(JsonHandler):
            def do_GET(self):
                stand_in.calls.append(self.path)
                self.reply({})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                stand_in.calls.append(self.path.split("?")[0])
                if self.path == "/collective_rpc" and body["method"] == "posttrain_join":
                    self.reply({"results": [stand_in.worker.posttrain_join(*body["args"])]})
                elif self.path == "/collective_rpc":
                    if body["method"] == "posttrain_load":
                        assert (Path(body["args"][0]) / WEIGHTS_FILE).is_file()
                    if stand_in.model is not None:  # posttrain serve's own worker extension loads them
                        getattr(stand_in.worker, body["method"])(*body["args"])
                    stand_in.version = int(body["args"][1]) + (1 if stand_in.wrong_version else 0)
                    stand_in.loaded.append(stand_in.version)
                    self.reply({"results": [str(stand_in.version)]})
                elif self.path == "/v1/completions" and stand_in.failing:  # its engine died mid-rollout
                    self.send_error(500, "EngineDeadError")
                elif self.path == "/v1/completions" and "prompt_logprobs" in body:
                    ids = body["prompt"]
                    entries = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(ids[1:], logprobs(ids))]
                    self.reply({"choices": [{"index": 0, "prompt_logprobs": entries}]})
                elif self.path == "/v1/completions":
                    stand_in.prompts += body["prompt"]
                    choices = []
                    for i, prompt in enumerate(body["prompt"]):
                        for j in range(body["n"]):
                            tokens = [prompt[0], j, stand_in.eos]
                            sampled = (logprobs(prompt + tokens)[-3:] if stand_in.model is not None
                                       else [-0.5, -0.25, -0.125])
                            choices.append({"index": i * body["n"] + j, "token_ids": tokens,
                                            "logprobs": None if stand_in.without_logprobs else {"token_logprobs": sampled},
                                            "finish_reason": "stop"})
                    self.reply({"choices": choices})
                else:
                    self.reply({})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def policy(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def generator(policy, urls, weights, timeout=10.0) -> RemoteGenerator:
    model, tokenizer = policy
    return RemoteGenerator(model, tokenizer, SamplingParams(8, 1.0, 1.0, 0), [tokenizer.eos_token_id], urls,
                           FilesystemWeights(weights), timeout_s=timeout)


def test_each_call_publishes_loads_and_shares_the_prompts_in_order(policy, tmp_path):
    eos = policy[1].eos_token_id
    servers = [StandIn(eos), StandIn(eos)]
    try:
        remote = generator(policy, [s.url for s in servers], tmp_path / "weights")
        prompts = [torch.tensor([10 + k, 1, 2]) for k in range(5)]
        out = remote.generate(prompts, num_samples=2)
        # rows i*2 + j: prompt i's first token, then j, then EOS; the engine's log-probs of each
        assert out.completion_ids[:, :3].tolist() == [[10 + k, j, eos] for k in range(5) for j in range(2)]
        assert out.sampling_logprobs[0, :3].tolist() == [-0.5, -0.25, -0.125]
        # 5 prompts over 2 servers: 3 to the first, 2 to the second, each published version loaded first
        assert [p[0] for p in servers[0].prompts] == [10, 11, 12] and [p[0] for p in servers[1].prompts] == [13, 14]
        for server in servers:
            assert server.calls[1:6] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
                                         "/v1/completions"]
            assert server.version == 0
        remote.generate(prompts, num_samples=1)
        assert [s.version for s in servers] == [1, 1]
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000000", "v000001"]
    finally:
        for server in servers:
            server.stop()


def test_a_dead_server_is_dropped_and_its_prompts_go_to_another(policy, tmp_path):
    eos = policy[1].eos_token_id
    alive, dying = StandIn(eos), StandIn(eos)
    try:
        remote = generator(policy, [dying.url, alive.url], tmp_path / "weights")
        dying.stop()
        prompts = [torch.tensor([10 + k, 1]) for k in range(4)]
        out = remote.generate(prompts, num_samples=1)
        assert out.completion_ids[:, 0].tolist() == [10, 11, 12, 13]  # every prompt answered, in order
        assert list(remote.dead) == [dying.url] and [p[0] for p in alive.prompts] == [10, 11, 12, 13]
        alive.stop()
        with pytest.raises(RolloutServerError, match=r"no rollout server is left: .*resume the run"):
            remote.generate(prompts, num_samples=1)
    finally:
        alive.stop()


def test_a_server_that_fails_its_shard_is_dropped_and_the_shard_sent_to_another(policy, tmp_path):
    eos = policy[1].eos_token_id
    failing, alive = StandIn(eos, failing=True), StandIn(eos)
    try:
        remote = generator(policy, [failing.url, alive.url], tmp_path / "weights")
        out = remote.generate([torch.tensor([10 + k, 1]) for k in range(4)], num_samples=2)
        assert out.completion_ids[:, 0].tolist() == [10, 10, 11, 11, 12, 12, 13, 13]
        # the second server answered its own shard, then the failed one's
        assert [p[0] for p in alive.prompts] == [12, 13, 10, 11]
        assert list(remote.dead) == [failing.url] and "HTTP 500" in remote.dead[failing.url]
    finally:
        failing.stop()
        alive.stop()


def test_a_server_that_omits_the_sampled_log_probs_is_named_not_read_as_zeros(policy, tmp_path):
    """A server that answers without ``logprobs.token_logprobs`` would have the correction and the mismatch
    metrics compare the trainer with log-probs of 0: it is dropped, naming it and what it left out; its prompts
    go to a server that answers them."""
    eos = policy[1].eos_token_id
    silent, alive, alone = StandIn(eos, without_logprobs=True), StandIn(eos), StandIn(eos, without_logprobs=True)
    try:
        remote = generator(policy, [silent.url, alive.url], tmp_path / "weights")
        out = remote.generate([torch.tensor([10 + k, 1]) for k in range(2)], num_samples=1)
        assert out.sampling_logprobs[:, :3].tolist() == [[-0.5, -0.25, -0.125]] * 2
        assert list(remote.dead) == [silent.url]
        assert f"{silent.url} returned sample 0 without a log-prob for each of its 3 tokens (logprobs.token_logprobs: " \
               "missing)" in remote.dead[silent.url]
        with pytest.raises(RolloutServerError, match="without a log-prob for each of its 3 tokens"):
            generator(policy, [alone.url], tmp_path / "other").generate([torch.tensor([10, 1])], num_samples=1)
    finally:
        for server in (silent, alive, alone):
            server.stop()


def test_a_server_that_loads_another_version_is_dropped(policy, tmp_path):
    eos = policy[1].eos_token_id
    right, wrong = StandIn(eos), StandIn(eos, wrong_version=True)
    try:
        remote = generator(policy, [wrong.url, right.url], tmp_path / "weights")
        remote.generate([torch.tensor([10, 1])], num_samples=1)
        assert list(remote.dead) == [wrong.url] and "loaded version ['1'], not 0" in remote.dead[wrong.url]
        assert wrong.prompts == [] and right.prompts == [[10, 1]]
    finally:
        right.stop()
        wrong.stop()


def test_servers_that_never_start_are_named(policy, tmp_path):
    stand_in = StandIn(policy[1].eos_token_id)
    stand_in.stop()  # its port is now closed
    with pytest.raises(RolloutServerError, match=rf"not ready after 1 s: {stand_in.url}: unreachable.*posttrain serve"):
        generator(policy, [stand_in.url], tmp_path / "weights", timeout=1.0)


def test_asynchronous_rollouts_from_servers_train_on_samples_one_version_stale(tiny_model_dir, tmp_path):
    """async_rollout with servers: a thread of the trainer drives them, each request's weights published and
    loaded before its samples; every step after the first trains on samples of the version before it, the
    servers' log-probs are the weights they were drawn with, and each load passes the trainer's sync check."""
    import posttrain
    from posttrain.config import Config
    from posttrain.tracking.metrics import read_metrics

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    server = StandIn(tokenizer.eos_token_id, model=AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    try:
        config = Config.from_flat({"model": str(tiny_model_dir), "task": "addition", "rollout_server": [server.url],
                                   "async_rollout": True, "max_staleness": 1, "max_steps": 4,
                                   "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "eval_size": 0,
                                   "eval_every": 0, "output": str(tmp_path / "run"), "progress": False,
                                   "report_to": "none", "learning_rate": 1e-2})
        posttrain.train(config)
    finally:
        server.stop()
    steps = [row for row in read_metrics(tmp_path / "run") if "staleness/max" in row]
    assert [row["staleness/max"] for row in steps] == [0, 1, 1, 1]
    # one load per request: steps 0 and 1's batches at the start, then one ahead per step (the last one, for
    # a step 4 that never runs, is what a checkpoint would keep): version numbers in order, none reused
    assert server.loaded == [0, 1, 2, 3, 4]
    assert all(row["mismatch/kl_k3"] < 1e-5 and row["sync/logprob_gap"] < 1e-4 for row in steps)


@pytest.mark.parametrize("transport", ["filesystem", "gloo"])
def test_each_transport_loads_the_trainers_weights_into_the_servers_worker(policy, tmp_path, transport):
    """The worker extension posttrain serve runs, on a transformers model: after each sync it holds exactly
    the trainer's weights, whether they came as a file or over a gloo group (joined once, reused)."""
    model, tokenizer = policy
    server = StandIn(tokenizer.eos_token_id, model=copy.deepcopy(model))
    try:
        weights = FilesystemWeights(tmp_path / "weights") if transport == "filesystem" else CollectiveWeights("gloo")
        remote = RemoteGenerator(model, tokenizer, SamplingParams(4, 1.0, 1.0, 0), [tokenizer.eos_token_id],
                                 [server.url], weights, timeout_s=30)
        for step in range(2):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.01 * torch.randn_like(param))
            remote.generate([torch.tensor([5, 6, 7])], num_samples=1)
            held = server.model.state_dict()
            assert all(torch.equal(held[name], value) for name, value in model.state_dict().items())
            assert server.loaded[-1] == step
        if transport == "gloo":
            assert [call for call in server.calls if call == "/collective_rpc"] == ["/collective_rpc"] * 3  # 1 join
    finally:
        server.stop()


def test_a_server_whose_receive_fails_is_dropped_and_the_others_load(policy, tmp_path):
    model, tokenizer = policy
    alive, dying = (StandIn(tokenizer.eos_token_id, model=copy.deepcopy(model)) for _ in range(2))
    try:
        remote = RemoteGenerator(model, tokenizer, SamplingParams(4, 1.0, 1.0, 0), [tokenizer.eos_token_id],
                                 [dying.url, alive.url], CollectiveWeights("gloo"), timeout_s=20)
        remote.generate([torch.tensor([5, 6])], num_samples=1)  # both joined
        dying.worker.posttrain_group = None  # its next receive fails before it takes a tensor (its group is gone)
        out = remote.generate([torch.tensor([5, 6]), torch.tensor([8, 9])], num_samples=1)
        assert out.completion_ids[:, 0].tolist() == [5, 8] and list(remote.dead) == [dying.url]
        assert alive.loaded == [0, 1]
    finally:
        alive.stop()
        dying.stop()


def test_transport_settings_are_checked_before_anything_starts(tiny_model_dir, tmp_path):
    import posttrain
    from posttrain.config import Config, ConfigError

    base = {"model": str(tiny_model_dir), "task": "addition", "rollout_server": ["http://127.0.0.1:9"],
            "max_steps": 1, "output": str(tmp_path / "run"), "report_to": "none", "progress": False}
    from posttrain.rollout import factory

    with pytest.raises(ConfigError, match="weight_transport: got 'rdma'; use filesystem, gloo or nccl"):
        factory.check(Config.from_flat({**base, "weight_transport": "rdma"}), episodes=False)  # the registry's names
    with pytest.raises(ConfigError, match="weight_sync_address: got 'trainer:http'; use HOST or HOST:PORT"):
        Config.from_flat({**base, "weight_sync_address": "trainer:http"})
    with pytest.raises(ConfigError, match="weight_transport: nccl sends the weights from the trainer's GPU"):
        posttrain.train(Config.from_flat({**base, "weight_transport": "nccl", "device": "cpu"}))
