"""The ``posttrain train`` flags: one per config field, preset field and translated TRL name, typed from the
dataclasses' annotations, and the short (``-h``: the flags most runs need, and examples) and full
(``--help-all``) help."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Sequence

import yaml

from posttrain.config import SECTIONS, trl


def _parse_value(text: str) -> Any:
    """Flag text to a Python value as YAML reads it (``0.2``, ``true``, ``none``, ``[sigmoid]``), for TRL's
    names, whose types posttrain's fields do not give."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _flag_type(annotation: Any):
    """argparse ``type`` for a config field annotation such as ``int | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    if typing.get_origin(base) is tuple:
        return typing.get_args(base)[0]
    return base if base in (int, float, str) else str


def add_config_flags(parser: argparse.ArgumentParser) -> None:
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


def _preset_kinds() -> dict[str, type]:
    from posttrain.algorithms.presets import (
        OnlineAlgorithm,
        PreferenceAlgorithm,
        SupervisedAlgorithm,
    )

    return {"online": OnlineAlgorithm, "preference": PreferenceAlgorithm, "supervised": SupervisedAlgorithm}


@dataclasses.dataclass(frozen=True)
class PresetFlag:
    """How a preset field reads from the command line: its type's name, its choices, None allowed."""

    kind: type  # bool, int, float, str or tuple (of floats)
    choices: tuple[str, ...] = ()
    optional: bool = False

    @property
    def metavar(self) -> str:
        shown = "{" + ",".join(self.choices) + "}" if self.choices else {
            int: "INT", float: "FLOAT", str: "NAME", tuple: "LOW,HIGH"}[self.kind]
        return shown + ("|none" if self.optional else "")

    def parse(self, text: str) -> Any:
        """``text`` as this field's value; an argparse error that names the type and the choices."""
        if self.optional and text.lower() in ("none", "null"):
            return None
        try:
            if self.kind is tuple:
                return tuple(float(part) for part in text.split(","))
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; use {self.metavar}") from None
        if self.choices and value not in self.choices:
            raise argparse.ArgumentTypeError(f"got {text!r}; use one of {', '.join(self.choices)}"
                                             + (" or none" if self.optional else ""))
        return value


def preset_flag(annotations: Sequence[Any]) -> PresetFlag:
    """The flag of a preset field from its annotations in the preset kinds that have it (``float | None``,
    ``Literal['token', 'sequence']``, ``tuple[float, float] | None``, ``bool``)."""
    optional, kinds, choices = False, [], []
    for annotation in annotations:
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        args = typing.get_args(annotation) if is_union else (annotation,)
        optional |= type(None) in args
        for arg in (a for a in args if a is not type(None)):
            if typing.get_origin(arg) is typing.Literal:
                kinds.append(str)
                choices.extend(typing.get_args(arg))
            else:
                kinds.append(typing.get_origin(arg) or arg)
    kind = float if set(kinds) == {int, float} else kinds[0]
    return PresetFlag(kind, tuple(dict.fromkeys(choices)), optional)


def add_preset_flags(parser: argparse.ArgumentParser) -> None:
    from posttrain.algorithms.presets import field_help

    group = parser.add_argument_group("algorithm options (override the preset's defaults; "
                                      "posttrain algorithms NAME lists a preset's settings)")
    config_fields = {f.name for klass in SECTIONS.values() for f in dataclasses.fields(klass)}
    kinds = {kind: (field_help(record), typing.get_type_hints(record)) for kind, record in _preset_kinds().items()}
    for name in dict.fromkeys(name for texts, _ in kinds.values() for name in texts):
        if name in config_fields:
            continue
        meanings = [f"{kind} presets: {texts[name]}" for kind, (texts, _) in kinds.items() if name in texts]
        flag = preset_flag([hints[name] for texts, hints in kinds.values() if name in texts])
        help_text = " | ".join(meanings) + " " + _preset_defaults(name)
        if flag.kind is bool:
            group.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument("--" + name.replace("_", "-"), type=flag.parse, default=argparse.SUPPRESS,
                               metavar=flag.metavar, help=help_text)


def boolean_flags() -> frozenset[str]:
    """The ``--x/--no-x`` flags of config and preset fields (for the older ``--x true`` spelling)."""
    names = {f.name for klass in SECTIONS.values() for f in dataclasses.fields(klass)
             if typing.get_type_hints(klass)[f.name] is bool}
    names |= {name for record in _preset_kinds().values() for name, hint in typing.get_type_hints(record).items()
              if hint is bool}
    return frozenset("--" + name.replace("_", "-") for name in names)


def add_trl_flags(parser: argparse.ArgumentParser) -> None:
    """TRL's names (``--per_device_train_batch_size 4``), hidden from the help: resolve_config translates them,
    with a note, or reports the ones without an equivalent (posttrain.config.trl). ``--bf16`` alone is true."""
    for name in sorted({*trl.RENAMED, *trl.TRANSLATED, *trl.BATCH_NAMES, *trl.NO_EQUIVALENT}):
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=_parse_value, nargs="?", const=True,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


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


COMMON_FLAGS = ("--algorithm", "--config", "--model", "--task", "--dataset", "--eval-dataset", "--reward",
                "--max-new-tokens", "--max-steps", "--learning-rate", "--prompts-per-step", "--group-size",
                "--pairs-per-step", "--lora-r", "--mixed-precision", "--device", "--eval-every", "--output",
                "--resume", "--seed")
"""The flags ``train -h`` shows: those the README's runs use."""

TRAIN_EXAMPLES = """examples:
  posttrain train --algorithm dapo --max-steps 200 --output runs/dapo
  posttrain train --algorithm grpo --model path/to/hf-model --dataset prompts.jsonl \\
      --reward my_rewards.py:correct --max-new-tokens 256 --lora-r 16
  posttrain train --algorithm dpo --config dpo.yaml --beta 0.2    # a YAML config (TRL's names work), flags win

posttrain train --help-all shows every field and preset setting; posttrain algorithms lists the presets."""


class ShortHelp(argparse.Action):
    """``-h``: the flags most runs need and three examples (``--help-all``: every flag)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        actions = {option: action for action in parser._actions for option in action.option_strings}
        formatter = parser._get_formatter()
        formatter.add_usage("%(prog)s [--FIELD VALUE ...]" % {"prog": parser.prog}, [], [])
        formatter.add_text(parser.description)
        formatter.start_section("common options")
        formatter.add_arguments([actions[flag] for flag in COMMON_FLAGS if flag in actions])
        formatter.end_section()
        print(formatter.format_help() + "\n" + TRAIN_EXAMPLES)  # the examples as written, not re-wrapped
        parser.exit()


class FullHelp(argparse.Action):
    """``--help-all``: every config field, preset setting and option."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.print_help()
        parser.exit()
