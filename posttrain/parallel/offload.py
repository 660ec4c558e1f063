"""Offloading: state that a step uses once leaves memory between its uses.

Two pieces of a full fine-tune's memory are each used once per step: the reference model (a second
copy of the weights, read for the reference log-probs) and AdamW's two moments (two more copies,
read and written by the optimizer step). Both can live outside the training device's memory:

- **on the CPU, in a file** (:class:`FileStore`): an unlinked temporary file, read into fresh
  tensors for each use. The kernel keeps it in its page cache while memory allows (a read is then a
  copy at memory speed) and drops it under pressure, rereading from disk; either way it is not the
  process's memory.
- **on an accelerator, in host memory** (:class:`HostStore`): pinned CPU copies, copied to the
  device for each use (what OpenRLHF's ``--ref_reward_offload`` and ``--adam_offload`` and verl's
  ``param_offload``/``optimizer_offload`` do). Not run on a GPU yet.

``--offload-reference`` (:func:`offload`, :func:`resident`): the reference's parameters are emptied
after each pass and filled again for the next; every use of the reference sits in
:func:`resident` (nested uses read once). The passes run while the gradient is unset (the previous
optimizer step freed it), and the gradient then takes over the memory the weights leave.

``--offload-optimizer`` (:class:`OffloadedAdamW`): AdamW stepped one parameter at a time, each
parameter's moments read in before its step and written out after, its gradient freed once applied.

Each offload lowers a step's peak memory for some time per step: the reference costs one read of its
weights a step, the moments a read and a write of theirs. ``benchmarks/memory.py`` measures it;
benchmarks/RESULTS.md has the figures. The math is untouched: the same bytes come back, and
log-probs, updates and checkpoints are bit-identical to resident state's (tested).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.config import ConfigError


def _bytes_of(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable buffer (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


ALIGN = 64
"""Byte alignment of each tensor in a :class:`FileStore` file (any dtype's, and a cache line)."""


class FileStore:
    """Tensors' bytes in one unlinked temporary file (in ``TMPDIR``, or ``POSTTRAIN_OFFLOAD_DIR``), read
    back into fresh tensors.

    Read, not memory-mapped, and one allocation per tensor: the reference is read while the
    gradient's memory is free, and tensors of the gradient's very shapes take it over, so the pass
    adds nothing to the peak. The pages of a map would count on top of that free memory, and a
    single buffer for all the tensors fits none of the free blocks: both peak higher
    (benchmarks/RESULTS.md).
    """

    def __init__(self, directory: str | None = None):
        self.directory = directory or tempfile.gettempdir()
        # unlinked at once: the file is gone when it is closed, with the store (the model) at the latest
        self.file = tempfile.TemporaryFile(prefix="posttrain-offload-", dir=self.directory)
        weakref.finalize(self, self.file.close)
        self.entries: list[tuple[int, torch.Size, torch.dtype]] = []
        self.size = 0

    def layout(self, specs: list[tuple[torch.Size, torch.dtype]]) -> None:
        """Room for tensors of these shapes and dtypes; until written, they read as zeros (a sparse file)."""
        entries, offset = [], 0
        for shape, dtype in specs:
            entries.append((offset, torch.Size(shape), dtype))
            offset += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGN) * ALIGN
        self._io(self.file.truncate, offset)
        self.entries, self.size = entries, offset

    def write(self, tensors: list[Tensor]) -> None:
        self.layout([(t.shape, t.dtype) for t in tensors])
        for i, tensor in enumerate(tensors):
            self.write_at(i, tensor)

    def write_at(self, i: int, tensor: Tensor) -> None:
        offset, shape, dtype = self.entries[i]
        if (tensor.shape, tensor.dtype) != (shape, dtype):
            raise ValueError(f"offload: entry {i} holds {tuple(shape)} {dtype}, "
                             f"not {tuple(tensor.shape)} {tensor.dtype}")
        self._io(os.pwrite, self.file.fileno(), _bytes_of(tensor.detach().cpu().contiguous()), offset)

    def read(self, device: torch.device) -> list[Tensor]:
        return [self.read_at(i, device) for i in range(len(self.entries))]

    def read_at(self, i: int, device: torch.device) -> Tensor:
        offset, shape, dtype = self.entries[i]
        tensor = torch.empty(shape, dtype=dtype)
        buffer, done = _bytes_of(tensor), 0
        while done < len(buffer):  # one read returns at most about 2 GB on Linux
            got = self._io(os.preadv, self.file.fileno(), [buffer[done:]], offset + done)
            if got == 0:
                raise OSError(f"offload: the temporary file in {self.directory} ends after {offset + done} of "
                              f"the {self.size} bytes written; it was truncated")
            done += got
        return tensor.to(device)

    def _io(self, call, *args):
        try:
            return call(*args)
        except OSError as error:
            raise OSError(f"offload: reading or writing the temporary file in {self.directory} failed ({error}); "
                          "free space there or set POSTTRAIN_OFFLOAD_DIR to another directory") from error


class HostStore:
    """Host copies (pinned where CUDA is available), copied to the device when read."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def layout(self, specs: list[tuple[torch.Size, torch.dtype]]) -> None:
        pin = torch.cuda.is_available()  # pinned: copies to and from the device run at full speed
        self.tensors = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in specs]

    def write(self, tensors: list[Tensor]) -> None:
        self.layout([(t.shape, t.dtype) for t in tensors])
        for i, tensor in enumerate(tensors):
            self.write_at(i, tensor)

    def write_at(self, i: int, tensor: Tensor) -> None:
        held = self.tensors[i]
        if (tensor.shape, tensor.dtype) != (held.shape, held.dtype):
            raise ValueError(f"offload: entry {i} holds {tuple(held.shape)} {held.dtype}, "
                             f"not {tuple(tensor.shape)} {tensor.dtype}")
        held.copy_(tensor.detach())  # blocking: the source may be freed right after

    def read(self, device: torch.device) -> list[Tensor]:
        return [self.read_at(i, device) for i in range(len(self.tensors))]

    def read_at(self, i: int, device: torch.device) -> Tensor:
        return self.tensors[i].to(device, non_blocking=True)


def new_store(device: torch.device) -> FileStore | HostStore:
    """A file in ``POSTTRAIN_OFFLOAD_DIR`` (else ``TMPDIR``) for CPU tensors, host memory for an accelerator's."""
    return FileStore(os.environ.get("POSTTRAIN_OFFLOAD_DIR")) if device.type == "cpu" else HostStore()


class Offloaded:
    """The parameters of ``model`` (each once, tied ones included) kept in ``store`` while not in use."""

    def __init__(self, model: nn.Module, store: FileStore | HostStore):
        self.params = list(model.parameters())  # deduplicated: a tied embedding and head are one entry
        if any(p.requires_grad for p in self.params):
            raise ValueError("offload: the model must be frozen (requires_grad False): it is a reference model")
        self.device = self.params[0].device
        self.store, self.depth = store, 0
        store.write([p.data for p in self.params])
        self._release()

    def _release(self) -> None:
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)

    @contextlib.contextmanager
    def resident(self, write: bool = False) -> Iterator[None]:
        """The weights in place for the block; ``write``: the block changes them, and the store keeps that."""
        if self.depth == 0:
            for p, tensor in zip(self.params, self.store.read(self.device)):
                p.data = tensor
        self.depth += 1
        try:
            yield
            if write:
                self.store.write([p.data for p in self.params])
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._release()


def offload(model: nn.Module) -> nn.Module:
    """Move the weights of frozen ``model`` out of memory until :func:`resident` asks for them: to a
    file on the CPU, to host memory on an accelerator. Returns ``model`` (its parameters now empty)."""
    model.posttrain_offloaded = Offloaded(model, new_store(next(model.parameters()).device))
    return model


def check(offload_reference: bool, needs_reference: bool, algorithm: str) -> None:
    """A ConfigError for ``--offload-reference`` where the preset runs no reference model."""
    if offload_reference and not needs_reference:
        raise ConfigError(f"offload_reference: {algorithm} as configured runs no reference model (its loss has no "
                          "reference term, or its KL coefficient is 0): nothing to offload; drop --offload-reference")


def resident(model: Any, write: bool = False) -> contextlib.AbstractContextManager:
    """A context in which ``model``'s weights are in place; nothing to do for a model that is not offloaded
    (or None). ``write=True``: changes made to the weights in the block are kept."""
    offloaded = getattr(model, "posttrain_offloaded", None)
    return offloaded.resident(write) if offloaded is not None else contextlib.nullcontext()


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW whose two moments live in a store between steps (a file on the CPU, host memory on a
    GPU), stepped one parameter at a time, each with its group's settings: one parameter's moments
    are in memory at once, and each parameter's gradient is freed (set to None) as soon as it is
    applied. Where the moments would be two copies of the weights through the forward and backward
    passes, they are none.

    Each parameter goes through AdamW's own step (the same fused kernel, on a one-tensor list), so
    weights and moments are bit-identical to AdamW's over the whole list (tested). ``state_dict``
    returns the moments (read back for the call); ``load_state_dict`` stores them.
    """

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        if any(group["amsgrad"] for group in self.param_groups):
            raise ValueError("OffloadedAdamW: amsgrad's third moment is not offloaded")
        self.order = [p for group in self.param_groups for p in group["params"]]
        self.index = {p: i for i, p in enumerate(self.order)}
        self.store = new_store(self.order[0].device)
        self.store.layout([(p.shape, p.dtype) for p in self.order for _ in self.MOMENTS])

    def _load(self, p: Tensor) -> None:
        state = self.state[p]
        if state:  # after the parameter's first step; before it, AdamW creates zeros itself
            for k, name in enumerate(self.MOMENTS):
                state[name] = self.store.read_at(2 * self.index[p] + k, p.device)

    def _release(self, p: Tensor, write: bool) -> None:
        state = self.state[p]
        for k, name in enumerate(self.MOMENTS):
            if write:
                self.store.write_at(2 * self.index[p] + k, state[name])
            state[name] = torch.empty(0, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        # AdamW's step walks every group: all but the current parameter's group are emptied meanwhile
        # (another group's parameters would be stepped with released moments)
        lists = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = []
            for group, params in zip(self.param_groups, lists):
                for p in params:
                    if p.grad is None:
                        continue
                    group["params"] = [p]
                    self._load(p)
                    super().step()
                    self._release(p, write=True)
                    p.grad = None  # applied: its memory is free before the next parameter's moments arrive
                group["params"] = []
        finally:
            for group, params in zip(self.param_groups, lists):
                group["params"] = params
        return None

    def state_dict(self) -> dict[str, Any]:
        stepped = [p for p in self.order if self.state[p]]
        for p in stepped:
            self._load(p)
        try:
            packed = super().state_dict()
            packed["state"] = {key: dict(value) for key, value in packed["state"].items()}  # keeps the tensors read
        finally:
            for p in stepped:
                self._release(p, write=False)
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p in self.order:
            if self.state[p]:
                self._release(p, write=True)
