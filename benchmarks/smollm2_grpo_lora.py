"""GRPO with LoRA on SmolLM2-135M-Instruct over the gsm task: held-out accuracy before/after, s/step, RSS.

    .venv/bin/python benchmarks/smollm2_grpo_lora.py --steps 5
    .venv/bin/python benchmarks/smollm2_grpo_lora.py --algorithm dr_grpo --prompts-per-step 8 --group-size 4 \
        --max-new-tokens 128 --eval-size 0 --steps 4   # the recipe's step shape, no reference pass

Needs the extras ``smollm2`` and ``lora`` (``make test-smollm2`` installs them). Held-out accuracy
is greedy, on the first ``--eval-size`` problems of the task's fixed held-out split, with per-template
counts. Time per step covers generation, scoring, the reference pass (presets with a KL term) and the update;
each step also prints its phases (generation, scoring, training) and its completion tokens. Peak RSS is
the process's high-water mark (``ru_maxrss``). The machine's load average is printed: on a shared
machine, compare runs made at the same load.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import time

import torch

from posttrain.parallel.allocator import keep_freed_memory
from posttrain.config import Config
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession


def accuracy_by_template(s: OnlineSession, rows: list[dict]) -> tuple[float, dict[str, str]]:
    """Greedy held-out accuracy, overall and per template ("right/total")."""
    from posttrain.data.prompts import as_completion, encode_prompt

    completions = s.generator.generate([encode_prompt(s.tokenizer, r["prompt"]) for r in rows], num_samples=1, greedy=True)
    texts = s.tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
    right = s.work.correct(prompts=[r["prompt"] for r in rows],
                           completions=[as_completion(r["prompt"], t) for r, t in zip(rows, texts)],
                           answer=[r["answer"] for r in rows])
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row, ok in zip(rows, right):
        counts[row["template"]][0] += ok
        counts[row["template"]][1] += 1
    return sum(right) / len(rows), {k: f"{a}/{n}" for k, (a, n) in sorted(counts.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--mini-batches", type=int, default=None, help="updates per rollout [default: the preset's]")
    parser.add_argument("--eval-size", type=int, default=50)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = Config.from_flat(dict(
        algorithm=args.algorithm, task="gsm", mixed_precision=args.mixed_precision, model="smollm2-135m",
        lora_r=args.lora_r, lora_alpha=2.0 * args.lora_r,
        **({} if args.mini_batches is None else {"mini_batches": args.mini_batches}),
        prompts_per_step=args.prompts_per_step, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
        learning_rate=args.learning_rate, micro_batch_size=args.micro_batch_size, max_steps=args.steps,
        eval_size=args.eval_size, temperature=args.temperature, progress=False, report_to="none", seed=0, device="cpu",
    ))
    started = time.perf_counter()
    keep_freed_memory()  # as posttrain.training.api does for every CLI run
    s = OnlineSession.create(config)
    trainable = sum(p.numel() for p in s.policy.parameters() if p.requires_grad)
    print(f"setup {time.perf_counter() - started:.1f}s; trainable {trainable:,} of "
          f"{sum(p.numel() for p in s.policy.parameters()):,} parameters; {args.threads} threads; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    rows = s.work.test_rows
    if rows:
        t0 = time.perf_counter()
        before, by_template = accuracy_by_template(s, rows)
        print(f"held-out accuracy before: {before:.1%} of {len(rows)} ({time.perf_counter() - t0:.0f}s)  "
              f"{by_template}", flush=True)
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = train_step(s)
        s.step += 1
        step_times.append(time.perf_counter() - t0)
        print(f"step {s.step}: {step_times[-1]:.1f}s  reward {metrics.get('reward/mean', float('nan')):.3f}  "
              f"loss {metrics.get('loss', float('nan')):.4f}  kl {metrics.get('kl', 0.0):.4f}  "
              f"generation {metrics['time/generation']:.1f}s  scoring {metrics['time/scoring']:.2f}s  "
              f"training {metrics['time/training']:.1f}s  completion tokens {int(s.last_groups.completions.lengths.sum())}"
              f"  load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.steps and rows:
        after, by_template = accuracy_by_template(s, rows)
        print(f"held-out accuracy after {args.steps} steps: {after:.1%} ({after - before:+.1%})  {by_template}")
    if args.steps:
        print(f"seconds per step: {sum(step_times) / len(step_times):.1f} (median {sorted(step_times)[len(step_times) // 2]:.1f})")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")


if __name__ == "__main__":
    main()
