"""How well a local model judges: its pointwise scores and pairwise verdicts against a task's answer check.

    .venv/bin/python benchmarks/judge.py [--judge smollm2-135m] [--policy smollm2-135m] [--task gsm]
                                          [--prompts 48] [--samples 4] [--seed 0]

The policy samples ``--samples`` completions of each of ``--prompts`` held-out problems (temperature 1);
the task's answer check labels them. The judge (``posttrain.data.judge.Judge``, the built-in rubrics)
then scores every completion and compares each prompt's samples two by two, in both orders. Printed:
how often its replies could not be read, its mean score on right and on wrong completions and the
AUROC of its scores for telling them apart (0.5: chance), how many pairs it gave a verdict on (the two
orders agreeing) and, of those where one answer is right and the other wrong, how often it chose the
right one; and its replies per second.
"""

from __future__ import annotations

import argparse
import os
import time


def auroc(right: list[float], wrong: list[float]) -> float:
    """P(a right completion's score > a wrong one's), ties counting half."""
    if not right or not wrong:
        return float("nan")
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / (len(right) * len(wrong))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--judge", default="smollm2-135m")
    parser.add_argument("--policy", default="smollm2-135m")
    parser.add_argument("--task", default="gsm")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from posttrain.data.judge import Judge
    from posttrain.data.prompts import encode_prompt
    from posttrain.data.tasks import get_task
    from posttrain.models.loading import load_model_and_tokenizer

    torch.manual_seed(args.seed)
    task = get_task(args.task)
    rows = task.test[:args.prompts]
    policy, tokenizer = load_model_and_tokenizer(args.policy)
    tokenizer.padding_side = "left"
    texts = []
    started = time.perf_counter()
    for row in rows:
        ids = torch.as_tensor(encode_prompt(tokenizer, row["prompt"])).view(1, -1)
        out = policy.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              max_new_tokens=task.max_new_tokens, num_return_sequences=args.samples,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    sampling = time.perf_counter() - started
    prompts = [row["prompt"] for row in rows for _ in range(args.samples)]
    columns = {k: [row[k] for row in rows for _ in range(args.samples)] for k in rows[0] if k != "prompt"}
    right = task.correct(prompts, texts, **columns)

    judge = Judge(*load_model_and_tokenizer(args.judge), batch_size=16)
    started = time.perf_counter()
    scores = judge(prompts, texts)
    pointwise_seconds = time.perf_counter() - started
    pointwise = judge.step_metrics()
    firsts, seconds, labels = [], [], []
    for i in range(len(rows)):
        for j in range(0, args.samples - 1, 2):
            a, b = i * args.samples + j, i * args.samples + j + 1
            firsts.append(texts[a])
            seconds.append(texts[b])
            labels.append((right[a], right[b]))
    started = time.perf_counter()
    verdicts = judge.prefer([rows[k // ((args.samples) // 2)]["prompt"] for k in range(len(firsts))], firsts, seconds)
    pairwise_seconds = time.perf_counter() - started
    pairwise = judge.step_metrics()

    read = [(s, r) for s, r in zip(scores, right) if s is not None]
    on_right = [s for s, r in read if r]
    on_wrong = [s for s, r in read if not r]
    decided = [(v, lab) for v, lab in zip(verdicts, labels) if v is not None]
    telling = [(v, lab) for v, lab in decided if lab[0] != lab[1]]
    chose_right = sum(lab[v] for v, lab in telling)
    print(f"judge {args.judge} on {args.policy}'s samples, task {args.task}: {len(rows)} prompts x {args.samples} "
          f"(sample accuracy {sum(right) / len(right):.3f}; sampling took {sampling:.0f} s); {os.cpu_count()} cores")
    print(f"pointwise: {pointwise['judge/parse_failures']} of {pointwise['judge/replies']} replies unreadable; "
          f"mean score on right {sum(on_right) / max(len(on_right), 1):.3f} ({len(on_right)}), on wrong "
          f"{sum(on_wrong) / max(len(on_wrong), 1):.3f} ({len(on_wrong)}); AUROC {auroc(on_right, on_wrong):.3f}; "
          f"{pointwise['judge/replies'] / pointwise_seconds:.1f} replies/s")
    print(f"pairwise: {len(decided)} of {len(firsts)} pairs decided (both orders agreeing), "
          f"{pairwise['judge/parse_failures']} of {pairwise['judge/replies']} replies unreadable; where one is right "
          f"and one wrong: chose the right one in {chose_right} of {len(telling)}; "
          f"{pairwise['judge/replies'] / pairwise_seconds:.1f} replies/s")


if __name__ == "__main__":
    main()
