"""TRL's config names in posttrain's terms, for configs and command lines brought from TRL.

``translate(flat, preset)`` takes a flat mapping (YAML or flags) that may use the field names of TRL's
``GRPOConfig``, ``DPOConfig``, ``SFTConfig`` and ``RewardConfig`` (and of transformers'
``TrainingArguments`` and TRL's ``ModelConfig`` and ``ScriptArguments``, which its command line reads
from the same YAML) and returns it in posttrain's names, with one note per translated name and one
problem per name that has no equivalent. docs/trl.md is the page for a reader; the tables here are
its source of truth:

1. ``RENAMED``: a TRL name whose value means the same under another posttrain name.
2. ``TRANSLATED``: a TRL name whose value becomes other values (``loss_type`` -> ``aggregation``,
   ``scale_rewards`` -> ``advantage``, ``use_vllm`` -> ``backend``, ...), by a function of the value,
   the preset and the rest of the mapping.
3. The batch (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``generation_batch_size``,
   ``steps_per_generation``) is translated together: TRL counts completions (GRPO) or examples per
   device and micro-step, posttrain counts prompts (or examples) per step (:func:`batch_fields`).
4. ``NO_EQUIVALENT``: a TRL name posttrain has nothing for, with the nearest posttrain field and what
   to do; it is an error, as a wrong translation would be worse.

Names TRL and posttrain share with one meaning (``learning_rate``, ``beta``, ``temperature``,
``lora_alpha``, ``max_length``, ...) need no entry. One process is assumed where TRL multiplies by
the number of processes (each of posttrain's processes takes its share of ``prompts_per_step``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.algorithms.presets import OnlineAlgorithm

RENAMED: dict[str, str] = {
    "output_dir": "output",
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "num_iterations": "num_epochs",
    "epsilon_high": "eps_high",
    "save_steps": "save_every",
    "eval_steps": "eval_every",
    "mask_truncated_completions": "overlong_filter",
    "precompute_ref_log_probs": "precompute_reference",
    "delta": "dual_clip",
    "sapo_temperature_pos": "tau_pos",
    "sapo_temperature_neg": "tau_neg",
    "off_policy_mask_threshold": "off_policy_mask",
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_dataset_split",
}
"""TRL name -> posttrain field with the same meaning and value. ``delta`` (INTELLECT-2's cap on the
ratio of the unclipped term) bounds the loss of a negative advantage at ``delta * |A|``, which is the
dual clip; for a positive advantage the clipped term already binds below it."""


@dataclass(frozen=True)
class Translation:
    """What one TRL name became: posttrain fields and their values, and a one-line note saying so."""

    values: dict[str, Any]
    note: str


class NoEquivalent(ValueError):
    """A TRL value posttrain has no translation for; the message names the nearest field and what to do."""


@dataclass(frozen=True)
class Context:
    """What a translation may depend on: the preset's kind and fields, and the whole mapping."""

    preset: Any  # OnlineAlgorithm | PreferenceAlgorithm | SupervisedAlgorithm (the base preset)
    flat: dict[str, Any]

    @property
    def kind(self) -> str:
        return type(self.preset).__name__.removesuffix("Algorithm").lower()  # online, preference, supervised

    def setting(self, name: str, default: Any = None) -> Any:
        """A posttrain field as the mapping gives it, else the preset's value, else ``default``."""
        if name in self.flat:
            return self.flat[name]
        return getattr(self.preset, name, default)


DPO_LOSS_TYPES = {"sigmoid": "dpo", "ipo": "ipo"}
"""DPOConfig ``loss_type`` -> the preference preset with that loss (its ``beta`` is TRL's: for ipo, the paper's
tau, as in TRL). tests/test_trl_preference_parity.py checks that each gives TRL's DPOTrainer's loss."""


def _loss_type(value: Any, context: Context) -> Translation:
    """GRPOConfig's ``loss_type`` is how token losses are aggregated; DPOConfig's is the preference loss."""
    types = [value] if isinstance(value, str) else list(value)
    preset = DPO_LOSS_TYPES.get(types[0]) if len(types) == 1 else None
    if context.kind == "preference":
        if preset is not None and context.preset.loss == preset:
            return Translation({}, f"loss_type {types[0]}: the {preset} preset's loss")
        if preset is not None:
            raise NoEquivalent(f"loss_type {value!r}: TRL's {types[0]} loss is --algorithm {preset}, not "
                               f"{context.preset.name}")
        raise NoEquivalent(f"loss_type {value!r}: posttrain's preference losses are presets: --algorithm dpo "
                           "(TRL's sigmoid), ipo (TRL's ipo), odpo, simpo, orpo or kto; with rpo_alpha for an added "
                           "NLL term")
    if preset is not None:
        raise NoEquivalent(f"loss_type {value!r}: DPOConfig's {types[0]} loss is --algorithm {preset}")
    if context.kind == "supervised":
        if value == "nll":
            return Translation({}, "loss_type nll: the sft objective")
        raise NoEquivalent(f"loss_type {value!r}: posttrain's SFT loss is the NLL (loss_type nll)")
    aggregations = {"grpo": "sequence_mean", "dapo": "token_mean", "dr_grpo": "constant"}
    if value in aggregations:
        return Translation({"aggregation": aggregations[value]},
                           f"loss_type {value} -> aggregation {aggregations[value]}")
    nearest = {
        "bnpo": "aggregation token_mean normalises over the optimizer step's tokens (TRL's dapo); posttrain does "
                "not normalise per micro-batch as bnpo does",
        "cispo": "use --algorithm cispo (clip is_weight, aggregation token_mean); its eps_high is TRL's "
                 "epsilon_high - 1 (the weight's cap is 1 + eps_high)",
        "sapo": "use --algorithm sapo (clip sapo, aggregation sequence_mean, TRL's loss for it); "
                "sapo_temperature_pos/neg are its tau_pos/tau_neg",
    }
    raise NoEquivalent(f"loss_type {value!r}: " + nearest.get(
        value, "posttrain's aggregations are sequence_mean (TRL's grpo), token_mean (dapo) and constant (dr_grpo)"))


def _scale_rewards(value: Any, context: Context) -> Translation:
    """True/group: divide by the group's std (advantage group); False/none: do not (group_mean, Dr.GRPO)."""
    scale = {True: "group", False: "none"}.get(value, value)
    advantage = context.setting("advantage")
    if context.kind != "online" or advantage not in ("group", "group_mean", "group_batch_std"):
        raise NoEquivalent(f"scale_rewards {value!r}: it chooses between the group estimators (advantage group "
                           f"or group_mean); {context.preset.name} uses advantage {advantage!r}")
    targets = {"group": "group", "none": "group_mean", "batch": "group_batch_std"}  # batch: Lite PPO's
    if scale not in targets:
        raise NoEquivalent(f"scale_rewards {value!r}: use group, batch, none (or true, false)")
    return Translation({"advantage": targets[scale]}, f"scale_rewards {value} -> advantage {targets[scale]}")


def _epsilon(value: Any, context: Context) -> Translation:
    """TRL's epsilon is the lower bound and, unless epsilon_high is given, the upper one too."""
    if "epsilon_high" in context.flat or "eps_high" in context.flat:
        return Translation({"eps_low": value}, f"epsilon {value} -> eps_low {value}")
    return Translation({"eps_low": value, "eps_high": value},
                       f"epsilon {value} -> eps_low {value} and eps_high {value} (no epsilon_high given)")


def _importance_sampling_level(value: Any, context: Context) -> Translation:
    if value not in ("token", "sequence"):
        raise NoEquivalent(f"importance_sampling_level {value!r}: use token or sequence")
    return Translation({"ratio": value}, f"importance_sampling_level {value} -> ratio {value}")


def _use_vllm(value: Any, context: Context) -> Translation:
    backend = "vllm" if value else "hf"
    return Translation({"backend": backend}, f"use_vllm {value} -> backend {backend}")


def _vllm_mode(value: Any, context: Context) -> Translation:
    if value != "colocate":
        raise NoEquivalent(f"vllm_mode {value!r}: posttrain's vllm backend runs the engine in the training "
                           "process (TRL's colocate); use backend vllm")
    return Translation({}, "vllm_mode colocate: how backend vllm runs")


def _resume_from_checkpoint(value: Any, context: Context) -> Translation:
    """TRL's ``True`` (resume from the output directory's last checkpoint when it has one) is auto_resume;
    a checkpoint path has no equivalent: posttrain resumes a run directory from its latest checkpoint."""
    if value is True or str(value).lower() == "true":
        return Translation({"auto_resume": True}, "resume_from_checkpoint true -> auto_resume")
    if value is False or value is None or str(value).lower() in ("false", "none"):
        return Translation({}, "resume_from_checkpoint false: a new run")
    raise NoEquivalent(f"resume_from_checkpoint {value!r}: posttrain resumes a run directory from its latest "
                       "checkpoint: --resume RUN_DIR, or --auto-resume with --output RUN_DIR")


def _bf16(value: Any, context: Context) -> Translation:
    precision = "bf16" if value else "no"
    return Translation({"mixed_precision": precision}, f"bf16 {value} -> mixed_precision {precision}")


def _lr_scheduler_type(value: Any, context: Context) -> Translation:
    """transformers' constant ignores the warm-up, constant_with_warmup keeps it; posttrain's constant
    follows the warm-up (warmup_steps, 0 by default), so both are constant."""
    schedules = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
    if value not in schedules:
        raise NoEquivalent(f"lr_scheduler_type {value!r}: lr_schedule is linear, cosine or constant")
    if value == "constant" and (context.flat.get("warmup_steps") or context.flat.get("warmup_ratio")):
        raise NoEquivalent("lr_scheduler_type 'constant' ignores the warm-up in TRL; use constant_with_warmup "
                           "(posttrain's constant after warmup_steps), or drop the warm-up")
    return Translation({"lr_schedule": schedules[value]}, f"lr_scheduler_type {value} -> lr_schedule {schedules[value]}")


def _use_peft(value: Any, context: Context) -> Translation:
    """TRL's ModelConfig trains LoRA adapters of rank lora_r (16 by default) only with use_peft."""
    if not value:
        return Translation({"lora_r": 0}, "use_peft false -> lora_r 0 (all weights train)")
    rank = context.flat.get("lora_r", 16)
    return Translation({"lora_r": rank}, f"use_peft true -> lora_r {rank}" + (
        "" if "lora_r" in context.flat else " (TRL ModelConfig's default rank)"))


def _dtype(value: Any, context: Context) -> Translation:
    if value not in ("float32", "bfloat16"):
        raise NoEquivalent(f"dtype {value!r}: posttrain's dtype is float32 or bfloat16 (mixed_precision bf16 "
                           "computes float32 weights in bfloat16)")
    return Translation({"dtype": value}, f"dtype {value} -> dtype {value}")


def _use_bias_correction_kl(value: Any, context: Context) -> Translation:
    """TRL multiplies its k3 KL by the (differentiable) importance ratio, DeepSeek-V3.2's unbiased KL; posttrain's
    kl_importance_weighted is the same weight on the same term (TRL's default is true, posttrain's false)."""
    if value and context.setting("kl_placement") != "loss":
        raise NoEquivalent(f"use_bias_correction_kl true: it weights a KL term in the loss, and "
                           f"{context.preset.name} puts its KL in {context.setting('kl_placement')!r}")
    return Translation({"kl_importance_weighted": bool(value)},
                       f"use_bias_correction_kl {value} -> kl_importance_weighted {bool(value)}")


def _assistant_only_loss(value: Any, context: Context) -> Translation:
    if not value:
        raise NoEquivalent("assistant_only_loss false: posttrain's completion_only_loss decides for messages and "
                           "prompt-completion data alike; set completion_only_loss false to train on every token")
    return Translation({"completion_only_loss": True}, "assistant_only_loss true -> completion_only_loss true")


def _disable_dropout(value: Any, context: Context) -> Translation:
    """posttrain's preference, SFT and reward-model trainers always run the model in eval mode (no dropout: the
    policy and its reference agree before the first update); the online trainer runs the model's own dropout,
    as TRL's GRPO does by default (modern LLM configs set it to 0)."""
    online = isinstance(context.preset, OnlineAlgorithm)
    if online and value:
        raise NoEquivalent("disable_dropout true: posttrain's online trainer runs the model's own dropout (TRL's "
                           "default); set the model config's dropout fields to 0 to train without it")
    if not online and not value:
        raise NoEquivalent("disable_dropout false: posttrain's preference, SFT and reward-model trainers always run "
                           "without dropout")
    return Translation({}, f"disable_dropout {value}: as posttrain runs it (" + (
        "the model's own dropout online)" if online else "preference, SFT and reward models run without dropout)"))


def _logging_steps(value: Any, context: Context) -> Translation:
    return Translation({}, f"logging_steps {value}: dropped (posttrain logs every step's metrics)")


def _warmup_ratio(value: Any, context: Context) -> Translation:
    steps = warmup_steps_of(value, context)
    return Translation({"warmup_steps": steps}, f"warmup_ratio {value} -> warmup_steps {steps} "
                       f"(ceil({value} x {optimizer_steps(context)} optimizer steps))")


def optimizer_steps(context: Context) -> int:
    """The run's optimizer steps: max_steps rollouts, each num_epochs x mini_batches updates (online)."""
    steps = context.flat.get("max_steps", 250)
    if context.kind == "online":
        steps *= context.setting("num_epochs", 1) * context.setting("mini_batches", 1)
    return steps


def warmup_steps_of(ratio: float, context: Context) -> int:
    """transformers' warm-up of a ratio: ``ceil(ratio * total optimizer steps)``."""
    return math.ceil(ratio * optimizer_steps(context))


TRANSLATED: dict[str, Callable[[Any, Context], Translation]] = {
    "loss_type": _loss_type,
    "scale_rewards": _scale_rewards,
    "epsilon": _epsilon,
    "importance_sampling_level": _importance_sampling_level,
    "use_vllm": _use_vllm,
    "vllm_mode": _vllm_mode,
    "bf16": _bf16,
    "resume_from_checkpoint": _resume_from_checkpoint,
    "lr_scheduler_type": _lr_scheduler_type,
    "use_peft": _use_peft,
    "torch_dtype": _dtype,
    "use_bias_correction_kl": _use_bias_correction_kl,
    "assistant_only_loss": _assistant_only_loss,
    "logging_steps": _logging_steps,
    "warmup_ratio": _warmup_ratio,
    "disable_dropout": _disable_dropout,
}
"""TRL name -> the function that translates its value (it raises NoEquivalent for a value without one)."""

BATCH_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
               "steps_per_generation")
"""TRL's batch settings, translated together by :func:`batch_fields`."""

TRL_DEFAULT_BATCH = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}

NO_EQUIVALENT: dict[str, str] = {
    "num_train_epochs": "passes over the training set; posttrain runs max_steps steps of prompts_per_step "
                        "prompts (pairs_per_step examples offline): set max_steps = epochs x rows / prompts_per_step. "
                        "(posttrain's num_epochs is TRL's num_iterations.)",
    "fp16": "posttrain's mixed precision is mixed_precision bf16",
    "per_device_eval_batch_size": "held-out prompts are scored in micro_batch_size batches; drop it",
    "eval_strategy": "posttrain evaluates every eval_every steps (0: only before and after training)",
    "save_strategy": "posttrain saves every save_every steps (0: only at the end)",
    "logging_strategy": "posttrain logs every step's metrics; drop it",
    "optim": "posttrain trains with AdamW (learning_rate, weight_decay)",
    "adam_beta1": "posttrain's AdamW keeps torch's betas (0.9, 0.999)",
    "adam_beta2": "posttrain's AdamW keeps torch's betas (0.9, 0.999)",
    "adam_epsilon": "posttrain's AdamW keeps torch's eps (1e-8)",
    "run_name": "the run's directory is output",
    "logging_dir": "metrics go under output (report_to chooses the trackers)",
    "push_to_hub": "posttrain writes OUTPUT/final_model/; upload it with huggingface-cli upload",
    "hub_model_id": "posttrain writes OUTPUT/final_model/; upload it with huggingface-cli upload",
    "sync_ref_model": "ref_refresh_every N copies the policy into the reference every N steps (TRL's "
                      "ref_model_mixup_alpha 1.0); there is no soft mix-up",
    "ref_model_sync_steps": "ref_refresh_every (a hard copy, TRL's ref_model_mixup_alpha 1.0)",
    "ref_model_mixup_alpha": "ref_refresh_every (a hard copy, TRL's ref_model_mixup_alpha 1.0)",
    "vllm_importance_sampling_correction": "correction (token-truncate, token-mask, sequence-truncate, sequence-mask; "
                                           "off by default) with correction_high (TRL's clip_max)",
    "vllm_importance_sampling_mode": "correction: TRL's token_truncate is token-truncate, sequence_mask sequence-mask",
    "vllm_importance_sampling_cap": "correction_high",
    "vllm_importance_sampling_clip_max": "correction_high",
    "vllm_importance_sampling_clip_min": "correction_low",
    "top_entropy_quantile": "posttrain's losses train every token",
    "min_p": "sampling takes temperature, top_p and top_k",
    "repetition_penalty": "sampling takes temperature, top_p and top_k",
    "log_completions": "log_samples_every N writes sampled completions to samples.jsonl",
    "num_completions_to_print": "log_samples_every N writes sampled completions to samples.jsonl",
    "loss_weights": "rpo_alpha weights an added NLL term (TRL's ['sigmoid', 'sft'] loss)",
    "model_init_kwargs": "dtype (float32 or bfloat16)",
    "dataset_text_field": "SFT reads a `text` column (or prompt + completion, or messages)",
    "truncation_mode": "max_length keeps the start of a completion and the end of a prompt (max_prompt_length)",
    "padding_free": "packing",
    "num_generations_eval": "held-out prompts are scored by one greedy completion each",
}
"""TRL name -> the nearest posttrain field and what to do."""


def batch_fields(given: dict[str, Any], context: Context) -> Translation:
    """TRL's batch settings as posttrain's.

    GRPO: one generation holds ``generation_batch_size`` completions (default ``per_device_train_batch_size
    x steps_per_generation``; ``steps_per_generation`` defaults to ``gradient_accumulation_steps``), i.e.
    ``generation_batch_size / num_generations`` prompts: posttrain's prompts_per_step. It is trained in
    ``steps_per_generation / gradient_accumulation_steps`` optimizer steps (posttrain's mini_batches, set
    only when steps_per_generation or generation_batch_size is given), each of micro-batches of
    ``per_device_train_batch_size`` completions (micro_batch_size).
    DPO, SFT, reward model: ``per_device_train_batch_size x gradient_accumulation_steps`` examples per
    optimizer step (pairs_per_step), micro-batches of ``per_device_train_batch_size`` examples
    (micro_batch_size counts sequences: a pair is two).
    """
    per_device = given.get("per_device_train_batch_size", TRL_DEFAULT_BATCH["per_device_train_batch_size"])
    accumulation = given.get("gradient_accumulation_steps", TRL_DEFAULT_BATCH["gradient_accumulation_steps"])
    for name, value in (("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", accumulation)):
        if not isinstance(value, int) or value < 1:
            raise NoEquivalent(f"{name} {value!r}: use a whole number >= 1")
    if context.kind != "online":
        if "generation_batch_size" in given or "steps_per_generation" in given:
            raise NoEquivalent("generation_batch_size, steps_per_generation: the offline trainers generate nothing")
        pairs = per_device * accumulation
        sequences = per_device * (2 if _paired(context) else 1)
        return Translation({"pairs_per_step": pairs, "micro_batch_size": sequences},
                           f"per_device_train_batch_size {per_device} x gradient_accumulation_steps {accumulation} "
                           f"-> pairs_per_step {pairs}, micro_batch_size {sequences} (sequences"
                           + (", two per pair)" if _paired(context) else ")"))
    group = context.flat.get("group_size", context.flat.get("num_generations", 8))  # TRL's default is posttrain's
    if not isinstance(group, int) or group < 1:
        raise NoEquivalent(f"completions count in groups of num_generations, which is {group!r}; use 1 or more")
    if "generation_batch_size" in given and "steps_per_generation" in given:
        raise NoEquivalent("generation_batch_size, steps_per_generation: give one (as TRL requires)")
    steps_per_generation = given.get("steps_per_generation", accumulation)
    completions = given.get("generation_batch_size", per_device * steps_per_generation)
    if completions % per_device:
        raise NoEquivalent(f"generation_batch_size {completions}: must be a multiple of per_device_train_batch_size "
                           f"{per_device} (as TRL requires)")
    steps_per_generation = completions // per_device
    if completions % group:
        raise NoEquivalent(f"per_device_train_batch_size {per_device} x steps_per_generation {steps_per_generation} "
                           f"= {completions} completions per generation is no whole number of groups of "
                           f"num_generations {group}; posttrain counts prompts (prompts_per_step)")
    if steps_per_generation % accumulation:
        raise NoEquivalent(f"steps_per_generation {steps_per_generation}: must be a multiple of "
                           f"gradient_accumulation_steps {accumulation} (whole optimizer steps per generation)")
    values = {"prompts_per_step": completions // group, "micro_batch_size": per_device}
    explicit = "generation_batch_size" in given or "steps_per_generation" in given
    if explicit:
        values["mini_batches"] = steps_per_generation // accumulation
    note = (f"{completions} completions per generation (per_device_train_batch_size {per_device} x "
            f"{steps_per_generation} steps) / num_generations {group} -> prompts_per_step {values['prompts_per_step']}, "
            f"micro_batch_size {per_device}")
    if explicit:
        note += f", mini_batches {values['mini_batches']} (= {steps_per_generation} / gradient_accumulation_steps " \
                f"{accumulation} optimizer steps per generation)"
    return Translation(values, note)


def _paired(context: Context) -> bool:
    """Examples are (chosen, rejected) pairs: two sequences each (paired preference losses, reward model)."""
    if context.kind == "preference":
        return context.preset.paired
    return getattr(context.preset, "objective", None) == "reward_model"


@dataclass
class Translated:
    """A flat mapping in posttrain's names, what each TRL name became, and the names without equivalent."""

    flat: dict[str, Any]
    notes: list[str]
    problems: list[str]


def translate(flat: dict[str, Any], preset: Any, around: dict[str, Any] | None = None) -> Translated:
    """``flat`` with every TRL name replaced by posttrain's (see the module docstring). ``around``: the
    values of the other layers of the config (a YAML file's, under the flags'), which translations that
    depend on other fields also read."""
    context = Context(preset, {**(around or {}), **flat})
    result = Translated({k: v for k, v in flat.items() if not is_trl_name(k)}, [], [])
    translations: list[tuple[list[str], Translation]] = []
    for key, value in flat.items():
        try:
            if key in RENAMED:
                translations.append(([key], Translation({RENAMED[key]: value}, f"{key} {value} -> {RENAMED[key]} {value}")))
            elif key in TRANSLATED:
                translations.append(([key], TRANSLATED[key](value, context)))
            elif key in NO_EQUIVALENT:
                result.problems.append(f"{key}: TRL's name, no posttrain equivalent: {NO_EQUIVALENT[key]}")
        except NoEquivalent as error:
            result.problems.append(f"{key}: {error}")
    batch = {k: flat[k] for k in BATCH_NAMES if k in flat}
    if batch:
        try:
            translations.append((list(batch), batch_fields(batch, context)))
        except NoEquivalent as error:
            result.problems.append(f"{', '.join(batch)}: {error}")
    for names, translation in translations:
        for target, value in translation.values.items():
            if target in result.flat and result.flat[target] != value:
                result.problems.append(f"{', '.join(names)}: TRL's name for {target}, which is also given "
                                       f"({result.flat[target]!r} against {value!r}); keep one")
            result.flat[target] = value
        result.notes.append(translation.note)
    return result


def is_trl_name(key: str) -> bool:
    """A name this module translates or refuses (never one of posttrain's own fields)."""
    return key in RENAMED or key in TRANSLATED or key in NO_EQUIVALENT or key in BATCH_NAMES
