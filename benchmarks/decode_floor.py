"""The SmolLM2 recipe's sampler against what this machine's memory bandwidth allows a decode step.

    .venv/bin/python benchmarks/decode_floor.py               # the recipe: 16 prompts x 4 samples, LoRA r16
    .venv/bin/python benchmarks/decode_floor.py --profile     # and where one decode step's time goes
    .venv/bin/python benchmarks/decode_floor.py --rows 1 4 16  # and a decode step at these batch sizes too
    .venv/bin/python benchmarks/decode_floor.py --compile      # and the step through torch.compile

The layers compute in the recipe's precision, ``mixed_precision auto``: bfloat16 where the CPU has AVX512-BF16
or AMX, float32 elsewhere (``--mixed-precision bf16`` or ``no`` forces one).

The session is ``benchmarks/run.py``'s ``grpo-smollm2-recipe`` (the recipe's model and settings, the
replay's first prompts), sampling through its own generator (posttrain's decode loop and fused step).
Prints, in one process:

- the machine: read bandwidth (a sum over 512 MB of float32) and a 1024^3 matmul's rate in float32 and in
  bfloat16 (emulated, and slower, on a CPU without AVX512-BF16 or AMX);
- what one decode step must read at least: the fused step's weights in the dtype it computes them in
  (the layers in bfloat16 under bf16 mixed precision, else float32; the LM head in float32) and the KV
  cache at the step's context (float32, as the decode cache holds it), at the recipe's 64 rows;
- the floor: those bytes at the measured bandwidth, and the step's GEMM FLOPs at the layers' dtype's rate;
- the step's own matrix products at its shapes (every layer's and the LM head's, on the kernels the fused step
  prepares, weights streamed as in a step): what the step would take with nothing but its products;
- the step measured: ``(t(T) - t(1)) / (T - 1)`` with no EOS (every row runs the budget; the prefill
  cancels), at the recipe's 128 tokens (mean context prompt + 64);
- with ``--rows``, the same step at fewer rows (a prompt's samples, the first prompts), as a generate call's
  tail runs it once most rows have finished: its floor, its products alone and the step measured over 32
  tokens;
- with ``--compile``, the same step with :meth:`~posttrain.rollout.decode_step.FusedDecoder.step` through
  ``torch.compile`` (inductor, dynamic shapes; the oneDNN products as opaque calls, :func:`compiled_fused_step`),
  and the first call's time, which includes the compilation;
- the recipe's real generate call (EOS on): completion tokens per second, against the call's own floor: the
  prefill's GEMM FLOPs (each distinct prompt once, the LM head at its last position) and, for every decode
  step, the larger of its bytes and its FLOPs at the rows still running then (rows leave as they finish, so
  the tail's steps read every weight for a few rows: bound by bytes where the full batch is bound by FLOPs).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import run  # noqa: E402  # benchmarks/run.py: the recipe's session and replay

NEVER = -1
"""An EOS id no model produces: every row runs the whole budget."""


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def step_bytes(model, rows: int, context: float) -> dict[str, float]:
    """Bytes one fused decode step reads at least: its weights as it computes them, and the KV cache."""
    from posttrain.models.modeling import unwrapped
    from posttrain.models.compute import autocast_dtype
    from posttrain.rollout.decode_step import effective_weight

    base = unwrapped(model)
    layer_dtype = autocast_dtype(model) or torch.float32
    # the projections' weights as the fused step holds them (LoRA folded in): the adapters' own small
    # matrices are not read at decode time
    layers = sum(effective_weight(m)[0].numel() for block in base.model.layers for name, m in block.named_modules()
                 if isinstance(m, torch.nn.Linear) and not hasattr(m, "base_layer") and "lora_" not in name)
    head = base.lm_head.weight.numel()
    c = base.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = rows * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * context * 4
    size = torch.tensor([], dtype=layer_dtype).element_size()
    return {"layers": layers * size, "head": head * base.lm_head.weight.element_size(), "cache": cache,
            "flops": 2 * rows * (layers + head), "layer_flops": 2 * rows * layers}


def call_floor(model, prompt_lengths: list[int], group: int, lengths: list[int], bandwidth: float,
               rate: float) -> tuple[float, float]:
    """(prefill, decode) seconds a generate call cannot go below: ``prompt_lengths`` [P] tokens, ``group``
    samples of each, whose completions came out ``lengths`` [P * group] tokens long (EOS included; row ``r``
    samples prompt ``r // group``). The prefill runs each prompt once and computes the LM head at its last
    position; decode step ``j`` (token ``j`` of a row, ``j >= 1``) runs the rows longer than ``j``, each
    reading its own context's keys and values, at :func:`step_bytes`' weights."""
    one = step_bytes(model, 1, 0.0)  # one row, one token: its bytes and FLOPs
    weights, cache_per_token = one["layers"] + one["head"], step_bytes(model, 1, 1.0)["cache"]
    head_flops = one["flops"] - one["layer_flops"]
    prefill = (one["layer_flops"] * sum(prompt_lengths) + head_flops * len(prompt_lengths)) / rate
    decode = 0.0
    for j in range(1, max(lengths)):
        running = [r for r, n in enumerate(lengths) if n > j]
        context = sum(prompt_lengths[r // group] + j for r in running)
        decode += max((weights + cache_per_token * context) / bandwidth, one["flops"] * len(running) / rate)
    return prefill, decode


def step_products(model, rows: int, repeats: int) -> float:
    """Seconds one fused decode step spends in its matrix products alone: every layer's four (fused QKV, output,
    fused gate-up, down) and the LM head's, at ``rows`` rows, on the kernels
    :class:`~posttrain.rollout.decode_step.FusedDecoder` prepares, in the step's order (so the weights stream
    from memory as they do in a step). What the step would take with nothing else in it (norms, rotary,
    attention over the cache, sampling, Python): the products' rate at the step's own shapes, which on a CPU is
    below a large square matmul's."""
    from posttrain.models.modeling import unwrapped
    from posttrain.rollout.decode_step import FusedDecoder

    decoder = FusedDecoder(model, rows=rows)
    hidden = unwrapped(model).config.hidden_size
    x_hidden = torch.randn(rows, hidden)
    x_heads = torch.randn(rows, decoder.heads * decoder.head_dim)
    x_inner = torch.randn(rows, decoder.intermediate)

    def products() -> None:
        for layer in decoder.layers:
            layer.qkv(x_hidden), layer.out(x_heads), layer.gate_up(x_hidden), layer.down(x_inner)
        decoder.lm_head(x_hidden)

    return best_of(products, repeats)


@functools.cache
def prepacked_linear_op():
    """``torch.ops.mkldnn._linear_pointwise`` on a weight reordered for oneDNN, as a custom op: inductor cannot
    lower that call on a reordered weight (its layout is oneDNN's), so the compiled step calls it as it is."""

    @torch.library.custom_op("posttrain_bench::prepacked_linear", mutates_args=())
    def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @prepacked_linear.register_fake
    def _(x, weight, bias, out_features):
        return x.new_empty(x.shape[0], out_features)

    return prepacked_linear


@contextlib.contextmanager
def compiled_fused_step():
    """Within it, every :class:`~posttrain.rollout.decode_step.FusedDecoder` steps through ``torch.compile``
    (inductor, dynamic shapes: the cache grows a position a step and rows leave) and its oneDNN products go
    through :func:`prepacked_linear_op`; the other kernels are the step's own."""
    from posttrain.rollout import decode_step

    op = prepacked_linear_op()
    eager_init, eager_call = decode_step.Linear.__init__, decode_step.Linear.__call__
    eager_step = decode_step.FusedDecoder.step

    def call(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != "onednn":
            return eager_call(self, x)
        return op(x.to(self.dtype), self.weight, self.bias, self.out_features)

    def init(self, weight, bias, rows, dtype=None):
        eager_init(self, weight, bias, rows, dtype)
        self.out_features = weight.shape[0]

    decode_step.Linear.__init__, decode_step.Linear.__call__ = init, call
    decode_step.FusedDecoder.step = torch.compile(eager_step, dynamic=True)
    try:
        yield
    finally:
        decode_step.Linear.__init__, decode_step.Linear.__call__ = eager_init, eager_call
        decode_step.FusedDecoder.step = eager_step


def compiled_step(long, prompts: list, group: int, t_short: float, repeats: int) -> float:
    """Seconds a decode step takes under :func:`compiled_fused_step`: ``long``'s call (a generator without EOS)
    minus ``t_short`` (the same call's prefill and first token, which the step does not change), per step.
    Prints the first call's time, which includes the compilation."""
    tokens = long.params.max_new_tokens
    with compiled_fused_step():  # each generate call prepares its decoder: under the patch here
        start = time.perf_counter()
        long.generate(prompts, num_samples=group)
        print(f"compiled (torch.compile, dynamic shapes): its first call {time.perf_counter() - start:.0f} s",
              flush=True)
        return (best_of(lambda: long.generate(prompts, num_samples=group), repeats) - t_short) / (tokens - 1)


def tail_step(model, fixed, prompts: list, n: int, group: int, context: float, bandwidth: float, rate: float,
              repeats: int) -> None:
    """Print a decode step at ``n`` rows (the first prompts' samples, over 32 tokens), as a generate call's tail
    runs it: its floor, its products alone and the step measured. ``fixed(tokens)``: a generator without EOS."""
    samples = min(n, group)
    few = prompts[: max(1, n // samples)]
    need = step_bytes(model, n, context)
    floor = max((need["layers"] + need["head"] + need["cache"]) / bandwidth, need["flops"] / rate)
    long, short = fixed(32), fixed(1)
    step = (best_of(lambda: long.generate(few, num_samples=samples), repeats)
            - best_of(lambda: short.generate(few, num_samples=samples), repeats)) / 31
    products = step_products(model, n, repeats)
    print(f"{n} rows: floor {1e3 * floor:.1f} ms, its products {1e3 * products:.1f} ms, measured "
          f"{1e3 * step:.1f} ms/step ({step / floor:.1f}x the floor)", flush=True)


def machine_rates(precision: str, repeats: int) -> tuple[float, float]:
    """This process's read bandwidth (bytes/s) and the 1024^3 matmul's rate (FLOP/s) in the layers' precision."""
    big = torch.randn(128 * 1024 * 1024)
    bandwidth = 0.5e9 / best_of(big.sum, repeats)
    del big
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        rates[dtype] = 10 * 2 * 1024**3 / best_of(lambda: [x @ y for _ in range(10)], repeats)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; matmul 1024^3: float32 {rates[torch.float32] / 1e9:.0f} "
          f"GFLOP/s, bfloat16 {rates[torch.bfloat16] / 1e9:.0f} GFLOP/s; the layers compute in "
          f"{'bfloat16' if precision == 'bf16' else 'float32'} (mixed_precision {precision})", flush=True)
    return bandwidth, rates[torch.bfloat16 if precision == "bf16" else torch.float32]


def recipe_call(s, prompts: list, group: int, floor_per_token: float, bandwidth: float, rate: float,
                repeats: int) -> None:
    """The recipe's own generate call (EOS on: rows leave as they finish) against its floor (`call_floor`)."""
    calls = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = s.generator.generate(prompts, num_samples=group)
        seconds = time.perf_counter() - start
        prefill, decode = call_floor(s.policy, [len(p) for p in prompts], group, out.mask.sum(1).long().tolist(),
                                     bandwidth, rate)
        calls.append((seconds, int(out.mask.sum()), out.completion_ids.shape[1], prefill, decode))
    wall, tokens, steps, prefill, decode = (statistics.median(c[i] for c in calls) for i in range(5))
    print(f"the recipe's generate (EOS on): {wall:.2f} s, {tokens:.0f} tokens in {steps:.0f} steps, "
          f"{tokens / wall:.0f} tokens/s; its floor with rows leaving as they finish {prefill + decode:.2f} s "
          f"(prefill {prefill:.2f}, decode steps {decode:.2f}): {wall / (prefill + decode):.1f}x; at the full "
          f"batch's floor rate {tokens * floor_per_token:.2f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="torch.profiler's table of 16 decode steps")
    parser.add_argument("--mixed-precision", default="auto", choices=("auto", "bf16", "no"))
    parser.add_argument("--rows", type=int, nargs="*", default=[], help="also measure a step at these batch sizes")
    parser.add_argument("--compile", action="store_true", help="also measure the step through torch.compile")
    args = parser.parse_args()

    from posttrain.parallel.allocator import keep_freed_memory

    keep_freed_memory()  # the heap setting every posttrain train runs with

    import dataclasses

    from posttrain.config import Config
    from posttrain.models.loading import resolve_mixed_precision
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import FastGenerator
    from posttrain.training.session import OnlineSession

    precision = resolve_mixed_precision(args.mixed_precision, "float32", torch.device("cpu"))
    b = dataclasses.replace(run.BENCHES["grpo-smollm2-recipe"], bf16=precision == "bf16")
    rows_data, prompt_lists, _ = run.replay_rows(b, 1)
    print(f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    bandwidth, rate = machine_rates(precision, args.repeats)

    with tempfile.TemporaryDirectory() as data:
        s = OnlineSession.create(Config.from_flat(run.recipe_config(b, Path(data), 1, rows_data)))
        prompts = [torch.tensor(ids) for ids in prompt_lists]
        rows = len(prompts) * b.group
        mean_prompt = statistics.mean(len(p) for p in prompts)
        need = step_bytes(s.policy, rows, mean_prompt + b.new_tokens / 2)
        total = need["layers"] + need["head"] + need["cache"]
        print(f"{rows} rows, prompts {mean_prompt:.0f} tokens on average, {b.new_tokens} new tokens", flush=True)
        print(f"one decode step reads at least: layers {need['layers'] / 1e6:.0f} MB, LM head {need['head'] / 1e6:.0f} "
              f"MB, KV cache {need['cache'] / 1e6:.0f} MB (mean context); {total / 1e6:.0f} MB in all", flush=True)
        floor = max(total / bandwidth, need["flops"] / rate)
        print(f"floor: bytes / bandwidth {1e3 * total / bandwidth:.1f} ms, GEMM FLOPs / matmul rate "
              f"{1e3 * need['flops'] / rate:.1f} ms -> {1e3 * floor:.1f} ms/step, "
              f"{rows / floor:.0f} tokens/s", flush=True)

        products = step_products(s.policy, rows, args.repeats)
        print(f"the step's own products at {rows} rows, on the kernels it prepares: {1e3 * products:.1f} ms "
              f"({need['flops'] / products / 1e9:.0f} GFLOP/s)", flush=True)

        def fixed(tokens: int) -> FastGenerator:
            return FastGenerator(s.policy, s.tokenizer, SamplingParams(tokens, 0.7, 1.0, 0), [NEVER])

        long, short = fixed(b.new_tokens), fixed(1)
        t_long = best_of(lambda: long.generate(prompts, num_samples=b.group), args.repeats)
        t_short = best_of(lambda: short.generate(prompts, num_samples=b.group), args.repeats)
        step = (t_long - t_short) / (b.new_tokens - 1)
        print(f"measured: {1e3 * step:.1f} ms/step, {rows / step:.0f} tokens/s at {rows} rows: "
              f"{step / floor:.1f}x the floor, {step / products:.1f}x its own products (prefill and first token "
              f"{t_short:.2f} s)", flush=True)
        if args.compile:
            compiled = compiled_step(long, prompts, b.group, t_short, args.repeats)
            print(f"{1e3 * compiled:.1f} ms/step, {compiled / floor:.1f}x the floor, {compiled / step:.2f}x the eager "
                  "step", flush=True)
        for n in args.rows:
            tail_step(s.policy, fixed, prompts, n, b.group, mean_prompt + b.new_tokens / 2, bandwidth, rate,
                      args.repeats)
        recipe_call(s, prompts, b.group, floor / rows, bandwidth, rate, args.repeats)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            sixteen = fixed(16)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                sixteen.generate(prompts, num_samples=b.group)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
