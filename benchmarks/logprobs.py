"""Token log-probs from final hidden states: the LM head plus log-softmax, fused and chunked or not.

    .venv/bin/python benchmarks/logprobs.py                 # SmolLM2's head: 49152 x 576, 512 rows
    .venv/bin/python benchmarks/logprobs.py --rows 2048 --vocab 151936 --dim 896

``unfused``: ``F.linear`` to a full ``[M, V]`` logits tensor, then ``selective_log_softmax`` and
``entropy_from_logits`` (what ``modeling.forward`` did before ``linear_log_softmax``). ``fused/C/recompute`` and ``fused/C/keep``:
:func:`posttrain.functional.linear_log_softmax` with C vocabulary entries per block, its backward
recomputing each block's logits or keeping them from the forward. Each runs in its own process,
timed forward (with entropy) plus backward, medians of ``--repeats``; its memory is the process's peak
RSS minus the RSS before its first call (inputs and weight gradient included).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

import torch

import posttrain.functional as F
from posttrain.parallel.allocator import keep_freed_memory


def unfused(hidden, weight, tokens):
    logits = torch.nn.functional.linear(hidden, weight)[None]
    return F.selective_log_softmax(logits, tokens[None])[0], F.entropy_from_logits(logits.detach())[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # run one variant (in a child process)
    args = parser.parse_args()
    keep_freed_memory()  # as training runs do
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.dim) * 0.05).requires_grad_()
    hidden = torch.randn(args.rows, args.dim).requires_grad_()
    tokens = torch.randint(args.vocab, (args.rows,))
    flop = 2 * args.rows * args.vocab * args.dim
    variants = {"unfused": lambda: unfused(hidden, weight, tokens)}
    for chunk in (1024, 2048, 4096, 8192, 16384):
        for recompute in (True, False):
            variants[f"fused/{chunk}/{'recompute' if recompute else 'keep'}"] = (
                lambda c=chunk, r=recompute: F.linear_log_softmax(hidden, weight, tokens, with_entropy=True,
                                                                  chunk_size=c, recompute=r))
    if args.variant is None:
        print(f"{args.rows} rows, head {args.vocab} x {args.dim}; {torch.get_num_threads()} threads", flush=True)
        for name in variants:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", name], check=True)
        return
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * resource.getpagesize() / 2**10
    for name, run in ((args.variant, variants[args.variant]),):
        times = []
        for _ in range(args.repeats + 1):
            weight.grad = hidden.grad = None
            t = time.perf_counter()
            logprobs, _ = run()
            logprobs.sum().backward()
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times[1:])
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 2**10
        print(f"{name:22s} {seconds * 1e3:7.1f} ms forward+backward  ({3 * flop / seconds / 1e9:5.1f} GFLOP/s "
              f"counting 3 head products)  memory {grown:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
