"""The ``posttrain`` command.

    posttrain train [--algorithm NAME] [--config run.yaml] [--FIELD VALUE ...]
    posttrain eval --model PATH [--task NAME]
    posttrain algorithms [NAME ...]

Every config field and every preset field is a flag (``--learning-rate``,
``--eps-high``; ``--learning_rate`` as in TRL works too); precedence is defaults <
``--config`` YAML < flags. With
``--resume RUN_DIR`` the run's saved config is the base.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence

from posttrain.config import (
    SECTIONS,
    Config,
    ConfigError,
    load_yaml,
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


def _parse_value(text: str) -> Any:
    """Flag text to a Python value for preset fields (types vary per preset)."""
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    if "," in text:
        return tuple(_parse_value(part) for part in text.split(","))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _flag_type(annotation: Any):
    """argparse ``type`` for a config field annotation such as ``int | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    if typing.get_origin(base) is tuple:
        return typing.get_args(base)[0]
    return base if base in (int, float, str) else str


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    hints = {}
    for title, klass in SECTIONS.items():
        group = parser.add_argument_group(f"{title.replace('_', '-')} options", klass.__doc__ if klass.__doc__
                                          and not klass.__doc__.startswith(klass.__name__ + "(") else None)
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata.get('help', '')} [default: {f.default!r}]"
            annotation = hints[f.name]
            if annotation is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                   help=help_text)
            elif typing.get_origin(_strip_none(annotation)) is tuple:
                group.add_argument(flag, action="append", type=_flag_type(annotation), default=argparse.SUPPRESS,
                                   help=help_text + " (repeatable)")
            else:
                group.add_argument(flag, type=_flag_type(annotation), default=argparse.SUPPRESS, help=help_text)


def _strip_none(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _add_preset_flags(parser: argparse.ArgumentParser) -> None:
    from posttrain.algorithms.presets import (
        OnlineAlgorithm,
        PreferenceAlgorithm,
        SupervisedAlgorithm,
        field_help,
    )

    group = parser.add_argument_group("algorithm options (override the preset's defaults; "
                                      "posttrain algorithms NAME lists a preset's settings)")
    config_fields = {f.name for klass in SECTIONS.values() for f in dataclasses.fields(klass)}
    kinds = {"online": field_help(OnlineAlgorithm), "preference": field_help(PreferenceAlgorithm),
             "supervised": field_help(SupervisedAlgorithm)}
    for name in dict.fromkeys(name for texts in kinds.values() for name in texts):
        if name in config_fields:
            continue
        meanings = [f"{kind} presets: {texts[name]}" for kind, texts in kinds.items() if name in texts]
        group.add_argument("--" + name.replace("_", "-"), type=_parse_value, default=argparse.SUPPRESS,
                           metavar="VALUE", help=" | ".join(meanings) + " " + _preset_defaults(name))


def _preset_defaults(setting: str) -> str:
    """``[default: 0.2; dapo: 0.28; cispo: 5.0]``: the value most presets that have ``setting`` give it,
    then the presets that differ."""
    from posttrain.algorithms.presets import ALGORITHMS, setting_names

    by_value: dict[str, list[str]] = {}
    for preset in ALGORITHMS.values():
        if setting in setting_names(preset):
            by_value.setdefault(repr(getattr(preset, setting)), []).append(preset.name)
    common, *others = sorted(by_value, key=lambda value: -len(by_value[value]))
    return "[default: " + "; ".join([common, *(f"{', '.join(by_value[v])}: {v}" for v in others)]) + "]"


def _add_compare_parsers(commands: Any) -> None:
    """The ``compare`` and ``report`` subcommands (see :mod:`posttrain.report.compare`)."""
    # "resolve": compare's own --output (the comparison's directory) replaces the run field's
    compare = commands.add_parser("compare", conflict_handler="resolve",
                                  help="run several presets side by side (K seeds each) and write a report",
                                  description=compare_module.__doc__.split("\n\n")[0])
    compare.add_argument("--config", help="YAML file of field: value pairs for every run")
    _add_config_flags(compare)
    _add_preset_flags(compare)
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

    train = commands.add_parser("train", help="train a model (no arguments: the embedded default)")
    train.add_argument("--algorithm", default=argparse.SUPPRESS, help="preset name (posttrain algorithms lists them)")
    train.add_argument("--config", help="YAML file of field: value pairs")
    _add_config_flags(train)
    _add_preset_flags(train)

    evaluate = commands.add_parser("eval", help="accuracy of a model on tasks or a dataset, with 95%% intervals; "
                                   "pass@1, pass@K and maj@K with --samples K")
    evaluate.add_argument("--model", required=False, help="model directory or built-in name (default: the first "
                          "task's)")
    evaluate.add_argument("--task", action="append", default=[], help="a built-in task, reasoning-gym:SPEC or "
                          "gem:ENV_ID, scored on its held-out split; repeat the flag for several tasks [default: addition, when no "
                          "--dataset is given]")
    evaluate.add_argument("--dataset", help="prompts file (as for train) scored by --reward, every row up to "
                          "--eval-size")
    evaluate.add_argument("--reward", action="append", default=[], help="FILE.py:FUNCTION for --dataset; repeat for "
                          "several")
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
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--dtype", default="float32")
    evaluate.add_argument("--output", help="also write the results as JSON to this file")
    evaluate.add_argument("--completions", help="also write every problem's greedy completion, parsed answer and "
                          "verdict as JSONL to this file")

    algorithms = commands.add_parser("algorithms", help="list presets, or compare the named ones side by side")
    algorithms.add_argument("names", nargs="*")
    _add_compare_parsers(commands)
    for command_parser in (parser, *commands.choices.values()):
        command_parser.allow_abbrev = False  # a flag's prefix is an unknown flag, not silently another field
    return parser


def resolve_config(args: argparse.Namespace) -> Config:
    """Defaults < the resumed run's config < --config YAML < flags."""
    flat: dict[str, Any] = {}
    options = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    if "resume" in options:
        flat.update(upgrade_saved_config(load_yaml(_run_config(options["resume"]))))
    if args.config:
        flat.update(load_yaml(args.config))
    flat.update(options)
    return Config.from_flat(flat)


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
    from posttrain.training.checkpoint import CheckpointError
    from posttrain.training.guards import NoLearningSignal, WeightsNotUpdated

    return (ConfigError, DataError, RewardError, CheckpointError, NoLearningSignal, WeightsNotUpdated,
            FileNotFoundError, FileExistsError)


def _hyphenated(argv: Sequence[str]) -> list[str]:
    """Flags spelled with underscores (``--max_steps``) as posttrain's (``--max-steps``): transformers'
    argument parser, which TRL's command line uses, takes both spellings."""
    tokens = list(argv)
    for i, token in enumerate(tokens):
        if token == "--":
            break
        if token.startswith("--"):
            name, equals, value = token.partition("=")
            tokens[i] = name.replace("_", "-") + equals + value
    return tokens


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
    spec = EvalSpec(tasks=tasks, dataset=args.dataset, reward=args.reward, reward_weights=args.reward_weights,
                    eval_size=args.eval_size, samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, success_threshold=args.success_threshold, seed=args.seed)
    name, results = evaluate_model(args.model, spec, device=args.device, dtype=args.dtype)
    print(format_results(name, results, spec))
    if args.output:
        write_results(args.output, name, results, spec)
    if args.completions:
        write_completions(args.completions, results)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(_hyphenated(sys.argv[1:] if argv is None else argv))
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
        if args.command == "compare":
            return compare_command(args)
        if args.command == "report":
            return report_command(args)
        try:
            config = resolve_config(args)
        except ValueError as error:  # an unknown preset, field or value: say which, no traceback
            raise ConfigError(str(error)) from error
        from posttrain.training.api import run

        run(config)
        return 0
    except _user_errors() as error:
        print(f"posttrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
