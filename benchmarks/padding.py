"""The training forward and backward of one micro-batch, with rows grouped by completion length
(``modeling.length_buckets``) against one pass padded to the longest row: same rows, same model,
alternated in one process so that machine load affects both alike.

    .venv/bin/python benchmarks/padding.py                      # SmolLM2-135M-Instruct, LoRA r16, bf16
    .venv/bin/python benchmarks/padding.py --model tiny-addition --lora-r 0 --mixed-precision no

The completion lengths are a sampled GRPO batch's (the recipe's step shape: 2 prompts x 4 samples per
micro-batch, up to 128 tokens, most ending well before); the prompts are the gsm task's.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from posttrain.config import Config
from posttrain.models import modeling
from posttrain.models.modeling import collate, forward
from posttrain.parallel.allocator import keep_freed_memory
from posttrain.training.session import OnlineSession

LENGTHS = (23, 41, 57, 128, 35, 62, 88, 128)  # two groups of four: a budget-bound sample in each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--mixed-precision", default="bf16", choices=("no", "bf16"))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--lengths", type=lambda text: tuple(int(x) for x in text.split(",")), default=LENGTHS)
    args = parser.parse_args()
    keep_freed_memory()
    task = "gsm" if args.model == "smollm2-135m" else "addition"
    config = Config.from_flat(dict(algorithm="dr_grpo", task=task, model=args.model, lora_r=args.lora_r,
                                   lora_alpha=2.0 * max(args.lora_r, 1), mixed_precision=args.mixed_precision,
                                   progress=False, report_to="none", device="cpu", eval_size=0))
    s = OnlineSession.create(config)
    groups = len(args.lengths) // 4
    prompts = [s.encoded_prompts[i] for i in range(groups) for _ in range(4)]
    width = max(args.lengths)
    generator = torch.Generator().manual_seed(0)
    completions = torch.randint(100, 1000, (len(args.lengths), width), generator=generator)
    mask = (torch.arange(width)[None] < torch.tensor(args.lengths)[:, None]).long()
    batch = collate(prompts, completions * mask, mask, s.tokenizer.pad_token_id, torch.device("cpu"))
    print(f"{args.model}: {len(prompts)} rows, prompts {[len(p) for p in prompts[::4]]} tokens, completions "
          f"{list(args.lengths)}: {int(mask.sum())} real of {mask.numel()} padded positions; "
          f"groups by length: {modeling.length_buckets(list(args.lengths), modeling.BUCKET_COST)}")

    def step() -> float:
        t0 = time.perf_counter()
        out = forward(s.policy, batch, temperature=0.7)
        (out.logprobs * batch.mask).sum().backward()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"one pass": [], "by length": []}
    step()  # warm-up
    for _ in range(args.repeats):
        for name, cost in (("one pass", 10**9), ("by length", modeling.BUCKET_COST)):
            saved, modeling.BUCKET_COST = modeling.BUCKET_COST, cost
            times[name].append(step())
            modeling.BUCKET_COST = saved
    for name, seconds in times.items():
        print(f"{name}: {min(seconds):.2f} s min, {sorted(seconds)[len(seconds) // 2]:.2f} s median "
              f"({', '.join(f'{t:.2f}' for t in seconds)})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
