"""Parallel: processes, sharding and memory.

Data parallelism over processes (:mod:`.distributed`), fully sharded parameters (:mod:`.fsdp`),
offloading state between its uses (:mod:`.offload`), and the allocator setting that keeps freed memory
in the process (:mod:`.allocator`). Knows nothing of algorithms or data.
"""
