"""What mixed precision (``--mixed-precision bf16``) costs in accuracy, and what it buys in time.

    .venv/bin/python benchmarks/precision.py                  # SmolLM2-135M-Instruct on the gsm task
    .venv/bin/python benchmarks/precision.py --model tiny     # the 3.2M-parameter benchmark model

Samples completions of the task's prompts with the float32 model (4 prompts x 4 samples x 64 tokens,
temperature 0.7), then scores them three ways:

- ``float32``: the reference;
- ``mixed``: posttrain's mixed precision (the decoder stack under bfloat16 autocast, the LM head and
  log-softmax in float32);
- ``bf16 head too``: the mixed-precision model with its LM head under autocast as well (what wrapping
  the whole model's forward would give), to show what keeping the head in float32 is worth.

Per setting it prints the error of the per-token log-probs against float32 (mean, 99th percentile
and largest absolute difference in nats), the mean k3 estimate of KL(float32 || setting) (the noise
floor it adds to any KL whose two sides are computed in different precisions), the gradient of a
GRPO-like surrogate (log-probs weighted by +-1 advantages per sequence) against float32's (cosine and
norm ratio), and the median time of that forward and backward. Then greedy decoding of the same
prompts in both precisions: the share of completions that come out token-for-token identical, and
where the first difference falls in the others.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402  (benchmarks/run.py: the benchmark model and its prompts)

import posttrain.functional as F  # noqa: E402
from posttrain.data.prompts import encode_prompt  # noqa: E402
from posttrain.models.compute import use_mixed_precision  # noqa: E402
from posttrain.models.modeling import collate, forward  # noqa: E402
from posttrain.models.loading import load_model_and_tokenizer  # noqa: E402
from posttrain.rollout.completions import SamplingParams  # noqa: E402
from posttrain.rollout.generators import FastGenerator  # noqa: E402
from posttrain.training.session import eos_token_ids  # noqa: E402

PROMPTS, SAMPLES, NEW_TOKENS, TEMPERATURE = 4, 4, 64, 0.7


def prompts_for(model: str) -> list:
    if model == "tiny":
        return [row["prompt"] for row in bench.prompt_rows(PROMPTS)]
    from posttrain.data.tasks import get_task

    return [row["prompt"] for row in list(get_task("gsm").test)[:PROMPTS]]


def scored(model, batch, autocast_all: bool):
    """Log-probs [N, T] and the gradient of the surrogate; ``autocast_all``: the whole forward, LM head
    included, under bfloat16 autocast."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_all):
        out = forward(model, batch, temperature=TEMPERATURE)
    signs = torch.tensor([1.0, -1.0]).repeat(len(batch.mask) // 2 + 1)[: len(batch.mask), None]
    (out.logprobs * batch.mask * signs).sum().backward()
    return out.logprobs.detach(), torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    args = parser.parse_args()
    torch.manual_seed(0)
    full, tokenizer = load_model_and_tokenizer(str(bench.model_dir(args.model)), device="cpu")
    full.train()
    mixed = copy.deepcopy(full)
    use_mixed_precision(mixed)
    eos = eos_token_ids(full, tokenizer)
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts_for(args.model)]

    sampled = FastGenerator(full, tokenizer, SamplingParams(NEW_TOKENS, TEMPERATURE), eos).generate(
        prompt_ids, num_samples=SAMPLES)
    rows = [p for p in prompt_ids for _ in range(SAMPLES)]
    batch = collate(rows, sampled.completion_ids, sampled.mask, tokenizer.pad_token_id, torch.device("cpu"))
    real = batch.mask.bool()
    print(f"{bench.model_dir(args.model).name}: {PROMPTS} prompts x {SAMPLES} samples, {int(real.sum())} completion "
          f"tokens sampled in float32 at temperature {TEMPERATURE}\n")

    settings = {"float32": (full, False), "mixed": (mixed, False), "bf16 head too": (mixed, True)}
    results = {name: scored(model, batch, autocast_all) for name, (model, autocast_all) in settings.items()}
    reference, reference_grad = results["float32"]
    print("| setting | mean abs dlogp | p99 | max | KL(fp32 || setting), k3 | grad cosine | grad norm ratio "
          "| fwd+bwd s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (logprobs, grad) in results.items():
        diff = (logprobs - reference)[real].abs()
        kl = F.kl_estimate(logprobs[real], reference[real], "k3").mean()
        cosine = torch.nn.functional.cosine_similarity(grad, reference_grad, dim=0)
        model, autocast_all = settings[name]
        seconds = timed(lambda: scored(model, batch, autocast_all))
        print(f"| {name} | {diff.mean():.4f} | {diff.quantile(0.99):.4f} | {diff.max():.4f} | {kl:.2e} "
              f"| {cosine:.5f} | {grad.norm() / reference_grad.norm():.4f} | {seconds:.2f} |")

    greedy = {}
    for name in ("float32", "mixed"):
        model = settings[name][0].eval()
        generator = FastGenerator(model, tokenizer, SamplingParams(NEW_TOKENS), eos)
        greedy[name] = generator.generate(prompt_ids, num_samples=1, greedy=True)
        seconds = timed(lambda: generator.generate(prompt_ids * SAMPLES, num_samples=1, greedy=True), repeats=2)
        print(f"\ngreedy decoding, {name}: {len(prompt_ids) * SAMPLES} rows x {NEW_TOKENS} tokens in {seconds:.2f} s",
              end="")
    a, b = greedy["float32"], greedy["mixed"]
    same, first = 0, []
    for row in range(len(prompt_ids)):
        x, y = a.completion_ids[row][a.mask[row].bool()], b.completion_ids[row][b.mask[row].bool()]
        if torch.equal(x, y):
            same += 1
        else:
            n = min(len(x), len(y))
            first.append(int((x[:n] != y[:n]).nonzero()[0]) if (x[:n] != y[:n]).any() else n)
    print(f"\ngreedy completions identical in both precisions: {same} of {len(prompt_ids)}"
          + (f"; the others first differ at tokens {first}" if first else ""))


if __name__ == "__main__":
    main()
