"""Prompt variants: the same problem asked under different instructions and answer conventions.

A model that learned a skill answers however it is asked; one that learned a prompt answers only the
phrasing it was trained on. A :class:`PromptVariant` turns a problem's bare question into the chat
messages one asker would send: a user turn built from a template holding ``{question}``, and
optionally a system message. ``posttrain eval --prompt-variants SPEC`` (and the run field
``eval_prompt_variants``) scores every problem under each variant of a set; ``train_prompt_variants``
draws one variant per training prompt.

A SPEC is a built-in set's name (:data:`VARIANT_SETS`: ``eval``, the seven below; ``train``, a
disjoint pool of other phrasings for training prompts), a comma-separated list of built-in variant
names (``bare,boxed``), or a YAML/JSON file of the user's own templates::

    - name: polite               # optional: file:1, file:2, ... when absent
      user: "Could you solve this? {question}"
      system: "You are a patient maths teacher."   # optional

Every template must hold ``{question}`` exactly once in its user turn (the system message may not
hold it); no other ``{...}`` field is allowed (write ``{{`` and ``}}`` for literal braces, as in
Python's ``str.format``).

The ``eval`` set covers the ways word problems are asked in practice: no instruction at all; the
``Answer: N`` line (posttrain's reasoning-gym tasks); "The answer is N" (a sentence); GSM8K's
``#### N``; ``\\boxed{}`` (the common instruction of math-tuned models); reasoning first, then a
sentence naming the answer, with the instruction before the question; and an instruction given as a
system prompt. Answers are read however they are written (:func:`posttrain.data.rewards.final_answer`),
so a variant measures whether the model solves the problem when asked that way, not whether it obeys
the format.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError

QUESTION = "question"
"""The template field a problem's question goes in, and the row column it is read from."""


@dataclass(frozen=True)
class PromptVariant:
    """One way of asking: ``user`` is a template with one ``{question}``; ``system`` an optional system message."""

    name: str
    user: str
    system: str | None = None

    def render(self, question: str) -> list[dict[str, str]]:
        """The chat messages that ask ``question`` this way."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return [*messages, {"role": "user", "content": self.user.format(question=question.strip())}]


BUILTIN_VARIANTS: dict[str, PromptVariant] = {v.name: v for v in (
    PromptVariant("bare", "{question}"),
    PromptVariant("answer_line", '{question}\n\nWork it out briefly, then end your reply with "Answer:" followed by '
                                 "the final answer alone."),
    PromptVariant("answer_is", '{question}\nEnd your reply with "The answer is N." where N is the final number.'),
    PromptVariant("hashes", "{question}\nSolve the problem, then write the final answer on the last line after "
                            '"####".'),
    PromptVariant("boxed", "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."),
    PromptVariant("reason_first", "Solve the following word problem. Reason step by step, then finish with a "
                                  "sentence that states the answer.\n\n{question}"),
    PromptVariant("system", "{question}", system="You are a careful math tutor. Solve the user's problem and end "
                                                 'with "The answer is N."'),
)}
"""The evaluation variants, by name (the ``eval`` set)."""

TRAINING_VARIANTS: dict[str, PromptVariant] = {v.name: v for v in (
    PromptVariant("train_plain", "Problem: {question}"),
    PromptVariant("train_final_answer", '{question}\nShow your work, then give "Final answer: N".'),
    PromptVariant("train_answer_sentence", "{question}\nExplain your steps briefly and conclude with the answer in a "
                                           "full sentence."),
    PromptVariant("train_answer_colon_first", 'Answer the question below. Finish with "Answer: <number>".\n'
                                              "{question}"),
    PromptVariant("train_box_short", "{question} Put the result in \\boxed{{}}."),
    PromptVariant("train_hashes_gsm8k", "Question: {question}\nGive the reasoning, then the answer after ####."),
    PromptVariant("train_think", "{question}\nThink it through one step at a time. What is the answer?"),
    PromptVariant("train_system_solver", "{question}", system="You solve math word problems. Answer with the final "
                                                              "number at the end."),
    PromptVariant("train_system_teacher", "Here is a question from a student: {question}",
                  system="You are a friendly teacher who explains arithmetic clearly."),
    PromptVariant("train_short", "{question}\nBe concise."),
)}
"""Training phrasings (the ``train`` set): none is an evaluation variant's wording, so an evaluation
under the ``eval`` set measures phrasings the run never saw."""

VARIANT_SETS: dict[str, dict[str, PromptVariant]] = {"eval": BUILTIN_VARIANTS, "train": TRAINING_VARIANTS}
"""Set name -> its variants."""

FILE_FIELDS = ("name", "user", "system")


def check_template(variant: PromptVariant, where: str) -> None:
    """A ConfigError naming ``where`` unless ``user`` holds ``{question}`` once and no other field does."""
    for part, text in (("user", variant.user), ("system", variant.system or "")):
        try:
            fields = [field for _, field, _, _ in string.Formatter().parse(text) if field is not None]
        except ValueError as error:
            raise ConfigError(f"{where}: {part} template {text!r} is not a format string ({error}); write literal "
                              "braces as {{ and }}") from None
        unknown = [field for field in fields if field != QUESTION]
        if unknown:
            raise ConfigError(f"{where}: {part} template has the unknown field {{{unknown[0]}}}; the one field is "
                              f"{{{QUESTION}}} (write literal braces as {{{{ and }}}})")
        count = fields.count(QUESTION)
        if part == "user" and count != 1:
            raise ConfigError(f"{where}: the user template must hold {{{QUESTION}}} exactly once, it holds it "
                              f"{count} times: {text!r}")
        if part == "system" and count:
            raise ConfigError(f"{where}: the system message may not hold {{{QUESTION}}}; the question goes in the "
                              "user turn")


def read_variant_file(path: Path) -> list[PromptVariant]:
    """The variants of a YAML or JSON file: a list of mappings with ``user`` (and ``name``, ``system``)."""
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            entries = json.loads(text)
        else:
            import yaml

            entries = yaml.safe_load(text)
    except Exception as error:  # a syntax error of either parser, with its position
        raise ConfigError(f"prompt variants file {str(path)!r} does not parse: {error}") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"prompt variants file {str(path)!r}: expected a non-empty list of templates "
                          f"(- user: \"... {{{QUESTION}}} ...\"), got {type(entries).__name__}")
    variants = []
    for k, entry in enumerate(entries, 1):
        where = f"prompt variants file {str(path)!r}, template {k}"
        if isinstance(entry, str):
            entry = {"user": entry}
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping with a user template, got {entry!r}")
        unknown = sorted(set(entry) - set(FILE_FIELDS))
        if unknown:
            raise ConfigError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(FILE_FIELDS)}")
        if not isinstance(entry.get("user"), str):
            raise ConfigError(f"{where}: needs a user template (a string holding {{{QUESTION}}})")
        if entry.get("system") is not None and not isinstance(entry["system"], str):
            raise ConfigError(f"{where}: system must be a string, got {entry['system']!r}")
        variant = PromptVariant(str(entry.get("name") or f"file:{k}"), entry["user"], entry.get("system"))
        check_template(variant, where)
        variants.append(variant)
    names = [v.name for v in variants]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise ConfigError(f"prompt variants file {str(path)!r}: two templates are named {repeated!r}")
    return variants


def resolve_variants(spec: str) -> list[PromptVariant]:
    """The variants of ``spec``: a set name, a comma-separated list of built-in names, or a file."""
    if spec in VARIANT_SETS:
        return list(VARIANT_SETS[spec].values())
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise ConfigError(f"prompt variants: file {spec!r} does not exist")
        return read_variant_file(path)
    known = {**BUILTIN_VARIANTS, **TRAINING_VARIANTS}
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ConfigError(f"prompt variants: unknown variant {(unknown or [spec])[0]!r}; give a set "
                          f"({', '.join(VARIANT_SETS)}), built-in names ({', '.join(known)}), or a .yaml/.json file "
                          "of templates")
    return [known[name] for name in dict.fromkeys(names)]


def question_of(row: dict[str, Any], where: str) -> str:
    """The bare question of a row (its ``question`` column); a ConfigError naming the row when it has none."""
    question = row.get(QUESTION)
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"prompt variants: {where} has no {QUESTION!r} column (the problem without any "
                          "instruction), which a variant needs to ask it its own way; built-in word-problem and "
                          "reasoning-gym tasks have one, a dataset needs the column")
    return question


def ask(rows: list[dict[str, Any]], variant: PromptVariant, source: str) -> list[dict[str, Any]]:
    """``rows`` with each prompt replaced by its question asked under ``variant``."""
    return [{**row, "prompt": variant.render(question_of(row, f"{source} row {i}"))} for i, row in enumerate(rows, 1)]


def ask_each_differently(rows: list[dict[str, Any]], variants: list[PromptVariant], seed: int,
                         source: str) -> list[dict[str, Any]]:
    """``rows`` with each prompt asked under a variant drawn for it (seeded: the same draw on a resume)."""
    rng = random.Random(seed)
    return [{**row, "prompt": rng.choice(variants).render(question_of(row, f"{source} row {i}"))}
            for i, row in enumerate(rows, 1)]
