"""Rollout servers for real: ``posttrain serve`` processes on loopback (vLLM's CPU build, ``make vllm``), sampled
from and synced by :class:`~posttrain.rollout.remote.RemoteGenerator` as a training run does.

Marked ``vllm`` (``make test-vllm``): each server takes seconds to start. The model is a small random Llama
(head size 64) in fp32 on both sides, so the servers' greedy samples must be the policy's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (make vllm, then make test-vllm)")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir) -> Path:
    return vllm_model_dir


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A ``posttrain serve`` process in its own process group: vLLM's engine and worker are its children."""
    port = free_port()
    # on a GPU the trainer and two servers share one device: each server takes a quarter of its memory (vLLM's
    # default, 0.9, would leave nothing for the other two); on a CPU the flag is vLLM's and unused
    sized = ["--gpu-memory-utilization", "0.25"] if torch.cuda.is_available() else []
    process = subprocess.Popen([sys.executable, "-m", "posttrain", "serve", "--model", str(model_dir), "--port",
                                str(port), "--dtype", "float32", "--max-model-len", "128", *sized],
                               stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def kill(process: subprocess.Popen) -> None:
    """Kill a server as a crash would, engine and worker processes too (killing only the API server's
    process leaves them running, holding the model and its KV cache)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Two servers of the same model (the tests that kill one start their own)."""
    logs = tmp_path_factory.mktemp("server-logs")
    started = [start_server(model_dir, logs / f"server{k}.log") for k in range(2)]
    yield [url for _, url in started]
    for process, _ in started:
        kill(process)


def make_generator(model_dir, urls, weights_dir, num_new=12, transport="filesystem"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.remote import CollectiveWeights, FilesystemWeights, RemoteGenerator

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = RemoteGenerator(policy, tokenizer, SamplingParams(num_new, 1.0, 1.0, 0), [tokenizer.eos_token_id],
                                list(urls), FilesystemWeights(weights_dir) if transport == "filesystem"
                                else CollectiveWeights(transport), timeout_s=600)  # a loaded machine starts servers slowly
    return policy, tokenizer, generator


def prompts(tokenizer, n=6) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(f"{k}{k + 3}+{2 * k}=")["input_ids"]) for k in range(n)]


def hf_greedy(policy, tokenizer, ids) -> list[list[int]]:
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import make_generator as local

    out = local("hf", policy, tokenizer, SamplingParams(12, 1.0, 1.0, 0), [tokenizer.eos_token_id]).generate(
        ids, num_samples=1, greedy=True)
    return [row[mask.bool()].tolist() for row, mask in zip(out.completion_ids, out.mask)]


def greedy(generator, ids) -> list[list[int]]:
    out = generator.generate(ids, num_samples=1, greedy=True)
    return [row[mask.bool()].tolist() for row, mask in zip(out.completion_ids, out.mask)]


def version_of(url: str) -> int:
    request = urllib.request.Request(url + "/collective_rpc", data=json.dumps({"method": "posttrain_version"}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    return int(json.loads(urllib.request.urlopen(request, timeout=30).read())["results"][0])


def generated_tokens(url: str) -> float:
    """The tokens the server has generated since it started (vLLM's ``/metrics``)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def test_servers_sample_what_the_policy_would_and_follow_each_sync(model_dir, servers, tmp_path):
    policy, tokenizer, generator = make_generator(model_dir, servers, tmp_path / "weights")
    ids = prompts(tokenizer)
    assert greedy(generator, ids) == hf_greedy(policy, tokenizer, ids)  # prompts shared by the two servers
    assert [version_of(url) for url in servers] == [0, 0]
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    after = greedy(generator, ids)
    assert after == hf_greedy(policy, tokenizer, ids)
    assert [version_of(url) for url in servers] == [1, 1]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000000", "v000001"]


@pytest.mark.parametrize("transport", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="nccl sends from a GPU (scripts/gpu_check.sh runs it)"))])
def test_weights_sent_over_a_group_are_followed_as_a_file_is(model_dir, servers, tmp_path, transport):
    """gloo and nccl: no file; each server joins the trainer's group once and loads what it is sent."""
    policy, tokenizer, generator = make_generator(model_dir, servers, tmp_path / "weights", transport=transport)
    ids = prompts(tokenizer)
    for _ in range(2):
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        assert greedy(generator, ids) == hf_greedy(policy, tokenizer, ids)
    assert len(generator.transport.groups) == 2 and not (tmp_path / "weights").exists()


def test_sampled_logprobs_are_the_policys(model_dir, servers, tmp_path):
    from posttrain.models.logprobs import probe_logprobs

    policy, tokenizer, generator = make_generator(model_dir, servers, tmp_path / "weights")
    ids = prompts(tokenizer, 3)
    out = generator.generate(ids, num_samples=4)
    assert out.completion_ids.shape[0] == 12
    for row in range(12):
        prompt, n = ids[row // 4], int(out.mask[row].sum())
        recomputed = probe_logprobs(policy, torch.cat([prompt, out.completion_ids[row, :n]]))[len(prompt) - 1:]
        torch.testing.assert_close(out.sampling_logprobs[row, :n], recomputed.float(), atol=2e-3, rtol=0)


def test_a_paused_server_holds_requests_until_it_resumes(servers):
    url = servers[0]
    post = lambda path, body=None: urllib.request.urlopen(urllib.request.Request(  # noqa: E731
        url + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"},
        method="POST"), timeout=60).read()
    post("/pause?mode=keep")
    done = threading.Event()
    threading.Thread(target=lambda: (post("/v1/completions", {"prompt": [1, 4, 5], "max_tokens": 4}), done.set()),
                     daemon=True).start()
    assert not done.wait(3.0)  # held while paused
    post("/resume")
    assert done.wait(300.0)


def test_a_killed_server_loses_no_samples_and_none_left_is_a_clear_error(model_dir, tmp_path):
    from posttrain.rollout.remote import RolloutServerError

    started = [start_server(model_dir, tmp_path / f"server{k}.log") for k in range(2)]
    try:
        policy, tokenizer, generator = make_generator(model_dir, [url for _, url in started], tmp_path / "weights")
        ids = prompts(tokenizer)
        expected = hf_greedy(policy, tokenizer, ids)
        kill(started[0][0])
        assert greedy(generator, ids) == expected  # its shard went to the other server
        assert list(generator.dead) == [started[0][1]] and "unreachable" in generator.dead[started[0][1]]
        kill(started[1][0])
        with pytest.raises(RolloutServerError, match="no rollout server is left: http://127.0.0.1:"):
            generator.generate(ids, num_samples=1, greedy=True)
    finally:
        for process, _ in started:
            kill(process)


def test_a_restarted_trainer_publishes_its_weights_before_it_samples(model_dir, servers, tmp_path):
    policy, tokenizer, generator = make_generator(model_dir, servers, tmp_path / "first")
    with torch.no_grad():
        for param in policy.parameters():
            param.mul_(0.7)
    greedy(generator, prompts(tokenizer))  # the servers now hold the first trainer's weights
    restarted, tokenizer, generator = make_generator(model_dir, servers, tmp_path / "second")  # the checkpoint's
    ids = prompts(tokenizer)
    assert greedy(generator, ids) == hf_greedy(restarted, tokenizer, ids)


def test_train_with_rollout_servers(model_dir, servers, tmp_path):
    import posttrain
    from posttrain.config import Config
    from posttrain.tracking.metrics import read_metrics

    config = Config.from_flat({"model": str(model_dir), "task": "addition", "rollout_server": servers,
                               "max_steps": 2, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 8,
                               "eval_size": 0, "eval_every": 0, "output": str(tmp_path / "run"), "progress": False,
                               "report_to": "none"})
    posttrain.train(config)
    steps = [row for row in read_metrics(tmp_path / "run") if "mismatch/kl_k3" in row]
    assert len(steps) == 2 and all(row["mismatch/kl_k3"] < 1e-6 and row["sync/logprob_gap"] < 1e-4 for row in steps)
    assert len(list((tmp_path / "run" / "weights").glob("v*"))) == 2  # the last two versions kept


def test_train_with_asynchronous_rollouts_on_servers(model_dir, servers, tmp_path):
    """async_rollout: the servers sample one step ahead while the trainer trains; the weights go over gloo."""
    import posttrain
    from posttrain.config import Config
    from posttrain.tracking.metrics import read_metrics

    config = Config.from_flat({"model": str(model_dir), "task": "addition", "rollout_server": servers,
                               "async_rollout": True, "max_staleness": 1, "weight_transport": "gloo",
                               "max_steps": 3, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 8,
                               "eval_size": 0, "eval_every": 0, "output": str(tmp_path / "run"), "progress": False,
                               "report_to": "none"})
    posttrain.train(config)
    steps = [row for row in read_metrics(tmp_path / "run") if "staleness/max" in row]
    assert [row["staleness/max"] for row in steps] == [0, 1, 1]
    assert all(row["mismatch/kl_k3"] < 1e-6 and row["sync/logprob_gap"] < 1e-4 for row in steps)


def test_partial_rollouts_abort_a_servers_request_and_continue_its_rows_under_the_newer_weights(
        model_dir, servers, tmp_path):
    """Asynchronous rollouts with ``partial``: request A is sampling on a server when B brings newer weights; the
    server aborts A, loads them, and A's rows go on from their own tokens. Greedy, so each row is the old
    policy's tokens up to its switch and the new policy's continuation of them after it, token for token.
    Where the abort lands depends on the machine's speed: up to three tries, each checked, until one catches
    a row mid-way."""
    import copy
    import time

    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import make_generator as local
    from posttrain.rollout.worker import Request, ThreadRolloutWorker

    budget = 100
    policy, tokenizer, generator = make_generator(model_dir, servers[:1], tmp_path / "weights", num_new=budget)
    new = copy.deepcopy(policy)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids, eos = prompts(tokenizer), [tokenizer.eos_token_id]

    def continuation(model, prompt, prefix, n):
        out = local("hf", model, tokenizer, SamplingParams(n, 1.0, 1.0, 0), eos).generate(
            [torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])], num_samples=1, greedy=True)
        return out.completion_ids[0, out.mask[0].bool()].tolist()

    for _ in range(3):
        worker_copy = copy.deepcopy(policy)
        worker = ThreadRolloutWorker(generator.for_model(worker_copy), worker_copy, rng_state=torch.get_rng_state(),
                                     partial=True)
        try:
            start = generated_tokens(servers[0])
            worker.submit(Request(0, 0, ids, num_samples=1, greedy=True))
            deadline = time.monotonic() + 120
            while generated_tokens(servers[0]) <= start and time.monotonic() < deadline:
                time.sleep(0.005)  # until A's first tokens are out
            worker.submit(Request(1, 1, ids[:2], num_samples=1, greedy=True,
                                  weights={name: p.detach().clone() for name, p in new.named_parameters()}))
            a, b = worker.receive(), worker.receive()
        finally:
            worker.close()
        switched = False
        for r, prompt in enumerate(ids):
            length = int(a.completions.lengths[r])
            versions = a.completions.token_versions[r, :length].tolist()
            n_old = versions.count(0)
            assert versions == [0] * n_old + [1] * (length - n_old)
            tokens = a.completions.completion_ids[r, :length].tolist()
            assert tokens[:n_old] == continuation(policy, prompt, [], budget)[:n_old]
            if n_old < length:
                assert tokens[n_old:] == continuation(new, prompt, tokens[:n_old], budget - n_old)
            switched |= 0 < n_old < length
        assert (b.completions.token_versions[b.completions.mask > 0] == 1).all()
        if switched:
            break
    assert switched, "no row was caught mid-way in three tries"
