"""vLLM's CPU build as posttrain's sampler: start-up, tokens/s, weight-sync time, and how far its log-probs are
from the trainer's, at the SmolLM2 recipe's rollout shape.

    make vllm
    .venv-vllm/bin/python benchmarks/vllm_cpu.py                       # 16 prompts x 4 samples x 128 tokens
    .venv/bin/python benchmarks/generation.py --prompts 16 --samples 4 --new-tokens 128 --skip eos   # posttrain

Runs in .venv-vllm (vLLM's pins). For each engine dtype (bfloat16, float32), one colocated engine
(:class:`posttrain.rollout.vllm.VLLMGenerator`, the ``--backend vllm`` path) on the recipe's gsm prompts:

- start-up: constructing the engine (model load, KV cache, warm-up);
- tokens/s: ``--samples`` completions of ``--new-tokens`` tokens for each of ``--prompts`` prompts, EOS
  never stopping a row (every row decodes the whole budget, as ``benchmarks/generation.py --skip eos``
  runs posttrain's decode loop), median of ``--repeats`` calls, weight sync excluded;
- sync: the in-place load of the policy's weights before each rollout;
- the sampler-trainer KL: the same calls at temperature 1 with EOS on, each sampled token's engine log-prob
  against the fp32 trainer's recomputed one (the ``mismatch/kl_k1`` and ``kl_k3`` a run logs).

Only one process should run: the figures are the machine's. The load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()

    from posttrain.data.prompts import encode_prompt
    from posttrain.data.tasks import get_task
    from posttrain.models.loading import load_model_and_tokenizer, resolve_model_path
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.vllm import VLLMGenerator
    from posttrain.training.session import eos_token_ids

    trainer, tokenizer = load_model_and_tokenizer(args.model, device="cpu")
    trainer.eval()
    rows = list(get_task("gsm").train)[: args.prompts]
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    eos = eos_token_ids(trainer, tokenizer)
    print(f"{args.model}: {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x "
          f"{args.samples} samples x {args.new_tokens} tokens; {torch.get_num_threads()} threads; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    path = str(resolve_model_path(args.model))
    for dtype in args.dtypes.split(","):
        from vllm import SamplingParams as VLLMSampling

        policy = trainer.to(getattr(torch, dtype))
        start = time.perf_counter()
        generator = VLLMGenerator(policy, tokenizer, SamplingParams(args.new_tokens, 1.0, 1.0, 0), eos,
                                  model_path=path, max_model_len=1024, seed=0)
        startup = time.perf_counter() - start
        # tokens/s of the engine the backend holds, every row decoding the whole budget
        budget = VLLMSampling(n=args.samples, max_tokens=args.new_tokens, ignore_eos=True, logprobs=0, temperature=1.0)
        requests = [{"prompt_token_ids": ids.tolist()} for ids in prompts]
        generator.llm.generate(requests[:2], sampling_params=budget, use_tqdm=False)  # warm-up
        rates, syncs = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            generator.sync_weights()
            syncs.append(time.perf_counter() - start)
            start = time.perf_counter()
            outputs = generator.llm.generate(requests, sampling_params=budget, use_tqdm=False)
            tokens = sum(len(sample.token_ids) for request in outputs for sample in request.outputs)
            rates.append(tokens / (time.perf_counter() - start))
        # the KL: the backend's own call (EOS on, temperature 1) against the fp32 trainer
        out = generator.generate(prompts, num_samples=args.samples)
        trainer.float()
        k1, k3, tokens = 0.0, 0.0, 0
        for row in range(len(out.completion_ids)):
            prompt, n = prompts[row // args.samples], int(out.mask[row].sum())
            with torch.no_grad():
                logits = trainer(input_ids=torch.cat([prompt, out.completion_ids[row, :n]])[None]).logits
            recomputed = torch.log_softmax(logits[0, len(prompt) - 1:-1].float(), -1)
            chosen = recomputed.gather(-1, out.completion_ids[row, :n, None])[:, 0]
            d = chosen - out.sampling_logprobs[row, :n]  # log(pi_trainer / pi_sampler)
            k1, k3, tokens = k1 + float(-d.sum()), k3 + float((torch.expm1(d) - d).sum()), tokens + n
        print(f"{dtype:9s} start-up {startup:5.1f} s   {statistics.median(rates):6.1f} tokens/s (median of "
              f"{args.repeats}: {', '.join(f'{r:.0f}' for r in rates)})   sync {statistics.median(syncs):.2f} s   "
              f"KL to the fp32 trainer: k1 {k1 / tokens:.2e}, k3 {k3 / tokens:.2e} over {tokens} tokens", flush=True)
        del generator
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
