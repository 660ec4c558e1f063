"""One training pass's memory on a real model against the defaults' estimate of it (posttrain.training.defaults).

    .venv/bin/python benchmarks/step_memory.py                       # SmolLM2: LoRA r16 and full, checkpointing off/on
    .venv/bin/python benchmarks/step_memory.py --prompts 8 --lora 16 --checkpointing 0

Each setting runs in a child process of its own (so that each peak is its own) with posttrain's allocator
setting (``keep_freed_memory``, as a run has it) and the model's packed attention, as a run loads them: it
collates a GRPO-shaped micro-batch (``--prompts`` prompts of ``--prompt-tokens`` tokens, 4 completions each of
``--completion-tokens``), runs the training forward (with entropies) and the backward, and samples the process's
resident memory every 5 ms. Printed per setting: the tokens of the pass, the measured rise over the memory
before it, and what the estimate counts for the same (its activations and LM-head blocks, and the trainable
parameters' gradients), with their ratio. The estimate's factors (``LORA_PASS_FACTOR``, ``FULL_PASS_FACTOR``,
``CHECKPOINTED_LAYERS``) come from these figures and a whole run's (benchmarks/model_defaults.py).
Needs the SmolLM2 GGUF (``make test-smollm2``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = 4


def child(model_name: str, lora: int, checkpointing: bool, prompts: int, prompt_tokens: int, completion_tokens: int) -> dict:
    import torch

    from posttrain.config import ModelConfig
    from posttrain.models.compute import checkpoint_layers, use_packed_attention
    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.models.lora import apply_lora
    from posttrain.models.modeling import collate, forward
    from posttrain.parallel.allocator import keep_freed_memory
    from posttrain.training.defaults import estimated_peak, model_shape

    keep_freed_memory()
    model, _ = load_model_and_tokenizer(model_name)
    if lora:
        model = apply_lora(model, ModelConfig(model=model_name, lora_r=lora))
    model.train()
    use_packed_attention(model)
    if checkpointing:
        checkpoint_layers(model)
    torch.manual_seed(0)
    prompt_ids = [torch.randint(100, 40000, (prompt_tokens,)) for _ in range(prompts)]
    prompt_ids = [p for p in prompt_ids for _ in range(GROUP)]  # a group's samples share their prompt
    completions = torch.randint(100, 40000, (prompts * GROUP, completion_tokens))
    mask = torch.ones_like(completions, dtype=torch.float)
    batch = collate(prompt_ids, completions, mask, 0, torch.device("cpu"))
    tokens = prompts * (prompt_tokens + GROUP * completion_tokens)  # the packed row: each prompt once

    def resident() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    before, peak = resident(), [0]

    def watch() -> None:
        while True:
            peak[0] = max(peak[0], resident())
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    out = forward(model, batch, with_entropy=True)
    (out.logprobs * mask).sum().backward()
    time.sleep(0.05)
    shape = model_shape(model, lora, model_name)
    fixed = shape.parameters * 4 + shape.trainable * 4 * 3  # the weights, gradients and moments (no step here)
    counted = estimated_peak(shape, tokens, checkpointing=checkpointing, reference=False) - fixed + shape.trainable * 4
    return {"tokens": tokens, "rise": peak[0] - before, "estimate": counted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lora", type=int, nargs="+", default=[16, 0], help="LoRA ranks (0: full fine-tuning)")
    parser.add_argument("--checkpointing", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--prompts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=110)
    parser.add_argument("--completion-tokens", type=int, default=90)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    gib = 2**30
    for lora, checkpointing, prompts in itertools.product(args.lora, args.checkpointing, args.prompts):
        spec = dict(model_name=args.model, lora=lora, checkpointing=bool(checkpointing), prompts=prompts,
                    prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens)
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT, check=True,
                              capture_output=True, text=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{'LoRA r' + str(lora) if lora else 'full':8s} checkpointing {'on ' if checkpointing else 'off'} "
              f"{r['tokens']:5d} tokens: measured {r['rise'] / gib:.2f} GiB, estimated {r['estimate'] / gib:.2f} GiB "
              f"({r['estimate'] / r['rise']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
