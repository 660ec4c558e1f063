"""The ``posttrain`` command.

    posttrain train [--algorithm NAME] [--config run.yaml] [--FIELD VALUE ...]
    posttrain eval --model PATH [--task NAME]
    posttrain algorithms [NAME ...]

Every config field and every preset field is a flag (``--learning-rate``,
``--eps-high``; ``--learning_rate`` as in TRL works too), and so is every TRL name
posttrain translates (:mod:`posttrain.config.trl`); precedence is defaults <
``--config`` YAML < flags. With ``--resume RUN_DIR`` the run's saved config is the base.
``train -h`` shows the flags most runs need, ``train --help-all`` every one. Every problem
of a command line (its fields, values, dataset and tasks) is reported at once, before any
model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Sequence

from posttrain.cli.flags import (
    COMMON_FLAGS,
    FullHelp,
    ShortHelp,
    add_config_flags,
    add_preset_flags,
    add_trl_flags,
    boolean_flags,
)
from posttrain.algorithms.presets import OnlineAlgorithm
from posttrain.config import (
    SECTIONS,
    Config,
    ConfigError,
    load_yaml,
    resolve,
    trl,
    unknown_field_hint,
    upgrade_saved_config,
)
from posttrain.report import compare as compare_module
from posttrain.report.compare import (
    TARGET_HELP,
    compare_command,
    names,
    parse_seeds,
    report_command,
)
from posttrain.training.lifecycle import PREEMPTED_EXIT_CODE, Preempted

__all__ = ["COMMON_FLAGS", "build_parser", "main", "resolve_config"]


def _add_compare_parsers(commands: Any) -> None:
    """The ``compare`` and ``report`` subcommands (see :mod:`posttrain.report.compare`)."""
    # "resolve": compare's own --output (the comparison's directory) replaces the run field's
    compare = commands.add_parser("compare", conflict_handler="resolve",
                                  help="run several presets side by side (K seeds each) and write a report",
                                  description=compare_module.__doc__.split("\n\n")[0])
    compare.add_argument("--config", help="YAML file of field: value pairs for every run")
    add_config_flags(compare)
    add_preset_flags(compare)
    own = compare.add_argument_group("comparison")
    own.add_argument("--algorithms", type=names, required=True, help="comma-separated presets, e.g. grpo,dapo")
    own.add_argument("--seeds", type=parse_seeds, default=3, help="K: seeds 0..K-1 per preset (one seed cannot "
                     "tell a difference from noise), or a list such as 1,2 (one seed: 2,) to add seeds to an earlier comparison "
                     "(the report then covers the runs named here; posttrain report DIR covers all) [default: 3]")
    own.add_argument("--output", required=True, help="comparison directory: DIR/<algorithm>/seed<k>/, DIR/report.html")
    own.add_argument("--jobs", type=int, default=1, help="runs trained in parallel processes [default: 1]")
    own.add_argument("--target", type=float, default=None, help=TARGET_HELP)

    report = commands.add_parser("report", help="the comparison report of existing run directories")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories, or directories holding them (a compare --output)")
    report.add_argument("--output", help="where report.html and figures/ go [default: the runs' common parent]")
    report.add_argument("--target", type=float, default=None, help=TARGET_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Post-train language models with RL and "
                                     "preference optimization.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model (no arguments: the embedded default)", add_help=False,
                                description="Train a model: an online RL, preference or supervised preset on a "
                                "built-in task or your dataset.")
    train.add_argument("-h", "--help", action=ShortHelp, help="the flags most runs need, and examples")
    train.add_argument("--help-all", action=FullHelp, help="every flag")
    train.add_argument("--algorithm", default=argparse.SUPPRESS, help="preset name: grpo (default), dapo, ppo, "
                       "dpo, sft, ...; posttrain algorithms lists them")
    train.add_argument("--config", help="YAML file of field: value pairs (posttrain's names or TRL's)")
    add_config_flags(train)
    add_preset_flags(train)
    add_trl_flags(train)

    evaluate = commands.add_parser("eval", help="accuracy of a model on tasks or a dataset, with 95%% intervals; "
                                   "pass@1, pass@K and maj@K with --samples K")
    evaluate.add_argument("--model", required=False, help="model directory or built-in name (default: the first "
                          "task's)")
    evaluate.add_argument("--task", action="append", default=[], help="a built-in task, reasoning-gym:SPEC or "
                          "gem:ENV_ID, scored on its held-out split; repeat the flag for several tasks [default: addition, when no "
                          "--dataset is given]")
    evaluate.add_argument("--dataset", help="prompts file (as for train) scored by --reward, every row up to "
                          "--eval-size")
    evaluate.add_argument("--reward", action="append", default=[], help="for --dataset: a built-in or registered "
                          "reward name (numeric_match, ...) or FILE.py:FUNCTION; repeat for several")
    evaluate.add_argument("--reward-weights", type=lambda t: [float(x) for x in t.split(",")], default=[],
                          help="comma-separated weights, one per --reward [default: 1 each]")
    evaluate.add_argument("--success-threshold", type=float, default=1.0, help="on --dataset: a completion is "
                          "correct when its total reward is at least this [default: 1.0]")
    evaluate.add_argument("--eval-size", type=int, default=500, help="problems per task [default: 500]")
    evaluate.add_argument("--samples", type=int, default=1, help="K completions sampled per problem for pass@1, "
                          "pass@K and maj@K (1: greedy accuracy only) [default: 1]")
    evaluate.add_argument("--temperature", type=float, default=1.0, help="for --samples [default: 1.0]")
    evaluate.add_argument("--top-p", type=float, default=1.0, help="for --samples [default: 1.0]")
    evaluate.add_argument("--max-new-tokens", type=int, help="token budget per completion [default: the task's]")
    evaluate.add_argument("--prompt-variants", metavar="SPEC", help="ask every problem under several instructions "
                          "and answer conventions and report each, their mean and the worst: eval (the seven "
                          "built-in variants), names such as bare,boxed, or a .yaml/.json file of templates holding "
                          "{question} [default: the task's own prompt]")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--dtype", default="float32")
    evaluate.add_argument("--output", help="also write the results as JSON to this file")
    evaluate.add_argument("--completions", help="also write every problem's greedy completion, parsed answer and "
                          "verdict as JSONL to this file")

    serve = commands.add_parser("serve", help="a rollout server: vLLM's OpenAI-compatible server that training runs "
                                "(--rollout-server URL) sample from and publish their weights to",
                                description="Start vLLM's OpenAI-compatible server with posttrain's worker extension "
                                "(needs vLLM: make vllm). Flags after -- go to vLLM.")
    serve.add_argument("--model", required=True, help="model directory or built-in name (smollm2-135m); the "
                       "training run's model, whose weights it publishes here")
    serve.add_argument("--port", type=int, default=8000, help="[default: 8000]")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for other machines "
                       "[default: 127.0.0.1]")
    serve.add_argument("--dtype", default="auto", help="weights' dtype in the server: auto (the model's), "
                       "bfloat16, float32 [default: auto]")
    serve.add_argument("--max-model-len", type=int, help="longest prompt + completion [default: the model's]")
    serve.add_argument("--seed", type=int, default=0)

    algorithms = commands.add_parser("algorithms", help="list presets, or compare the named ones side by side")
    algorithms.add_argument("names", nargs="*")
    _add_compare_parsers(commands)
    for command_parser in (parser, *commands.choices.values()):
        command_parser.allow_abbrev = False  # a flag's prefix is an unknown flag, not silently another field
    return parser


def resolve_config(args: argparse.Namespace) -> Config:
    """Defaults < the resumed run's config < --config YAML < flags; every problem of its fields at once in a
    ConfigError (the data is read when the run starts)."""
    return _resolve(args, read_data=False)[0]


def _resolve(args: argparse.Namespace, read_data: bool = True) -> tuple[Config, list[str]]:
    """The config and what each TRL name in it became; a ConfigError holding every problem of the fields,
    their values and, with ``read_data``, the dataset and the tasks, one per line (all that can be known
    before a model loads)."""
    options = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    given = [load_yaml(args.config)] if args.config else []
    given.append(options)
    base = options.get("resume") or _auto_resumed(given)
    layers = [upgrade_saved_config(load_yaml(_run_config(base)))] if base else []
    layers += given
    flat, notes, problems = _in_posttrain_names(layers)
    resolved = resolve(flat)
    problems += resolved.problems + (_data_problems(resolved.flat) if read_data else [])
    if resolved.config is not None and isinstance(resolved.config.preset(), OnlineAlgorithm):
        problems += _rollout_problems(resolved.config)
    if problems:
        raise ConfigError(*problems)
    return resolved.config, notes + resolved.notes


def _in_posttrain_names(layers: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The layers (saved run < YAML < flags) merged, each translated from TRL's names first, so that a flag
    in posttrain's name wins over the YAML's TRL name for the same field; notes and problems of each."""
    from posttrain.algorithms.presets import algorithm

    merged = {key.replace("-", "_"): value for layer in layers for key, value in layer.items()}
    try:
        preset = algorithm(merged.get("algorithm", "grpo"))
    except ValueError:
        return merged, [], []  # resolve() reports the unknown preset
    flat, notes, problems = {}, [], []
    for layer in layers:
        translated = trl.translate({key.replace("-", "_"): value for key, value in layer.items()}, preset, merged)
        flat.update(translated.flat)
        notes += translated.notes
        problems += translated.problems
    return flat, notes, problems


def _rollout_problems(config: Config) -> list[str]:
    """The rollout combination's problems that the config alone shows (the rollout factory's check; a task's own
    tools are known once it loads, and the session checks again then, with the backend's package)."""
    import torch

    from posttrain.rollout import factory

    m = config.model
    on_gpu = m.device == "cuda" or (m.device == "auto" and torch.cuda.is_available())
    e = config.episodes
    return factory.problems(config, episodes=bool(e.tools or e.mcp_server or e.environment), on_gpu=on_gpu,
                            agent=e.agent is not None, installed=False)


def _data_problems(flat: dict[str, Any]) -> list[str]:
    """What a run's data would refuse before its model loads: unknown tasks, a dataset that cannot be read,
    fewer prompts than one step samples. ``flat``: the config in posttrain's names (values may be invalid:
    their own problems are reported beside these)."""
    from posttrain.algorithms.presets import ALGORITHMS, OnlineAlgorithm
    from posttrain.config import DataConfig, RolloutConfig
    from posttrain.data.prompts import DataError, read_rows

    online = isinstance(ALGORITHMS.get(flat.get("algorithm", "grpo")), OnlineAlgorithm)
    dataset = flat.get("dataset")
    eval_tasks = flat.get("eval_tasks") or ()
    problems = _task_problems("eval_tasks", [eval_tasks] if isinstance(eval_tasks, str) else eval_tasks)
    if online and dataset is None:
        problems += _task_problems("task", [flat.get("task", DataConfig.task)])
    if not isinstance(dataset, str):
        return problems
    try:
        rows = read_rows(dataset, flat.get("dataset_config"), flat.get("dataset_split", DataConfig.dataset_split))
    except (DataError, ConfigError) as error:
        return [*problems, f"dataset: {error}"]
    per_step = flat.get("prompts_per_step", RolloutConfig.prompts_per_step)
    if online and isinstance(per_step, int) and per_step > len(rows):
        problems.append(f"prompts_per_step: {per_step} is more than the {len(rows)} prompts of {dataset}; "
                        f"use {len(rows)} or fewer")
    return problems


def _task_problems(field_name: str, names: Sequence[str]) -> list[str]:
    """``field: unknown task ...`` for each name that is no task (without building the ones that are)."""
    from posttrain.data.tasks import TASKS, get_task
    from posttrain.data.tasks.task import GEM_PREFIX, REASONING_GYM_PREFIX

    problems = []
    for name in names:
        if not isinstance(name, str) or name in TASKS or name.startswith((REASONING_GYM_PREFIX, GEM_PREFIX)):
            continue
        try:
            get_task(name)  # raises at once for a name that is no task
        except ValueError as error:
            problems.append(f"{field_name}: {error}")
    return problems


def _auto_resumed(layers: list[dict[str, Any]]) -> str | None:
    """The run directory ``--auto-resume`` continues: ``--output`` (or TRL's ``output_dir``) when it holds a
    checkpoint. Its saved config is then the base, as for ``--resume``."""
    from posttrain.training.checkpoint import latest_checkpoint

    merged = {key.replace("-", "_"): value for layer in layers for key, value in layer.items()}
    auto = merged.get("auto_resume") or str(merged.get("resume_from_checkpoint")).lower() == "true"
    output = merged.get("output") or merged.get("output_dir")
    if auto and isinstance(output, str) and latest_checkpoint(output) is not None:
        return output
    return None


def _run_config(run_dir: str) -> Path:
    """The saved config of the run that ``--resume run_dir`` names; a ConfigError on ``resume`` if none."""
    path = Path(run_dir) / "config.yaml"
    if not Path(run_dir).is_dir():
        raise ConfigError(f"resume: run directory {run_dir!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"resume: {run_dir!r} is not a run directory (it has no config.yaml)")
    return path


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that explain a problem with the user's input: printed as one line, no traceback."""
    from posttrain.data.prompts import DataError
    from posttrain.data.scoring import RewardError
    from posttrain.models.logprobs import TrainingPathError
    from posttrain.training.checkpoint import CheckpointError, StorageError
    from posttrain.rollout.remote import RolloutServerError
    from posttrain.training.guards import NoLearningSignal, WeightsNotUpdated

    return (ConfigError, DataError, RewardError, CheckpointError, StorageError, NoLearningSignal,
            WeightsNotUpdated, RolloutServerError, TrainingPathError, FileNotFoundError, FileExistsError)


def _hyphenated(argv: Sequence[str]) -> list[str]:
    """Flags spelled with underscores (``--max_steps``) as posttrain's (``--max-steps``): transformers'
    argument parser, which TRL's command line uses, takes both spellings. A boolean flag given a value in
    the older style (``--dynamic-sampling false``) becomes ``--no-dynamic-sampling``."""
    tokens = list(argv)
    for i, token in enumerate(tokens):
        if token == "--":
            break
        if token.startswith("--"):
            name, equals, value = token.partition("=")
            tokens[i] = name.replace("_", "-") + equals + value
    return _boolean_values_as_flags(tokens)


def _boolean_values_as_flags(tokens: list[str]) -> list[str]:
    """``--x true`` -> ``--x``, ``--x false`` (or ``--x=false``) -> ``--no-x``, for the ``--x/--no-x`` flags."""
    booleans, out, i = boolean_flags(), [], 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            return out + tokens[i:]
        name, equals, value = token.partition("=")
        if name in booleans:
            if not equals and i + 1 < len(tokens) and tokens[i + 1].lower() in ("true", "false"):
                value, i = tokens[i + 1], i + 1
            if value.lower() in ("true", "false"):
                token = name if value.lower() == "true" else "--no-" + name[2:]
        out.append(token)
        i += 1
    return out


def _unrecognized(tokens: Sequence[str]) -> str:
    """argparse's complaint about ``tokens``, with posttrain's name for each flag that is TRL's."""
    from posttrain.algorithms.presets import (
        OnlineAlgorithm,
        PreferenceAlgorithm,
        SupervisedAlgorithm,
    )

    valid = [f.name for klass in (*SECTIONS.values(), OnlineAlgorithm, PreferenceAlgorithm, SupervisedAlgorithm)
             for f in dataclasses.fields(klass)]
    hints = []
    for token in tokens:
        flag = token.partition("=")[0]
        hint = unknown_field_hint(flag[2:], valid) if flag.startswith("--") else ""
        if hint:
            hints.append(flag + hint)
    return f"unrecognized arguments: {' '.join(tokens)}" + "".join(f"; {h}" for h in hints)


def eval_command(args: argparse.Namespace) -> int:
    from posttrain.training.evaluation import (
        EvalSpec,
        evaluate_model,
        format_results,
        write_completions,
        write_results,
    )

    tasks = args.task or ([] if args.dataset else ["addition"])
    problems = _task_problems("task", tasks)
    if problems:  # before the model loads, as train's are
        raise ConfigError(*problems)
    spec = EvalSpec(tasks=tasks, dataset=args.dataset, reward=args.reward, reward_weights=args.reward_weights,
                    eval_size=args.eval_size, samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, success_threshold=args.success_threshold, seed=args.seed,
                    prompt_variants=args.prompt_variants)
    name, results = evaluate_model(args.model, spec, device=args.device, dtype=args.dtype)
    print(format_results(name, results, spec))
    if args.output:
        write_results(args.output, name, results, spec)
    if args.completions:
        write_completions(args.completions, results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passed_on: list[str] = []  # serve: what follows -- goes to vLLM
    if argv[:1] == ["serve"] and "--" in argv:
        cut = argv.index("--")
        argv, passed_on = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(_hyphenated(argv))
    if unknown:
        parser.error(_unrecognized(unknown))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one to watch
    try:
        if args.command == "algorithms":
            from posttrain.algorithms.tables import (
                format_presets_table,
                format_side_by_side,
            )

            print(format_side_by_side(args.names) if args.names else format_presets_table())
            return 0
        if args.command == "eval":
            return eval_command(args)
        if args.command == "serve":
            return serve_command(args, passed_on)
        if args.command == "compare":
            return compare_command(args)
        if args.command == "report":
            return report_command(args)
        config, notes = _resolve(args)
        for note in notes:  # what each TRL name became
            print(f"posttrain: TRL's {note}", file=sys.stderr)
        from posttrain.training.api import run

        run(config)
        return 0
    except Preempted as stopped:
        print(f"posttrain: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except _user_errors() as error:
        print(_error_text(error), file=sys.stderr)
        return 2
    except OSError as error:  # a full disk or a read-only directory under the logs: the path, not a traceback
        from posttrain.training.checkpoint import STORAGE_ERRNOS

        if error.errno not in STORAGE_ERRNOS:
            raise
        print(f"posttrain: error: {error.strerror}: {error.filename or error}; free space or fix the "
              "permissions, then resume the run (--resume RUN_DIR)", file=sys.stderr)
        return 2


def serve_command(args: argparse.Namespace, passed_on: list[str]) -> int:
    """Replace this process with vLLM's server (signals reach vLLM directly); its argv is printed first."""
    import os
    import shlex

    from posttrain.models.loading import resolve_model_path
    from posttrain.rollout.vllm_worker import serve_command as command

    try:
        argv, env = command(str(resolve_model_path(args.model)), host=args.host, port=args.port, dtype=args.dtype,
                            max_model_len=args.max_model_len, seed=args.seed, extra=passed_on)
    except RuntimeError as error:
        print(f"posttrain: error: {error}", file=sys.stderr)
        return 2
    print("posttrain serve: " + shlex.join(argv), file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)
    return 0  # not reached


def _error_text(error: BaseException) -> str:
    """One line for one problem; several (a ConfigError's) one per line under a count."""
    problems = getattr(error, "problems", None) or [str(error)]
    if len(problems) == 1:
        return f"posttrain: error: {problems[0]}"
    return f"posttrain: error: {len(problems)} problems:\n" + "\n".join(f"  {problem}" for problem in problems)

