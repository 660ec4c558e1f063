"""The sections of a run's configuration: frozen dataclasses, one per concern.

Every field carries a one-line help text (``metadata["help"]``) that the CLI shows in ``posttrain
train --help``; invalid values are rejected where a section is built, with a message that names the
field and says what to change. :mod:`posttrain.config` puts the sections together into a
:class:`~posttrain.config.Config` and maps it to and from a flat YAML mapping.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.tracking.metrics import TRACKERS


def _help(text: str, default: Any = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": text}, **kw)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix. ``problems`` holds one
    line per problem when several are reported at once (the message is those lines)."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def is_reward_name(spec: str) -> bool:
    """Whether a ``reward`` spec names a registered reward, ``NAME`` or ``NAME(SETTING=VALUE,...)``, rather than
    a function in a file, ``FILE.py:FUNCTION``; the name is looked up where the rewards are loaded
    (posttrain.data.rewards.load_reward)."""
    return re.fullmatch(r"\s*[A-Za-z_]\w*\s*(\(.*\))?\s*", spec, re.DOTALL) is not None


class Checks:
    """A section's problems, collected so that a config reports all of them at once, not one per run."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def __call__(self, ok: bool, field_name: str, message: str) -> None:
        if not ok:
            self.problems.append(f"{field_name}: {message}")

    def raise_any(self) -> None:
        if self.problems:
            raise ConfigError(*self.problems)


DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
"""File types a dataset may be read from; a name with one of them is a file, never a hub id."""

HUB_PREFIX = "hf:"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def hub_dataset_name(source: str) -> str | None:
    """The Hugging Face dataset that ``source`` names, or None when it names a file.

    ``hf:NAME`` is always a hub id; otherwise a path that exists, or ends in a data-file suffix, is a
    file, and ``name`` or ``owner/name`` (letters, digits, ``-``, ``_``, ``.``) is a hub id."""
    if source.startswith(HUB_PREFIX):
        return source[len(HUB_PREFIX):]
    if Path(source).exists() or source.endswith(DATA_FILE_SUFFIXES) or not _HUB_ID.fullmatch(source):
        return None
    return source


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _help(
        "Policy model: a local Hugging Face directory, a .gguf file, or a built-in name "
        "(tiny-addition, tiny-addition-base: untrained, for SFT; smollm2-135m). Default: the task's own starting model."
    )
    dtype: str = _help("Parameter and compute dtype: float32 or bfloat16.", "float32")
    mixed_precision: str = _help(
        "no, bf16 or auto. bf16: float32 weights, gradients and optimizer state, with the decoder layers computed "
        "in bfloat16 (torch.autocast) in training and generation; the LM head, log-probs and losses stay "
        "float32. Needs a GPU or a CPU with AVX512-BF16 or AMX. auto: bf16 where the hardware computes it "
        "natively, else no (elsewhere bfloat16 products are emulated, slower than float32). A model of 20M "
        "parameters or more gets auto unless set.", "no",
    )
    device: str = _help("cpu, cuda, or auto (cuda when available).", "auto")
    lora_r: int = _help("LoRA rank (0 = train all weights). With LoRA the reference is the base model.", 0)
    lora_alpha: float = _help("LoRA scaling numerator (scale = lora_alpha / lora_r).", 16.0)
    lora_dropout: float = _help("Dropout on the LoRA branch.", 0.0)
    train_vision: str = _help("A vision-language model's vision parts: none (the tower and the projector frozen; "
                              "the language model trains), projector (the projector trains too) or tower (both "
                              "do). Under LoRA the adapters stay on the language model and these train whole.",
                              "none")
    lora_target_modules: tuple[str, ...] = _help(
        "Module names that get adapters (repeatable). Default: every linear layer but the LM head and a router "
        "(attention, MLP, linear-attention and convolution projections) and a mixture of experts' experts "
        "(docs/reference/models.md).", (),
    )
    trust_remote_code: bool = _help(
        "Run the Python code a model directory ships (config.json's auto_map) to build a model transformers does "
        "not have. Off: such a model is refused, naming its code.", False,
    )
    gradient_checkpointing: bool = _help(
        "Keep only each decoder layer's input through the forward pass and recompute the layer in the "
        "backward: the same gradients with a fraction of the activation memory, for about one more "
        "forward pass of time. A model of 20M parameters or more gets it where its step would not fit in half "
        "the machine's memory otherwise, unless set.", False,
    )
    offload_reference: bool = _help(
        "Keep the reference model's weights (and a teacher's) out of memory between its passes (in a temporary "
        "file on the CPU, in host memory on a GPU) and load them for each pass: one copy of the weights less "
        "at the step's peak, for one read of them per pass. The log-probs are unchanged.", False,
    )
    teacher: str | None = _help(
        "On-policy distillation's teacher (a distillation preset, e.g. on_policy_distill): a local Hugging Face "
        "directory, a .gguf file or a built-in name with the student's tokenizer. It scores the student's samples "
        "token by token, frozen, where the reference does.", None,
    )
    teachers: tuple[str, ...] = _help(
        "Multi-teacher distillation (multi_teacher_distill): TASK=MODEL, one per task of the mixture; each row is "
        "scored by its own task's teacher (data's task_column), which must share the student's tokenizer.", (),
    )
    fsdp: bool = _help(
        "Shard the policy, its gradients and AdamW's state over processes with PyTorch FSDP2 "
        "(on by itself under an `accelerate launch` FSDP config). Multi-process runs only.", False,
    )

    def __post_init__(self) -> None:
        require = Checks()
        require(self.dtype in ("float32", "bfloat16"), "dtype", f"got {self.dtype!r}; use float32 or bfloat16")
        require(self.mixed_precision in ("no", "bf16", "auto"), "mixed_precision",
                f"got {self.mixed_precision!r}; use no, bf16 or auto")
        require(self.mixed_precision != "bf16" or self.dtype == "float32", "mixed_precision",
                 f"bf16 computes float32 weights in bfloat16; with dtype {self.dtype} they already are "
                 "(use dtype float32 with mixed_precision bf16, or mixed_precision no)")
        require(self.device in ("cpu", "cuda", "auto"), "device", f"got {self.device!r}; use cpu, cuda or auto")
        require(self.lora_r >= 0, "lora_r", f"got {self.lora_r}; use 0 (off) or a positive rank")
        require(self.lora_alpha > 0, "lora_alpha", f"got {self.lora_alpha}; use a value > 0")
        require(0 <= self.lora_dropout < 1, "lora_dropout", f"got {self.lora_dropout}; use a value in [0, 1)")
        require(self.train_vision in ("none", "projector", "tower"), "train_vision",
                f"got {self.train_vision!r}; use none, projector or tower")
        require(not (self.offload_reference and self.lora_r), "offload_reference",
                 "with LoRA the reference is the policy with its adapters off, not a copy: there is nothing to "
                 "offload; drop --offload-reference or set lora_r 0")
        for problem in teacher_problems(self.teachers):
            require(False, "teachers", problem)
        require.raise_any()

    def teacher_by_task(self) -> dict[str, str]:
        """``teachers`` as task -> model (each item split at its first ``=``)."""
        return dict(item.split("=", 1) for item in self.teachers)


def teacher_problems(items: tuple[str, ...]) -> list[str]:
    """What is wrong with ``teachers`` items: each must be TASK=MODEL, both sides given, each task once."""
    problems, seen = [], set()
    for item in items:
        task, separator, model = item.partition("=")
        if not separator or not task.strip() or not model.strip():
            problems.append(f"got {item!r}; give TASK=MODEL, e.g. --teachers chain_sum=./math-teacher")
        elif task in seen:
            problems.append(f"task {task!r} is given two teachers; give each task one")
        seen.add(task)
    return problems


@dataclass(frozen=True)
class DataConfig:
    task: str | None = _help(
        "Built-in task: addition, addition-process, gsm, gsm-calculator, calculator, code or shapes (images, "
        "tiny-vision's); reasoning-gym:FAMILY[(NAME=VALUE,...)][=WEIGHT],... for "
        "reasoning-gym's procedural families, mixed by weight (the reasoning-gym extra); or gem:ENV_ID for a GEM "
        "environment's multi-turn games (the gem extra). Online presets; ignored when --dataset is given.",
        "addition")
    dataset: str | None = _help(
        "Training data: a .jsonl/.json/.parquet/.csv file; a directory (a datasets save_to_disk Dataset or "
        "DatasetDict, or data-file shards of one kind, read in name order); or a Hugging Face dataset by name "
        "(owner/name; hf:owner/name too), read by datasets.load_dataset from the local cache when offline. Online "
        "presets need a `prompt` column; other columns reach the reward functions."
    )
    dataset_config: str | None = _help("The configuration (subset) of a Hugging Face --dataset / --eval-dataset "
                                       "by name; default: the dataset's only or default one.")
    dataset_split: str = _help("The split of a Hugging Face --dataset by name, or of a saved DatasetDict, that "
                               "trains.", "train")
    eval_dataset: str | None = _help("Held-out prompts for --dataset runs (same formats); none by default.")
    eval_dataset_split: str = _help("The split of a Hugging Face --eval-dataset by name, or of a saved "
                                    "DatasetDict.", "test")
    reward: tuple[str, ...] = _help(
        "Reward function(s), repeatable: a built-in or registered name (exact_match, numeric_match, math_answer, "
        "format_reward, length_penalty), its settings in parentheses if any ('length_penalty(max_chars=400)'), or "
        "FILE.py:FUNCTION. Default: the task's rewards.", (),
    )
    reward_weights: tuple[float, ...] = _help("One weight per reward function (default 1.0 each).", ())
    reward_url: tuple[str, ...] = _help(
        "A reward service's URL (repeatable): each step's batch is posted to it as JSON (prompts, completions, "
        "every column) and it answers one score per completion (a list, or {\"scores\": [...]}; null: does not "
        "apply), added to the rewards with weight 1.", ())
    reward_url_timeout: float = _help("Seconds a reward service (--reward-url, a --judge URL) has to answer one "
                                      "request before it is retried.", 60.0)
    reward_url_retries: int = _help("Retries of a request to a reward service that cannot be reached, times out "
                                    "or answers 5xx, after 0.5 s, 1 s, 2 s, ...", 2)
    reward_model: str | None = _help(
        "A learned reward: a sequence-classification model directory (num_labels 1; posttrain train --algorithm "
        "reward_model makes one) that scores each prompt + completion, batched on the training device. With "
        "--reward it is added to the functions; without, it replaces the task's rewards (the task's answer check "
        "still gives accuracy, so reward hacking shows).")
    reward_model_weight: float = _help("Weight of the reward model's score in the total reward.", 1.0)
    reward_model_normalize: str = _help(
        "none, or batch: standardise the reward model's scores over each scoring call's batch (mean 0, std 1), "
        "so their scale does not depend on how the reward model was trained.", "none")
    judge: str | None = _help(
        "LLM-as-judge: a causal language model (directory, .gguf or built-in name) that scores each prompt + "
        "completion with judge_rubric (an integer on 1-10, mapped to [0, 1]; an unreadable reply scores None and "
        "is counted in judge/parse_failures), greedy, batched on the training device, cached per (prompt, "
        "completion). With --reward it is added to the functions, without it replaces the task's rewards; in "
        "preference runs on the policy's own pairs it labels the pairs instead (pairwise, both orders). A URL "
        "(http://...) names a judge service instead, which is posted the batch and judge_rubric's text as "
        "--reward-url is (online presets).")
    judge_rubric: str = _help(
        "The judge's pointwise template: pointwise (built-in) or a text file with {prompt}, {completion}, "
        "{low} and {high}.", "pointwise")
    judge_pairwise_rubric: str = _help(
        "The judge's pairwise template: pairwise (built-in) or a text file with {prompt}, {first} and {second}.",
        "pairwise")
    judge_weight: float = _help("Weight of the judge's score in the total reward.", 1.0)
    group_length_penalty: float | None = _help(
        "Weight of Kimi k1.5's length penalty (arXiv:2501.12599, sec. 2.3.3; F.group_length_penalty) added to "
        "the reward: within a prompt's group, 0.5 - (length - shortest) / (longest - shortest) for a correct "
        "completion, at most 0 for a wrong one. Online presets on a task that checks answers. Default: off.")
    group_length_penalty_after: int = _help(
        "Steps trained without the length penalty before it applies (Kimi k1.5's warm-up: standard policy "
        "optimization first, then the constant penalty). A model right on few of its samples learns to stop "
        "early under the penalty (in a group with no right answer it alone ranks the completions, the shortest "
        "first): warm up until most groups hold a right answer. Default: 0.", 0)
    reward_timeout: float = _help(
        "Seconds per reward-function call; > 0 runs each call in a forked worker killed at the limit.", 0.0,
    )
    reward_errors: str = _help(
        "When a reward raises, times out or returns NaN: error (stop, showing the sample) or skip "
        "(drop that sample's group from the update, counted in reward/failures).", "error",
    )
    long_prompts: str = _help("Online prompts over max_prompt_length: error (naming the first) or drop (counted).", "error")
    difficulty_filter_low: float | None = _help(
        "Skip, before generating, a training prompt whose group pass rate when last sampled was at or below "
        "this (0: never solved), for the rest of the run (prime-rl's hard threshold). Online presets on a task "
        "that checks answers. Default: off.")
    difficulty_filter_high: float | None = _help(
        "Skip, before generating, a training prompt whose group pass rate when last sampled was at or above "
        "this (1: always solved), for the rest of the run (prime-rl's easy threshold). Default: off.")
    eval_size: int = _help("Held-out prompts scored (greedy) at each evaluation (at most the task's held-out split).", 500)
    eval_tasks: tuple[str, ...] = _help(
        "More tasks (built-in or reasoning-gym:SPEC, repeatable) whose held-out splits are scored at every "
        "evaluation besides the run's own, e.g. a family the run does not train on, to see whether a skill "
        "transfers; logged as eval/LABEL/accuracy (LABEL: the task's name, or a reasoning-gym spec's families "
        "joined by +). Online presets.", (),
    )
    train_prompt_variants: str | None = _help(
        "Ask each training prompt under a variant drawn for it, so the problem is learnt, not a phrasing: train "
        "(ten built-in phrasings), built-in names, or a .yaml/.json file of templates holding {question}.")
    eval_prompt_variants: str | None = _help(
        "Score each eval_tasks entry under every variant (eval: seven built-in ways of asking; names; a file) "
        "at each evaluation: eval/LABEL@VARIANT/, eval/LABEL/variants_mean and variants_worst.")
    eval_subset: int = _help(
        "Held-out prompts scored at the evaluations during training: the first N of the eval_size set, to keep "
        "evaluation a small share of a slow model's run; the evaluations before and after training score all "
        "eval_size. 0: all.", 0,
    )
    privileged_column: str | None = _help(
        "Self-distillation (sdft): the column each row's teacher reads after its prompt, a demonstration or a "
        "worked answer. Default: solution on a built-in task, privileged_context (TRL's name) on a --dataset.")
    task_column: str | None = _help(
        "Multi-teacher distillation (multi_teacher_distill): the column naming each row's task, the TASK of its "
        "--teachers entry. Default: a reasoning-gym row's family, else the column task.")
    teacher_prompt_template: str = _help(
        "Self-distillation (sdft): how the teacher's prompt joins the row's prompt and its privileged context; "
        "holds {prompt} and {privileged_context} (TRL's default). A chat prompt's last user message is filled.",
        "{prompt}\n\n{privileged_context}")

    def __post_init__(self) -> None:
        require = Checks()
        for placeholder in ("{prompt}", "{privileged_context}"):
            require(placeholder in self.teacher_prompt_template, "teacher_prompt_template",
                    f"{self.teacher_prompt_template!r} has no {placeholder}; the teacher reads the prompt and the "
                    "row's privileged context, e.g. '{prompt}\\n\\n{privileged_context}'")
        try:
            self.teacher_prompt_template.format(prompt="", privileged_context="")
        except (KeyError, IndexError, ValueError) as error:
            require(False, "teacher_prompt_template", f"{self.teacher_prompt_template!r} is not a template of "
                    f"{{prompt}} and {{privileged_context}} alone ({type(error).__name__}: {error}); write a literal "
                    "brace as {{ or }}")
        require(self.reward_timeout >= 0, "reward_timeout", f"got {self.reward_timeout}; use 0 (off) or seconds")
        require(self.reward_errors in ("error", "skip"), "reward_errors", f"got {self.reward_errors!r}; use error or skip")
        for url in self.reward_url:
            require(url.startswith(("http://", "https://")), "reward_url",
                    f"got {url!r}; give the service's URL, e.g. http://127.0.0.1:8000/score")
        require(len(set(self.reward_url)) == len(self.reward_url), "reward_url", "a service is named twice; "
                "name each once")
        require(self.reward_url_timeout > 0, "reward_url_timeout", f"got {self.reward_url_timeout}; use seconds > 0")
        require(self.reward_url_retries >= 0, "reward_url_retries", f"got {self.reward_url_retries}; use 0 or more")
        require(self.long_prompts in ("error", "drop"), "long_prompts", f"got {self.long_prompts!r}; use error or drop")
        require(self.group_length_penalty is None or self.group_length_penalty > 0, "group_length_penalty",
                f"got {self.group_length_penalty}; use a weight > 0 (Kimi k1.5 adds it with weight 1), or none")
        require(self.group_length_penalty_after >= 0, "group_length_penalty_after",
                f"got {self.group_length_penalty_after}; use a number of steps >= 0")
        low, high = self.difficulty_filter_low, self.difficulty_filter_high
        require(low is None or 0 <= low < 1, "difficulty_filter_low",
                f"got {low}; use a pass rate in [0, 1) (0 skips prompts never solved), or none")
        require(high is None or 0 < high <= 1, "difficulty_filter_high",
                f"got {high}; use a pass rate in (0, 1] (1 skips prompts always solved), or none")
        require(low is None or high is None or low < high, "difficulty_filter_high",
                f"got {high} with difficulty_filter_low {low}: no pass rate would be trained on; use "
                "difficulty_filter_low < difficulty_filter_high")
        require(self.eval_size >= 0, "eval_size", f"got {self.eval_size}; use 0 (no evaluation) or more")
        require(self.eval_subset >= 0, "eval_subset", f"got {self.eval_subset}; use 0 (all of eval_size) or more")
        require(self.eval_prompt_variants is None or bool(self.eval_tasks), "eval_prompt_variants",
                "asks the eval_tasks' problems several ways; add an eval_tasks entry (or use posttrain eval "
                "--prompt-variants on a final model)")
        require(
            not self.reward_weights or len(self.reward_weights) == len(self.reward),
            "reward_weights",
            f"{len(self.reward_weights)} weights for {len(self.reward)} --reward functions; give one per function",
        )
        for name in ("dataset", "eval_dataset"):
            source = getattr(self, name)
            require(source is None or hub_dataset_name(source) is not None or Path(source).exists(), name,
                    f"file {source!r} does not exist (a Hugging Face dataset is named owner/name)")
        require(self.reward_model_normalize in ("none", "batch"), "reward_model_normalize",
                 f"got {self.reward_model_normalize!r}; use none or batch")
        if self.reward_model is not None:
            require(Path(self.reward_model, "config.json").is_file(), "reward_model",
                     f"{self.reward_model!r} is not a model directory (no config.json); give the final_model/ of a "
                     "posttrain train --algorithm reward_model run, or any sequence-classification model directory")
        for name in ("judge_rubric", "judge_pairwise_rubric"):
            spec = getattr(self, name)
            require(spec in ("pointwise", "pairwise") or Path(spec).is_file(), name,
                    f"{spec!r} is neither a built-in rubric (pointwise, pairwise) nor a file")
        for spec in self.reward:
            if is_reward_name(spec):
                continue
            path = spec.rsplit(":", 1)[0]
            require(":" in spec, "reward", f"{spec!r} is not FILE.py:FUNCTION")
            require(Path(path).exists(), "reward", f"file {path!r} of {spec!r} does not exist")
        require.raise_any()


TOOL_FORMATS = ("auto", "hermes", "llama3", "mistral", "json", "inline", "qwen3_coder", "harmony")

CORRECTIONS = {"token-truncate": ("token", "truncate"), "token-mask": ("token", "mask"),
               "sequence-truncate": ("sequence", "truncate"), "sequence-mask": ("sequence", "mask"),
               "geometric-mask": ("geometric", "mask")}
"""``correction`` name -> (level, mode) of :func:`posttrain.functional.rollout_correction`."""


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = _help("Prompts per optimizer step (B). A model of 20M parameters or more on a CPU: 16, "
                                  "unless set.", 32)
    group_size: int = _help("Completions sampled per prompt (G). A model of 20M parameters or more on a CPU: 4, "
                            "unless set.", 8)
    max_new_tokens: int | None = _help("Token budget per completion. Default: the task's.")
    temperature: float = _help("Sampling temperature (log-probs are computed at the same temperature).", 1.0)
    top_p: float = _help("Nucleus sampling threshold (1.0 = off).", 1.0)
    top_k: int = _help("Top-k sampling (0 = off).", 0)
    backend: str = _help("Generation backend: hf (posttrain's decode loop) or vllm (a colocated vLLM engine: its CUDA build "
                         "on a GPU, its CPU build from make vllm on a CPU).", "hf")
    rollout_server: tuple[str, ...] = _help(
        "URL of a rollout server started with posttrain serve (repeatable): the rollouts are sampled there, the "
        "prompts shared among the servers, the policy's weights published to them before each rollout; a server "
        "that fails is dropped and its prompts go to the others.", ())
    rollout_timeout: float = _help("Seconds a rollout server may take to start, answer a request or load weights "
                                   "before it is dropped.", 600.0)
    weight_transport: str = _help(
        "How the weights reach the rollout servers: filesystem (a file per version in weight_sync_dir), gloo (sent "
        "over TCP to each server: no shared disk needed) or nccl (GPU to GPU; the trainer on a GPU).", "filesystem")
    weight_sync_dir: str | None = _help(
        "With weight_transport filesystem: the directory the weights are published to (every server must read "
        "it: one machine, or a shared disk). Default: weights/ in the run's output directory.")
    weight_sync_address: str = _help(
        "With weight_transport gloo or nccl: HOST or HOST:PORT of this machine as the servers reach it, where the "
        "trainer listens for them to join (port 0 or none: a free one).", "127.0.0.1")
    max_no_signal_steps: int = _help(
        "Stop after this many consecutive steps in which every group's rewards were all equal (zero "
        "advantages: nothing is learned); a warning comes after 5. 0 = never stop.", 25,
    )
    def __post_init__(self) -> None:
        require = Checks()
        require(self.prompts_per_step >= 1, "prompts_per_step", f"got {self.prompts_per_step}; use 1 or more")
        require(self.group_size >= 1, "group_size", f"got {self.group_size}; use 1 or more")
        require(
            self.max_new_tokens is None or self.max_new_tokens > 0,
            "max_new_tokens", f"got {self.max_new_tokens}; the token budget must be > 0",
        )
        require(self.temperature > 0, "temperature", f"got {self.temperature}; use a value > 0")
        require(0 < self.top_p <= 1, "top_p", f"got {self.top_p}; use a value in (0, 1]")
        require(self.top_k >= 0, "top_k", f"got {self.top_k}; use 0 (off) or more")
        for url in self.rollout_server:
            require(url.startswith(("http://", "https://")), "rollout_server",
                    f"got {url!r}; give the server's URL, e.g. http://127.0.0.1:8000")
        require(self.rollout_timeout > 0, "rollout_timeout", f"got {self.rollout_timeout}; use seconds > 0")
        port = self.weight_sync_address.rpartition(":")[2] if ":" in self.weight_sync_address else "0"
        require(port.isdigit() and int(port) < 65536, "weight_sync_address",
                f"got {self.weight_sync_address!r}; use HOST or HOST:PORT, e.g. 10.0.0.5:29600")
        require(self.max_no_signal_steps >= 0, "max_no_signal_steps",
                 f"got {self.max_no_signal_steps}; use 0 (never stop) or more")
        require.raise_any()


@dataclass(frozen=True)
class EpisodeConfig:
    """Multi-turn episodes: tools the policy calls, an environment it plays (posttrain.rollout.episodes)."""

    tools: tuple[str, ...] = _help(
        "Tools the policy may call, as FILE.py:FUNCTION (repeatable): each completion becomes a multi-turn "
        "episode in which a call's result is inserted (and never trained on) before the policy goes on.", (),
    )
    tool_format: str | None = _help(
        "How calls are written: auto (from the chat template: one of the families below where it renders tool "
        "calls, else json); hermes (Qwen2.5/3, Hermes: <tool_call>{...}</tool_call>), llama3 ({\"name\": ..., "
        "\"parameters\": ...}), mistral ([TOOL_CALLS] [...]), qwen3_coder (Qwen3-Coder, Qwen3.5: <tool_call> "
        "<function=NAME> <parameter=ARG>...) or harmony (gpt-oss: a message to=functions.NAME ending with "
        "<|call|>), each ending the turn, its results rendered by the chat template; json (<tool_call>{...}"
        "</tool_call> mid-turn, answered by <tool_response>) or inline ([tool argument], for character-level "
        "models). Default: the task's, else auto.")
    mcp_server: tuple[str, ...] = _help(
        "An MCP server whose tools the policy may call, as the command line that starts it over stdio, e.g. "
        "'npx -y @modelcontextprotocol/server-everything' (repeatable; split as a shell would, run in this "
        "directory with this environment): its tools join those of --tools, described to the model by their JSON "
        "schemas, each call waiting up to tool_timeout. One that cannot start stops the run at its start, quoting "
        "its stderr; one that exits later makes its calls fail as crash (posttrain.rollout.mcp_tools).", ())
    environment: str | None = _help(
        "An environment the policy plays, as FILE.py:CLASS (reset(row), step(turn) -> Step; "
        "posttrain.data.environments): each completion is an episode whose turns the environment answers; its "
        "reward reaches the reward functions as the environment_reward column, and is added to them. Or "
        "verifiers:NAME[(KEY=VALUE,...)], an installed verifiers taskset with its settings (the verifiers "
        "extra): it replaces --task, bringing its tasks, its rewards and its multi-turn env or tools.")
    agent: str | None = _help(
        "Your agent, as FILE.py:FUNCTION or module:function, FUNCTION(client, row) -> float | None: each episode "
        "runs it once with client, an openai.OpenAI (openai.AsyncOpenAI for an async def) pointed at posttrain's "
        "chat-completions endpoint, and the dataset row; every call is answered by the policy and recorded token "
        "for token (posttrain.rollout.agents). The number it returns is the episode's reward; None leaves the "
        "episode to the task's rewards. With --reward (or --reward-url, --reward-model, --judge) those score every "
        "episode, the number reaching them as the agent_reward column.")
    agent_timeout: float = _help("Seconds an agent's episode may run (its calls included); one that runs past "
                                 "it is dropped and counted in episode/dropped/timeout. 0: no limit.", 600.0)
    max_turns: int = _help("Policy turns per episode with tools or an environment (the last turn's call, if any, "
                           "is not run).", 4)
    tool_timeout: float | None = _help("Seconds per tool call; > 0 runs each in a forked worker killed at the limit "
                                       "(an MCP server's call is cancelled at it), 0 in-process with no limit. "
                                       "Default: the task's, else 10.")
    tool_errors: str = _help("When a call fails (unknown tool, malformed call, a raise, a timeout, a non-text "
                             "result): feedback (the policy reads the error; counted in episode/tool_errors) or "
                             "error (stop the run). An environment that raises: feedback ends its episode with "
                             "reward -1 (counted in episode/environment_errors); error stops the run.", "feedback")

    def __post_init__(self) -> None:
        require = Checks()
        require(self.tool_format in (None, *TOOL_FORMATS), "tool_format",
                 f"got {self.tool_format!r}; use {', '.join(TOOL_FORMATS)}")
        require(self.max_turns >= 1, "max_turns", f"got {self.max_turns}; use 1 or more")
        require(self.tool_timeout is None or self.tool_timeout >= 0, "tool_timeout",
                 f"got {self.tool_timeout}; use 0 (in-process) or seconds")
        require(self.tool_errors in ("feedback", "error"), "tool_errors",
                 f"got {self.tool_errors!r}; use feedback or error")
        require(self.agent is None or _is_function_spec(self.agent), "agent",
                f"{self.agent!r} is not FILE.py:FUNCTION of an existing file or module:function")
        require(self.agent_timeout >= 0, "agent_timeout", f"got {self.agent_timeout}; use seconds, or 0 for no limit")
        for command in self.mcp_server:
            require(_command_words(command) is not None, "mcp_server",
                    f"{command!r} is not a command line (e.g. 'python server.py --flag'): its quotes do not close"
                    if command.strip() else "an empty command; give the command line that starts the server")
        for field_name, specs, kind in (("tools", self.tools, "FUNCTION"),
                                        ("environment", (self.environment,) if self.environment else (), "CLASS")):
            for spec in specs:
                require(spec.startswith("verifiers:") and field_name == "environment"
                        or ":" in spec and Path(spec.rsplit(":", 1)[0]).is_file(), field_name,
                        f"{spec!r} is not FILE.py:{kind} of an existing file"
                        + (" or verifiers:NAME" if field_name == "environment" else ""))
        require.raise_any()


def _is_function_spec(spec: str) -> bool:
    """``FILE.py:NAME`` of an existing file, or ``module.path:name``."""
    location, sep, name = spec.rpartition(":")
    if not sep or not name.isidentifier():
        return False
    if location.endswith(".py") or "/" in location:
        return Path(location).is_file()
    return all(part.isidentifier() for part in location.split("."))


def _command_words(command: str) -> list[str] | None:
    """A command line's words as a shell splits them; None when it has none or its quotes do not close."""
    try:
        return shlex.split(command) or None
    except ValueError:
        return None


@dataclass(frozen=True)
class OffPolicyConfig:
    """Samples from a sampler that is not the trained policy: measured, corrected (F.rollout_correction)."""

    correction: str | None = _help(
        "Correct the policy gradient for a sampler that is not the trained policy (another engine or precision, "
        "a perturbed copy): token-truncate (TIS), token-mask, sequence-truncate, sequence-mask or geometric-mask "
        "(F.rollout_correction). Needs the sampler's log-probs (the hf decode loop and vLLM keep them); the "
        "mismatch/ metrics are logged whenever they are known. Default: no correction.")
    correction_high: float = _help("The correction's cap (truncate) or its band's upper bound (mask).", 2.0)
    correction_low: float | None = _help("The band's lower bound of the mask corrections. Default 1 / correction_high.")
    sampler_noise: float = _help(
        "Sample from a copy of the policy whose weights carry multiplicative Gaussian noise of this relative "
        "size, drawn afresh each step: a deliberately mismatched sampler, to measure the correction. 0: sample "
        "from the policy.", 0.0)
    sampler_dtype: str | None = _help(
        "Sample from a copy of the policy whose weights are in this dtype (bfloat16 or float16) while the trainer "
        "keeps its own: the engine-precision mismatch of the papers on rollout correction. Default: the policy's.")
    routing_replay: bool = _help(
        "A mixture of experts' training passes take the experts each token was routed to while it was sampled "
        "(Rollout Routing Replay, arXiv:2510.11370), the weights recomputed from the trainer's router: a sampler "
        "in another precision (sampler_dtype) or version routes some tokens elsewhere, and the trainer would "
        "otherwise score another computation than the one that sampled. Needs the hf backend, single turns, "
        "and no gradient checkpointing.", False)
    async_rollout: bool = _help(
        "Sample in a process of its own, with its own copy of the weights, up to max_staleness steps ahead of the "
        "trainer, which trains meanwhile: each step trains on completions sampled by the policy max_staleness "
        "versions before it (posttrain.training.rollouts). With rollout_server the servers sample, driven from a "
        "thread of the trainer. The sampler's log-probs are kept, so the correction and the mismatch/ metrics "
        "apply.", False)
    max_staleness: int = _help(
        "With async_rollout: how many policy versions (optimizer steps of the preset) a step's completions may be "
        "behind the policy it updates. 0 samples each batch when its step begins, as a synchronous run does, "
        "with the same result.", 1)
    rollout_threads: int | None = _help(
        "With async_rollout and max_staleness >= 1: torch threads of the rollout process; the trainer keeps the "
        "rest of its own. Default: half (on 2 cores, one each). With max_staleness 0 the two take turns, and the "
        "rollout process has as many as the trainer.")
    partial_rollouts: bool = _help(
        "With async_rollout and max_staleness >= 1: a request still being sampled when newer weights reach the "
        "rollout process is interrupted (between two decode steps; rollout servers abort it), and its unfinished "
        "rows continue from their own tokens under the new weights (their keys and values recomputed by them, as "
        "AReaL does); every token records the policy version that sampled it (the staleness/token_ metrics), and "
        "its sampler log-prob is that version's, so the correction applies per token. Needs posttrain's own "
        "sampler or rollout servers (backend hf) and single-turn rollouts.", False)

    @property
    def sampling_copy(self) -> bool:
        """Whether a copy of the policy, not the policy, samples the rollouts."""
        return bool(self.sampler_noise or self.sampler_dtype)

    def __post_init__(self) -> None:
        require = Checks()
        require(self.correction in (None, *CORRECTIONS), "correction",
                 f"got {self.correction!r}; use one of {', '.join(CORRECTIONS)}")
        require(self.correction_high > 0, "correction_high", f"got {self.correction_high}; use a value > 0")
        require(self.correction != "geometric-mask" or self.correction_high >= 1.0, "correction_high",
                 f"got {self.correction_high}; the geometric mask's band must contain 1")
        low = 1.0 / max(self.correction_high, 1e-12) if self.correction_low is None else self.correction_low
        require(0 < low <= self.correction_high, "correction_low",
                 f"got {self.correction_low}; use a value in (0, correction_high]")
        require(self.sampler_noise >= 0, "sampler_noise", f"got {self.sampler_noise}; use 0 or more")
        require(self.sampler_dtype in (None, "bfloat16", "float16"), "sampler_dtype",
                 f"got {self.sampler_dtype!r}; use bfloat16 or float16")
        require(self.max_staleness >= 0, "max_staleness", f"got {self.max_staleness}; use 0 or more")
        require(self.rollout_threads is None or self.rollout_threads >= 1, "rollout_threads",
                 f"got {self.rollout_threads}; use 1 or more")
        require(not self.partial_rollouts or self.async_rollout, "partial_rollouts",
                 "it interrupts the requests of the rollout process; add --async-rollout with --max-staleness 1 "
                 "or more, or drop --partial-rollouts")
        require(not (self.partial_rollouts and self.async_rollout and self.max_staleness == 0), "partial_rollouts",
                 "with max_staleness 0 each request is answered before newer weights exist, so none is ever "
                 "interrupted; set --max-staleness 1 or more, or drop --partial-rollouts")
        require(not (self.partial_rollouts and self.routing_replay), "partial_rollouts",
                 "a continued row's experts are not recorded across the weight update; drop --routing-replay or "
                 "--partial-rollouts")
        require.raise_any()


LR_SCHEDULES = ("constant", "linear", "cosine")
PAIR_SOURCES = ("auto", "dataset", "policy")
"""``pairs_from`` values; ``auto`` is ``policy`` on a built-in task and ``dataset`` with ``--dataset``."""


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = _help("AdamW learning rate (a preset may default to its own: posttrain algorithms "
                                 "lists default_learning_rate). A model of 20M parameters or more gets TRL's rate "
                                 "for its trainer (1e-6 RL and preference, 2e-5 SFT, 1e-5 reward model), ten times "
                                 "that under LoRA, unless set.", 1e-4)
    weight_decay: float = _help("AdamW weight decay.", 0.0)
    warmup_steps: int = _help("Linear learning-rate warm-up over this many optimizer steps.", 0)
    lr_schedule: str = _help(
        "Learning rate after the warm-up: linear (to 0 at the last step, as in TRL), cosine (to 0) or constant.",
        "linear",
    )
    max_grad_norm: float = _help("Gradient clipping by global norm (0 = off).", 1.0)
    micro_batch_size: int = _help(
        "Sequences per forward/backward pass; gradients accumulate to the full optimizer step.", 64,
    )
    max_tokens_per_micro_batch: int | None = _help(
        "Size micro-batches by tokens instead of rows: rows (online), examples (preference, SFT) or pairs "
        "(reward model) are placed by length, best-fit decreasing, into micro-batches of at most this many "
        "prompt + completion tokens (a prompt computed once counted once); a longer one runs alone. Replaces "
        "micro_batch_size; the loss is the same. A model of 20M parameters or more gets the largest of 4096 down "
        "to 256 whose step fits in half the machine's memory, unless this or micro_batch_size is set.")
    share_prompts: bool = _help(
        "Online and preference trainers: rows of a micro-batch that share a prompt (a group's samples, a pair's "
        "two answers) run it once, each completion attending to it (where that saves enough positions to pay); "
        "the same log-probs, losses and gradients. false: every row runs its prompt.", True)
    trim_padding: bool = _help(
        "A micro-batch's sequences run as one packed row, no padding computed, attention kept inside each "
        "sequence (with transformers' SDPA attention, the default; with another, the online and preference "
        "trainers group rows by completion length, each group trimmed to its longest); the same log-probs, "
        "losses and gradients. false: one pass over the padded micro-batch.", True)
    value_loss_coef: float = _help("Weight of the value loss (PPO's value head).", 0.1)
    ref_refresh_every: int = _help("Copy the policy into the reference model every N steps (0 = never).", 0)
    max_bad_steps: int = _help("Stop after this many consecutive steps with a non-finite loss or gradient.", 3)
    offload_optimizer: bool = _help(
        "Keep AdamW's two moments out of memory between optimizer steps (in a temporary file on the CPU, "
        "in host memory on a GPU) and step one parameter at a time: two copies of the weights less "
        "through the forward and backward passes, for one read and one write of them per step. "
        "The update is unchanged.", False,
    )

    def __post_init__(self) -> None:
        require = Checks()
        require(self.learning_rate > 0, "learning_rate", f"got {self.learning_rate}; use a value > 0")
        require(self.warmup_steps >= 0, "warmup_steps", f"got {self.warmup_steps}; use 0 or more")
        require(self.lr_schedule in LR_SCHEDULES, "lr_schedule",
                 f"got {self.lr_schedule!r}; use one of {', '.join(LR_SCHEDULES)}")
        require(self.micro_batch_size >= 1, "micro_batch_size", f"got {self.micro_batch_size}; use 1 or more")
        require(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
                "max_tokens_per_micro_batch", f"got {self.max_tokens_per_micro_batch}; use 1 or more (or none)")
        require(self.max_grad_norm >= 0, "max_grad_norm", f"got {self.max_grad_norm}; use 0 (off) or more")
        require(self.ref_refresh_every >= 0, "ref_refresh_every", f"got {self.ref_refresh_every}; use 0 or more")
        require(self.max_bad_steps >= 1, "max_bad_steps", f"got {self.max_bad_steps}; use 1 or more")
        require.raise_any()


@dataclass(frozen=True)
class PreferenceConfig:
    """The offline trainers' data: preference presets, SFT and the reward model."""

    pairs_per_step: int = _help("Examples per optimizer step: preference pairs (KTO: labelled examples; sft: "
                                "demonstrations; reward_model: pairs).", 64)
    max_length: int = _help("Token budget of prompt + completion; longer completions keep their start.", 1024)
    max_prompt_length: int = _help("Prompt token budget: preference data keeps a longer one's end; online: long_prompts.", 512)
    precompute_reference: bool = _help(
        "Score the whole dataset with the reference model once at the start instead of every step.", False,
    )
    pairs_from: str = _help(
        "Where the training pairs come from: auto (policy on a built-in task, dataset with --dataset), dataset "
        "(--dataset's pairs, or the built-in task's fixed synthetic pairs: a right scratchpad against one with a "
        "slip) or policy (group_size completions per prompt sampled from the policy being trained and labelled by "
        "the task's answer check: a correct completion is chosen over an incorrect one of the same prompt; built-in "
        "tasks only). The reward model samples its pairs once, from the starting model.", "auto",
    )
    resample_every: int = _help(
        "With pairs_from policy: sample a new round of pairs from the current policy every N steps (iterative, "
        "or with 1 online, preference optimization); a round samples prompts_per_step x N prompts.", 10,
    )
    packing: bool = _help(
        "SFT: place each step's demonstrations into rows of up to max_length tokens (positions restart per "
        "example, attention never crosses one) instead of padding each to the longest: the same loss, faster "
        "on examples of varied length; a small model on short examples runs faster padded "
        "(benchmarks/sft_packing.py).", True,
    )

    def __post_init__(self) -> None:
        _require(self.pairs_per_step >= 1, "pairs_per_step", f"got {self.pairs_per_step}; use 1 or more")
        _require(self.pairs_from in PAIR_SOURCES, "pairs_from",
                 f"got {self.pairs_from!r}; use {', '.join(PAIR_SOURCES)}")
        _require(self.resample_every >= 1, "resample_every", f"got {self.resample_every}; use 1 or more")
        _require(isinstance(self.packing, bool), "packing", f"got {self.packing!r}; use true or false")
        _require(not (self.pairs_from == "policy" and self.precompute_reference), "precompute_reference",
                 "pairs sampled from the policy change every resample_every steps, so the reference scores them "
                 "as they come; drop precompute_reference or use pairs_from dataset")
        _require(self.max_prompt_length >= 1, "max_prompt_length", f"got {self.max_prompt_length}; use 1 or more")
        _require(
            self.max_length > self.max_prompt_length, "max_length",
            f"got {self.max_length} with max_prompt_length {self.max_prompt_length}; "
            "leave room for the completion: max_length > max_prompt_length",
        )


@dataclass(frozen=True)
class RunConfig:
    output: str | None = _help("Run directory (default: runs/<algorithm>-<time>).")
    max_steps: int = _help("Optimizer steps to run.", 250)
    max_minutes: float = _help("Stop after this much training time (0 = no limit).", 0.0)
    seed: int = _help("Seed for sampling, data order and initialisation.", 0)
    eval_every: int = _help("Evaluate on held-out prompts every N steps (0 = only before and after).", 25)
    save_every: int = _help("Save a checkpoint every N steps (0 = only at the end).", 50)
    log_samples_every: int = _help("Write sampled completions to samples.jsonl every N steps.", 10)
    resume: str | None = _help("Resume the run in this directory from its latest checkpoint.")
    auto_resume: bool = _help("Resume the run in output if it has a checkpoint, else start it: one command for "
                              "a job and its requeues.", False)
    report_to: tuple[str, ...] = _help(
        "Experiment trackers that get the metrics: tensorboard, wandb, mlflow, trackio, or none. Each logs "
        "locally: W&B offline unless WANDB_MODE is set, MLflow to RUN_DIR/mlflow.db unless MLFLOW_TRACKING_URI "
        "is set.", ("tensorboard",),
    )
    divergence_check: str = _help("The reward-hacking guard's check on eval/reward: auto (held-out accuracy, where "
                                  "the reward differs), none, an eval/ metric, or a reward function's name.", "auto")
    divergence_evals: int = _help("Evaluations in a row of a falling check and a climbing proxy before it warns.", 2)
    stop_on_divergence: bool = _help("Stop when the guard warns; best_model/ holds the best by the check.", False)
    project: str = _help("Tracker project (W&B, trackio) and MLflow experiment name.", "posttrain")
    plugin: tuple[str, ...] = _help(
        "Python file(s) imported before anything else (repeatable): where a run's own presets, advantage "
        "estimators and losses are registered (posttrain.register_algorithm, register_advantage, ...).", (),
    )
    progress: bool = _help("Show a progress bar.", True)

    def __post_init__(self) -> None:
        require = Checks()
        require(self.max_steps >= 1, "max_steps", f"got {self.max_steps}; use 1 or more (posttrain eval scores a "
                 "model without training it)")
        require(self.divergence_evals >= 1, "divergence_evals", f"got {self.divergence_evals}; use 1 or more")
        for name in ("eval_every", "save_every", "log_samples_every"):
            require(getattr(self, name) >= 0, name, f"got {getattr(self, name)}; use 0 (off) or more")
        _check_report_to(require, self.report_to)
        for path in self.plugin:
            require(path.endswith(".py") and Path(path).is_file(), "plugin", f"{path!r} is not a Python file")
        if self.resume is not None:
            require(Path(self.resume).is_dir(), "resume", f"run directory {self.resume!r} does not exist")
        require(not self.auto_resume or bool(self.output), "auto_resume", "needs output: the run directory a "
                "requeued job resumes")
        require.raise_any()


def _check_report_to(require: Checks, report_to: tuple[str, ...]) -> None:
    """Every name a tracker of ``posttrain.tracking.metrics.TRACKERS``, or ``none`` alone."""
    valid = f"use one or more of {', '.join(TRACKERS)}, or none alone"
    if not isinstance(report_to, tuple):
        require(False, "report_to", f"got {report_to!r}; {valid}, as a tuple")
        return
    for name in report_to:
        require(name in TRACKERS or name == "none", "report_to", f"got {name!r}; {valid}")
    require("none" not in report_to or len(report_to) == 1, "report_to",
            f"got {', '.join(report_to)}: none means no tracker; {valid}")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "episodes": EpisodeConfig,
    "off_policy": OffPolicyConfig,
    "optim": OptimConfig,
    "preference": PreferenceConfig,
    "run": RunConfig,
}


