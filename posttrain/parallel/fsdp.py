"""Fully sharded data parallelism for the policy, on PyTorch's FSDP2 (``fully_shard``).

On (``--fsdp``, or ``accelerate launch`` with an FSDP config, which sets
``ACCELERATE_USE_FSDP``), every decoder layer and the whole policy become FSDP units: between
steps each of ``W`` processes holds ``1/W`` of the policy's parameters, and AdamW's state and the
reduced gradients are sharded the same way, so a full fine-tune's 16 bytes per parameter (fp32
weights, gradient, two moments) become about ``4 + 12/W`` between steps.

What stays as in the data-parallel path (``posttrain.parallel.distributed``), so the update equals the
one-process update on the whole batch (tests/test_distributed.py):

- prompts are split over processes and the loss normaliser is the whole step's;
- gradients are *summed* over processes (FSDP's default is the mean): each unit's reduce-scatter
  uses a plain sum (``set_gradient_divide_factor(1.0)``);
- a process may hold fewer rows than another, or none.

How a step runs: generation, the rollout's log-prob passes and each optimizer step's forward and
backward passes happen inside :func:`full_parameters`: the parameters are all-gathered once on
entry, every pass inside is local (processes may run different numbers of passes: generation
lengths and row counts differ), gradients accumulate unsharded, and each process's last backward
of the optimizer step (:func:`sync_gradients`) reduce-scatters them; a process with no rows runs
one zero-weighted backward (:func:`join_backward`) so the collectives pair up. Then the
parameters are resharded and AdamW steps on the shards. So during a step every process holds
the full parameters and gradient (as generation needs the full model anyway); AdamW's state,
the largest part, stays sharded throughout. docs/decisions.md, "FSDP", says why.

Checkpoints and the final model hold full, unsharded tensors in the same files as a
one-process run (:func:`full_state_dict`, :func:`full_optimizer_state`, :func:`load_state`), so a
run saved with FSDP resumes with any process count, with or without FSDP.

Not supported (refused with a ConfigError): LoRA with FSDP, CPU offload (``FSDP_OFFLOAD_PARAMS``),
the vLLM backend.
The reference model is a full copy on every process (KL presets).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.config import Config, ConfigError
from posttrain.parallel import distributed

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - the package requires a torch that has them
    FSDPModule = fully_shard = DTensor = distribute_tensor = None


def requested(config: Config) -> bool:
    """Whether the run shards the policy: ``--fsdp`` or an accelerate FSDP launch."""
    return config.model.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def check(config: Config) -> None:
    """Reject what this FSDP path does not do, naming the setting (before any model loads)."""
    if not requested(config):
        return
    if fully_shard is None:
        raise ConfigError(f"fsdp: needs torch >= 2.6 (FSDP2's fully_shard); this is torch {torch.__version__}")
    if config.model.lora_r:
        raise ConfigError("fsdp: LoRA with FSDP is not supported; train LoRA data-parallel (fsdp off), "
                          "or all weights (lora_r 0) with FSDP")
    if config.optim.offload_optimizer:
        raise ConfigError("fsdp: offload_optimizer is not supported with FSDP, which shards AdamW's state over "
                          "the processes already; drop one of the two")
    if config.rollout.backend == "vllm":
        raise ConfigError("fsdp: the vllm backend needs the full weights in every process; use backend hf with FSDP")
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "").lower() == "true":
        raise ConfigError("fsdp: CPU offload (FSDP_OFFLOAD_PARAMS in the accelerate config) is not supported; "
                          "set offload_params: false")


def shard(model: nn.Module) -> nn.Module:
    """Make each decoder layer (the model's ``_no_split_modules``) and the whole ``model`` an FSDP
    unit over all processes, with gradients summed, not averaged; in place, returned. A no-op in one
    process."""
    if distributed.world_size() == 1:
        distributed.say("FSDP: one process, nothing to shard; training unsharded")
        return model
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(model.device.type, (distributed.world_size(),))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(f"fsdp: {type(model).__name__} names no decoder-layer class (_no_split_modules), "
                          "so it cannot be sharded layer by layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in _units(model):
        unit.set_gradient_divide_factor(1.0)  # the sum over processes: the loss is already normalised globally
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-scaled sum
    distributed.say(f"FSDP: {len(layers)} decoder layers and the rest of the policy sharded over "
                    f"{distributed.world_size()} processes")
    return model


def is_sharded(model: Any) -> bool:
    return FSDPModule is not None and isinstance(model, FSDPModule)


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """Inside, every process holds ``model``'s full parameters: forward and backward passes need no
    collective, so processes may run different numbers of them. Gradients accumulate unsharded
    until a backward with :func:`sync_gradients` on. On exit the parameters are resharded (the
    full copies freed). Every process must enter together; a no-op for an unsharded model."""
    if not is_sharded(model):
        yield
        return
    units = _units(model)
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    sync_gradients(model, False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        model.set_reshard_after_forward(True)
        model.set_reshard_after_backward(True)
        sync_gradients(model, True)


def sync_gradients(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters the accumulated gradients (each process's last
    backward of an optimizer step must, and only it)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)


def join_backward(model: nn.Module) -> None:
    """A zero-weighted forward and backward on one token, for a process with no rows in an optimizer
    step: it takes part in the gradient reduce-scatter and adds nothing to the gradient. A no-op
    for an unsharded model (the gradient sum needs no pass)."""
    if not is_sharded(model):
        return
    sync_gradients(model, True)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    (model(input_ids=token).logits.sum() * 0.0).backward()


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered in full (a collective: every process
    calls it); the model's own state dict when it is not sharded. Tied weights (one parameter under
    two names) stay one tensor, so ``save_pretrained`` writes them once, as in one process."""
    first_name: dict[int, str] = {}  # a parameter's first name, by identity (tied ones have several)
    alias = {name: first_name.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}
    out: dict[str, Tensor] = {}
    for name, value in model.state_dict().items():
        same = alias.get(name, name)
        out[name] = out[same] if same in out else full_tensor(value)
    return out


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with sharded moments gathered in full: the same layout as a
    one-process run's (every process calls it)."""
    state = optimizer.state_dict()
    return {**state, "state": {index: {key: full_tensor(value) for key, value in entry.items()}
                               for index, entry in state["state"].items()}}


def load_state(own: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` (full, as saved) laid out like ``own`` (a sharded model's state dict): each process
    keeps its shard of every tensor that ``own`` holds sharded."""
    return {name: _like(own[name], value) if name in own else value for name, value in tensors.items()}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> dict[str, Any]:
    """A saved (full) optimizer state laid out for ``optimizer``'s (possibly sharded) parameters. The
    kernel choice (``fused``/``foreach``) stays ``optimizer``'s own: it is not state, and the fused
    kernel refuses sharded parameters, so a checkpoint moves between FSDP and plain runs."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kernels = [{key: group[key] for key in ("fused", "foreach") if key in group} for group in optimizer.param_groups]
    return {**state,
            "param_groups": [{**saved, **own} for saved, own in zip(state["param_groups"], kernels)],
            "state": {index: {key: _like(params[int(index)], value) if key != "step" else value
                              for key, value in entry.items()}
                      for index, entry in state["state"].items()}}


def grad_norm_and_clip(params: Sequence[nn.Parameter], max_norm: float) -> float:
    """The global gradient norm over sharded and replicated parameters; scales the gradients down to
    ``max_norm`` when it is exceeded (0: never), as ``clip_grad_norm_`` does in one process."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = sum((g.to_local().double().pow(2).sum() for g in grads if isinstance(g, DTensor)),
                  torch.zeros((), dtype=torch.float64))
    local = sum((g.double().pow(2).sum().cpu() for g in grads if not isinstance(g, DTensor)),
                torch.zeros((), dtype=torch.float64))
    norm = float((distributed.all_sum(sharded.cpu()) + local).sqrt())
    if max_norm and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


def is_sharded_parameter(param: Tensor) -> bool:
    """A parameter of an FSDP unit: its gradient is reduced by FSDP, not by ``distributed.sum_gradients``."""
    return DTensor is not None and isinstance(param, DTensor)


def _units(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def full_tensor(value: Any) -> Any:
    """A sharded tensor (DTensor) gathered in full (a collective); any other value as it is."""
    return value.full_tensor() if DTensor is not None and isinstance(value, DTensor) else value


def _like(own: Any, value: Tensor) -> Tensor:
    if DTensor is None or not isinstance(own, DTensor):
        return value
    value = value.to(device=own.device, dtype=own.dtype)
    return distribute_tensor(value, own.device_mesh, own.placements, src_data_rank=None)
