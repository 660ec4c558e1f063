"""LLM-as-judge: a language model scores completions against a rubric, or picks the better of two.

``Judge(model)`` is a reward function (TRL's signature): each (prompt, completion) is put into the
pointwise rubric, the judge replies greedily, and the first integer of its reply on the rubric's
scale becomes the reward, mapped to [0, 1]. A reply without one scores None (the sample's other
rewards still count) and is counted (``judge/parse_failures``, per step). Replies are
cached per (prompt, completion): a group's repeated completions, and completions seen before, cost
nothing. ``Judge.prefer`` is the pairwise form: it asks for A or B with the pair in both orders and
keeps a verdict only when the two agree (a judge that always picks the first answer gives none),
which is how on-policy preference pairs are labelled with ``--judge``.

The judge runs batched on its model's device, greedy, under ``torch.no_grad``; ``--judge MODEL`` loads
it on the training device. Anything that maps a list of rendered prompts to a list of replies can
stand in for the model (``Judge(complete=fn)``), which is how it is tested. ``--judge URL`` names a judge
service instead, scoring online runs' completions: :func:`posttrain.data.remote.remote_judge` posts it each
batch with the pointwise rubric's text, the way ``--reward-url`` posts a reward service.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.data.rewards import completion_text

POINTWISE = (
    "Grade the answer to the question below.\n\nQuestion:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "How correct and useful is the answer? Reply with one integer from {low} (wrong or useless) to {high} "
    "(correct and complete) and nothing else."
)
PAIRWISE = (
    "Compare two answers to the question below.\n\nQuestion:\n{prompt}\n\nAnswer A:\n{first}\n\nAnswer B:\n{second}"
    "\n\nWhich answer is more correct and useful? Reply with the letter A or B and nothing else."
)
RUBRICS = {"pointwise": POINTWISE, "pairwise": PAIRWISE}
_INTEGER = re.compile(r"-?\d+")
_LETTER = re.compile(r"\b([AB])\b")


class Judge:
    """A judge model as a reward function; ``prefer`` for pairs. See the module docstring."""

    __name__ = "judge"

    def __init__(self, model: torch.nn.Module | None = None, tokenizer: Any = None, *,
                 complete: Callable[[list[str]], list[str]] | None = None, rubric: str = POINTWISE,
                 pairwise_rubric: str = PAIRWISE, scale: tuple[int, int] = (1, 10), batch_size: int = 16,
                 max_new_tokens: int = 8):
        for name, text, fields in (("rubric", rubric, ("{prompt}", "{completion}")),
                                   ("pairwise_rubric", pairwise_rubric, ("{prompt}", "{first}", "{second}"))):
            missing = [f for f in fields if f not in text]
            if missing:
                raise ValueError(f"judge {name}: the template has no {', '.join(missing)}; it needs "
                                 f"{', '.join(fields)}")
        if not scale[0] < scale[1]:
            raise ValueError(f"judge scale: got {scale}; give (lowest, highest) with lowest < highest")
        if (model is None) == (complete is None):
            raise ValueError("Judge needs a model (with its tokenizer) or complete=, not both")
        self.rubric, self.pairwise_rubric, self.scale = rubric, pairwise_rubric, scale
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self._complete = complete
        self.model, self.tokenizer = None, tokenizer
        if model is not None:
            if tokenizer is None:
                raise ValueError("Judge given a model also needs its tokenizer")
            tokenizer.padding_side = "left"  # generation continues every row from its last token
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            self.model = model.eval().requires_grad_(False)
        self._scores: dict[tuple[str, str], float | None] = {}
        self._counts = {"calls": 0, "parse_failures": 0, "cache_hits": 0}

    # --- pointwise: a reward function --------------------------------------------------------------

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        keys = [(_text(p), completion_text(c)) for p, c in zip(prompts, completions)]
        new = list(dict.fromkeys(k for k in keys if k not in self._scores))
        self._counts["cache_hits"] += len(keys) - len(new)
        low, high = self.scale
        replies = self.complete([self.rubric.format(prompt=p, completion=c, low=low, high=high) for p, c in new])
        for key, reply in zip(new, replies):
            score = self.parse_score(reply)
            self._scores[key] = None if score is None else (score - low) / (high - low)
        self._counts["calls"] += len(new)
        self._counts["parse_failures"] += sum(self._scores[k] is None for k in new)
        return [self._scores[k] for k in keys]

    def parse_score(self, reply: str) -> int | None:
        """The first integer in the reply when it is on the scale, else None."""
        match = _INTEGER.search(reply)
        if match is None:
            return None
        value = int(match.group())
        return value if self.scale[0] <= value <= self.scale[1] else None

    # --- pairwise ------------------------------------------------------------------------------------

    def prefer(self, prompts: Sequence[Any], first: Sequence[Any], second: Sequence[Any]) -> list[int | None]:
        """0 where the judge prefers ``first``, 1 where ``second``, None where its two verdicts (the pair
        shown in both orders) disagree or a reply names neither."""
        texts = [(_text(p), completion_text(a), completion_text(b)) for p, a, b in zip(prompts, first, second)]
        asked = [self.pairwise_rubric.format(prompt=p, first=a, second=b) for p, a, b in texts]
        swapped = [self.pairwise_rubric.format(prompt=p, first=b, second=a) for p, a, b in texts]
        replies = self.complete(asked + swapped)
        verdicts = []
        for forward, backward in zip(replies[:len(texts)], replies[len(texts):]):
            picked, picked_swapped = _letter(forward), _letter(backward)
            self._counts["parse_failures"] += (picked is None) + (picked_swapped is None)
            agree = picked is not None and picked_swapped is not None and picked != picked_swapped
            verdicts.append((0 if picked == "A" else 1) if agree else None)
        self._counts["calls"] += 2 * len(texts)
        return verdicts

    # --- the model -----------------------------------------------------------------------------------

    def complete(self, texts: list[str]) -> list[str]:
        """The judge's greedy replies to rendered rubric texts, in batches."""
        if not texts:
            return []
        if self._complete is not None:
            replies = list(self._complete(texts))
            if len(replies) != len(texts):
                raise ValueError(f"judge: complete returned {len(replies)} replies for {len(texts)} texts")
            return replies
        return [reply for start in range(0, len(texts), self.batch_size)
                for reply in self._generate(texts[start:start + self.batch_size])]

    @torch.no_grad()
    def _generate(self, texts: list[str]) -> list[str]:
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None):
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                   add_generation_prompt=True) for t in texts]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        out = self.model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)
        return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)

    def step_metrics(self) -> dict[str, float]:
        """Counts since the last call (then they start again): the judge's replies, those it could not
        read, and scores served from the cache."""
        counts, self._counts = self._counts, {"calls": 0, "parse_failures": 0, "cache_hits": 0}
        return {"judge/replies": counts["calls"], "judge/parse_failures": counts["parse_failures"],
                "judge/cached": counts["cache_hits"]}


def _text(prompt: Any) -> str:
    """A prompt as the judge reads it: the string, or the chat messages' contents, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(message.get("content", "")) for message in prompt)


def _letter(reply: str) -> str | None:
    match = _LETTER.search(reply.strip().upper()[:40])
    return match.group(1) if match else None


def load_rubric(spec: str, kind: str) -> str:
    """A rubric template: ``pointwise``/``pairwise`` (the built-ins) or a text file's contents."""
    if spec in RUBRICS:
        return RUBRICS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"judge {kind} rubric: {spec!r} is neither a built-in ({', '.join(RUBRICS)}) nor a file")
    return path.read_text()
