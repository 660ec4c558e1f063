"""Rewards from a service over HTTP: a scorer of the user's own, in any language, on any machine.

:class:`RemoteReward` is a reward function (TRL's signature) that posts the batch as one JSON object,

    {"prompts": [...], "completions": [...], "<column>": [...], ...}

one entry per completion in every list (chat prompts and completions as their messages, every dataset
column as :mod:`posttrain.data.rewards` passes it), and reads back one score per completion: a JSON list,
or ``{"scores": [...]}``, each a number, or ``null`` for "does not apply" (a Python reward's None).
:func:`remote_judge` is the same transport for ``--judge URL``: the object also carries ``"rubric"``, the
pointwise rubric's text, and the scores are used as the service gives them (no 1-10 scale is assumed).

Each request may take ``timeout`` seconds; one that cannot connect, times out or is answered 5xx is tried
again ``retries`` times, after 0.5 s, 1 s, 2 s, ... An answer that is not scores (a 4xx, text, the wrong
count, a non-number) fails at once. Either way :class:`RemoteRewardError` names the URL, the status and
what was wrong, and the run's ``reward_errors`` policy decides, as for a reward function that raises:
stop, or drop the batch's samples. A service that failed a batch is not asked again sample by sample
(``retry_samples_alone``: :mod:`posttrain.data.scoring`), which would cost every sample its retries.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from posttrain.config.sections import DataConfig

FIRST_BACKOFF_S = 0.5
"""Seconds before the first retry; each later one waits twice as long as the one before."""


class RemoteRewardError(RuntimeError):
    """A reward service could not be reached, or its answer is not one score per completion."""


def is_url(spec: str | None) -> bool:
    """Whether a ``--judge`` or ``--reward-url`` value is a service's URL."""
    return spec is not None and spec.startswith(("http://", "https://"))


class RemoteReward:
    """A reward service as a reward function; see the module docstring. Logged as ``reward/HOST:PORT/PATH``
    unless ``name`` is given; ``fields`` are sent with every batch (the judge's rubric)."""

    retry_samples_alone = False  # a failed batch fails its samples: one service, one answer per batch

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 2, name: str | None = None,
                 fields: dict[str, Any] | None = None):
        if not is_url(url):
            raise ValueError(f"a reward service's URL starts with http:// or https://, got {url!r}")
        parts = urlsplit(url)
        self.url, self.timeout, self.retries, self.fields = url, timeout, retries, dict(fields or {})
        self.__name__ = name or f"{parts.netloc}{parts.path.rstrip('/')}"

    def __call__(self, prompts: list, completions: list, **columns: Sequence[Any]) -> list[float | None]:
        clashes = sorted(set(self.fields) & set(columns))
        if clashes:
            raise RemoteRewardError(f"{self.url}: the dataset column {clashes[0]!r} has the name of a field the "
                                    "request carries itself; rename the column")
        body = json_body(self.url, {"prompts": list(prompts), "completions": list(completions),
                                    **{name: list(values) for name, values in columns.items()}, **self.fields})
        status, text = self._post(body)
        return read_scores(self.url, status, text, len(completions))

    def _post(self, body: bytes) -> tuple[int, str]:
        """(status, text) of a 2xx answer; retried on a connection error, a timeout or a 5xx."""
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(FIRST_BACKOFF_S * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.status, response.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as error:
                answered = f"answered {error.code} {error.reason}: {_excerpt(error.read().decode('utf-8', 'replace'))}"
                if error.code < 500:  # the request is wrong: asking again gets the same answer
                    raise RemoteRewardError(f"{self.url} {answered}") from None
                problem = answered
            except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, cut off
                reason = getattr(error, "reason", error)
                problem = (f"did not answer within {self.timeout:g} s (reward_url_timeout)"
                           if isinstance(reason, TimeoutError) else f"could not be reached ({reason})")
        raise RemoteRewardError(f"{self.url} {problem}; tried {self.retries + 1} times (reward_url_retries)")


def json_body(url: str, fields: dict[str, Any]) -> bytes:
    """The request's JSON; a field JSON cannot carry (an object, NaN) is an error that names it."""
    try:
        return json.dumps(fields, allow_nan=False).encode()
    except (TypeError, ValueError):
        for name, values in fields.items():
            try:
                json.dumps(values, allow_nan=False)
            except (TypeError, ValueError) as error:
                raise RemoteRewardError(f"{url}: the column {name!r} cannot be sent as JSON ({error}); give it "
                                        "as strings, finite numbers, lists or dicts, or leave it out of the "
                                        "dataset") from None
        raise


def read_scores(url: str, status: int, text: str, count: int) -> list[float | None]:
    """The ``count`` scores of a service's answer: a JSON list, or ``{"scores": [...]}``; numbers or null."""
    expected = 'answer a JSON list of scores, or {"scores": [...]}, one per completion (null: does not apply)'
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"{url} answered {status} with text, not JSON: {_excerpt(text)}; {expected}") from None
    scores = answer.get("scores") if isinstance(answer, dict) else answer
    if not isinstance(scores, list):
        raise RemoteRewardError(f"{url} answered {status} with {_excerpt(text)}; {expected}")
    if len(scores) != count:
        raise RemoteRewardError(f"{url} answered {status} with {len(scores)} scores for {count} completions; "
                                f"{expected}")
    for i, value in enumerate(scores):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RemoteRewardError(f"{url} answered {status} with score {i} = {json.dumps(value)}; each score is a "
                                    "number, or null for 'does not apply'")
    return [None if value is None else float(value) for value in scores]


def _excerpt(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def remote_rewards(data: DataConfig) -> list[RemoteReward]:
    """The run's ``--reward-url`` services, in order."""
    return [RemoteReward(url, timeout=data.reward_url_timeout, retries=data.reward_url_retries)
            for url in data.reward_url]


def remote_judge(data: DataConfig) -> RemoteReward:
    """The run's ``--judge URL``: the batch and the pointwise rubric's text (``judge_rubric``) go to the service,
    logged as ``reward/judge``."""
    from posttrain.data.judge import load_rubric

    return RemoteReward(data.judge, timeout=data.reward_url_timeout, retries=data.reward_url_retries, name="judge",
                        fields={"rubric": load_rubric(data.judge_rubric, "pointwise")})
