"""The allocator setting is applied in a child process (it is process-wide) and can be opted out of."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

CHILD = """
import resource, sys, torch
from posttrain.parallel.allocator import keep_freed_memory
applied = keep_freed_memory()
def churn():
    for _ in range(20):
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB: above the largest mmap threshold glibc adapts to (32 MiB)
        del x
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults_and_the_default_can_be_kept():
    def faults(env_value):
        env = {**os.environ, "POSTTRAIN_MALLOC": env_value}
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        applied, count = out.stdout.split()
        return applied == "True", int(count)

    applied, tuned = faults("")
    kept, default = faults("default")
    assert applied and not kept
    # 20 x 64 MiB of fresh pages by default (16384 faults each); reused heap memory faults almost never
    assert default > 20 * 8000 and tuned < 1000


KERNELS_CHILD = """
import os, torch
from posttrain.parallel.allocator import bound_kernel_caches
bound_kernel_caches()
def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
weight = torch.randn(128, 64).bfloat16()
for rows in range(1, 901):  # a new shape each time: oneDNN compiles and caches a kernel for each
    torch.nn.functional.linear(torch.randn(rows, 64).bfloat16(), weight)
    if rows == 300:  # past a cap of 128 entries: a bounded cache is full and stays that size
        full = rss_mb()
print(os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], rss_mb() - full)
"""


@pytest.mark.skipif(not (platform.system() == "Linux" and torch.cpu._is_avx512_bf16_supported()),
                    reason="bfloat16 products on oneDNN need AVX512-BF16 (and /proc for the RSS)")
def test_bfloat16_kernel_caches_are_bounded_unless_set():
    def growth(**env):
        clean = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
        out = subprocess.run([sys.executable, "-c", KERNELS_CHILD], env={**clean, **env}, capture_output=True,
                             text=True, check=True)
        lru, primitives, grown = out.stdout.split()
        return lru, primitives, float(grown)

    *bounded, bounded_mb = growth()
    *kept, unbounded_mb = growth(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert bounded == ["128", "128"] and kept == ["1024", "1024"]  # a value the user set is kept
    # shapes 301-900: each adds a kernel of 0.6-0.9 MB (AVX512-BF16) or about 1.1 MB (AMX) to oneDNN's default
    # caches of 1024 entries; bounded caches are full by then and evict one per new kernel
    assert unbounded_mb > 200 and bounded_mb < 40, (bounded_mb, unbounded_mb)
