"""The allocator setting is applied in a child process (it is process-wide) and can be opted out of."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from posttrain.allocator import keep_freed_memory
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
