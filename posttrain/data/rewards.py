"""Built-in reward functions, with TRL's calling convention.

A reward function is any callable

    fn(prompts: list, completions: list, **columns) -> list[float | None]

with one entry per completion. ``completions`` are strings, or, for chat
datasets, lists of messages ``[{"role": "assistant", "content": ...}]``;
the built-ins score the content of the last message. Every dataset column
other than ``prompt`` arrives as a keyword argument holding one value per
completion (``answer=[...]``). ``None`` means "not applicable to this
sample" (TRL semantics); combining several functions and weighting them is
the trainer's job, not this module's.

Built-ins (factories return a callable whose ``__name__`` is used in logs):

- :func:`exact_match` - extracted answer equals the ``answer`` column as strings;
- :func:`numeric_match` - extracted answer equals ``answer`` as a number, within tolerance;
- :func:`math_answer` - the final answer equals ``answer`` mathematically (``math_verify`` when installed);
- :func:`format_reward` - 1.0 when the completion fully matches a regex;
- :func:`length_penalty` - 0.0 up to a length, then down to ``-scale``;
- :func:`code_tests` - the share of a row's hidden unit tests the completion's function passes, in the sandbox;
- :class:`RewardModel` - the scalar score of a sequence-classification model;
- :func:`load_reward_function` - a user's function from ``path/to/file.py:name``.

Rewards by name: the factories above (the reward model aside) are registered in :data:`REWARDS`, so a
``reward`` spec (``--reward``, YAML, ``posttrain.train(reward_funcs=[...])``) can name one, with its
settings as keyword arguments: ``numeric_match``, ``'numeric_match(rel_tol=1e-3)'``,
``'length_penalty(max_chars=400, scale=0.5)'`` (settings parsed as :mod:`posttrain.data.settings`
does). :func:`register_reward` adds a user's factory under a name of its own (the CLI finds it once
``--plugin FILE.py`` has imported the file that registers it). :func:`load_reward` resolves a spec:
a name through the registry, anything else as ``FILE.py:FUNCTION``.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from posttrain.config import ConfigError, is_reward_name
from posttrain.data.settings import parse_settings

RewardFn = Callable[..., list[float | None]]
Factory = TypeVar("Factory", bound=Callable[..., RewardFn])

REWARDS: dict[str, Callable[..., RewardFn]] = {}
"""Reward name -> the factory that builds its reward function from a spec's settings (keyword arguments)."""


def register_reward(name: str, *, replace: bool = False) -> Callable[[Factory], Factory]:
    """Register the decorated factory as the reward ``name``.

    A factory takes the reward's settings as keyword arguments and returns a reward function with TRL's
    signature: ``--reward NAME`` calls it with none (a setting without a default must then be given),
    ``--reward 'NAME(SETTING=VALUE,...)'`` with those. A reward without settings is a factory of none::

        @posttrain.register_reward("brevity")
        def brevity(max_words: int = 50):
            def brevity(prompts, completions, **columns):
                return [float(len(c.split()) <= max_words) for c in completions]
            return brevity

    Registering a name twice is an error unless it is the same function again (a module imported twice)
    or ``replace=True``.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a reward's name must be an identifier such as 'my_reward', got {name!r}")

    def decorator(factory: Factory) -> Factory:
        old = REWARDS.get(name)
        same = old is not None and (old.__module__, old.__qualname__) == (factory.__module__, factory.__qualname__)
        if old is not None and not (same or replace):
            raise ValueError(f"reward {name!r} is already registered (by {old.__module__}.{old.__qualname__}); "
                             "choose another name, or pass replace=True to replace it")
        REWARDS[name] = factory
        return factory

    return decorator

_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+"
_ANSWER_IS = re.compile(r"answer is:?\s*(.+?)\s*(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of a completion: the string itself, or the last chat message's content."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
    return None  # unbalanced: the completion was cut off inside the box


def extract_answer(text: str, delimiter: str | None = None) -> str | None:
    r"""The final answer written in ``text``, or None if none can be found.

    Tried in order: the text after the last ``delimiter`` (when given and
    present); the content of the last ``\boxed{...}``; what follows the last
    "answer is" up to a full stop or line end; the last number.

    >>> extract_answer("7+5=12|12", delimiter="|")
    '12'
    >>> extract_answer("so $\\boxed{3}$ and 4")
    '3'
    >>> extract_answer("The answer is 1,234.")
    '1,234'
    >>> extract_answer("I get 3 then 45.5 apples")
    '45.5'
    """
    if delimiter is not None and delimiter in text:
        return text.rsplit(delimiter, 1)[1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].strip()
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


_CUE = re.compile(r"####|\\boxed\{|\banswer(?:\s+(?:is|was|would be|will be)\b\s*:?|\s*\**\s*[:=])",
                  re.IGNORECASE)
_STATEMENT_END = re.compile(r"\n|\.(?=\s|$)|$")
_SENTENCE_BREAK = re.compile(r"\n|(?<=[.!?])\s")


def final_answer(text: str, question: str | None = None) -> str | None:
    r"""The final answer however the reply writes it, or None: one parser for every answer convention.

    The last answer cue that states something decides: ``\boxed{...}`` (its content), ``####``, or
    "answer" ("The answer is", "Answer:", "Final answer =", ...), the answer being what follows the cue
    up to the line's or the sentence's end; a cue with a number beats a later one without (a reply that
    repeats its instruction, ``... followed by the final answer alone``), and an empty box states
    nothing. In the statement, a worked equation counts by its result (the number after the last
    ``=``), and otherwise its first number (units and explanations after it are dropped); an answer
    without a number (a weekday, a word) is returned whole, and one in LaTeX as written.

    With no cue, the last sentence that holds a number states the answer: its equation's result, else
    its last number; given the ``question``, its last number that the question does not hold
    ("Hugo spends $9 on 3 sandwiches" answers "... buys 3 sandwiches" with 9).

    >>> final_answer("So the answer is 6 x 21 = 126.")
    '126'
    >>> final_answer("Answer: 12 apples (she had 15 and gave away 3)")
    '12'
    >>> final_answer("3 + 4 = 7\n#### 7")
    '7'
    >>> final_answer("It is $\\boxed{\\frac{1}{2}}$ of the cake")
    '\\frac{1}{2}'
    >>> final_answer("So, in 5 years, Jack will be 49 years old.", question="How old will Jack be in 5 years?")
    '49'
    """
    statements = [statement for statement in map(partial(_stated, text), reversed(list(_CUE.finditer(text))))
                  if statement]
    if statements:
        statement = next((s for s in statements if re.search(_NUMBER, s)), statements[0])
        value = statement.rsplit("=", 1)[-1].strip().strip("*$ ")
        if not value or parse_number(value) is not None or "\\" in value:
            return value or None
        numbers = re.findall(_NUMBER, value)
        return numbers[0] if numbers else value
    sentences = [part for part in _SENTENCE_BREAK.split(text) if re.search(_NUMBER, part)]
    if not sentences:
        return None
    worked = re.findall(_NUMBER, sentences[-1].rsplit("=", 1)[-1]) if "=" in sentences[-1] else []
    if worked:
        return worked[0]
    numbers = re.findall(_NUMBER, sentences[-1])
    given = {parse_number(n) for n in re.findall(_NUMBER, question or "")}
    fresh = [n for n in numbers if parse_number(n) not in given]
    return (fresh or numbers)[-1]


def _stated(text: str, cue: re.Match) -> str | None:
    """What an answer cue states: a box's content, else the rest of its line or sentence (None: nothing)."""
    if cue.group(0).lower().startswith("\\boxed"):
        return _boxed(text[cue.start():]) or None
    rest = text[cue.end():].lstrip(" :*")
    statement = rest[:_STATEMENT_END.search(rest).start()].strip()
    return None if "\\boxed{" in statement else statement or None  # a box states its own answer, if it closes


def parse_number(text: str | None) -> float | None:
    """``text`` as a float (thousands commas, ``$`` and ``%`` ignored), or None."""
    if text is None:
        return None
    cleaned = text.strip().strip("$%").replace(",", "").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


def _answers(name: str, answer: Sequence[Any] | None, n: int) -> Sequence[Any]:
    if answer is None:
        raise ValueError(f"reward {name!r} needs an 'answer' column in the dataset")
    if len(answer) != n:
        raise ValueError(f"reward {name!r}: {len(answer)} answers for {n} completions")
    return answer


@register_reward("exact_match")
def exact_match(delimiter: str | None = None) -> RewardFn:
    """1.0 when :func:`extract_answer` of the completion equals ``str(answer).strip()``, else 0.0.

    A row whose answer is None scores None (not applicable).
    """

    def exact_match(prompts: list, completions: list, answer: Sequence[Any] | None = None, **columns: Any):
        answers = _answers("exact_match", answer, len(completions))
        scores: list[float | None] = []
        for completion, gold in zip(completions, answers):
            predicted = extract_answer(completion_text(completion), delimiter)
            scores.append(None if gold is None else float(predicted == str(gold).strip()))
        return scores

    return exact_match


@register_reward("numeric_match")
def numeric_match(delimiter: str | None = None, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> RewardFn:
    """1.0 when the extracted answer and ``answer`` are numbers within tolerance, else 0.0.

    Equality is ``math.isclose(predicted, gold, rel_tol=rel_tol, abs_tol=abs_tol)``.
    An unparseable prediction scores 0.0; an unparseable or None gold answer
    scores None (the row is not a numeric problem).
    """

    def numeric_match(prompts: list, completions: list, answer: Sequence[Any] | None = None, **columns: Any):
        answers = _answers("numeric_match", answer, len(completions))
        scores: list[float | None] = []
        for completion, gold in zip(completions, answers):
            gold_value = parse_number(None if gold is None else str(gold))
            if gold_value is None:
                scores.append(None)
                continue
            predicted = parse_number(extract_answer(completion_text(completion), delimiter))
            close = predicted is not None and math.isclose(predicted, gold_value, rel_tol=rel_tol, abs_tol=abs_tol)
            scores.append(float(close))
        return scores

    return numeric_match


THINK_ANSWER_FORMAT = r"(?s)<think>.*?</think>\s*<answer>.*?</answer>"
"""DeepSeek-R1's output format: reasoning inside ``<think>...</think>``, then the answer inside
``<answer>...</answer>`` (``(?s)``: the parts may span lines)."""


@register_reward("format_reward")
def format_reward(pattern: str = THINK_ANSWER_FORMAT, name: str = "format") -> RewardFn:
    """1.0 when the whole completion matches the regex ``pattern`` (``re.fullmatch``), else 0.0; by default
    :data:`THINK_ANSWER_FORMAT`."""
    regex = re.compile(pattern)

    def format_fn(prompts: list, completions: list, **columns: Any) -> list[float | None]:
        return [float(regex.fullmatch(completion_text(c)) is not None) for c in completions]

    format_fn.__name__ = name
    return format_fn


@register_reward("length_penalty")
def length_penalty(max_chars: int, scale: float = 1.0) -> RewardFn:
    """0.0 for completions of at most ``max_chars`` characters, then linearly down to ``-scale``.

    penalty = -scale * min(1, (len - max_chars) / max_chars): a completion
    twice the limit or longer gets the full ``-scale``.
    """
    if max_chars <= 0:
        raise ValueError(f"length_penalty needs max_chars > 0, got {max_chars}")

    def length_penalty(prompts: list, completions: list, **columns: Any) -> list[float | None]:
        excess = [max(0, len(completion_text(c)) - max_chars) for c in completions]
        return [-scale * min(1.0, e / max_chars) for e in excess]

    return length_penalty


def reward_model_text(tokenizer: Any, prompt: Any, completion: Any) -> str:
    """The one text a reward model scores for ``(prompt, completion)``: a string prompt followed by the
    completion's text, or the chat template over the prompt's messages and the assistant reply. The
    reward-model trainer trains on this rendering, so a score is read on text of the kind it learnt from."""
    if isinstance(prompt, str):
        return prompt + completion_text(completion)
    reply = completion if not isinstance(completion, str) else [{"role": "assistant", "content": completion}]
    return tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False)


class RewardModel:
    """The scalar score of a sequence-classification reward model (``num_labels=1``).

    Scores ``prompt + completion`` as one text; when prompts are chat messages
    and the tokenizer has a chat template, the conversation ``prompt +
    [assistant completion]`` is rendered with it. Runs under ``torch.no_grad``
    in batches of ``batch_size`` on ``device`` (default: where the model is).
    ``normalize="batch"`` standardises each call's scores (mean 0, std 1).
    """

    __name__ = "reward_model"

    def __init__(self, path_or_model: str | Path | torch.nn.Module, tokenizer: Any = None, batch_size: int = 16,
                 *, normalize: str = "none", device: str | torch.device | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(path_or_model, (str, Path)):
            model = AutoModelForSequenceClassification.from_pretrained(path_or_model)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(path_or_model)
        else:
            model = path_or_model
            if tokenizer is None:
                raise ValueError("RewardModel given a model object also needs its tokenizer")
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model must have num_labels=1 (one scalar score), this one has {model.config.num_labels}")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # the model finds each row's last token through it
            model.config.pad_token_id = tokenizer.pad_token_id
        if normalize not in ("none", "batch"):
            raise ValueError(f"normalize: got {normalize!r}; use none or batch")
        self.model = model.eval() if device is None else model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.normalize = normalize

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        texts = [reward_model_text(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        scores: list[float | None] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True)
            batch = {k: v.to(self.model.device) for k, v in batch.items()}
            logits_B1 = self.model(**batch).logits
            scores.extend(logits_B1[:, 0].float().tolist())
        if self.normalize == "batch" and len(scores) > 1:  # mean 0, std 1 over this call's completions
            values = torch.tensor(scores, dtype=torch.float64)
            scores = ((values - values.mean()) / (values.std() + 1e-6)).tolist()
        return scores


USER_MODULE_PREFIX = "posttrain_user_reward_"
"""The module name of a file :func:`load_reward_function` loads begins with this (a process that unpickles
its functions loads the file again under the same name: posttrain.rollout.worker)."""


def load_reward_function(spec: str, what: str = "reward") -> RewardFn:
    """Import ``func_name`` from the Python file of ``"path/to/file.py:func_name"`` (``what`` names it in errors:
    a reward function, a tool)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise ValueError(f"{what} function {spec!r} is not of the form path/to/file.py:func_name")
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} (from {spec!r}) does not exist")
    module_name = f"{USER_MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        raise AttributeError(f"{str(path)!r} defines no {name!r}; functions defined there: {', '.join(defined) or 'none'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in {str(path)!r} is a {type(fn).__name__}, not a callable {what} function")
    return fn



def load_reward(spec: str) -> RewardFn:
    """The reward function of a ``reward`` spec: a registered name, ``NAME`` or ``NAME(SETTING=VALUE,...)``
    (:data:`REWARDS`), built by its factory with those settings; anything else is ``FILE.py:FUNCTION``
    (:func:`load_reward_function`). A ConfigError names an unknown reward, setting or value."""
    if not is_reward_name(spec):
        return load_reward_function(spec)
    name, settings = parse_reward_name(spec)
    factory = REWARDS[name]
    parameters = inspect.signature(factory).parameters
    hints = typing.get_type_hints(factory)
    for setting, value in settings.items():
        if setting not in parameters:
            raise ConfigError(f"reward: {name} has no setting {setting!r}; its settings: {', '.join(parameters)}")
        _check_setting_type(name, setting, value, hints.get(setting))
    missing = [p.name for p in parameters.values() if p.default is p.empty and p.name not in settings]
    if missing:
        example = ", ".join(f"{m}=VALUE" for m in missing)
        raise ConfigError(f"reward: {name} needs {', '.join(missing)} (no default): give --reward '{name}({example})'")
    try:
        return factory(**settings)
    except ValueError as error:  # a value of the right type outside its range, as the factory checks it
        raise ConfigError(f"reward: {spec.strip()}: {error}") from None


def parse_reward_name(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME(SETTING=VALUE,...)`` -> (name, settings); a ConfigError naming the close matches and every
    registered reward unless ``NAME`` is one.

    >>> parse_reward_name("length_penalty(max_chars=400, scale=0.5)")
    ('length_penalty', {'max_chars': 400, 'scale': 0.5})
    """
    name, _, rest = spec.strip().partition("(")
    name = name.strip()
    if name not in REWARDS:
        close = difflib.get_close_matches(name, REWARDS, n=1)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ConfigError(f"reward: unknown reward {name!r}{hint}; the rewards by name are "
                          f"{', '.join(sorted(REWARDS))} (posttrain.register_reward adds one); a function of "
                          "your own is given as FILE.py:FUNCTION")
    settings_text = rest.removesuffix(")").strip()
    return name, parse_settings(settings_text, f"reward {name!r}", "reward") if settings_text else {}


def _check_setting_type(reward: str, setting: str, value: Any, hint: Any) -> None:
    """A ConfigError unless ``value`` is of a type the factory's annotation ``hint`` names (an int is a float
    setting's value too, a bool no int's). Annotations other than plain classes and their unions are not
    checked: the factory sees the value as it is."""
    if typing.get_origin(hint) not in (None, typing.Union, types.UnionType):
        return
    allowed = [kind for kind in (typing.get_args(hint) or (hint,)) if isinstance(kind, type)]
    if not allowed:
        return
    if float in allowed:
        allowed.append(int)
    if not isinstance(value, tuple(allowed)) or (isinstance(value, bool) and bool not in allowed):
        names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in dict.fromkeys(allowed))
        raise ConfigError(f"reward: setting {setting}={value!r} of {reward} must be of type {names}")


def _prompt_text(prompt: Any) -> str:
    """A prompt's text: the string, or its chat messages' contents joined."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt or ())


def _math_equal(predicted: str, gold: str, rel_tol: float, abs_tol: float) -> bool:
    """Whether two final answers agree: by ``math_verify`` when installed (``\\frac{1}{2}`` equals
    ``0.5``, ``7 apples`` equals ``7``), else as the last number each one writes, within tolerance."""
    if importlib.util.find_spec("math_verify") is not None:
        import threading

        from math_verify import parse, verify

        # math_verify's timeouts use signal.alarm, which works only in the main thread.
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        return verify(parse(gold, parsing_timeout=timeout), parse(predicted, parsing_timeout=timeout),
                      timeout_seconds=timeout)
    numbers = [parse_number(text) for text in (predicted, gold)]
    if numbers[0] is None:  # "7 apples": the answer's last number
        found = re.findall(_NUMBER, predicted)
        numbers[0] = parse_number(found[-1]) if found else None
    return None not in numbers and math.isclose(numbers[0], numbers[1], rel_tol=rel_tol, abs_tol=abs_tol)


@register_reward("math_answer")
def math_answer(rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> RewardFn:
    """1.0 when the final answer written in free text equals ``answer`` mathematically, else 0.0.

    The final answer is :func:`final_answer`'s (the last ``\\boxed{}``, ``####`` or "answer is/Answer:"
    statement, else the answer sentence's number), so any answer convention counts; it is compared
    with the gold answer by ``math_verify.verify`` when the ``math-verify`` package is installed,
    otherwise numerically (``math.isclose`` with the given tolerances). A completion without an answer
    scores 0.0; a row whose answer is None scores None.
    """

    def math_answer(prompts: list, completions: list, answer: Sequence[Any] | None = None, **columns: Any):
        answers = _answers("math_answer", answer, len(completions))
        scores: list[float | None] = []
        for prompt, completion, gold in zip(prompts, completions, answers):
            if gold is None:
                scores.append(None)
                continue
            predicted = final_answer(completion_text(completion), _prompt_text(prompt))
            scores.append(float(predicted is not None and _math_equal(predicted, str(gold), rel_tol, abs_tol)))
        return scores

    return math_answer


@register_reward("code_tests")
def code_tests(seconds_per_test: float = 0.5, timeout_s: float = 5.0, memory_mb: int = 512) -> RewardFn:
    """The fraction of a row's unit tests the completion's function passes, run in the sandbox.

    Rows need ``entry_point`` (the function's name) and ``tests`` (a list of ``{"input": [args...],
    "output": expected}`` or that list as JSON); the code is the completion's first fenced block that
    defines the function (:func:`posttrain.data.code_execution.extract_code`). Each completion runs in a
    fresh :mod:`posttrain.sandbox` (``timeout_s`` and ``memory_mb`` for all its tests, ``seconds_per_test``
    each), a step's completions in parallel; the outputs are compared outside the sandbox. A row without
    tests scores None.
    """
    from posttrain.data.code_execution import extract_code, run_tests

    # (code, function, tests) -> score: a group's repeated completions, and evaluation asking for the reward
    # and for correctness of the same completion, run once
    scored: dict[tuple[str, str, str], float] = {}

    def code_tests(prompts: list, completions: list, entry_point: Sequence[str] | None = None,
                   tests: Sequence[Any] | None = None, **columns: Any) -> list[float | None]:
        if entry_point is None or tests is None:
            raise ValueError("reward 'code_tests' needs 'entry_point' and 'tests' columns in the dataset")
        if len(scored) > 100_000:  # a long run's completions: keep memory bounded
            scored.clear()
        keys = [None if t is None else (extract_code(completion_text(c), e), e, t if isinstance(t, str) else repr(t))
                for c, e, t in zip(completions, entry_point, tests)]
        new = list(dict.fromkeys(k for k in keys if k is not None and k not in scored))
        originals = {k: t for k, t in zip(keys, tests) if k in new}  # the tests as the row gave them
        reports = run_tests([k[0] for k in new], [k[1] for k in new], [originals[k] for k in new],
                            seconds_per_test=seconds_per_test, timeout_s=timeout_s, memory_mb=memory_mb)
        scored.update((k, report.fraction) for k, report in zip(new, reports))
        return [None if k is None else scored[k] for k in keys]

    return code_tests
