"""posttrain's steps of the SmolLM2 recipe on replayed completions, under chosen settings, with an optional
profile: where a step's time goes.

    .venv/bin/python benchmarks/recipe_step.py                                   # the recipe's settings
    .venv/bin/python benchmarks/recipe_step.py --set trim_padding=false --set share_prompts=false \\
        --set micro_batch_size=16 --set max_tokens_per_micro_batch=null          # the padded reference
    .venv/bin/python benchmarks/recipe_step.py --profile                         # torch.profiler's table
    .venv/bin/python benchmarks/recipe_step.py --compile                         # the layers' MLPs and norms compiled

The replay and the session are ``benchmarks/run.py``'s ``grpo-smollm2-recipe`` (the same prompts and
completions, sampled once and cached); this runs one warm-up step, then ``--steps`` timed ones, in this
process, and prints each step's time, its tokens and the rate of its products (LoRA's: 4 FLOPs a frozen weight a
token) against a 1024^3 matmul's rate measured in the same process after the warm-up: the step's time over
what its products would take at that rate is its distance from the matmul floor. ``--set FIELD=VALUE``
overrides a config field (a YAML value; quote strings that YAML reads otherwise: ``'mixed_precision="no"'``). For comparisons that matter use
``run.py``, which runs each system in a fresh process, several times.

``--compile`` measures what fusing the elementwise work around the products would give: each decoder layer's
MLP and RMSNorms through ``torch.compile`` (inductor, dynamic shapes), attention left as it runs (its packed
pieces are a Python loop over the layout). The warm-up step's time includes the compilation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run  # noqa: E402  # benchmarks/run.py: the replay and the recipe's settings


def matmul_rate(dtype: torch.dtype, repeats: int = 3) -> float:
    """FLOP/s of a 1024^3 matmul in ``dtype``, the best of ``repeats`` runs of ten: the floor's rate."""
    x, y = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            x @ y
        best = min(best, time.perf_counter() - start)
    return 10 * 2 * 1024**3 / best


def compile_mlps_and_norms(model: torch.nn.Module) -> None:
    """``torch.compile`` every decoder layer's MLP and its two RMSNorms, one graph for all layers.

    posttrain gives each LoRA linear its fused forward on the instance
    (:func:`posttrain.models.lora.fuse_adapter_products`); dynamo guards on that object, so each layer
    would compile again and the eighth recompilation would leave the rest eager. Here the same forward
    moves to a subclass shared by every layer: the same products."""
    from peft.tuners.lora.layer import Linear

    from posttrain.models.architecture import decoder_body
    from posttrain.models.lora import fused_lora_forward

    class FusedLoraLinear(Linear):
        forward = fused_lora_forward

    for module in model.modules():
        if type(module) is Linear and "forward" in vars(module):
            del module.forward
            module.__class__ = FusedLoraLinear
    for layer in decoder_body(model).layers:
        for module in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            module.compile(dynamic=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up (at most 3)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--profile", action="store_true", help="profile one step instead of timing")
    parser.add_argument("--compile", action="store_true", help="torch.compile each layer's MLP and norms")
    args = parser.parse_args()

    from posttrain.parallel.allocator import keep_freed_memory

    keep_freed_memory()  # the heap setting every posttrain train runs with

    from posttrain.models.compute import autocast_dtype
    from posttrain.training.online import train_step

    b = run.BENCHES["grpo-smollm2-recipe"]
    total = b.warmup + b.steps
    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    with tempfile.TemporaryDirectory() as data:
        s = run.replay_session(b, Path(data), total, **overrides)
        if args.compile:
            compile_mlps_and_norms(s.policy)
        start = time.perf_counter()
        train_step(s)  # warm-up
        s.step += 1
        print(f"warm-up step: {time.perf_counter() - start:.1f} s", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                train_step(s)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            return
        rate = matmul_rate(autocast_dtype(s.policy) or torch.float32)  # the layers' products' dtype
        print(f"matmul 1024^3 in this process: {rate / 1e9:.0f} GFLOP/s; load average {os.getloadavg()[0]:.1f}",
              flush=True)
        layers = sum(p.numel() for n, p in s.policy.named_parameters() if ".layers." in n and "lora_" not in n)
        head = s.policy.get_output_embeddings().weight.numel()
        for _ in range(min(args.steps, total - 1)):
            start = time.perf_counter()
            metrics = train_step(s)
            s.step += 1
            seconds = time.perf_counter() - start
            g = s.last_groups
            completion_tokens = int(g.completions.mask.sum())
            prompt_tokens = sum(len(p) for p in g.prompt_ids[::g.group_size])  # a group's prompt, passed once
            # the products of a LoRA (frozen-weight) pass: forward and the activations' backward, 2 + 2 FLOPs a
            # weight a token for the layers, the LM head at the scored (completion) tokens only
            flops = 4 * layers * (prompt_tokens + completion_tokens) + 4 * head * completion_tokens
            print(f"step {s.step}: {seconds:.2f} s ({metrics['time/training']:.2f} s training); "
                  f"{prompt_tokens} prompt + {completion_tokens} completion tokens; "
                  f"{flops / 1e12:.2f} TFLOP of products, {flops / metrics['time/training'] / 1e9:.0f} GFLOP/s: "
                  f"{metrics['time/training'] * rate / flops:.2f}x the matmul floor", flush=True)


if __name__ == "__main__":
    main()
