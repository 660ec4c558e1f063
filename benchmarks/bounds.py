"""How close generation and training come to what this machine's fp32 GEMM allows (issue 6's targets).

    .venv/bin/python benchmarks/bounds.py                 # SmolLM2-135M-Instruct, GRPO's 4 x 4 x 32 shapes
    .venv/bin/python benchmarks/bounds.py --prompts 16 --samples 4

Prints, in one process:
- a plain fp32 matmul's throughput (1024 x 1024 x 1024): the machine's reference;
- training: one forward and backward of posttrain's log-prob pass over ``prompts * samples`` rows of
  ``--prompt-length + --new-tokens`` tokens, as 6 x parameters x tokens per second and as a fraction
  of the reference;
- generation: the time of one decode step of posttrain's decode loop (``(t(34) - t(2)) / 32``: the
  prefill cancels), and of every linear layer of the model called back to back on that many rows (no
  attention, norms or sampling): the floor of a decode step made of these GEMMs;
- fp32 GEMM throughput at 16 to 1024 rows against the model's MLP shape, and the weight bytes read per
  second, beside the machine's plain read bandwidth (a sum over 512 MB);
- the same 16-row GEMM computed as ``(W @ x.T).T``, which MKL runs faster at few rows.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from posttrain.rollout.generation import decode, preallocated_cache
from posttrain.models.loading import load_model_and_tokenizer
from posttrain.models.modeling import collate, forward


def seconds(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=13, help="13: the benchmark's gsm prompts, about")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(args.model, dtype="float32", device="cpu")
    rows = args.prompts * args.samples
    ids = torch.randint(100, 1000, (args.prompts, args.prompt_length))

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    reference = 2 * 1024**3 / seconds(lambda: [a @ b for _ in range(10)]) * 10
    print(f"threads {torch.get_num_threads()}; fp32 matmul 1024^3: {reference / 1e9:.0f} GFLOP/s")

    model.train()
    completions = torch.randint(100, 1000, (rows, args.new_tokens))
    batch = collate([row for row in ids.repeat_interleave(args.samples, 0)], completions,
                    torch.ones_like(completions), 0, torch.device("cpu"))

    def forward_backward() -> None:
        forward(model, batch).logprobs.sum().backward()
        model.zero_grad(set_to_none=True)

    t = seconds(forward_backward)
    params = sum(p.numel() for p in model.parameters())
    tokens = batch.input_ids.numel()
    print(f"training forward+backward, {rows} x {batch.input_ids.shape[1]} tokens: {1e3 * t:.0f} ms, "
          f"6 x {params / 1e6:.1f}M x {tokens} / s = {6 * params * tokens / t / 1e9:.0f} GFLOP/s, "
          f"{6 * params * tokens / t / reference:.0%} of the matmul")
    model.eval()
    ids = torch.randint(100, 1000, (args.prompts, 80))  # generation: longer prompts, as the decode loop sees them

    def run(new_tokens: int) -> None:
        cache = preallocated_cache(model.config, args.samples, ids.shape[1] + new_tokens + 1)
        decode(model, cache, ids, torch.ones_like(ids), num_samples=args.samples, max_new_tokens=new_tokens,
               eos_ids=torch.tensor([-1]), pad_id=0, greedy=False)

    step = (seconds(lambda: run(34)) - seconds(lambda: run(2))) / 32
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(rows, m.in_features) for m in linears]
    floor = seconds(lambda: [torch.nn.functional.linear(x, m.weight) for x, m in zip(inputs, linears)])
    params = sum(m.weight.numel() for m in linears)
    print(f"generation, {rows} rows; the linear layers hold {params / 1e6:.1f}M weights")
    print(f"decode step {1e3 * step:.1f} ms; the linear layers alone {1e3 * floor:.1f} ms "
          f"({2 * rows * params / floor / 1e9:.0f} GFLOP/s)")

    big = torch.randn(128 * 1024 * 1024)  # 512 MB
    print(f"read bandwidth (sum over 512 MB): {0.5 / seconds(big.sum):.1f} GB/s")
    weights = [torch.randn(1536, 576) for _ in range(150)]  # the MLP shape, 530 MB in all
    nbytes = sum(w.numel() * 4 for w in weights)
    for n in (16, 64, 256, 1024):
        x = torch.randn(n, 576)
        t = seconds(lambda: [x @ w.T for w in weights])
        print(f"GEMM x[{n}, 576] @ W.T: {2 * n * nbytes / 4 / t / 1e9:.0f} GFLOP/s, weights read at {nbytes / t / 1e9:.1f} GB/s")
    x = torch.randn(16, 576)
    t = seconds(lambda: [(w @ x.T).T for w in weights])
    print(f"GEMM (W @ x.T).T at 16 rows: {2 * 16 * nbytes / 4 / t / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
