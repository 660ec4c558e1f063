"""Calling user code that may raise, hang or crash: in a forked worker process killed at a time limit.

Reward functions and tools both run here when a timeout is set. The worker is forked, so nothing is
pickled but the result (the function and its arguments are the parent's memory); a worker that
hangs is killed at the limit, and one that dies (a segfault, ``os._exit``) is reported, never waited on.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any


class CallFailed(Exception):
    """One call failed; ``detail`` says how (a traceback, a timeout, a dead worker) and ``kind`` which:
    ``error``, ``timeout`` or ``crash``."""

    def __init__(self, detail: str, kind: str = "error"):
        super().__init__(detail)
        self.detail = detail
        self.kind = kind


def call(fn: Callable[..., Any], kwargs: dict[str, Any], *, timeout: float, limit_name: str,
         convert: Callable[[Any], Any] = lambda result: result) -> Any:
    """``fn(**kwargs)`` in this process when ``timeout`` <= 0, else in a forked worker killed after ``timeout``
    seconds (``limit_name`` names the setting in the error), which sends back ``convert(result)`` (what can
    cross the pipe, e.g. a list for a generator). Raises :class:`CallFailed`."""
    if timeout <= 0:
        try:
            return fn(**kwargs)
        except Exception:
            raise CallFailed(traceback.format_exc()) from None
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_worker, args=(fn, kwargs, convert, sender), daemon=True)
    worker.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            raise CallFailed(f"timed out after {timeout:g} s ({limit_name})", "timeout")
        try:
            ok, payload = receiver.recv()
        except EOFError:
            raise CallFailed("the worker process died without an answer", "crash") from None
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join()
        receiver.close()
    if not ok:
        raise CallFailed(payload)
    return payload


def _worker(fn: Callable[..., Any], kwargs: dict[str, Any], convert: Callable[[Any], Any], sender: Any) -> None:
    try:
        sender.send((True, convert(fn(**kwargs))))
    except BaseException:
        sender.send((False, traceback.format_exc()))
