"""Prompt data: loading user datasets, encoding prompts, and the prompt sampler.

Datasets follow TRL's column conventions: a ``prompt`` column (a string, or a
list of chat messages rendered with the tokenizer's chat template); every other
column is passed to the reward functions as a keyword argument.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.config.sections import DataConfig, hub_dataset_name


class DataError(ValueError):
    """A dataset row is unusable; the message names the file, the row and the field."""


@dataclass(frozen=True)
class HubSplits:
    """Which part of a Hugging Face dataset named by ``--dataset``/``--eval-dataset`` is read: its config
    (None: the default) and the training and held-out splits (a saved ``DatasetDict``'s too). Files ignore it."""

    config: str | None = None
    split: str = "train"
    eval_split: str = "test"


def hub_splits(data: DataConfig) -> HubSplits:
    """The ``--dataset-config``, ``--dataset-split`` and ``--eval-dataset-split`` of a run's data section."""
    return HubSplits(data.dataset_config, data.dataset_split, data.eval_dataset_split)


DATA_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""A data file's suffix -> the ``datasets`` builder that reads it."""


def read_rows(path: str, config: str | None = None, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a JSONL/JSON/Parquet/CSV file; of a directory (:func:`_read_directory`: a dataset saved by
    ``datasets``' ``save_to_disk``, a ``DatasetDict``'s ``split`` of one, or shards of one kind); or of a
    Hugging Face dataset named ``owner/name`` (or ``hf:owner/name``): its ``config`` (None: the default) and
    ``split``, through ``datasets.load_dataset``, which reads the local cache when offline."""
    name = hub_dataset_name(path)
    if name is not None:
        return _read_hub(name, config, split)
    file = Path(path)
    if not file.exists():
        raise DataError(f"{path}: file does not exist")
    if file.is_dir():
        return _read_directory(file, split)
    if file.suffix not in DATA_KINDS:
        raise DataError(f"{path}: unsupported file type {file.suffix!r}; use .jsonl, .json, .parquet or .csv, a "
                        "directory of them or one saved by datasets' save_to_disk, or name a Hugging Face dataset "
                        "(owner/name)")
    return _read_files([file])


def _read_files(files: list[Path]) -> list[dict[str, Any]]:
    """Rows of data files of one kind, in the order given (JSONL by posttrain's reader, which names a bad line)."""
    if files[0].suffix == ".jsonl":
        return [row for file in files for row in _read_jsonl(file)]
    import datasets

    loaded = datasets.load_dataset(DATA_KINDS[files[0].suffix], data_files=[str(f) for f in files], split="train")
    return [dict(row) for row in loaded]


def _read_directory(directory: Path, split: str) -> list[dict[str, Any]]:
    """A directory's rows: a ``save_to_disk`` Dataset, a ``save_to_disk`` DatasetDict's ``split``, or its data
    files of one kind (a suffix of :data:`DATA_KINDS`; other files, hidden ones and ``_SUCCESS``-style markers
    left out) in name order."""
    if (directory / "dataset_dict.json").is_file() or (directory / "state.json").is_file():
        import datasets

        saved = datasets.load_from_disk(str(directory))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise DataError(f"{directory}: the saved DatasetDict has no split {split!r}; its splits: "
                                f"{', '.join(saved)} (choose with --dataset-split, or --eval-dataset-split for "
                                "--eval-dataset)")
            saved = saved[split]
        return [dict(row) for row in saved]
    entries = sorted(p for p in directory.iterdir() if not p.name.startswith((".", "_")))
    files = [p for p in entries if p.is_file() and p.suffix in DATA_KINDS]
    kinds = sorted({p.suffix for p in files})
    if len(kinds) > 1:
        found = ", ".join(f"{sum(p.suffix == kind for p in files)} {kind}" for kind in kinds)
        raise DataError(f"{directory}: the directory holds data files of several kinds ({found}); keep the shards "
                        "of one kind in it")
    if not files:
        found = ", ".join(p.name + "/" * p.is_dir() for p in entries[:10]) + (", ..." if len(entries) > 10 else "")
        raise DataError(f"{directory}: no data file in the directory (found: {found or 'nothing'}); give a "
                        "directory of .jsonl, .json, .parquet or .csv shards, or one saved by datasets' "
                        "save_to_disk")
    return _read_files(files)


def _read_hub(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """A Hugging Face dataset's split; a DataError that says how to fetch it when it is not cached."""
    import datasets

    arguments = ", ".join(map(repr, [name, *([config] if config else [])]))
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except ConnectionError:
        raise DataError(
            f"{name}: the Hugging Face dataset is not in the local cache and the Hub cannot be reached; fetch it "
            f"where there is internet, with the same HF_HOME: python -c \"import datasets; "
            f"datasets.load_dataset({arguments})\" (then copy HF_HOME's datasets cache here), or give a local "
            f"file") from None
    except ValueError as error:  # an unknown config or split: datasets names the ones there are
        raise DataError(f"{name}: {error}".replace("\n", " ")) from None
    return [dict(row) for row in dataset]


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    rows = []
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{file}:{number}: line is not valid UTF-8 ({error})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{file}:{number}: malformed JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{file}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def check_prompt_rows(rows: list[dict[str, Any]], source: str) -> None:
    """Every row has a non-empty ``prompt``; errors name the row (1-based)."""
    if not rows:
        raise DataError(f"{source}: the dataset has no rows")
    for number, row in enumerate(rows, start=1):
        prompt = row.get("prompt")
        if prompt is None:
            raise DataError(f"{source}: row {number} has no 'prompt' column (columns: {', '.join(row)})")
        if isinstance(prompt, str) and not prompt.strip():
            raise DataError(f"{source}: row {number} has an empty prompt")
        if isinstance(prompt, list) and not all(isinstance(m, dict) and "content" in m for m in prompt):
            raise DataError(f"{source}: row {number}: a chat prompt must be a list of {{'role', 'content'}} messages")


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list)


def require_chat_template(tokenizer: Any, where: str) -> None:
    """A DataError naming ``where`` unless the tokenizer can render chat messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: the prompt is a list of chat messages, but the model's tokenizer has no chat "
                        "template (tokenizer_config.json has no 'chat_template'); give the prompts as plain "
                        "strings, or use a chat model")


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], where: str = "prompt",
                  tools: Sequence[Callable] = ()) -> Tensor:
    """Token ids of a prompt; chat messages get the template and the generation prompt, and the ``tools``'
    descriptions (:func:`tool_schema`): rendered by the template where it renders tools, else in a system
    message (:func:`with_tool_descriptions`)."""
    if is_chat(prompt):
        require_chat_template(tokenizer, where)
        if tools and not renders_tools(tokenizer):
            prompt = with_tool_descriptions(prompt, tools)
        ids = tokenizer.apply_chat_template(prompt, tools=[tool_schema(tool) for tool in tools] or None,
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def within_prompt_budget(prompt_ids: Sequence[Tensor], limit: int, policy: str, source: str,
                         per_step: int = 1) -> list[int]:
    """Indices of the prompts of at most ``limit`` tokens. A longer prompt is never cut (the question's start
    or its instruction would go): ``policy`` ``error`` refuses the data, naming how many are longer, the first
    of them (1-based row) and its length; ``drop`` leaves them out (the caller says how many). Fewer than
    ``per_step`` prompts left is an error either way."""
    long = [i for i, ids in enumerate(prompt_ids) if len(ids) > limit]
    if not long:
        return list(range(len(prompt_ids)))
    first = long[0]
    what = (f"{source}: {len(long)} of {len(prompt_ids)} prompts are longer than max_prompt_length {limit} tokens "
            f"(the first: row {first + 1}, {len(prompt_ids[first])} tokens)")
    if policy == "error" or len(long) == len(prompt_ids):
        fix = "raise max_prompt_length, shorten them" + ("" if policy == "drop" else ", or set long_prompts drop")
        raise DataError(f"{what}; {'no prompt is left; ' if policy == 'drop' else ''}{fix}")
    if len(prompt_ids) - len(long) < per_step:
        raise DataError(f"{source}: {len(prompt_ids) - len(long)} prompts are left within max_prompt_length, fewer "
                        f"than prompts_per_step {per_step}; raise max_prompt_length or lower prompts_per_step")
    return [i for i in range(len(prompt_ids)) if len(prompt_ids[i]) <= limit]


TOOLS_SYSTEM_PROMPT = (
    "You may call these tools, one call at a time, and read each result before you go on:\n{tools}\n"
    "To call one, write the call and stop; its result comes back in <tool_response></tool_response>. "
    "A call is written like this:\n{example}"
)
"""The system message that describes tools to a chat template that does not render them (Hermes' format,
the one ``JSONCalls`` parses), with an example call of the first tool."""


class ExternalTool(ABC):
    """A tool that is no Python function of this process, such as an MCP server's
    (:mod:`posttrain.rollout.mcp_tools`). It brings its own description, a JSON schema, where a function is
    described from its type hints and docstring, and it runs its calls itself within the time limit it is
    given, where a function runs in a forked worker (:class:`posttrain.rollout.episodes.Tools`)."""

    __name__: str
    """The tool's name, which a call names (as a function's ``__name__``)."""
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``: the shape of transformers'
    ``get_json_schema`` of a function, so that a chat template renders both alike."""

    @abstractmethod
    def call(self, positional: Sequence[Any], arguments: dict[str, Any], timeout: float) -> str:
        """The call's result as text, waiting at most ``timeout`` seconds (0: no limit); a failure raises
        :class:`posttrain.data.isolation.CallFailed` with its kind (``error``, ``timeout``, ``crash``,
        ``not_text``)."""


def tool_schema(tool: Callable | ExternalTool | dict[str, Any]) -> dict[str, Any]:
    """How a chat template is told about a tool: a schema as it is (an agent's request sends them), an
    :class:`ExternalTool`'s own, a function's from its type hints and docstring (transformers'
    ``get_json_schema``, what ``apply_chat_template`` makes of a function)."""
    if isinstance(tool, dict):
        return tool
    if isinstance(tool, ExternalTool):
        return tool.schema
    from transformers.utils import get_json_schema

    return get_json_schema(tool)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the tools it is given into the prompt."""
    def probe(fn_name: str) -> str:
        tool = {"type": "function", "function": {"name": fn_name, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        return tokenizer.apply_chat_template([{"role": "user", "content": "-"}], tools=[tool], tokenize=False)

    return "posttrain_probe_tool" in probe("posttrain_probe_tool")


def with_tool_descriptions(messages: list[dict[str, str]], tools: Sequence[Callable]) -> list[dict[str, str]]:
    """``messages`` with the tools' JSON schemas (:func:`tool_schema`) in the system message,
    :data:`TOOLS_SYSTEM_PROMPT`; after the conversation's own system message, where it has one."""
    schemas = [tool_schema(tool) for tool in tools]
    first = schemas[0]["function"]
    example = {"name": first["name"], "arguments": {name: "..." for name in first["parameters"].get("properties", {})}}
    text = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(schema) for schema in schemas),
                                      example=f"<tool_call>{json.dumps(example)}</tool_call>")
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def as_completion(prompt: Any, text: str) -> str | list[dict[str, str]]:
    """What reward functions receive: a string, or an assistant message for chat prompts (TRL)."""
    return [{"role": "assistant", "content": text}] if is_chat(prompt) else text


TALLIES = ("skipped_easy", "skipped_hard", "drawn_with_rate", "drawn_rate_sum")
"""What a :class:`PromptSampler` counts over a run: prompts passed over as too easy and as too hard, and the
prompts it handed out that had a recorded pass rate, with the sum of those rates."""


class PromptSampler:
    """Shuffled epochs over the prompts, resumable, that can leave prompts out before they are generated.

    - ``history_resampling``: a prompt whose every completion was correct during an epoch is left out of
      the following epochs (SRPO, arXiv:2504.14286, sec. 3.2).
    - difficulty filtering (prime-rl's easy and hard thresholds): every sampled prompt's group pass rate
      is recorded (:meth:`record_pass_rates`); when a prompt's turn comes in a later epoch and its last
      rate is at or below ``difficulty_filter_low`` (too hard) or at or above ``difficulty_filter_high``
      (too easy), it is passed over, counted in :attr:`tally`, and the next prompt of the order is
      taken. A skipped prompt is never retried: it is not sampled again, so its rate stays what it was,
      as in prime-rl, whose easy and hard pools are not drawn from by default. Retrying after some epochs
      would be one more setting whose right value depends on the run; a run that wants its hard prompts
      back starts a second run from its final model, whose sampler has no rates yet.
    """

    def __init__(self, num_rows: int, seed: int, history_resampling: bool = False,
                 difficulty_filter_low: float | None = None, difficulty_filter_high: float | None = None):
        self.num_rows = num_rows
        self.seed = seed
        self.history_resampling = history_resampling
        self.difficulty_filter_low = difficulty_filter_low
        self.difficulty_filter_high = difficulty_filter_high
        self.epoch = 0
        self.position = 0
        self.excluded: set[int] = set()
        self.solved_this_epoch: set[int] = set()
        self.pass_rates: dict[int, float] = {}
        self.tally: dict[str, float] = dict.fromkeys(TALLIES, 0)

    @property
    def filters_difficulty(self) -> bool:
        return self.difficulty_filter_low is not None or self.difficulty_filter_high is not None

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_rows, generator=generator).tolist()
        return [i for i in order if i not in self.excluded]

    def too_easy_or_hard(self, index: int) -> str | None:
        """``easy`` or ``hard`` when the difficulty filter passes the prompt over, else None."""
        rate = self.pass_rates.get(index)
        if rate is None:
            return None
        if self.difficulty_filter_low is not None and rate <= self.difficulty_filter_low:
            return "hard"
        if self.difficulty_filter_high is not None and rate >= self.difficulty_filter_high:
            return "easy"
        return None

    def next(self, count: int) -> list[int]:
        picked: list[int] = []
        while len(picked) < count:
            order = self._order()
            if not order:
                raise RuntimeError("history resampling has excluded every prompt: the policy solves all of them")
            if self.filters_difficulty and all(self.too_easy_or_hard(i) for i in order):
                raise RuntimeError(
                    f"difficulty filtering has left out every prompt: each one's last pass rate is at or below "
                    f"difficulty_filter_low ({self.difficulty_filter_low}) or at or above difficulty_filter_high "
                    f"({self.difficulty_filter_high}); widen the band between them, raise group_size (a pass rate "
                    "of 0 or 1 is less likely from more samples), or add prompts")
            if self.position >= len(order):
                self._end_epoch()
                continue
            for index in order[self.position:]:
                if len(picked) == count:
                    break
                self.position += 1
                verdict = self.too_easy_or_hard(index)
                if verdict is not None:
                    self.tally[f"skipped_{verdict}"] += 1
                    continue
                picked.append(index)
                if index in self.pass_rates:
                    self.tally["drawn_with_rate"] += 1
                    self.tally["drawn_rate_sum"] += self.pass_rates[index]
        return picked

    def _end_epoch(self) -> None:
        if self.history_resampling:
            self.excluded |= self.solved_this_epoch
        self.solved_this_epoch = set()
        self.epoch += 1
        self.position = 0

    def record_pass_rates(self, pass_rates: dict[int, float]) -> None:
        """Sampled prompts' group pass rates (the share of their completions judged correct): the difficulty
        filter's evidence; a rate of 1 is a prompt solved in this epoch, for history resampling."""
        self.pass_rates.update(pass_rates)
        self.solved_this_epoch.update(i for i, rate in pass_rates.items() if rate == 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "excluded": sorted(self.excluded),
            "solved_this_epoch": sorted(self.solved_this_epoch),
            "pass_rates": sorted(self.pass_rates.items()),  # JSON has no integer keys: [index, rate] pairs
            "tally": dict(self.tally),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.excluded, self.solved_this_epoch = set(state["excluded"]), set(state["solved_this_epoch"])
        # absent from checkpoints written before pass rates were recorded
        self.pass_rates = {int(i): float(rate) for i, rate in state.get("pass_rates", [])}
        self.tally = {**dict.fromkeys(TALLIES, 0), **state.get("tally", {})}
