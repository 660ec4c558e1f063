"""Run configuration: a few frozen dataclasses, one per concern (:mod:`.sections`), put together.

Every field carries a one-line help text (``metadata["help"]``) that the CLI
shows in ``posttrain train --help``. A YAML config is a flat mapping of the
same field names (the algorithm's fields included), so

    algorithm: dapo
    learning_rate: 1.0e-4
    group_size: 8
    eps_high: 0.3

is a complete config. Invalid values are rejected where a dataclass is built,
with a message that names the field and says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from posttrain.algorithms.presets import ALGORITHMS, algorithm, setting_names
from posttrain.config import trl
from posttrain.config.sections import (
    CORRECTIONS,
    LR_SCHEDULES,
    SECTIONS,
    ConfigError,
    DataConfig,
    EpisodeConfig,
    ModelConfig,
    OffPolicyConfig,
    OptimConfig,
    PreferenceConfig,
    RolloutConfig,
    RunConfig,
    hub_dataset_name,
    is_reward_name,
)

__all__ = ["CORRECTIONS", "LR_SCHEDULES", "SECTIONS", "Config", "ConfigError", "DataConfig",
           "EpisodeConfig", "ModelConfig", "OffPolicyConfig", "OptimConfig", "PreferenceConfig", "RolloutConfig",
           "Resolved", "RunConfig", "absolute_path", "hub_dataset_name", "import_plugins", "is_reward_name", "load_yaml", "resolve", "save_yaml", "unknown_field_hint",
           "upgrade_saved_config"]


@dataclass(frozen=True)
class Config:
    """A whole run: the algorithm preset (name + overrides) and one section per concern."""

    algorithm: str = "grpo"
    overrides: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    episodes: EpisodeConfig = field(default_factory=EpisodeConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    run: RunConfig = field(default_factory=RunConfig)
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    """The fields the user set (a flag, a YAML key, a keyword of posttrain.train): the others may be suited to the
    model and machine at the start of a run (posttrain.training.defaults). A resumed run's saved config sets
    every field."""

    def preset(self):  # -> OnlineAlgorithm | PreferenceAlgorithm
        return algorithm(self.algorithm, **self.overrides)

    def with_absolute_paths(self) -> "Config":
        """The same config with every local file or directory it names made absolute, so that the
        ``config.yaml`` of a run resumes from any working directory. Built-in names (``smollm2-135m``,
        ``addition``) and ``hf:`` datasets are left as they are."""
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, model=absolute_path(self.model.model),
                                      teachers=tuple(f"{task}={absolute_path(path)}"
                                                     for task, path in self.model.teacher_by_task().items())),
            data=dataclasses.replace(
                self.data, dataset=absolute_path(self.data.dataset), eval_dataset=absolute_path(self.data.eval_dataset),
                reward=tuple(spec if is_reward_name(spec) else _absolute_spec(spec) for spec in self.data.reward),
                reward_model=absolute_path(self.data.reward_model)),
            episodes=dataclasses.replace(self.episodes, tools=tuple(_absolute_spec(spec) for spec in self.episodes.tools),
                                         environment=_absolute_spec(self.episodes.environment)
                                         if self.episodes.environment else None,
                                         agent=_absolute_spec(self.episodes.agent)
                                         if self.episodes.agent and Path(self.episodes.agent.rpartition(":")[0]).is_file()
                                         else self.episodes.agent),
            run=dataclasses.replace(self.run, output=absolute_path(self.run.output),
                                    resume=absolute_path(self.run.resume),
                                    plugin=tuple(absolute_path(path) for path in self.run.plugin)),
        )

    def to_flat(self) -> dict[str, Any]:
        """The flat mapping a YAML config holds (the inverse of ``Config.from_flat``)."""
        flat: dict[str, Any] = {"algorithm": self.algorithm, **self.overrides}
        for section in SECTIONS:
            for f in fields(getattr(self, section)):
                value = getattr(getattr(self, section), f.name)
                flat[f.name] = list(value) if isinstance(value, tuple) else value
        return flat

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> "Config":
        """Build from a flat mapping (posttrain's names or TRL's, :mod:`posttrain.config.trl`); every problem
        of every field is reported at once, one per line, in a ConfigError."""
        resolved = resolve(flat)
        if resolved.problems:
            raise ConfigError(*resolved.problems)
        return resolved.config


@dataclass
class Resolved:
    """A flat mapping resolved: the config (None when any problem), the mapping in posttrain's names, what
    each TRL name became, and every problem found."""

    config: Config | None
    flat: dict[str, Any]
    notes: list[str]
    problems: list[str]


def resolve(flat: dict[str, Any]) -> Resolved:
    """Translate TRL's names, sort the fields into sections, and build them, collecting every problem
    (unknown fields, invalid values of each section and of the preset, combinations) instead of
    stopping at the first; a key that is neither a config nor an algorithm field is a problem."""
    flat = {key.replace("-", "_"): value for key, value in flat.items()}
    plugins = flat.get("plugin") or ()
    import_plugins([plugins] if isinstance(plugins, str) else plugins)  # before the names they register are looked up
    name = flat.pop("algorithm", "grpo")
    try:
        preset = algorithm(name)
    except ValueError as error:  # an unknown preset: nothing else can be checked against it
        return Resolved(None, flat, [], [f"algorithm: {error}"])
    translated = trl.translate(flat, preset)
    problems = list(translated.problems)
    preset_fields = set(setting_names(preset))
    owner = {f.name: s for s, klass in SECTIONS.items() for f in fields(klass)}
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    overrides: dict[str, Any] = {}
    for key, value in translated.flat.items():
        if key in owner:
            sections[owner[key]][key] = _coerce_tuple(SECTIONS[owner[key]], key, value)
        elif key in preset_fields:
            overrides[key] = value
        else:
            problems.append(str(_unknown_field(key, name, sorted(owner) + sorted(preset_fields))))
    preset_rate = getattr(preset, "default_learning_rate", None)
    if preset_rate is not None and "learning_rate" not in sections["optim"]:
        sections["optim"]["learning_rate"] = preset_rate  # the preset's, where none is given
    built = {}
    for section, values in sections.items():
        try:
            built[section] = SECTIONS[section](**values)
        except (ConfigError, TypeError) as error:
            problems.extend(_problems_of(error))
    try:
        algorithm(name, **overrides)  # validate the overrides now, before any model is loaded
    except (ValueError, TypeError) as error:
        problems.append(str(error))
    config = None
    if len(built) == len(SECTIONS):
        try:
            given = frozenset(key for values in sections.values() for key in values) - (
                {"learning_rate"} if preset_rate is not None and "learning_rate" not in translated.flat else set())
            config = Config(algorithm=name, overrides=overrides, given=given, **built)
        except ConfigError as error:
            problems.extend(error.problems)
    translated_flat = {"algorithm": name, **translated.flat}
    return Resolved(None if problems else config, translated_flat, translated.notes, problems)


def _problems_of(error: Exception) -> list[str]:
    """The lines of a section's error (a ConfigError holds several; a TypeError is a wrong value type)."""
    return list(error.problems) if isinstance(error, ConfigError) else [str(error)]


def _unknown_field(key: str, algorithm_name: str, valid: Sequence[str]) -> ConfigError:
    """The error for a key that is no field of this config: a setting of other presets says whose it is."""
    owners = [name for name, preset in ALGORITHMS.items() if key in setting_names(preset)]
    users = [name for name in owners if getattr(ALGORITHMS[name], key) is not None]  # None: a setting not in use
    owners = users or owners
    if owners:
        return ConfigError(f"{key}: not a setting of {algorithm_name!r}; it belongs to {', '.join(owners)} "
                           f"(posttrain algorithms {algorithm_name} lists {algorithm_name}'s settings)")
    return ConfigError(f"unknown config field {key!r}{unknown_field_hint(key, valid)}; "
                       f"valid fields: {', '.join(valid)}")


SHORT_NAMES = {"lr": "learning_rate"}
"""Abbreviations users type for a field, for the error that meets them (hints, not aliases)."""

RENAMED_FIELDS = {
    "tensorboard": "report_to (TensorBoard is its default; report_to none turns it off)",
    "no_tensorboard": "report_to none",
    "wandb_project": "project, with report_to wandb",
}
"""Fields posttrain has renamed, with what replaces them, for the error that meets an old config or command
line (hints, not aliases)."""


def unknown_field_hint(key: str, valid: Sequence[str]) -> str:
    """What to say after "unknown field KEY": posttrain's name for a TRL field, an abbreviation or a renamed
    field, or the closest valid name."""
    key = key.replace("-", "_")
    if key in SHORT_NAMES:
        return f" (did you mean {SHORT_NAMES[key]!r}?)"
    if key in RENAMED_FIELDS:
        return f" (renamed; now {RENAMED_FIELDS[key]})"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def import_plugins(paths: Sequence[str]) -> None:
    """Import each Python file once per process (by its resolved path), running what it registers."""
    for path in paths:
        file = Path(path).resolve()
        if not file.is_file() or file.suffix != ".py":
            raise ConfigError(f"plugin: {path!r} is not a Python file")
        name = f"posttrain_plugin_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules[name]
            raise


def absolute_path(value: str | None) -> str | None:
    """``value`` as an absolute path when it names an existing local file or directory, else unchanged."""
    if value is None or value.startswith("hf:") or not Path(value).exists():
        return value
    return str(Path(value).resolve())


def _absolute_spec(spec: str) -> str:
    """``FILE.py:NAME`` (a reward function, a tool, an environment class) with FILE absolute."""
    path, _, function = spec.rpartition(":")
    return f"{absolute_path(path)}:{function}"


def _coerce_tuple(klass: type, key: str, value: Any) -> Any:
    annotation = {f.name: f.type for f in fields(klass)}[key]
    if str(annotation).startswith("tuple") and not isinstance(value, tuple):
        return tuple(value) if isinstance(value, list) else (value,)
    return value


def upgrade_saved_config(flat: dict[str, Any]) -> dict[str, Any]:
    """A run directory's saved config in today's fields, so that runs saved before a rename resume as they
    are: ``tensorboard`` and ``wandb_project`` became ``report_to`` and ``project``. (A config the user
    writes gets the rename hint instead: only saved runs are upgraded.)"""
    flat = dict(flat)
    if "tensorboard" in flat or "wandb_project" in flat:
        trackers = ["tensorboard"] if flat.pop("tensorboard", True) else []
        project = flat.pop("wandb_project", None)
        if project:
            trackers.append("wandb")
            flat.setdefault("project", project)
        flat.setdefault("report_to", trackers or ["none"])
    return flat


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of field: value, got {type(data).__name__}")
    return data


def save_yaml(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_flat(), sort_keys=False))
