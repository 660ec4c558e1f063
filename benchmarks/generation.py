"""Generation speed: transformers' ``generate`` (HFGenerator) against posttrain's decode loop (FastGenerator).

    .venv/bin/python benchmarks/generation.py                  # SmolLM2-135M-Instruct, 4 prompts x 4 samples, 64 tokens
    .venv/bin/python benchmarks/generation.py --prompts 16 --samples 1 --new-tokens 32
    .venv/bin/python benchmarks/generation.py --model tiny
    .venv/bin/python benchmarks/generation.py --prompts 16 --samples 4 --new-tokens 128 --skip eos --dtype bfloat16

Prompts are the gsm task's (chat template applied). Two kinds of run, each timed for both generators,
alternating, ``--repeats`` times, medians reported:

- ``fixed``: no EOS (every row decodes the whole budget), so both do the same number of steps. Time per
  decode step is ``(t(T) - t(1)) / (T - 1)``: the prefill (and the first token) cancel out.
- ``eos``: the model's EOS tokens end rows, as in training. Tokens/s counts completion tokens (through
  EOS). Greedy outputs should be identical (checked and printed), so both do the same work; sampled
  ones differ run to run.

CPU time of this process is printed beside wall time: on a shared machine wall time includes waiting
for a core. The machine's load average is printed at the start and the end; compare the two
generators' ratio within one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # generate warns about the EOS id -1 at every call

from posttrain.parallel.allocator import keep_freed_memory
from posttrain.data.prompts import encode_prompt
from posttrain.models.loading import load_model_and_tokenizer
from posttrain.rollout.completions import SamplingParams
from posttrain.rollout.generators import FastGenerator, HFGenerator
from posttrain.training.session import eos_token_ids
from posttrain.data.tasks import get_task

NEVER = -1
"""An EOS id no model produces: every row runs the whole budget."""


def timed(generator, prompts, samples: int, greedy: bool) -> tuple[float, float, int, int, torch.Tensor]:
    """(wall s, CPU s, completion tokens, steps, completion ids) of one generate call."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = generator.generate(prompts, num_samples=samples, greedy=greedy)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, int(out.mask.sum()), out.completion_ids.shape[1], out.completion_ids


class ForwardStepGenerator(FastGenerator):
    """posttrain's decode loop running the model's own forward at every step (no fused step)."""

    def generate(self, *args, **kwargs):
        os.environ["POSTTRAIN_DECODE_STEP"] = "forward"
        try:
            return super().generate(*args, **kwargs)
        finally:
            del os.environ["POSTTRAIN_DECODE_STEP"]


def build(model, tokenizer, new_tokens: int, eos: list[int], args) -> dict[str, object]:
    """``generate``: transformers; ``forward``: posttrain's loop with the model's forward per step;
    ``fast``: posttrain's loop with the fused step (posttrain.rollout.decode_step) where the model has one."""
    params = SamplingParams(new_tokens, args.temperature, args.top_p, args.top_k)
    return {"generate": HFGenerator(model, tokenizer, params, eos),
            "forward": ForwardStepGenerator(model, tokenizer, params, eos),
            "fast": FastGenerator(model, tokenizer, params, eos)}


def fixed_budget(model, tokenizer, prompts, args) -> None:
    """ms per decode step with every row running the whole budget."""
    for greedy in (True, False):
        long, short = build(model, tokenizer, args.new_tokens, [NEVER], args), build(model, tokenizer, 1, [NEVER], args)
        times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in long}
        for _ in range(args.repeats):
            for name in long:
                wall_t, cpu_t, *_ = timed(long[name], prompts, args.samples, greedy)
                wall_1, cpu_1, *_ = timed(short[name], prompts, args.samples, greedy)
                times[name]["wall"].append((wall_t - wall_1) / (args.new_tokens - 1))
                times[name]["cpu"].append((cpu_t - cpu_1) / (args.new_tokens - 1))
        rows = len(prompts) * args.samples
        report = {name: (statistics.median(t["wall"]), statistics.median(t["cpu"])) for name, t in times.items()}
        for name, (wall, cpu) in report.items():
            print(f"fixed {'greedy' if greedy else 'sample':6s} {name:8s}  {wall * 1e3:7.1f} ms/step  "
                  f"(CPU {cpu * 1e3:7.1f})  {rows / wall:7.1f} tokens/s in decode", flush=True)
        for slow in ("generate", "forward"):
            print(f"fixed {'greedy' if greedy else 'sample':6s} fast vs {slow}: {report[slow][0] / report['fast'][0]:.2f}x "
                  f"per decode step (CPU time {report[slow][1] / report['fast'][1]:.2f}x)", flush=True)


def with_eos(model, tokenizer, prompts, args) -> None:
    """Whole generate calls with EOS stopping: completion tokens per second."""
    eos = eos_token_ids(model, tokenizer)
    generators = build(model, tokenizer, args.new_tokens, eos, args)
    for greedy in (True, False):
        runs: dict[str, list[tuple]] = {name: [] for name in generators}
        for _ in range(args.repeats):
            for name, generator in generators.items():
                runs[name].append(timed(generator, prompts, args.samples, greedy))
        rates = {}
        for name, rs in runs.items():
            wall = statistics.median(r[0] for r in rs)
            rates[name] = statistics.median(r[2] / r[0] for r in rs)
            print(f"eos   {'greedy' if greedy else 'sample':6s} {name:8s}  {wall:7.2f} s/call  "
                  f"(CPU {statistics.median(r[1] for r in rs):6.2f})  {rates[name]:7.1f} tokens/s  "
                  f"tokens {[r[2] for r in rs]} steps {[r[3] for r in rs]}", flush=True)
        mode = "greedy" if greedy else "sample"
        for slow in ("generate", "forward"):
            same = f"; identical completions: {torch.equal(runs['fast'][0][4], runs[slow][0][4])}" if greedy else ""
            print(f"eos   {mode:6s} fast vs {slow}: {rates['fast'] / rates[slow]:.2f}x tokens/s{same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a model spec; 'tiny' is the built-in tiny-addition")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip", choices=["fixed", "eos"], help="skip one kind of run")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's weights (bfloat16: as a bf16 sampler, e.g. vLLM's, holds them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as every training run does (posttrain.training.api): no fresh pages per sampled step
    model_name, task = ("tiny-addition", "addition") if args.model == "tiny" else (args.model, "gsm")
    model, tokenizer = load_model_and_tokenizer(model_name, device="cpu")
    model.to(getattr(torch, args.dtype))
    rows = list(get_task(task).train)[: args.prompts]
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    print(f"{model_name}: {sum(p.numel() for p in model.parameters()):,} parameters; {len(prompts)} prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x {args.samples} samples, "
          f"{args.new_tokens} new tokens, {args.dtype}; {args.threads} threads; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    torch.manual_seed(0)
    for name, generator in build(model, tokenizer, 2, [NEVER], args).items():  # warm-up
        generator.generate(prompts, num_samples=args.samples)
    if args.skip != "fixed":
        fixed_budget(model, tokenizer, prompts, args)
    if args.skip != "eos":
        with_eos(model, tokenizer, prompts, args)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
