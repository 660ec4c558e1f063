"""Built-in verifiable tasks: a dataset split, its rewards and its correctness check.

A :class:`Task` bundles what a run needs besides a model: ``train`` and
``test`` rows (a ``prompt`` string plus columns such as ``answer`` that
reach reward functions as keyword arguments, TRL style), default reward
functions with weights, a ``correct`` check used for held-out accuracy, a
token budget and the built-in starting model the task was designed for.

Besides the registry :data:`TASKS`, ``--task reasoning-gym:SPEC`` builds a task from reasoning-gym's
procedural families (:mod:`posttrain.data.tasks.reasoning_gym`, needs the ``reasoning-gym`` extra), and
``--task gem:ENV_ID`` a multi-turn task from a GEM environment (:mod:`posttrain.data.tasks.gem`, needs
the ``gem`` extra), and ``--environment verifiers:NAME`` (or ``--task verifiers:NAME``) a task from a
taskset of ``verifiers`` (:mod:`posttrain.data.tasks.verifiers`, needs the ``verifiers`` extra).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from posttrain.config import ConfigError
from posttrain.data.tasks.task import (
    GEM_PREFIX,
    REASONING_GYM_PREFIX,
    VERIFIERS_PREFIX,
    Task,
)


def _addition(seed: int) -> Task:
    from posttrain.data.tasks import addition

    return addition.make_task(seed)


def _addition_process(seed: int) -> Task:
    from posttrain.data.tasks import addition

    return addition.make_process_task(seed)


def _gsm(seed: int) -> Task:
    from posttrain.data.tasks import gsm

    return gsm.make_task(seed)


def _gsm_calculator(seed: int) -> Task:
    from posttrain.data.tasks import gsm

    return gsm.make_tool_task(seed)


def _calculator(seed: int) -> Task:
    from posttrain.data.tasks import calculator

    return calculator.make_task(seed)


def _code(seed: int) -> Task:
    from posttrain.data.tasks import code

    return code.make_task(seed)


def _shapes(seed: int) -> Task:
    from posttrain.data.tasks import shapes

    return shapes.make_task(seed)


TASKS: dict[str, Callable[[int], Task]] = {"addition": _addition, "addition-process": _addition_process, "gsm": _gsm,
                                           "gsm-calculator": _gsm_calculator, "calculator": _calculator, "code": _code,
                                           "shapes": _shapes}
"""Task name -> builder taking the split seed."""

def _reasoning_gym(spec: str, seed: int) -> Task:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ConfigError(f"task: {spec!r} needs the reasoning-gym package: pip install 'posttrain[reasoning-gym]'")
    from posttrain.data.tasks import reasoning_gym

    return reasoning_gym.make_task(spec, seed)


def _gem(spec: str, seed: int) -> Task:
    if importlib.util.find_spec("gem") is None:
        raise ConfigError(f"task: {spec!r} needs the gem-llm package: pip install 'posttrain[gem]' && "
                          "pip install --no-deps gem-llm==0.1.0 (it pins an older reasoning-gym than posttrain's)")
    from posttrain.data.tasks import gem

    return gem.make_task(spec, seed)


def _verifiers(spec: str, seed: int) -> Task:
    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError(f"environment: {spec!r} needs the verifiers package: pip install 'posttrain[verifiers]'")
    from posttrain.data.tasks import verifiers

    return verifiers.make_task(spec, seed)


def get_task(name: str, seed: int = 0) -> Task:
    """The built-in task ``name``, the reasoning-gym task of a ``reasoning-gym:...`` spec, or the GEM
    environment of a ``gem:ENV_ID`` spec, the verifiers taskset of a ``verifiers:NAME`` spec, its split drawn
    with ``seed``."""
    if name.startswith(REASONING_GYM_PREFIX):
        return _reasoning_gym(name, seed)
    if name.startswith(GEM_PREFIX):
        return _gem(name, seed)
    if name.startswith(VERIFIERS_PREFIX):
        return _verifiers(name, seed)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}, "
                         f"or {REASONING_GYM_PREFIX}FAMILY for a reasoning-gym family, {GEM_PREFIX}ENV_ID for a "
                         f"GEM environment, or {VERIFIERS_PREFIX}NAME for a verifiers taskset")
    return TASKS[name](seed)
