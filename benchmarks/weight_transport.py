"""How long a rollout server's weight sync takes through each transport: the time from the trainer's
weights to a server that samples with them (publish, pause, load in place, reset the prefix cache,
resume), for a SmolLM2-135M policy and one ``posttrain serve`` process on this machine.

    make vllm
    .venv/bin/python benchmarks/weight_transport.py            # filesystem and gloo, 5 syncs each

The server runs in .venv-vllm (started and killed here, with its process group); the trainer's side runs in
this interpreter, which needs no vLLM. ``filesystem`` writes a safetensors file and the server reads it back;
``gloo`` broadcasts the tensors over TCP on loopback. Each figure is the median of ``--repeats`` syncs after
one warm-up (gloo's warm-up includes the server joining the group). The probe check is left out: it is the
same for both. Only one process besides the server should run; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", help="the server's (the trainer's weights are fp32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transports", default="filesystem,gloo")
    args = parser.parse_args()

    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.remote import CollectiveWeights, FilesystemWeights, RemoteGenerator
    from posttrain.training.session import eos_token_ids

    policy, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    size = sum(p.numel() * p.element_size() for p in policy.parameters())
    port = free_port()
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    log = open(Path(tempfile.gettempdir()) / "weight_transport_server.log", "w")
    server = subprocess.Popen([str(vllm_python), "-m", "posttrain", "serve", "--model", args.model, "--port", str(port),
                               "--dtype", args.dtype, "--max-model-len", "512"], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    print(f"{args.model}: {size / 1e6:.0f} MB of fp32 weights; server dtype {args.dtype}; {torch.get_num_threads()} "
          f"threads; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    try:
        with tempfile.TemporaryDirectory() as weights_dir:
            for name in args.transports.split(","):
                transport = (FilesystemWeights(Path(weights_dir)) if name == "filesystem"
                             else CollectiveWeights(name))
                generator = RemoteGenerator(policy, tokenizer, SamplingParams(8, 1.0, 1.0, 0),
                                            eos_token_ids(policy, tokenizer), [url], transport, timeout_s=600)
                seconds = []
                for _ in range(args.repeats + 1):
                    with torch.no_grad():
                        for param in policy.parameters():
                            param.mul_(1.0 + 1e-4)
                    start = time.perf_counter()
                    generator.sync_weights()
                    seconds.append(time.perf_counter() - start)
                median = statistics.median(seconds[1:])
                print(f"{name:10s} first {seconds[0]:.2f} s, then median {median:.2f} s "
                      f"(min {min(seconds[1:]):.2f}, max {max(seconds[1:]):.2f}); "
                      f"{size / 1e6 / median:.0f} MB/s", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
