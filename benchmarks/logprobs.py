"""Token log-probs from final hidden states: the LM head plus log-softmax, fused and chunked or not.

    .venv/bin/python benchmarks/logprobs.py                 # SmolLM2's head: 49152 x 576, 512 rows
    .venv/bin/python benchmarks/logprobs.py --rows 2048 --vocab 151936 --dim 896

``unfused``: ``F.linear`` to a full ``[M, V]`` logits tensor, then ``selective_log_softmax`` and
``entropy_from_logits`` (what ``modeling.forward`` did before ``linear_log_softmax``). ``fused/C``:
:func:`posttrain.functional.linear_log_softmax` with C vocabulary entries per block. Each is timed forward (with
entropy) plus backward, medians of ``--repeats``; the extra memory each needs is printed as the growth
of peak RSS over the run (the first row's includes its warm-up allocations).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import posttrain.functional as F
from posttrain.allocator import keep_freed_memory


def unfused(hidden, weight, tokens):
    logits = torch.nn.functional.linear(hidden, weight)[None]
    return F.selective_log_softmax(logits, tokens[None])[0], F.entropy_from_logits(logits.detach())[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    keep_freed_memory()  # as training runs do
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.dim) * 0.05).requires_grad_()
    hidden = torch.randn(args.rows, args.dim).requires_grad_()
    tokens = torch.randint(args.vocab, (args.rows,))
    flop = 2 * args.rows * args.vocab * args.dim
    variants = {"unfused": lambda: unfused(hidden, weight, tokens)}
    for chunk in (1024, 2048, 4096, 8192, 16384):
        variants[f"fused/{chunk}"] = lambda c=chunk: F.linear_log_softmax(hidden, weight, tokens, with_entropy=True,
                                                                          chunk_size=c)
    print(f"{args.rows} rows, head {args.vocab} x {args.dim}; {torch.get_num_threads()} threads")
    for name, run in variants.items():
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times = []
        for _ in range(args.repeats + 1):
            weight.grad = hidden.grad = None
            t = time.perf_counter()
            logprobs, _ = run()
            logprobs.sum().backward()
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times[1:])
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 2**10
        print(f"{name:10s} {seconds * 1e3:7.1f} ms forward+backward  ({3 * flop / seconds / 1e9:5.1f} GFLOP/s "
              f"counting 3 head products)  peak RSS +{grown:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
