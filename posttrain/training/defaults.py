"""Defaults that suit the model a run trains and the machine it runs on.

The config's defaults are the built-in tiny model's (a 0.6M-parameter model: a learning rate of 1e-4, 32
prompts x 8 samples a step, float32, 64 rows a pass). On a real model they are wrong in every direction: a
135M-parameter SmolLM2 at those settings took six minutes a step and 21.8 GB of a 24 GB machine, and 1e-4
full fine-tuning made it worse. So before anything loads, a run whose model has at least
:data:`REAL_MODEL_PARAMETERS` parameters gets, for each of these fields it does not set itself:

- ``learning_rate``: the field's common default for the trainer and full fine-tuning (TRL's: 1e-6 for RL and
  preference optimisation, 2e-5 for SFT, 1e-5 for a reward model), ten times that under LoRA (LoRA's best
  rate is about ten times full fine-tuning's: Schulman et al., "LoRA Without Regret", 2025);
- ``prompts_per_step`` x ``group_size`` (online, on a CPU): 16 x 4, the SmolLM2 recipe's (64 completions a
  step); on a GPU the defaults stay;
- ``mixed_precision``: ``bf16`` where the hardware computes bfloat16 natively (a GPU, a CPU with AVX512-BF16
  or AMX), else ``no``;
- ``max_tokens_per_micro_batch`` (where ``micro_batch_size`` is not set either) and
  ``gradient_checkpointing``: the largest token budget of :data:`TOKEN_BUDGETS` whose estimated peak
  (:func:`estimated_peak`) fits in half the machine's memory, checkpointing only where no budget of 1,024
  tokens or more fits without it.

A built-in task may carry run settings tuned on its own built-in model (``Task.run_defaults``: ``shapes`` on
``tiny-vision``); an online run of the task on that model takes those it does not set, first.

The run prints what it chose and why in its first lines. A step that fits at no budget is refused with the
estimate; settings the user gave are kept, with a warning when their estimate does not fit.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.algorithms.presets import PreferenceAlgorithm, SupervisedAlgorithm
from posttrain.config import SECTIONS, Config, ConfigError
from posttrain.data.tasks import TASKS, get_task
from posttrain.functional._logprobs import KEEP_LOGITS_BYTES
from posttrain.models.loading import bf16_supported, is_image_text, resolve_mixed_precision, resolve_model_path
from posttrain.models.lora import default_target_modules, default_target_parameters
from posttrain.models.modeling import resolve_device
from posttrain.parallel.distributed import say

REAL_MODEL_PARAMETERS = 20_000_000
"""Below this, a model keeps the config's defaults (tuned on the built-in tiny models)."""
FULL_FINE_TUNING_RATES = {"online": 1e-6, "preference": 1e-6, "sft": 2e-5, "reward_model": 1e-5}
LORA_RATE_FACTOR = 10.0
TOKEN_BUDGETS = (4096, 2400, 1600, 1024, 512, 256)
"""Token budgets per pass, largest first (2,400: the SmolLM2 recipe's). Those of 1,024 and more are tried
without gradient checkpointing, then with it, before the smaller ones (with it): below about 1,024 tokens a
pass's fixed cost makes more passes dearer than recomputing each layer once."""
MEMORY_SHARE = 0.5
"""The share of the machine's memory a step's estimated peak may take."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model, read from its config on the meta device (no weights loaded)."""

    name: str
    parameters: int
    trainable: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int


def model_shape(model: nn.Module, lora_r: int, name: str) -> ModelShape:
    """The shape of ``model`` (real or on the meta device); trainable: every parameter, or LoRA's adapters of rank
    ``lora_r`` on the default targets (``r * (in + out)`` per linear layer, per expert)."""
    parameters = sum(p.numel() for p in model.parameters())
    trainable = parameters
    if lora_r:
        targets = set(default_target_modules(model))
        head = model.get_output_embeddings()
        trainable = sum(lora_r * (m.in_features + m.out_features) for n, m in model.named_modules()
                        if isinstance(m, nn.Linear) and m is not head and n.rsplit(".", 1)[-1] in targets)
        experts = {p.rsplit(".", 1)[-1] for p in default_target_parameters(model)}
        trainable += sum(lora_r * (value.shape[1] + value.shape[2]) * value.shape[0]
                         for n, value in model.named_parameters() if value.dim() == 3 and n.rsplit(".", 1)[-1] in experts)
    config = model.config.get_text_config()
    return ModelShape(name, parameters, trainable, config.num_hidden_layers, config.hidden_size,
                      getattr(config, "intermediate_size", None) or 4 * config.hidden_size, config.vocab_size)


def machine_memory(device: torch.device) -> int:
    """Bytes of memory the run may use: the GPU's, or the CPU's (the smaller of RAM and a cgroup's limit)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        if os.path.isfile(limit):
            text = open(limit).read().strip()
            if text.isdigit():
                total = min(total, int(text))
    return total


LORA_PASS_FACTOR = 1.4
"""A LoRA step's measured peak over the hand count of its activations: the adapters' products keep their own
inputs (a packed pass of SmolLM2 rose 1.18x the count, benchmarks/step_memory.py), and a run's later steps
find the freed memory of the phases before them in pieces (4-step runs peaked 1.15-1.2x their largest pass)."""
FULL_PASS_FACTOR = 1.2
"""The same for full fine-tuning, whose passes rose 0.97x the count, and whose 4-step run peaked 1.2x it."""
CHECKPOINTED_LAYERS = 12
"""Layers' worth of full activations a checkpointed pass holds at once, beside each layer's input: measured
470-770 KB a token on SmolLM2 (benchmarks/step_memory.py), against one layer's 61 KB that recomputation alone
would need: the backward's recomputed layer, the LM head's blocks and the pieces the heap cannot reuse."""


def estimated_peak(shape: ModelShape, tokens: int, *, checkpointing: bool, reference: bool,
                   weight_bytes: int = 4) -> int:
    """Bytes a training step's peak takes: the weights (and a reference copy), the trainable parameters'
    gradients and AdamW's two moments in float32, and the activations of a pass of ``tokens`` tokens. A layer
    keeps about ``16 d + 4 m`` floats per token for its backward (projections, norms, the MLP's gate, up and
    activation), times what a run measured above that count (:data:`LORA_PASS_FACTOR`, :data:`FULL_PASS_FACTOR`);
    when checkpointed, ``d`` per token per layer (its input) plus :data:`CHECKPOINTED_LAYERS` layers' full set;
    the LM head's log-softmax runs a block of vocabulary at a time, about 1,024 tokens' logits and their
    gradient, or holds every scored token's logits for its backward where they fit in
    :data:`~posttrain.functional._logprobs.KEEP_LOGITS_BYTES` (a pass's tokens counted as all scored).
    Calibrated on SmolLM2 with posttrain's allocator setting (benchmarks/step_memory.py re-measures)."""
    weights = shape.parameters * weight_bytes * (2 if reference else 1)
    optimizer = shape.trainable * 4 * 3
    per_layer = (16 * shape.hidden + 4 * shape.intermediate) * 4
    if checkpointing:
        activations = tokens * (shape.layers * shape.hidden * 4 + CHECKPOINTED_LAYERS * per_layer)
    else:
        factor = LORA_PASS_FACTOR if shape.trainable < shape.parameters else FULL_PASS_FACTOR
        activations = int(tokens * shape.layers * per_layer * factor)
    kept = tokens * shape.vocab * 4
    logits = max(2 * min(tokens, 1024) * shape.vocab * 4, kept if kept <= KEEP_LOGITS_BYTES else 0)
    return weights + optimizer + activations + logits


def trainer_kind(config: Config) -> str:
    preset = config.preset()
    if isinstance(preset, SupervisedAlgorithm):
        return "sft" if preset.objective in ("sft", "gkd") else "reward_model"
    return "preference" if isinstance(preset, PreferenceAlgorithm) else "online"


def _shown(value: object) -> str:
    return {True: "on", False: "off"}.get(value, f"{value:g}") if isinstance(value, (bool, float)) else str(value)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def held_memory(device: torch.device) -> int:
    """Bytes this process holds already (its resident set) where the step's memory is the host's, a CPU's: the
    interpreter, PyTorch, transformers and the data, about 1 GiB before a model loads. A step's peak is that plus
    :func:`estimated_peak` (about 0.4 GiB of a SmolLM2 run's)."""
    if device.type != "cpu" or not os.path.exists("/proc/self/statm"):
        return 0
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def suited(config: Config, shape: ModelShape, device: torch.device, memory: int,
           held: int = 0) -> tuple[Config, list[str]]:
    """``config`` with the fields it does not set (``config.given``) suited to ``shape`` on ``device`` with
    ``memory`` bytes, ``held`` of them taken already (:func:`held_memory`), and the lines that say so; ``config``
    itself for a model below :data:`REAL_MODEL_PARAMETERS`."""
    if shape.parameters < REAL_MODEL_PARAMETERS:
        return config, []
    given, m, o, r = config.given, config.model, config.optim, config.rollout
    kind, lora = trainer_kind(config), bool(m.lora_r)
    chosen: dict[str, dict] = {"model": {}, "optim": {}, "rollout": {}}
    if "learning_rate" not in given:
        chosen["optim"]["learning_rate"] = FULL_FINE_TUNING_RATES[kind] * (LORA_RATE_FACTOR if lora else 1.0)
    if kind == "online" and device.type == "cpu":
        for name, value in (("prompts_per_step", 16), ("group_size", 4)):
            if name not in given:
                chosen["rollout"][name] = value
    if "mixed_precision" not in given and m.dtype == "float32":
        chosen["model"]["mixed_precision"] = "bf16" if bf16_supported(device) else "no"
    weight_bytes = 2 if m.dtype == "bfloat16" else 4
    reference = not lora and _needs_reference(config)
    limit = int(memory * MEMORY_SHARE)
    budget_free = "max_tokens_per_micro_batch" not in given and "micro_batch_size" not in given
    checkpoint_free = "gradient_checkpointing" not in given
    fit = None
    if budget_free:
        large = [tokens for tokens in TOKEN_BUDGETS if tokens >= 1024]
        small = [tokens for tokens in TOKEN_BUDGETS if tokens < 1024]
        settings = [(t, False) for t in large] + [(t, True) for t in large + small]
        if not checkpoint_free:  # the user's checkpointing, at every budget
            settings = [(t, m.gradient_checkpointing) for t in TOKEN_BUDGETS]
        fit = next(((t, c) for t, c in settings if held + estimated_peak(
            shape, t, checkpointing=c, reference=reference, weight_bytes=weight_bytes) <= limit), None)
        if fit is None:
            smallest = held + estimated_peak(shape, TOKEN_BUDGETS[-1], checkpointing=True, reference=reference,
                                             weight_bytes=weight_bytes)
            raise ConfigError(f"model: {shape.name} ({shape.parameters / 1e6:.0f}M parameters) needs about "
                              f"{_gib(smallest)} for a step of {TOKEN_BUDGETS[-1]} tokens with gradient "
                              f"checkpointing, over half of this machine's {_gib(memory)}; train LoRA adapters "
                              "(--lora-r 16), in bfloat16, or on a machine with more memory")
        chosen["optim"]["max_tokens_per_micro_batch"] = fit[0]
        if checkpoint_free:
            chosen["model"]["gradient_checkpointing"] = fit[1]
    tokens = fit[0] if fit else (o.max_tokens_per_micro_batch or o.micro_batch_size * 256)
    checkpointing = fit[1] if fit else m.gradient_checkpointing
    peak = held + estimated_peak(shape, tokens, checkpointing=checkpointing, reference=reference,
                                 weight_bytes=weight_bytes)
    suited_config = dataclasses.replace(
        config, model=dataclasses.replace(m, **chosen["model"]), optim=dataclasses.replace(o, **chosen["optim"]),
        rollout=dataclasses.replace(r, **chosen["rollout"]))
    values = [f"{k} {_shown(v)}" for section in (chosen["optim"], chosen["rollout"], chosen["model"])
              for k, v in section.items()]
    hardware = device.type if device.type == "cuda" else \
        f"a CPU {'with' if bf16_supported(device) else 'without'} native bfloat16"
    lines = [f"defaults for {shape.name} ({shape.parameters / 1e6:.0f}M parameters, "
             f"{'LoRA' if lora else 'full fine-tuning'}) on {hardware} with {_gib(memory)}: "
             + (", ".join(values) if values else "none changed (every one of them is set)")
             + f"; estimated peak {_gib(peak)}" + (f" ({_gib(held)} of it held before the model loads)" if held else "")
             + f" (limit {_gib(limit)}, half the memory); set a field to override it"]
    if peak > limit:
        lines.append(f"warning: the settings given are estimated to need {_gib(peak)}, over half of this "
                     f"machine's {_gib(memory)}: a smaller max_tokens_per_micro_batch, gradient_checkpointing "
                     "or LoRA would fit")
    return suited_config, lines


def _needs_reference(config: Config) -> bool:
    preset = config.preset()
    return bool(getattr(preset, "needs_reference", False))


def decided_precision(config: Config) -> Config:
    """``config`` with ``mixed_precision auto`` decided for its device (:func:`resolve_mixed_precision`), said in
    one line; unchanged otherwise."""
    m = config.model
    if m.mixed_precision != "auto":
        return config
    device = resolve_device(m.device)
    decided = resolve_mixed_precision("auto", m.dtype, device)
    why = ("the weights are already bfloat16" if m.dtype != "float32" else
           f"{'this GPU' if device.type == 'cuda' else 'this CPU'} computes bfloat16 natively" if decided == "bf16"
           else "this CPU has neither AVX512-BF16 nor AMX: its bfloat16 products are emulated, slower than float32")
    say(f"mixed_precision auto -> {decided}: {why}")
    return dataclasses.replace(config, model=dataclasses.replace(m, mixed_precision=decided))


def task_defaults(config: Config, model: nn.Module | None) -> tuple[Config, list[str]]:
    """``config`` with the fields it does not set taken from its task's ``run_defaults`` (those fields then count
    as set), and the line that says so: for an online run of a built-in task on the task's own model, which the
    settings were tuned on; not for a dataset, another model or a model object a Python caller passed."""
    data, name = config.data, config.model.model
    if model is not None or data.dataset is not None or data.task not in TASKS or trainer_kind(config) != "online":
        return config, []
    task = get_task(data.task)
    chosen = {key: value for key, value in task.run_defaults.items() if key not in config.given}
    if name not in (None, task.default_model) or not chosen:
        return config, []
    owner = {f.name: section for section, klass in SECTIONS.items() for f in dataclasses.fields(klass)}
    sections: dict[str, dict] = {}
    for key, value in chosen.items():
        sections.setdefault(owner[key], {})[key] = value
    replaced = {section: dataclasses.replace(getattr(config, section), **values) for section, values in sections.items()}
    config = dataclasses.replace(config, **replaced, given=config.given | frozenset(chosen))
    line = (f"defaults for task {task.name} on {task.default_model}: "
            + ", ".join(f"{key} {_shown(value)}" for key, value in chosen.items()) + "; set a field to override it")
    return config, [line]


def suit_defaults(config: Config, model: nn.Module | None) -> Config:
    """:func:`task_defaults`, then :func:`suited` for the run's model (``model``: an object a Python caller passed;
    else the config's, read on the meta device), their lines said; the config unchanged for the tiny built-in
    default."""
    config, lines = task_defaults(config, model)
    config = decided_precision(config)
    for line in lines:
        say(line)
    name = config.model.model
    if model is None and name is None:
        return config  # the task's own built-in model
    device = resolve_device(config.model.device)
    if model is None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        path = resolve_model_path(name)
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
        kind = AutoModelForImageTextToText if is_image_text(path) else AutoModelForCausalLM
        with torch.device("meta"):
            model = kind.from_config(model_config, trust_remote_code=config.model.trust_remote_code)
    shape = model_shape(model, config.model.lora_r, name or type(model).__name__)
    suited_config, lines = suited(config, shape, device, machine_memory(device), held_memory(device))
    for line in lines:
        say(line)
    return suited_config
