"""Peers' own code, loaded for cross-checks: verl's ``core_algos`` without verl's dependencies.

verl installs with ``pip install --no-deps verl`` (scripts/setup.sh does it for the dev extra);
its package imports ray, omegaconf and tensordict at import time, none of which the loss functions
use. ``verl_core_algos()`` stands in empty modules for those and returns the module, or None when
verl is not installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from functools import cache
from unittest import mock

UNUSED_BY_THE_LOSSES = ("ray", "omegaconf", "tensordict", "codetiming", "hydra", "pydantic", "torchdata")


class _Stub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


class _StubFinder:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in UNUSED_BY_THE_LOSSES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class VerlConfig(dict):
    """What verl's policy losses read from their ``ActorConfig``: attributes, ``get`` and ``policy_loss``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


@cache
def verl_core_algos():
    if importlib.util.find_spec("verl") is None:
        return None
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        from verl.trainer.ppo import core_algos
    finally:
        sys.meta_path.remove(finder)
    core_algos.ActorConfig = VerlConfig  # SAPO asserts its config is an ActorConfig
    core_algos.AlgoConfig = type("AlgoConfig", (), {})  # the others assert it is not an AlgoConfig
    return core_algos


def verl_config(*, eps_low=0.2, eps_high=0.2, **fields) -> VerlConfig:
    policy_loss = VerlConfig({k: fields.pop(k) for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub",
                                                         "kl_cov_ratio", "ppo_kl_coef") if k in fields})
    return VerlConfig(clip_ratio=eps_low, clip_ratio_low=eps_low, clip_ratio_high=eps_high, global_batch_info={},
                      policy_loss=policy_loss, **fields)
