"""RemoteGenerator's protocol without vLLM: stand-in servers on loopback that speak the endpoints a ``posttrain
serve`` server answers (tests/test_rollout_server.py runs real ones, with vLLM). What runs here, in the
default suite: the publish-pause-load-resume sequence and its version check, prompts shared across servers
in order, a dead server's prompts re-sent to another, and the errors when none is left or none starts."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.rollout.completions import SamplingParams
from posttrain.rollout.remote import FilesystemWeights, RemoteGenerator, RolloutServerError
from posttrain.rollout.vllm_worker import WEIGHTS_FILE


class StandIn:
    """A server that answers each prompt's sample ``j`` with the tokens ``[first prompt token, j, EOS]``, and
    records what it was asked; ``loads`` the version it reports (``wrong_version``: one off)."""

    def __init__(self, eos: int, wrong_version: bool = False, failing: bool = False):
        self.eos, self.wrong_version, self.failing, self.calls, self.prompts = eos, wrong_version, failing, [], []
        self.version = -1
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stand_in.calls.append(self.path)
                self.reply({})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                stand_in.calls.append(self.path.split("?")[0])
                if self.path == "/collective_rpc":
                    path, version = body["args"]
                    assert (Path(path) / WEIGHTS_FILE).is_file()
                    stand_in.version = int(version) + (1 if stand_in.wrong_version else 0)
                    self.reply({"results": [str(stand_in.version)]})
                elif self.path == "/v1/completions" and stand_in.failing:  # its engine died mid-rollout
                    self.send_error(500, "EngineDeadError")
                elif self.path == "/v1/completions":
                    stand_in.prompts += body["prompt"]
                    choices = [{"index": i * body["n"] + j, "token_ids": [prompt[0], j, stand_in.eos],
                                "logprobs": {"token_logprobs": [-0.5, -0.25, -0.125]}, "finish_reason": "stop"}
                               for i, prompt in enumerate(body["prompt"]) for j in range(body["n"])]
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
