"""reasoning-gym's procedural task families as a posttrain task: ``--task reasoning-gym:SPEC``.

reasoning-gym (PyPI ``reasoning-gym``) generates problems of 100+ families (``chain_sum``,
``gsm_symbolic``, ``basic_arithmetic``, ...) from a seed, and scores an answer with each family's
own ``score_answer``. This module turns a spec string into a :class:`~posttrain.data.tasks.Task`.

Spec grammar (a FAMILY is a name registered in ``reasoning_gym.factory.DATASETS``)::

    SPEC      := "reasoning-gym:" COMPONENT ("," COMPONENT)*
    COMPONENT := FAMILY ["(" SETTING ("," SETTING)* ")"] ["=" WEIGHT]
    SETTING   := NAME "=" VALUE

for example ``reasoning-gym:chain_sum``, ``reasoning-gym:chain_sum=2,gsm_symbolic=1`` or
``reasoning-gym:chain_sum(min_terms=2,max_terms=4)=2,gsm_symbolic``. Besides reasoning-gym's own
families, ``gsm_templates`` is the ``gsm`` task's word problems (:class:`GsmTemplatesDataset`), so a
mix can hold them: ``reasoning-gym:gsm_templates=2,basic_arithmetic``. A WEIGHT is a positive
number (1 when omitted). A setting NAME is a field of the family's config dataclass other than
``seed`` and ``size`` (the split sets those); a VALUE is a Python literal (``4``, ``0.5``, ``True``,
``'+'``, ``('+', '-')``) or else a bare word read as a string (``format_style=natural``). Each
family appears once. Quote the spec in a shell: parentheses are shell syntax.

Mixing: a split of ``n`` rows gives family ``i`` the quota ``n * w_i / sum(w)`` rounded by largest
remainder: each family gets the floor of its quota, and the rows left over go one each to the
families with the largest fractional parts (earlier in the spec on ties). The counts sum to ``n``
and each is within one row of its quota (weights 2 and 1 over 10 rows: quotas 6.67 and 3.33, so 7
and 3). The families' rows are then shuffled together with a seeded ``random.Random``, so a prefix
of the held-out split (``eval_size``) holds the families in about their proportions.

Splits: a family's ``k`` training rows are the items of ``create_dataset(family, seed=seed,
size=k)``; its held-out rows come from the seed ``seed + HELD_OUT_SEED_OFFSET``. Most generators
draw item ``i`` from ``random.Random(seed + i)``, so two seeds closer than the training size would
share items (held-out seed ``seed + 1`` would be the training split shifted by one); the offset is
far beyond any training size. A small problem space still repeats a problem across distant seeds,
so a held-out row whose question text is among the training questions, or earlier in the held-out
split, is dropped: the held-out split then holds fewer than ``n_test`` rows, and the task's
description says how many were dropped. Training rows keep their repeats (a repeated problem is
just sampled more often).

Rows: ``prompt`` is one user chat message (the question, then :data:`INSTRUCTION`), rendered by the
model's chat template like the ``gsm`` task's; ``answer`` is the generator's reference answer (None
for families whose scorer checks validity instead, such as ``graph_color``); ``rg_entry`` is the
generator's entry (``question``, ``answer``, ``metadata``) plus its ``family``: what
``score_answer`` reads, and which family's scorer to ask. It is JSON-serialisable, but a few
families (``arc_agi``, ``rearc``) keep tuples in ``metadata`` that JSON turns into lists, which
their scorers then reject: rows stay in memory, so the scorer sees them as generated.

Reward (one function, weight 1): the family's ``score_answer`` on the completion's final answer
(:func:`answer_of`). Where the reference is a number, the answer is read however the reply writes it
(:func:`posttrain.data.rewards.final_answer`: ``Answer: N``, "the answer is N", ``#### N``,
``\\boxed{N}``, the result of a worked equation, the last number), so the same problem asked under
another instruction (:mod:`posttrain.data.prompt_variants`) is scored on its answer, not its format.
Otherwise it is the text after the last ``Answer:``, so multi-line answers such as grids survive
(without it, the last ``\\boxed{}``, "the answer is ...", or the last number). A completion with no
answer (none found, or nothing after ``Answer:``) scores 0.0 without calling the scorer: some scorers give a missing answer a small
positive score (``countdown``: 0.01), and a missing answer earns nothing here, whatever the family.
``correct``: the score is 1.0.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS, register_dataset

from posttrain.config import ConfigError
from posttrain.data.rewards import (
    RewardFn,
    completion_text,
    extract_answer,
    final_answer,
    parse_number,
)
from posttrain.data.settings import parse_settings as parse_setting_text
from posttrain.data.settings import split_top_level
from posttrain.data.tasks import gsm
from posttrain.data.tasks.task import REASONING_GYM_PREFIX, Task

DELIMITER = "Answer:"
INSTRUCTION = f'Work it out briefly, then end your reply with "{DELIMITER}" followed by the final answer alone.'
HELD_OUT_SEED_OFFSET = 10**9
"""Held-out seed = training seed + this: far beyond any training size (item i uses seed + i)."""
SPLIT_SETTINGS = ("seed", "size")
"""Config fields the split sets; a spec may not."""
LISTED_FAMILIES = 40
"""How many valid family names an unknown-family error lists."""


@dataclass(frozen=True)
class Component:
    """One family of a spec: its generator settings and its weight in the mix."""

    family: str
    settings: dict[str, Any]
    weight: float


# --- posttrain's own families -------------------------------------------------------------


@dataclass
class GsmTemplatesConfig:
    """Settings of ``gsm_templates``: posttrain's templated word problems (:mod:`posttrain.data.tasks.gsm`)."""

    easy_share: float = gsm.EASY_SHARE
    """Probability that a problem comes from one of the four one-operation templates."""
    seed: int | None = None
    size: int = 500

    def validate(self) -> None:
        assert 0.0 <= self.easy_share <= 1.0, f"easy_share must be in [0, 1], got {self.easy_share}"


class GsmTemplatesDataset(ProceduralDataset):
    """The ``gsm`` task's word problems as a reasoning-gym family, so that a spec can mix them with
    reasoning-gym's families under one answer format (``Answer:``) and one reward. Item ``i`` is drawn
    from ``random.Random(seed + i)``, as most reasoning-gym generators draw theirs."""

    def __init__(self, config: GsmTemplatesConfig):
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        rng = random.Random(self.seed + idx)
        template = rng.choice(gsm.EASY if rng.random() < self.config.easy_share else gsm.HARDER)
        question, answer, _ = template(rng)
        return {"question": question, "answer": str(answer), "metadata": {"template": template.__name__}}

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        """1.0 when the answer is the reference number (``$``, ``%`` and thousands commas ignored),
        else 0.0: no partial credit for an answer that merely contains it."""
        value = parse_number(answer)
        return 1.0 if value is not None and value == float(entry["answer"]) else 0.0


POSTTRAIN_FAMILIES = {"gsm_templates": (GsmTemplatesDataset, GsmTemplatesConfig)}
"""Families posttrain adds to reasoning-gym's registry when this module is imported."""
for _name, (_dataset, _config) in POSTTRAIN_FAMILIES.items():
    if _name not in DATASETS:
        register_dataset(_name, _dataset, _config)


# --- parsing the spec ---------------------------------------------------------------------


def parse_weight(family: str, text: str | None) -> float:
    """The weight after ``=`` (1.0 when absent); a ConfigError unless it is a finite number > 0."""
    if text is None:
        return 1.0
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError(f"task: the weight of reasoning-gym family {family!r} must be a positive number, "
                          f"got {text!r}")
    return weight


def split_component(text: str) -> tuple[str, str | None, str | None]:
    """``FAMILY(SETTINGS)=WEIGHT`` -> (family, settings text or None, weight text or None).

    >>> split_component("chain_sum(min_terms=2)=3")
    ('chain_sum', 'min_terms=2', '3')
    """
    head, weight = text, None
    if not text.endswith(")") and "=" in text.rpartition(")")[2]:
        head, _, weight = text.rpartition("=")
        head, weight = head.strip(), weight.strip()
    if "(" not in head:
        return head, None, weight
    family, _, rest = head.partition("(")
    if not rest.endswith(")"):
        raise ConfigError(f"task: {text!r} is not FAMILY(NAME=VALUE,...)=WEIGHT: the settings must close with ')'")
    return family.strip(), rest[:-1], weight


def check_family(family: str) -> None:
    """A ConfigError naming close matches and the valid families unless ``family`` is registered."""
    if family in DATASETS:
        return
    names = sorted(DATASETS)
    close = difflib.get_close_matches(family, names, n=3)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    listed = ", ".join(names[:LISTED_FAMILIES])
    more = f", ... and {len(names) - LISTED_FAMILIES} more" if len(names) > LISTED_FAMILIES else ""
    raise ConfigError(f"task: unknown reasoning-gym family {family!r}{hint}; the {len(names)} families are "
                      f"{listed}{more} (all: reasoning_gym.factory.DATASETS)")


def _field_default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


ACCEPTED_TYPES: dict[type, tuple[type, ...]] = {
    bool: (bool,), int: (int,), float: (int, float), str: (str,), tuple: (tuple, list), list: (tuple, list),
}
"""A setting's default type -> the value types it accepts (an int is no bool and a bool no int)."""


def check_setting(family: str, name: str, value: Any) -> None:
    """A ConfigError naming the family, setting and value unless ``name`` is a settable field of the
    family's config and ``value`` has its default's type. Other defaults (dates, None, option
    objects) are left to the config's own ``validate``."""
    fields = {f.name: f for f in dataclasses.fields(DATASETS[family][1]) if f.name not in SPLIT_SETTINGS}
    if name not in fields:
        fixed = " (the split sets it)" if name in SPLIT_SETTINGS else ""
        raise ConfigError(f"task: reasoning-gym family {family!r} has no setting {name!r}{fixed}; "
                          f"its settings: {', '.join(fields) or 'none'}")
    default = _field_default(fields[name])
    accepted = ACCEPTED_TYPES.get(type(default))
    if accepted is None:
        return
    if isinstance(value, bool) != (bool in accepted) or not isinstance(value, accepted):
        raise ConfigError(f"task: setting {name}={value!r} of reasoning-gym family {family!r} must be of type "
                          f"{type(default).__name__} (default {default!r})")


def parse_settings(family: str, text: str | None) -> dict[str, Any]:
    """``NAME=VALUE,...`` -> {name: value}, each checked by :func:`check_setting`."""
    if text is None:
        return {}
    settings = parse_setting_text(text, f"reasoning-gym family {family!r}", "task")
    for name, value in settings.items():
        check_setting(family, name, value)
    return settings


def parse_spec(spec: str) -> list[Component]:
    """The components of ``reasoning-gym:COMPONENT,...`` (grammar in the module docstring), checked
    against reasoning-gym's registry; a ConfigError that names the family, setting or weight at fault."""
    if not spec.startswith(REASONING_GYM_PREFIX):
        raise ConfigError(f"task: a reasoning-gym task is {REASONING_GYM_PREFIX}FAMILY[,FAMILY...], got {spec!r}")
    body = spec[len(REASONING_GYM_PREFIX):]
    components: list[Component] = []
    for text in split_top_level(body):
        if not text:
            raise ConfigError(f"task: empty family in {spec!r}; give e.g. {REASONING_GYM_PREFIX}chain_sum or "
                              f"{REASONING_GYM_PREFIX}chain_sum=2,gsm_symbolic=1")
        family, settings_text, weight_text = split_component(text)
        check_family(family)
        if any(c.family == family for c in components):
            raise ConfigError(f"task: reasoning-gym family {family!r} appears twice in {spec!r}; give it once")
        components.append(Component(family, parse_settings(family, settings_text), parse_weight(family, weight_text)))
    return components


# --- drawing the splits -------------------------------------------------------------------


def apportion(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` rows split in proportion to ``weights`` by largest remainder (ties: earlier first).

    >>> apportion(10, [2, 1])  # quotas 6.67, 3.33: floors 6, 3; the one row left goes to the .67
    [7, 3]
    """
    quotas = [n * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: -(quotas[i] - counts[i]))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def create_dataset(component: Component, seed: int, size: int) -> ProceduralDataset:
    """reasoning-gym's dataset of ``size`` items for ``component``; a ConfigError naming the family and
    settings when its config rejects them."""
    try:
        return reasoning_gym.create_dataset(component.family, seed=seed, size=size, **component.settings)
    except (AssertionError, ValueError, TypeError) as error:
        raise ConfigError(f"task: reasoning-gym family {component.family!r} rejects the settings "
                          f"{component.settings}: {error or type(error).__name__}") from None


def make_row(family: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A task row: the question as a chat prompt with :data:`INSTRUCTION`, the reference answer, the bare
    question (what a prompt variant asks its own way), the entry."""
    content = f"{entry['question'].rstrip()}\n\n{INSTRUCTION}"
    return {"prompt": [{"role": "user", "content": content}], "answer": entry["answer"],
            "question": entry["question"], "rg_entry": {"family": family, **entry}}


def draw_rows(components: Sequence[Component], seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` rows from ``seed``, apportioned over the components by weight, shuffled together."""
    counts = apportion(n, [c.weight for c in components])
    rows = [make_row(c.family, entry)
            for c, count in zip(components, counts) if count
            for entry in create_dataset(c, seed, count)]
    random.Random(seed).shuffle(rows)
    return rows


def drop_seen(test: list[dict[str, Any]], train: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out rows whose question is neither a training question nor an earlier held-out one."""
    seen = {row["rg_entry"]["question"] for row in train}
    kept = []
    for row in test:
        if row["rg_entry"]["question"] not in seen:
            seen.add(row["rg_entry"]["question"])
            kept.append(row)
    return kept


# --- reward -------------------------------------------------------------------------------


def answer_of(text: str, reference: Any, question: str | None = None) -> str | None:
    """The answer a reply gives: for a numeric reference, however it is written (``Answer: N``, "the answer
    is N", ``#### N``, ``\\boxed{N}``, the answer sentence's number: :func:`~posttrain.data.rewards.final_answer`), so that
    a prompt asking another convention is scored on the problem, not the format; otherwise (a grid, a word,
    a list) the text after the last :data:`DELIMITER`, lines and all, else the generic cues."""
    if isinstance(reference, (int, float)) or parse_number(str(reference)) is not None:
        return final_answer(text, question)
    return extract_answer(text, DELIMITER)


def family_score(scorers: dict[str, ProceduralDataset]) -> RewardFn:
    """The reward: each completion's final answer scored by its row's family scorer (module docstring).

    ``scorers`` maps a family to the dataset whose ``score_answer`` judges its answers.
    """

    def reasoning_gym_score(prompts: list, completions: list, rg_entry: Sequence[dict[str, Any]],
                            **columns: Any) -> list[float | None]:
        scores: list[float | None] = []
        for completion, entry in zip(completions, rg_entry):
            answer = answer_of(completion_text(completion), entry["answer"], entry["question"])
            scores.append(float(scorers[entry["family"]].score_answer(answer, entry)) if answer else 0.0)
        return scores

    return reasoning_gym_score


def scores_one(reward: RewardFn) -> Callable[..., list[bool]]:
    """The task's ``correct`` check: whether each completion's reward (its family's score) is 1.0."""

    def correct(prompts: list, completions: list, **columns: Any) -> list[bool]:
        return [score == 1.0 for score in reward(prompts, completions, **columns)]

    return correct


def describe(components: Sequence[Component], dropped: int) -> str:
    """One line for ``--help`` and logs: the families and their shares, the answer format, the reward."""
    total = sum(c.weight for c in components)
    families = ", ".join(f"{c.family} ({c.weight / total:.0%})" if len(components) > 1 else c.family
                         for c in components)
    return (f"reasoning-gym {families}; chat prompts, final answer after {DELIMITER!r}; reward: the family's "
            f"score_answer; {dropped} held-out problem(s) dropped as repeats")


def make_task(spec: str, seed: int = 0, n_train: int = 2000, n_test: int = 200) -> Task:
    """The task of ``spec`` (``reasoning-gym:...``): ``n_train`` training rows from ``seed``, at most
    ``n_test`` held-out rows from ``seed + HELD_OUT_SEED_OFFSET`` (repeats dropped)."""
    components = parse_spec(spec)
    train = draw_rows(components, seed, n_train)
    drawn_test = draw_rows(components, seed + HELD_OUT_SEED_OFFSET, n_test)
    test = drop_seen(drawn_test, train)
    reward = family_score({c.family: create_dataset(c, seed, 1) for c in components})
    return Task(
        name=spec,
        description=describe(components, len(drawn_test) - len(test)),
        train=train,
        test=test,
        reward_funcs=(reward,),
        reward_weights=(1.0,),
        correct=scores_one(reward),
        max_new_tokens=256,
        default_model="smollm2-135m",
        final_answer=final_answer,
    )
