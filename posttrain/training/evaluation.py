"""``posttrain eval``: one model on built-in tasks and datasets, with intervals users can trust.

:func:`evaluate_model` loads the model once and evaluates it on one or more built-in tasks (their
held-out split) and/or a dataset scored by reward functions: greedy decoding for accuracy and, with
``samples`` > 1, K sampled completions per problem for pass@1, pass@K and maj@K (the estimators
and their intervals are in :mod:`posttrain.tracking.stats`). Correct means the task's own check; on a
dataset, a total reward of at least ``success_threshold``. maj@K votes with the task's final-answer
parser (``Task.final_answer``), on a dataset with :func:`posttrain.data.rewards.final_answer` (boxed,
``####``, "answer is", the last number).

With ``prompt_variants`` every problem is asked under each variant of the set
(:mod:`posttrain.data.prompt_variants`: no instruction, ``Answer:``, "The answer is", ``####``,
``\\boxed{}``, reasoning first, a system prompt; or the user's own templates) and scored per variant,
then summarised across them: the mean over variants and the worst one, each with its interval
(:func:`posttrain.tracking.stats.across_variants`). A gain that holds only under the training prompt
shows as a high mean with a low worst.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config import Config, ConfigError, DataConfig, ModelConfig, RolloutConfig
from posttrain.data.images import encode_row_prompt, has_images, image_names
from posttrain.data.prompt_variants import PromptVariant, ask, resolve_variants
from posttrain.data.rewards import final_answer
from posttrain.models.loading import load_model_and_tokenizer
from posttrain.parallel.distributed import say
from posttrain.rollout.completions import Completions, SamplingParams
from posttrain.rollout.episodes import Tools, make_episode_generator, tool_format
from posttrain.rollout.generators import generate_texts, make_generator
from posttrain.tracking.stats import across_variants, summarise, wilson_interval
from posttrain.training.session import (
    Workload,
    eos_token_ids,
    load_workload,
    score_texts,
)


@dataclass
class EvalSpec:
    """What ``posttrain eval`` evaluates on besides the model; the defaults are the CLI's."""

    tasks: list[str] = field(default_factory=list)  # built-in task names or reasoning-gym:SPEC
    dataset: str | None = None  # JSONL/JSON/CSV/Parquet prompts scored by ``reward``
    reward: list[str] = field(default_factory=list)  # FILE.py:FUNCTION, for the dataset
    reward_weights: list[float] = field(default_factory=list)
    eval_size: int = 500  # problems per task (at most the task's held-out split)
    samples: int = 1  # K sampled completions per problem (1: greedy only)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None  # default: the task's
    success_threshold: float = 1.0  # on a dataset: a completion is correct when its total reward >= this
    seed: int = 0
    prompt_variants: str | None = None  # a variant set, names or a template file: each problem asked every way


@dataclass
class TaskResult:
    name: str  # the task, and with prompt variants the variant: "TASK [VARIANT]"
    problems: int
    metrics: dict[str, float]  # e.g. accuracy, accuracy_low, accuracy_high, pass@1, ...
    greedy: list[dict[str, Any]] = field(default_factory=list)  # per problem: prompt, completion, correct, ...
    task: str = ""  # the task alone ("" : name)
    variant: str | None = None  # the prompt variant the problems were asked under (None: the task's prompts)

    @property
    def correct(self) -> int:
        """Problems whose greedy completion was correct (``accuracy`` times ``problems``)."""
        return sum(bool(record["correct"]) for record in self.greedy)


@dataclass(frozen=True)
class Evaluation:
    """A model's results on the tasks of an :class:`EvalSpec` (what ``posttrain.evaluate`` returns): ``str()`` is
    what ``posttrain eval`` prints, :meth:`to_dict` what its ``--output`` writes, ``evaluation[task]`` one
    task's :class:`TaskResult`."""

    model: str
    spec: EvalSpec
    results: tuple[TaskResult, ...]

    def __getitem__(self, task: str) -> TaskResult:
        for result in self.results:
            if result.name == task:
                return result
        raise KeyError(f"{task!r} was not evaluated; the tasks: {', '.join(r.name for r in self.results)}")

    def __str__(self) -> str:
        return format_results(self.model, self.results, self.spec)

    @property
    def across_variants(self) -> dict[str, dict[str, float | str]]:
        """Per task asked under prompt variants: the mean accuracy over variants and the worst variant's, with
        intervals (:func:`variant_summaries`); empty without ``prompt_variants``."""
        return variant_summaries(self.results)

    def to_dict(self) -> dict[str, Any]:
        return results_payload(self.model, self.results, self.spec)


def evaluate_model(model: str | None, spec: EvalSpec, *, device: str = "auto",
                   dtype: str = "float32") -> tuple[str, list[TaskResult]]:
    """Evaluate ``model`` (default: the first task's built-in model) on every task of ``spec``; returns
    the model's name and one result per task. Every task and dataset is loaded and checked before
    the model is."""
    if spec.samples < 1:
        raise ConfigError(f"samples: got {spec.samples}; use 1 (greedy only) or more")
    variants = resolve_variants(spec.prompt_variants) if spec.prompt_variants else [None]
    targets = [(name, config, load_workload(config)) for name, config in _targets(model, spec, device, dtype)]
    asked = [(name, config, work, variant, _asked_rows(name, work, variant))
             for name, config, work in targets for variant in variants]  # a row without a question fails here
    model_name = model or next((work.default_model for _, _, work in targets if work.default_model), None)
    if model_name is None:
        raise ConfigError("model: give --model PATH (a local Hugging Face model directory)")
    policy, tokenizer = load_model_and_tokenizer(model_name, dtype=dtype, device=device)
    policy.eval()
    eos_ids = eos_token_ids(policy, tokenizer)
    return model_name, [_evaluate_task(name, config, work, policy, tokenizer, eos_ids, spec, rows, variant)
                        for name, config, work, variant, rows in asked]


def _asked_rows(name: str, work: Workload, variant: PromptVariant | None) -> list[dict[str, Any]]:
    """The held-out rows, their prompts asked under ``variant`` (None: as the task asks them)."""
    return work.test_rows if variant is None else ask(work.test_rows, variant, name)


def _targets(model: str | None, spec: EvalSpec, device: str, dtype: str) -> list[tuple[str, Config]]:
    """(name, Config) per task of ``spec``, then the dataset's: the training config's data checks apply."""
    def config(data: DataConfig) -> Config:
        return Config(algorithm="grpo", model=ModelConfig(model=model, device=device, dtype=dtype), data=data,
                      rollout=RolloutConfig(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                                            top_p=spec.top_p))

    targets = [(task, config(DataConfig(task=task, eval_size=spec.eval_size))) for task in spec.tasks]
    if spec.dataset is not None:  # every row is a problem: the dataset is its own held-out set
        targets.append((spec.dataset, config(DataConfig(
            dataset=spec.dataset, eval_dataset=spec.dataset, reward=tuple(spec.reward),
            reward_weights=tuple(spec.reward_weights), eval_size=spec.eval_size))))
    if not targets:
        raise ConfigError("eval: name a --task or a --dataset (with --reward) to evaluate on")
    return targets


def _evaluate_task(name: str, config: Config, work: Workload, policy: Any, tokenizer: Any, eos_ids: list[int],
                   spec: EvalSpec, rows: list[dict[str, Any]], variant: PromptVariant | None) -> TaskResult:
    """Greedy completions of every held-out problem, then (``spec.samples`` > 1) K samples each."""
    if not rows:
        raise ConfigError(f"eval: {name} has no problems to evaluate on")
    extract = work.final_answer or final_answer
    label = name if variant is None else f"{name} [{variant.name}]"

    def outcomes(texts: list[str], g: int, completions: Completions) -> tuple[list[bool], list[float]]:
        scores, correct = score_texts(work, config.data, rows, texts, g, completions.rewards)
        total = scores.total.tolist()
        verdicts = correct.tolist() if correct is not None else [t >= spec.success_threshold for t in total]
        return verdicts, total

    torch.manual_seed(spec.seed)
    params = SamplingParams(work.max_new_tokens, spec.temperature, spec.top_p, 0)
    if work.tools or work.environment:  # a task with tools or an environment is scored on its episodes
        generator = make_episode_generator(
            "hf", policy, tokenizer, params, eos_ids,
            Tools(work.tools, timeout=work.tool_timeout or 0.0) if work.tools else None,
            tool_format(work.tool_format or "auto", tokenizer) if work.tools else None,
            max_turns=config.episodes.max_turns,
            environment=work.environment)
    else:
        generator = make_generator("hf", policy, tokenizer, params, eos_ids)
    prompt_ids = [encode_row_prompt(tokenizer, row, f"{name}: row {i}", tools=work.tools)[0]
                  for i, row in enumerate(rows, 1)]
    say(f"eval: {label}, {len(rows)} problems" + (f", {spec.samples} samples each" if spec.samples > 1 else ""))
    k, per_sample, answers = spec.samples, None, None
    with torch.no_grad():
        greedy_texts, greedy_completions = generate_texts(generator, tokenizer, prompt_ids, greedy=True, rows=rows)
        if k > 1:
            texts, completions = generate_texts(generator, tokenizer, prompt_ids, k, rows=rows)
    correct, rewards = outcomes(greedy_texts, 1, greedy_completions)
    lengths = greedy_completions.lengths.float().tolist()
    calls = tool_calls_of(greedy_completions) if work.tools and not work.environment else None
    if k > 1:
        flat, _ = outcomes(texts, k, completions)
        per_sample = [flat[i * k:(i + 1) * k] for i in range(len(rows))]
        answers = [[extract(t) for t in texts[i * k:(i + 1) * k]] for i in range(len(rows))]
    greedy = [{"task": name, "variant": variant and variant.name, "question": row.get("question"),
               "prompt": row["prompt"], "answer": row.get("answer"), "completion": text,
               "final_answer": extract(text), "correct": ok, "reward": reward, "length": length,
               **({"images": image_names(row)} if has_images(row) else {})}
              for row, text, ok, reward, length in zip(rows, greedy_texts, correct, rewards, lengths)]
    metrics = summarise(correct, rewards, lengths, per_sample, answers)
    if calls is not None:
        for record, n in zip(greedy, calls):
            record["tool_calls"] = n
        called = sum(n > 0 for n in calls)
        metrics["tool_call_rate"] = called / len(rows)
        metrics["tool_call_rate_low"], metrics["tool_call_rate_high"] = wilson_interval(called, len(rows))
        metrics["tool_calls"] = sum(calls) / len(rows)
    return TaskResult(label, len(rows), metrics, greedy, name, variant and variant.name)


def tool_calls_of(completions: Completions) -> list[int]:
    """Tool calls in each episode: the spans of inserted tokens (each call's result is one span, and the
    policy writes at least one token between two calls; a malformed call's error counts, as it is a call)."""
    inserted = completions.inserted
    if inserted is None:
        return [0] * len(completions.completion_ids)
    starts = inserted & ~torch.nn.functional.pad(inserted[:, :-1], (1, 0), value=False)
    return starts.sum(dim=1).tolist()


def variant_summaries(results: Sequence[TaskResult]) -> dict[str, dict[str, float | str]]:
    """Per task evaluated under prompt variants: :func:`~posttrain.tracking.stats.across_variants` of its
    variants' greedy verdicts (the mean over variants and the worst, with intervals)."""
    by_task: dict[str, dict[str, list[bool]]] = {}
    for result in results:
        if result.variant is not None:
            by_task.setdefault(result.task, {})[result.variant] = [bool(r["correct"]) for r in result.greedy]
    return {task: across_variants(correct) for task, correct in by_task.items()}


def format_results(model: str, results: Sequence[TaskResult], spec: EvalSpec) -> str:
    """One block per task: greedy accuracy, reward, length; pass@1, pass@K, maj@K with K samples."""
    lines = []
    for result in results:
        m = result.metrics
        lines.append(f"{model} on {result.name} ({result.problems} problems)")
        lines.append(f"  greedy accuracy {m['accuracy']:.3f}  95% CI [{m['accuracy_low']:.3f}, "
                     f"{m['accuracy_high']:.3f}]   reward {m['reward']:.3f}   length {m['completion_length']:.1f}")
        if spec.samples > 1:
            k = spec.samples
            parts = [f"{name} {m[name]:.3f} [{m[name + '_low']:.3f}, {m[name + '_high']:.3f}]"
                     for name in (*(key for key in m if key.startswith("pass@") and key.count("_") == 0),
                                  f"maj@{k}") if name in m]
            lines.append(f"  {k} samples at temperature {spec.temperature:g}: " + "   ".join(parts))
        if "tool_call_rate" in m:
            lines.append(f"  tool calls: {m['tool_call_rate']:.3f} of episodes call a tool  95% CI "
                         f"[{m['tool_call_rate_low']:.3f}, {m['tool_call_rate_high']:.3f}]   "
                         f"{m['tool_calls']:.2f} calls per episode")
    for task, summary in variant_summaries(results).items():
        count = sum(result.task == task and result.variant is not None for result in results)
        lines.append(f"{model} on {task} across {count} prompt variants: mean accuracy {summary['mean']:.3f} "
                     f"[{summary['mean_low']:.3f}, {summary['mean_high']:.3f}]   worst {summary['worst']:.3f} "
                     f"[{summary['worst_low']:.3f}, {summary['worst_high']:.3f}] ({summary['worst_variant']})")
    return "\n".join(lines)


def results_payload(model: str, results: Sequence[TaskResult], spec: EvalSpec) -> dict[str, Any]:
    """The results as JSON values: the model, the settings, and each task's problem count and metrics."""
    payload = {"model": model, "settings": {k: v for k, v in vars(spec).items()},
               "tasks": {r.name: {"problems": r.problems, **r.metrics} for r in results}}
    summaries = variant_summaries(results)
    if summaries:
        payload["across_variants"] = summaries
    return payload


def write_results(path: str | Path, model: str, results: Sequence[TaskResult], spec: EvalSpec) -> None:
    """:func:`results_payload` written to ``path`` as JSON."""
    Path(path).write_text(json.dumps(results_payload(model, results, spec), indent=2) + "\n", encoding="utf-8")


def write_completions(path: str | Path, results: Sequence[TaskResult]) -> None:
    """Every problem's greedy completion as JSONL: task, prompt, reference answer, completion, the
    final answer parsed from it, correct, reward, length: what the model does, before and after."""
    with open(path, "w", encoding="utf-8") as out:
        for result in results:
            for record in result.greedy:
                out.write(json.dumps(record, default=str) + "\n")
