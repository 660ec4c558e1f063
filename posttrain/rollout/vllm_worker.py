"""What ``posttrain serve`` adds to each vLLM worker (``--worker-extension-cls``), and how the server is launched.

vLLM mixes an extension class into its worker; its methods are called by name through the server's
``/collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), with string arguments. :class:`WeightSync` loads the
weights a trainer published (:mod:`posttrain.rollout.remote`), in the base model's names: a directory of
safetensors files, or tensors the trainer broadcasts over a group the worker joined. Either is loaded in
place as the colocated backend loads its weights (:func:`posttrain.rollout.vllm.reload_in_place`), and
their version remembered, which the server reports.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"
"""The file a published version holds (the base model's parameter names, merged under LoRA)."""


class WeightSync:
    """Mixed into vLLM's worker: ``posttrain_load(path, version)`` (a published file), ``posttrain_join`` and
    ``posttrain_receive`` (weights broadcast by the trainer), ``posttrain_version()``."""

    def posttrain_load(self, path: str, version: str) -> str:
        """Load the weights published at ``path`` (a directory holding :data:`WEIGHTS_FILE`) in place."""
        from safetensors.torch import load_file

        from posttrain.rollout.vllm import reload_in_place

        runner: Any = self.model_runner  # type: ignore[attr-defined]  # the worker's, once mixed in
        weights = load_file(str(Path(path) / WEIGHTS_FILE), device=str(next(runner.get_model().parameters()).device))
        reload_in_place(runner, list(weights.items()))
        self.posttrain_weight_version = int(version)
        return version

    def posttrain_join(self, address: str, prefix: str, backend: str, timeout_s: str) -> str:
        """Join the trainer's two-member group (rank 1) at ``address`` (its store) under ``prefix``: the
        weights' channel of :class:`posttrain.rollout.remote.CollectiveWeights`. A trainer that restarts
        calls again with its own prefix; the old group is let go."""
        import datetime

        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False,
                                                       timeout=datetime.timedelta(seconds=float(timeout_s))))
        timeout = datetime.timedelta(seconds=float(timeout_s))
        self.posttrain_group = (dist.ProcessGroupNCCL(store, 1, 2) if backend == "nccl"
                                else dist.ProcessGroupGloo(store, 1, 2, timeout))
        return prefix

    def posttrain_receive(self, meta: str, version: str) -> str:
        """Receive the tensors ``meta`` lists (JSON ``[[name, dtype, shape], ...]``, in the order the trainer
        broadcasts them) over the joined group and load them in place."""
        import json

        import torch

        from posttrain.rollout.vllm import reload_in_place

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        device = next(runner.get_model().parameters()).device
        weights = []
        for name, dtype, shape in json.loads(meta):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            self.posttrain_group.broadcast(tensor, 0).wait()  # type: ignore[attr-defined]
            weights.append((name, tensor))
        reload_in_place(runner, weights)
        self.posttrain_weight_version = int(version)
        return version

    def posttrain_version(self) -> int:
        """The version of the weights loaded last (-1: the model's own, as the server started)."""
        return getattr(self, "posttrain_weight_version", -1)


EXTENSION = f"{__name__}.WeightSync"


def vllm_python() -> str:
    """The interpreter that has vLLM: this one, else ``POSTTRAIN_VLLM_PYTHON``, else the project's .venv-vllm."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidates = [os.environ.get("POSTTRAIN_VLLM_PYTHON", ""),
                  str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return candidate
    from posttrain.rollout.vllm import VLLM_INSTALL

    raise RuntimeError(f"serve needs vLLM, which is not installed here or in .venv-vllm: {VLLM_INSTALL}")


def serve_command(model_path: str, *, host: str, port: int, dtype: str, max_model_len: int | None, seed: int,
                  extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of vLLM's OpenAI-compatible server with posttrain's worker extension, the
    development endpoints the weight sync uses, and on a CPU the settings vLLM's CPU build wants."""
    from posttrain.rollout.vllm import CPU_ENVIRONMENT

    python = vllm_python()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", host,
            "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--worker-extension-cls", EXTENSION,
            "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs"]  # the distribution sampled from
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if not shutil.which("nvidia-smi"):
        env = {**{k: v for k, v in CPU_ENVIRONMENT.items()}, **env}
        argv += ["--enforce-eager"]
    return argv + extra, env
