"""``posttrain.train(...)``: training from Python, with what TRL users pass.

The CLI builds a :class:`~posttrain.config.Config` from flags and calls :func:`run` with it; from
Python, :func:`train` also takes a model object (or a path or built-in name), a dataset (rows, a
Hugging Face ``Dataset``, a pandas ``DataFrame``, or a file), reward callables with TRL's signature
``fn(prompts, completions, **columns) -> list[float]`` or rewards by name, a preset name, callbacks
that watch the run and may stop it (:class:`~posttrain.training.runner.Callback`), and any config field
or preset setting as keyword arguments. It returns the run directory and the held-out metrics before
and after. :func:`evaluate` is ``posttrain eval`` from Python: it returns what the command prints, as values.

Decisions:

1. **Rows are written to the run directory** (``RUN_DIR/inputs/train.jsonl`` and ``eval.jsonl``) and
   the saved ``config.yaml`` names those files, so a run started from Python resumes and reproduces
   from the CLI like any other.
2. **Reward callables and tools defined in a file** are recorded in ``config.yaml`` as ``FILE.py:NAME``
   for the same reason; others (lambdas, closures, functions of an interactive session) are called all the
   same, but a resume from the CLI must be given them again (``--reward``).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from posttrain.algorithms.presets import PreferenceAlgorithm, SupervisedAlgorithm
from posttrain.config import Config, ConfigError, load_yaml
from posttrain.parallel.allocator import keep_freed_memory
from posttrain.training.evaluation import EvalSpec, Evaluation, evaluate_model
from posttrain.training.defaults import suit_defaults
from posttrain.training.runner import Callback, completed, run_training
from posttrain.training.setup import Inputs


def train(config: Config | Mapping[str, Any] | str | Path | None = None, *, model: str | nn.Module | None = None,
          tokenizer: Any = None, algorithm: str | None = None, train_dataset: Any = None, eval_dataset: Any = None,
          reward_funcs: Callable | str | Iterable[Callable | str] | None = None,
          tools: Callable | str | Iterable[Callable | str] | None = None, environment: type | str | None = None,
          agent: Callable | str | None = None, callbacks: Iterable[Callback] = (), **fields: Any) -> dict[str, Any]:
    """Train a model; returns ``{"run_dir": Path, "before": {...}, "after": {...}}`` (held-out metrics).

    Args:
        config: a :class:`Config`, a flat mapping of fields, or a YAML file (``posttrain train --config``'s);
            the keyword arguments below override it.
        model: a local model directory, a ``.gguf`` file, a built-in name, or a ``transformers`` causal LM
            object (then ``tokenizer`` too).
        algorithm: a preset name (``posttrain.ALGORITHMS``; ``posttrain.register_algorithm`` adds one).
        train_dataset, eval_dataset: a file (JSONL, JSON, Parquet, CSV, ``hf:NAME``) or rows: a list of
            dicts, a Hugging Face ``Dataset`` or a pandas ``DataFrame``. Online presets read ``prompt`` and
            whatever columns the rewards take; preference presets ``prompt``, ``chosen``, ``rejected``.
        reward_funcs: callables with TRL's signature, rewards by name (``"numeric_match"``,
            ``"length_penalty(max_chars=400)"``: :data:`posttrain.REWARDS`) or ``FILE.py:FUNCTION`` specs, one
            or several.
        tools: functions the policy may call (type hints and a docstring describe them to a chat template),
            or ``FILE.py:FUNCTION`` specs: each completion becomes a multi-turn episode (``max_turns``,
            ``tool_format``, ``tool_timeout``, ``tool_errors``).
        environment: an environment class (``reset(row)``, ``step(turn) -> Step``:
            :mod:`posttrain.data.environments`) or a ``FILE.py:CLASS`` spec: each completion is an episode
            the environment answers turn by turn, up to ``max_turns``; its reward is added to the rewards.
        agent: your agent, ``agent(client, row) -> float | None`` (``async def`` too), or a ``FILE.py:FUNCTION``
            or ``module:function`` spec: each episode runs it with an OpenAI client pointed at the policy, every
            call recorded token for token (:mod:`posttrain.rollout.agents`); its number is the reward.
        callbacks: :class:`posttrain.Callback` objects: each sees every step's metrics
            (``on_step(step, metrics)``; returning True stops the run after that step, which then ends as at
            ``max_steps``), every evaluation's (``on_evaluate``) and the result (``on_train_end``).
        **fields: any config field or preset setting, e.g. ``max_steps=50``, ``learning_rate=1e-5``,
            ``beta=0.04``, ``lora_r=16`` (``posttrain train --help`` lists them).
    """
    callbacks = _checked_callbacks(callbacks)
    if isinstance(config, Config):
        if not (fields or model is not None or tokenizer is not None or algorithm is not None
                or train_dataset is not None or eval_dataset is not None or reward_funcs is not None
                or tools is not None or environment is not None or agent is not None):
            return run(config, callbacks=callbacks)
        flat = config.to_flat()
    elif isinstance(config, (str, Path)):
        flat = load_yaml(config)
    else:
        flat = dict(config or {})
    flat.update(fields)
    if algorithm is not None:
        flat["algorithm"] = algorithm
    inputs = Inputs()
    if isinstance(model, nn.Module):
        inputs = Inputs(model=model, tokenizer=tokenizer)
        flat["model"] = getattr(model.config, "name_or_path", None) or None
    elif model is not None:
        flat["model"] = str(model)
    if train_dataset is not None or eval_dataset is not None:
        output = Path(flat.get("output") or Path("runs") / f"{flat.get('algorithm', 'grpo')}-{time.strftime('%Y%m%d-%H%M%S')}")
        flat["output"] = str(output)
        for key, dataset, name in (("dataset", train_dataset, "train"), ("eval_dataset", eval_dataset, "eval")):
            if dataset is not None:
                flat[key] = dataset_path(dataset, output / "inputs" / f"{name}.jsonl", f"{name}_dataset")
    inputs = _record_rewards(flat, inputs, _as_list(reward_funcs))
    inputs = _record_episodes(flat, inputs, _as_list(tools), environment)
    if agent is not None:
        spec = recordable(agent, "agent")
        if spec is not None:
            flat["agent"] = spec
        else:
            from posttrain.rollout.agents import Agent

            inputs = dataclasses.replace(inputs, agent=Agent(agent))
    return run(Config.from_flat(flat), inputs, callbacks)


def evaluate(model: str | Path | None = None, *, tasks: str | Iterable[str] | None = None,
             dataset: str | Path | None = None, reward: Callable | str | Iterable[Callable | str] = (),
             device: str = "auto", dtype: str = "float32", **settings: Any) -> Evaluation:
    """Score ``model`` as ``posttrain eval`` does; returns what it prints: ``str(evaluation)`` is the printed
    text, ``evaluation["addition"].metrics["accuracy"]`` (and ``accuracy_low``/``accuracy_high``, its 95%
    interval; ``pass@1``, ``pass@K``, ``maj@K`` with samples K > 1) the numbers, ``.problems`` and
    ``.correct`` the counts, ``.greedy`` every problem's completion and verdict.

    Args:
        model: a model directory (a run's ``final_model/``), a ``.gguf`` file or a built-in name; default:
            the first task's built-in model.
        tasks: built-in task names, ``reasoning-gym:SPEC`` or ``gem:ENV_ID``, each scored on its held-out
            split; default: ``addition`` when no ``dataset`` is given.
        dataset: a prompts file (as for training) whose rows are scored by ``reward``: rewards by name
            (``"numeric_match"``), ``FILE.py:FUNCTION`` specs or functions defined in a file.
        **settings: ``eval_size`` (problems per task, 500), ``samples`` (K completions per problem, 1),
            ``temperature``, ``top_p``, ``max_new_tokens``, ``success_threshold`` (on a dataset, the total
            reward that counts as correct, 1.0), ``reward_weights``, ``seed``,
            ``prompt_variants`` (each problem asked every way of a variant set: results per variant,
            ``evaluation.across_variants`` their mean and worst): :class:`EvalSpec`'s fields, ``posttrain
            eval``'s flags.
    """
    valid = [f.name for f in dataclasses.fields(EvalSpec) if f.name not in ("tasks", "dataset", "reward")]
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a setting of posttrain.evaluate; its settings: {', '.join(valid)}")
    specs = [recordable(fn, "reward") for fn in _as_list(reward)]
    if None in specs:  # evaluate_model loads every reward by its spec
        raise ConfigError("reward: posttrain.evaluate takes rewards by name, FILE.py:FUNCTION or functions defined "
                          "at a module file's top level; a lambda or a closure has no name to load it by")
    task_names = _as_list(tasks) if tasks is not None else ([] if dataset is not None else ["addition"])
    spec = EvalSpec(tasks=task_names, dataset=None if dataset is None else str(dataset), reward=specs, **settings)
    name, results = evaluate_model(None if model is None else str(model), spec, device=device, dtype=dtype)
    return Evaluation(name, spec, tuple(results))


def _checked_callbacks(callbacks: Iterable[Callback]) -> tuple[Callback, ...]:
    """The callbacks as a tuple; a ConfigError naming one that lacks a method of :class:`Callback`."""
    if isinstance(callbacks, Callback):
        raise ConfigError("callbacks: give a list of callbacks, e.g. callbacks=[my_callback]")
    checked = tuple(callbacks)
    for number, callback in enumerate(checked, start=1):
        if not isinstance(callback, Callback):
            missing = [name for name in ("on_step", "on_evaluate", "on_train_end") if not callable(getattr(callback, name, None))]
            raise ConfigError(f"callbacks: callback {number} ({type(callback).__name__}) has no {', '.join(missing)}; "
                              "subclass posttrain.Callback, whose methods do nothing until overridden")
    return checked


def _record_rewards(flat: dict[str, Any], inputs: Inputs, funcs: list[Callable | str]) -> Inputs:
    """Reward functions defined in files go into ``flat`` as specs (a resume finds them), the others into
    ``inputs``, each with its weight."""
    weights = list(flat.pop("reward_weights", None) or [])
    if weights and len(weights) != len(funcs) + len(flat.get("reward", ())):
        raise ConfigError(f"reward_weights: {len(weights)} weight(s) for {len(funcs) + len(flat.get('reward', ()))} "
                          "reward function(s); give one per function")
    # the config's own specs come last: the order load_workload calls them in, weights alike
    given = [*funcs, *flat.get("reward", ())]
    weights = weights or [1.0] * len(given)
    in_memory, recorded = [], []
    for fn, weight in zip(given, weights):
        spec = recordable(fn, "reward_funcs")
        (recorded if spec is not None else in_memory).append((spec or fn, weight))
    if given:
        flat["reward"] = [spec for spec, _ in recorded]
        flat["reward_weights"] = [w for _, w in recorded] if in_memory or any(w != 1.0 for w in weights) else []
    if not in_memory:
        return inputs
    return dataclasses.replace(inputs, reward_funcs=tuple(fn for fn, _ in in_memory),
                               reward_weights=tuple(w for _, w in in_memory))


def _record_episodes(flat: dict[str, Any], inputs: Inputs, tools: list[Callable | str],
                     environment: type | str | None) -> Inputs:
    """Tools and an environment class defined in files go into ``flat`` as specs, the others into ``inputs``."""
    objects = []
    for fn in tools:
        spec = recordable(fn, "tools")
        if spec is not None:
            flat["tools"] = [*flat.get("tools", ()), spec]
        else:
            objects.append(fn)
    if objects:
        inputs = dataclasses.replace(inputs, tools=tuple(objects))
    if environment is not None:
        spec = recordable(environment, "environment")
        if spec is not None:
            flat["environment"] = spec
        else:
            inputs = dataclasses.replace(inputs, environment=environment)
    return inputs


def run(config: Config, inputs: Inputs = Inputs(), callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Route a config to its trainer (online, preference, SFT or reward model) and run it, watched by
    ``callbacks``."""
    keep_freed_memory()  # about a third less CPU time per step on CPU (posttrain/parallel/allocator.py)
    done = completed(config)  # a requeued job of a finished run: before any model loads
    if done is not None:
        return done
    config = suit_defaults(config, inputs.model)  # a real model's learning rate, batch, precision and memory
    preset = config.preset()
    if isinstance(preset, SupervisedAlgorithm) and preset.objective in ("sft", "gkd"):
        from posttrain.training import sft

        session, train_step, evaluate_held_out = sft.SFTSession.create(config, inputs), sft.train_step, sft.evaluate
    elif isinstance(preset, SupervisedAlgorithm):
        from posttrain.training import reward_model

        session, train_step, evaluate_held_out = (reward_model.RewardModelSession.create(config, inputs),
                                                  reward_model.train_step, reward_model.evaluate)
    elif isinstance(preset, PreferenceAlgorithm):
        from posttrain.training import preference

        session, train_step, evaluate_held_out = (preference.PreferenceSession.create(config, inputs),
                                                  preference.train_step, preference.evaluate)
    else:
        from posttrain.training import online
        from posttrain.training.session import OnlineSession
        from posttrain.training.session import evaluate as evaluate_online

        session, train_step, evaluate_held_out = OnlineSession.create(config, inputs), online.train_step, evaluate_online
    return run_training(session, config, train_step, evaluate_held_out, callbacks)


def dataset_path(dataset: Any, path: Path, field: str) -> str:
    """A file name as it is; rows (a list of dicts, a ``datasets.Dataset``, a pandas ``DataFrame``) written to
    ``path`` as JSONL first."""
    if isinstance(dataset, (str, Path)):
        return str(dataset)
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # a pandas DataFrame
        rows = dataset.to_dict("records")
    elif isinstance(dataset, Iterable) and not isinstance(dataset, Mapping):
        rows = list(dataset)
    else:
        raise ConfigError(f"{field}: expected a file name or rows (a list of dicts, a datasets.Dataset, a pandas "
                          f"DataFrame), got {type(dataset).__name__}")
    if not rows:
        raise ConfigError(f"{field}: the dataset has no rows")
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, Mapping):
            raise ConfigError(f"{field}: row {number} is a {type(row).__name__}, not a mapping of column to value")
        try:
            lines.append(json.dumps(dict(row), default=_plain, ensure_ascii=False))
        except TypeError as error:
            raise ConfigError(f"{field}: row {number} cannot be saved as JSON ({error})") from None
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def recordable(item: Callable | str, field: str) -> str | None:
    """A ``FILE.py:FUNCTION`` spec as it is, a function defined in a file as its spec, None for another callable."""
    if isinstance(item, str):
        return item
    if not callable(item):
        raise ConfigError(f"{field}: {item!r} is neither a callable nor a FILE.py:FUNCTION spec")
    return function_spec(item)


def function_spec(fn: Callable) -> str | None:
    """``FILE.py:NAME`` of a function or class defined at the top level of a module file, else None: a
    lambda, a closure, a callable object, or one of ``__main__`` (loading a script again would run it)."""
    name = getattr(fn, "__name__", "")
    if (not (inspect.isfunction(fn) or inspect.isclass(fn)) or fn.__qualname__ != name or not name.isidentifier()
            or fn.__module__ == "__main__" or (inspect.isfunction(fn) and fn.__globals__.get(name) is not fn)):
        return None
    file = inspect.getsourcefile(fn)
    return f"{Path(file).resolve()}:{name}" if file and file.endswith(".py") and Path(file).is_file() else None


def _plain(value: Any) -> Any:
    """NumPy scalars and arrays as Python values (what a Dataset or DataFrame row may hold)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str) or callable(value):
        return [value]
    return list(value)
