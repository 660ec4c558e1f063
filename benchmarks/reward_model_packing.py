"""A reward model's training pass over pairs of unequal lengths: one packed row against right-padded rows.

    .venv/bin/python benchmarks/reward_model_packing.py                  # SmolLM2-135M, 8 pairs a pass
    .venv/bin/python benchmarks/reward_model_packing.py --pairs 4 --repeats 5

The texts are ``benchmarks/sft_packing.py``'s (log-normal lengths, median 96 words, 16-512), tokenized by
SmolLM2's tokenizer; a pass scores ``--pairs`` chosen and as many rejected texts
(``posttrain.models.reward_head.sequence_scores``) and back-propagates a Bradley-Terry loss, as the
reward-model trainer's micro-batch does. The same model runs both ways (``trim_padding`` decides which
attention it gets: the packed one, or transformers' SDPA over padded rows), alternated in one process so
that machine load weighs on both alike; medians reported, with the positions each computes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from sft_packing import text_rows  # noqa: E402

from posttrain.functional import bradley_terry_loss  # noqa: E402
from posttrain.models.compute import use_packed_attention  # noqa: E402
from posttrain.models.reward_head import load_reward_model, sequence_scores  # noqa: E402
from posttrain.parallel.allocator import keep_freed_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    keep_freed_memory()
    models = {}
    for mode in ("padded", "packed"):
        torch.manual_seed(0)  # the same fresh score head both ways
        model, tokenizer = load_reward_model(args.model, device="cpu")
        if mode == "packed":
            assert use_packed_attention(model)
        models[mode] = model.train(False)
    texts = [row["text"] for row in text_rows(2 * args.pairs, seed=1)]
    sequences = [torch.tensor(tokenizer(text)["input_ids"][:512]) for text in texts]
    real = sum(len(s) for s in sequences)
    padded = len(sequences) * max(len(s) for s in sequences)
    print(f"{args.model}: {args.pairs} pairs, {real} tokens ({padded} padded positions); "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}", flush=True)

    def one_pass(model) -> float:
        start = time.perf_counter()
        scores = sequence_scores(model, sequences, tokenizer.pad_token_id).view(2, -1)
        bradley_terry_loss(scores[0], scores[1])[0].backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {mode: [] for mode in models}
    for k in range(args.repeats + 1):
        for mode, model in models.items():
            seconds = one_pass(model)
            if k:  # the first pass of each warms up
                times[mode].append(seconds)
    for mode, ts in times.items():
        seconds = statistics.median(ts)
        print(f"{mode:7s} {seconds:6.2f} s/pass  {real / seconds:6.0f} tokens/s", flush=True)
    print(f"packed / padded: {statistics.median(times['packed']) / statistics.median(times['padded']):.2f}; "
          f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
