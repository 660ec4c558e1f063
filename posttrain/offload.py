"""A frozen model whose weights leave memory between its passes: the offloaded reference model.

A full fine-tune's reference model is a second copy of the weights, read once or twice per step
(the reference log-probs) and never changed (except by ``ref_refresh_every``). With
``--offload-reference`` (:func:`offload`) its parameters are emptied after each use and filled
again for the next, from a store outside the training device's memory:

- **on the CPU, a file** (:class:`FileStore`): the weights' bytes are written once to an unlinked
  temporary file; each pass reads them into fresh tensors, which are freed when it ends. The kernel
  keeps the file in its page cache while memory allows (a read is then a copy at memory speed) and
  drops it under pressure, rereading from disk; either way it is not the process's memory.
- **on an accelerator, host memory** (:class:`HostStore`): pinned CPU copies, copied to the device
  for each pass (what OpenRLHF's ``--ref_offload`` and verl's reference ``param_offload`` do).

The reference passes run while the gradient is unset (the previous optimizer step freed it), and
the gradient then takes over the memory the reference's weights leave, so the step's peak loses one
copy of the weights: a GRPO step on SmolLM2 with micro-batches of one group and gradient
checkpointing peaks at 2.76-2.96 GB with it, 3.25 GB without (``benchmarks/memory.py``), for one
read of 0.5 GB per step (about 65 ms from the page cache). The math is untouched: the same bytes
come back for every pass, and log-probs and updates are bit-identical to a resident reference's
(tested).

Every use of the reference is inside :func:`resident`; nested uses load once.
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


def _bytes_of(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable buffer (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


ALIGN = 64
"""Byte alignment of each tensor in a :class:`FileStore` file (any dtype's, and a cache line)."""


class FileStore:
    """Tensors' bytes in one unlinked temporary file (in ``TMPDIR``, or ``POSTTRAIN_OFFLOAD_DIR``), read
    back into fresh tensors.

    Read, not memory-mapped, and one allocation per tensor: the gradient's memory is free while the
    reference runs (the optimizer step unsets it), and tensors of the gradient's very shapes take it
    over, so the reference pass adds nothing to the peak. The pages of a map would count on top of
    that free memory (measured on SmolLM2: 3.26 GB at the peak, against 2.76-2.96 read), and a single
    0.5 GB buffer fits none of the free blocks (3.45 GB).
    """

    def __init__(self, directory: str | None = None):
        self.directory = directory or tempfile.gettempdir()
        # unlinked at once: the file is gone when it is closed, with the store (the model) at the latest
        self.file = tempfile.TemporaryFile(prefix="posttrain-reference-", dir=self.directory)
        weakref.finalize(self, self.file.close)
        self.entries: list[tuple[int, torch.Size, torch.dtype]] = []
        self.size = 0

    def write(self, tensors: list[Tensor]) -> None:
        entries, offset = [], 0
        for tensor in tensors:
            entries.append((offset, tensor.shape, tensor.dtype))
            offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        try:
            self.file.truncate(offset)
            for (start, _, _), tensor in zip(entries, tensors):
                os.pwrite(self.file.fileno(), _bytes_of(tensor.detach().cpu().contiguous()), start)
        except OSError as error:
            raise OSError(f"offload_reference: writing the reference weights to a temporary file in "
                          f"{self.directory} failed ({error}); free space there or set POSTTRAIN_OFFLOAD_DIR"
                          ) from error
        self.entries, self.size = entries, offset

    def read(self, device: torch.device) -> list[Tensor]:
        tensors = []
        for offset, shape, dtype in self.entries:
            tensor = torch.empty(shape, dtype=dtype)
            buffer, done = _bytes_of(tensor), 0
            while done < len(buffer):  # one read returns at most about 2 GB on Linux
                got = os.preadv(self.file.fileno(), [buffer[done:]], offset + done)
                if got == 0:
                    raise OSError(f"offload_reference: the temporary file in {self.directory} ends after "
                                  f"{offset + done} of the {self.size} bytes written; it was truncated")
                done += got
            tensors.append(tensor.to(device))
        return tensors


class HostStore:
    """Pinned host copies (where pinning is available), copied to the device for each pass."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def write(self, tensors: list[Tensor]) -> None:
        pin = torch.cuda.is_available()
        self.tensors = [t.detach().to("cpu", copy=True).pin_memory() if pin else t.detach().to("cpu", copy=True)
                        for t in tensors]

    def read(self, device: torch.device) -> list[Tensor]:
        return [t.to(device, non_blocking=True) for t in self.tensors]


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
    store = FileStore(os.environ.get("POSTTRAIN_OFFLOAD_DIR")) if next(model.parameters()).is_cpu else HostStore()
    model.posttrain_offloaded = Offloaded(model, store)
    return model


def check(offload_reference: bool, needs_reference: bool, algorithm: str) -> None:
    """A ConfigError for ``--offload-reference`` where the preset runs no reference model."""
    from posttrain.config import ConfigError

    if offload_reference and not needs_reference:
        raise ConfigError(f"offload_reference: {algorithm} as configured runs no reference model (its loss has no "
                          "reference term, or its KL coefficient is 0): nothing to offload; drop --offload-reference")


def resident(model: Any, write: bool = False) -> contextlib.AbstractContextManager:
    """A context in which ``model``'s weights are in place; nothing to do for a model that is not offloaded
    (or None). ``write=True``: changes made to the weights in the block are kept."""
    offloaded = getattr(model, "posttrain_offloaded", None)
    return offloaded.resident(write) if offloaded is not None else contextlib.nullcontext()
