"""SFT steps with padding against packing: seconds per optimizer step and tokens per second.

    .venv/bin/python benchmarks/sft_packing.py                      # both models, 2 warm-up + 6 timed steps each
    .venv/bin/python benchmarks/sft_packing.py --only tiny --steps 10

Each model trains through ``posttrain.training.sft.train_step`` three times, from the same weights on the
same examples in the same order:

- ``padding``: ``packing`` and ``trim_padding`` off, each example its own row, right-padded to the
  micro-batch's longest;
- ``block-mask``: ``packing`` on, ``trim_padding`` off: the step's examples in rows of up to
  ``max_length`` positions, transformers' SDPA with the block mask of each row's examples (every pair
  of a row's positions computed, the cross-example ones masked);
- ``packed``: the defaults: the micro-batch's examples as one row without padding, one causal SDPA call
  per example (``posttrain.models.packing``).

The sessions' steps alternate (padding, block-mask, packed, padding, ...), so a change in the machine's
load weighs on all alike; the figures are medians over the timed steps.

- ``tiny``: the built-in ``tiny-addition-base`` (0.6M parameters) on the addition task's demonstrations
  (9-37 tokens each), 64 per step, ``max_length`` 1024 (the default), full fine-tuning; ``tiny-128``
  the same with ``max_length`` 128 (packed rows of about four examples, the longest being 37 tokens).
- ``smollm2``: ``smollm2-135m`` with LoRA r16 on text demonstrations whose lengths follow a log-normal
  mix (median 96 words, about a token each, clipped to 16-512: a chat SFT set's spread, scaled down
  for a CPU), 16 per step, ``max_length`` 512, micro-batches of 4 rows (either way at most
  4 x 512 positions per pass: the same bound on activation memory).

``tokens/s`` counts the examples' real tokens (what a step trains on), ``positions`` the model's
input positions (padding included), so ``positions / tokens`` is the padding's overhead.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from posttrain.config import Config
from posttrain.data.sft import layout
from posttrain.parallel.allocator import keep_freed_memory
from posttrain.training.sft import SFTSession, micro_batches, train_step

WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this had not but "
         "what all were when we there can more if no out so said one about up them time would has been").split()


def text_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` text demonstrations of log-normally spread lengths, in words (median 96, 16-512)."""
    rng = random.Random(seed)
    lengths = [min(512, max(16, round(rng.lognormvariate(math.log(96), 0.8)))) for _ in range(count)]
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(n))} for n in lengths]


def configs(root: Path) -> dict[str, dict]:
    data = root / "text.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in text_rows(512)))
    common = dict(algorithm="sft", max_steps=1000, eval_size=0, progress=False, report_to="none", learning_rate=1e-4)
    return {
        "tiny": dict(common, model="tiny-addition-base", task="addition", pairs_per_step=64, max_length=1024,
                     max_prompt_length=512),
        "tiny-128": dict(common, model="tiny-addition-base", task="addition", pairs_per_step=64, max_length=128,
                         max_prompt_length=64),
        "smollm2": dict(common, model="smollm2-135m", dataset=str(data), lora_r=16, pairs_per_step=16,
                        micro_batch_size=4, max_length=512, max_prompt_length=256),
    }


MODES = {"padding": dict(packing=False, trim_padding=False), "block-mask": dict(packing=True, trim_padding=False),
         "packed": dict(packing=True, trim_padding=True)}


def pass_positions(s: SFTSession, rows: list[list[int]]) -> int:
    """The input positions of one micro-batch's forward pass: its real tokens in a packed pass, else its
    rows' padded rectangle."""
    batch = layout(s.train, rows, 0)
    return int((batch.example >= 0).sum()) if s.config.optim.trim_padding else batch.input_ids.numel()


def measure(name: str, flat: dict, warmup: int, steps: int) -> None:
    sessions = {mode: SFTSession.create(Config.from_flat({**flat, **settings})) for mode, settings in MODES.items()}
    times: dict[str, list[float]] = {mode: [] for mode in sessions}
    tokens: dict[str, list[int]] = {mode: [] for mode in sessions}
    positions: dict[str, list[int]] = {mode: [] for mode in sessions}
    for step in range(warmup + steps):
        for mode, s in sessions.items():
            idx = copy.deepcopy(s.sampler).next(flat["pairs_per_step"])  # the examples the step takes
            start = time.perf_counter()
            train_step(s)
            if step >= warmup:
                times[mode].append(time.perf_counter() - start)
                tokens[mode].append(sum(len(s.train.input_ids[i]) for i in idx))
                positions[mode].append(sum(pass_positions(s, rows) for rows in micro_batches(s, s.train, idx)))
    for mode in sessions:
        seconds = statistics.median(times[mode])
        rate = statistics.median(t / s for t, s in zip(tokens[mode], times[mode]))
        overhead = sum(positions[mode]) / sum(tokens[mode])
        print(f"{name:9s} {mode:10s} {seconds:7.3f} s/step {rate:9.0f} tokens/s  positions/tokens {overhead:.2f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=("tiny", "tiny-128", "smollm2"),
                        default=("tiny", "tiny-128", "smollm2"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    args = parser.parse_args()
    keep_freed_memory()  # as training runs do
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as root:
        for name, flat in configs(Path(root)).items():
            if name in args.only:
                measure(name, flat, args.warmup, args.steps)


if __name__ == "__main__":
    main()
