"""Keep freed memory in the process instead of returning it to the kernel (glibc malloc).

With glibc's defaults every allocation above a (dynamic, at most 32 MiB) threshold is a fresh
``mmap`` and every free an ``munmap``: a training step of a 135M-parameter model allocates and
frees its logits, activations and gradients (tens to hundreds of MiB each) every micro-batch, and
each time the kernel zero-fills the pages again on first touch. :func:`keep_freed_memory` keeps the
freed memory in the process instead: most of those page faults and much of a step's CPU time go, for
a slightly higher peak RSS (benchmarks/RESULTS.md has the figures). That is what preloading jemalloc
buys too, without a preload.

It changes a process-wide setting, so the library never calls it on import: ``posttrain.training.api``
(the CLI and ``posttrain compare``'s runs) calls it once before loading a model. Set
``POSTTRAIN_MALLOC=default`` to keep glibc's behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap (no per-allocation ``mmap``) and never trim it back
    to the kernel. Returns whether the setting was applied (glibc only; a no-op elsewhere)."""
    if os.environ.get("POSTTRAIN_MALLOC", "").lower() == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success, 0 on error
    applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**30))
    if not applied:
        logger.warning("mallopt refused the allocator settings; keeping glibc's defaults")
    return applied


KERNEL_CACHE_CAPACITY = 128
"""Entries kept in each of oneDNN's caches of compiled kernels when bfloat16 runs on the CPU."""


def bound_kernel_caches() -> None:
    """Cap oneDNN's caches of compiled bfloat16 kernels (ideep's ``LRU_CACHE_CAPACITY`` and oneDNN's
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) at :data:`KERNEL_CACHE_CAPACITY` entries, unless set already.

    Float32 products go to MKL; bfloat16 ones to oneDNN, which compiles a kernel for every new shape
    and keeps up to 1024 of them in each cache, each holding its own memory. Training batches change
    shape every micro-batch, so uncapped caches keep growing over a run, and a mixed-precision run
    peaks well above the same run in float32. Capped, a miss costs one compilation. The figures per
    CPU are in benchmarks/RESULTS.md. Both variables are read when oneDNN first runs, so this acts only
    before the process's first oneDNN product.
    """
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))
