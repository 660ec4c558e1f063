"""Tools from MCP servers: ``--mcp-server "COMMAND ARGS"`` gives the policy the tools of a server it starts.

Each ``mcp_server`` command line is split as a shell splits it (:func:`shlex.split`) and started as a
Model Context Protocol server over stdio by the ``mcp`` SDK's client (``mcp.client.stdio``,
``ClientSession``), in the run's working directory and environment. The SDK is asynchronous and the
episodes are not: each server's client session lives for the whole run on a thread of its own that runs
its event loop, and a call is a request sent to that loop. Its tools are listed once, at the start; each
is an :class:`McpTool`, which an episode calls by name as it calls a Python tool
(:class:`posttrain.rollout.episodes.Tools`) and which the chat template is told about as it is told about
one, ``{"type": "function", "function": {"name", "description", "parameters"}}``, its parameters the
input schema the server gives.

How a server's tool differs from a Python tool:

1. A call runs on the server, not in a forked worker: it waits for the answer up to ``tool_timeout``
   seconds (0: no limit) and is cancelled at the limit, a ``timeout`` fault.
2. Its result is the text of the answer's text content, joined by newlines; an answer marked ``isError``
   is the tool's error (an ``error`` fault), one with content but no text a ``not_text`` fault.
3. A server that exits during the run makes its tools' calls fail at once as ``crash`` faults; it is
   said once on stderr, with the server's last lines of stderr, and not restarted.
4. Tools only: a server's resources, prompts and requests to the client (sampling, elicitation) are not
   used.

A server that cannot start (no such program, it exits, or it has not listed its tools within
:data:`START_SECONDS`) is a ConfigError at the start of the run that names the command and quotes its
stderr's last lines. Stopping a server (:func:`stop_mcp_servers`, at the end of the run) closes its
stdin; the SDK terminates, then kills, a server that has not exited within 2 seconds of each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import shlex
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from posttrain.config import Config, ConfigError
from posttrain.data.isolation import CallFailed
from posttrain.data.prompts import ExternalTool
from posttrain.parallel.distributed import say

START_SECONDS = 60.0
"""How long a server has to start and list its tools (a package runner may fetch the server first)."""
STOP_SECONDS = 10.0
"""How long stopping a server may take: the SDK's 2 s for it to exit after its stdin closes, 2 s after it
is terminated, then it is killed."""
STDERR_LINES = 20
"""How many of a server's last stderr lines an error quotes."""


def with_mcp_tools(config: Config, tools: Sequence[Callable[..., Any]]) -> tuple[Callable[..., Any], ...]:
    """``tools`` and the tools of the run's ``mcp_server`` commands, whose servers this starts (stop them with
    :func:`stop_mcp_servers`); a ConfigError when two tools share a name, naming where each comes from."""
    if not config.episodes.mcp_server:
        return tuple(tools)
    rollout = config.rollout
    unsupported = ("backend hf: multi-turn episodes run on posttrain's decode loop" if rollout.backend != "hf" else
                   "no --rollout-server: multi-turn episodes sample on this process" if rollout.rollout_server else
                   "no --routing-replay: multi-turn episodes are not recorded" if config.off_policy.routing_replay
                   else None)
    if unsupported:
        raise ConfigError(f"mcp_server: the tools of MCP servers need {unsupported}")
    servers: list[McpServer] = []
    try:
        for command in config.episodes.mcp_server:
            servers.append(McpServer.start(command))
        everything = (*tools, *(tool for server in servers for tool in server.tools))
        _check_names(everything)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return everything


def stop_mcp_servers(tools: Sequence[Callable[..., Any]]) -> None:
    """Stop the servers of the MCP tools among ``tools`` (each once); their tools' calls fail after."""
    for server in dict.fromkeys(tool.server for tool in tools if isinstance(tool, McpTool)):
        server.close()


def _check_names(tools: Sequence[Callable[..., Any]]) -> None:
    first: dict[str, Callable[..., Any]] = {}
    for tool in tools:
        other = first.setdefault(tool.__name__, tool)
        if other is not tool:
            raise ConfigError(f"tools: two tools are named {tool.__name__!r}: {_source(other)} and {_source(tool)}; "
                              "a call names its tool, so leave one out (or rename the Python function)")


def _source(tool: Callable[..., Any]) -> str:
    if isinstance(tool, McpTool):
        return f"the MCP server {tool.server.command!r}"
    return f"the Python function {tool.__qualname__} ({inspect.getsourcefile(tool) or tool.__module__})"


class McpTool(ExternalTool):
    """One tool of an MCP server: called by name as a Python tool is, described by the server's schema."""

    def __init__(self, server: McpServer, listing: dict[str, Any]):
        self.server = server
        self.__name__ = listing["name"]
        self.schema = {"type": "function", "function": {
            "name": listing["name"], "description": inspect.cleandoc(listing.get("description") or ""),
            "parameters": listing.get("inputSchema") or {"type": "object", "properties": {}}}}

    def call(self, positional: Sequence[Any], arguments: dict[str, Any], timeout: float) -> str:
        """Positional arguments (the ``inline`` format's one) are the schema's parameters, in its order."""
        names = list(self.schema["function"]["parameters"].get("properties", {}))
        if len(positional) > len(names):
            raise CallFailed(f"it takes {len(names)} arguments, not {len(positional)}")
        return self.server.call(self.__name__, {**dict(zip(names, positional)), **arguments}, timeout)

    def __call__(self, *positional: Any, **arguments: Any) -> str:
        """The call's result, with no time limit (a failure raises CallFailed)."""
        return self.call(positional, arguments, 0.0)

    def __repr__(self) -> str:
        return f"McpTool({self.__name__!r} of {self.server.command!r})"


@dataclass
class StderrTail:
    """The last lines a server writes on stderr, read from a pipe by a thread of their own."""

    write_end: BinaryIO
    """The server's stderr; closed here once the server holds it, so that its exit ends the reading."""
    reader: threading.Thread
    lines: deque[str]

    @classmethod
    def open(cls, command: str) -> StderrTail:
        read_fd, write_fd = os.pipe()
        lines: deque[str] = deque(maxlen=STDERR_LINES)
        reader = threading.Thread(target=_read_lines, args=(read_fd, lines), name=f"stderr of {command}",
                                  daemon=True)
        reader.start()
        return cls(os.fdopen(write_fd, "wb"), reader, lines)

    def quoted(self, wait: float = 0.0) -> str:
        """``; its stderr ended with:`` and the lines, after waiting up to ``wait`` s for the server to close it."""
        self.reader.join(wait)
        if not self.lines:
            return "; it wrote nothing on stderr"
        return "; its stderr ended with:\n" + "\n".join(f"  {line}" for line in self.lines)


def _read_lines(fd: int, lines: deque[str]) -> None:
    with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
            lines.append(raw.decode(errors="replace").rstrip())


class McpServer:
    """A server started from a command line and the client session that talks to it, on a thread that runs
    the session's event loop. :meth:`start` makes one; it pickles as its command (a process that unpickles
    it, as asynchronous rollouts' does, starts its own) and is shared, not copied, by ``copy.deepcopy``."""

    def __init__(self, command: str, loop: asyncio.AbstractEventLoop, session: Any, stderr: StderrTail,
                 listing: list[dict[str, Any]], stop: Callable[[], None]):
        self.command, self.loop, self.session, self.stderr = command, loop, session, stderr
        self.tools = [McpTool(self, tool) for tool in listing]
        self.exited = False
        """A call found the connection closed: the server's process has gone."""
        self._stop = weakref.finalize(self, stop)  # a server nobody stopped stops when the process exits

    @classmethod
    def start(cls, command: str) -> McpServer:
        """Start ``command``'s server and list its tools; a ConfigError, quoting its stderr, if it cannot."""
        try:
            import mcp  # noqa: F401 - the optional extra
        except ImportError:
            raise ConfigError("mcp_server: the MCP client is the mcp package: pip install 'posttrain[mcp]'") from None
        argv = shlex.split(command)
        stderr = StderrTail.open(command)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=f"mcp server {command}", daemon=True)
        thread.start()
        stopping = asyncio.Event()
        started: concurrent.futures.Future = concurrent.futures.Future()
        served = asyncio.run_coroutine_threadsafe(_serve(argv, stderr.write_end, started, stopping), loop)
        stop = functools.partial(_stop_loop, loop, thread, stopping, served)
        concurrent.futures.wait([started, served], START_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)
        if not started.done():
            timed_out = not served.done()
            stop()
            raise ConfigError(f"mcp_server: {command!r} {_start_failure(served, timed_out, stderr)}")
        session, listing = started.result()
        return cls(command, loop, session, stderr, listing, stop)

    def call(self, name: str, arguments: dict[str, Any], timeout: float) -> str:
        """The text of tool ``name``'s answer to ``arguments`` (see the module's docstring for the faults)."""
        if self.exited or not self._stop.alive:
            raise CallFailed("the MCP server has exited" if self.exited else "the MCP server was stopped", "crash")
        future = asyncio.run_coroutine_threadsafe(self.session.call_tool(name, arguments), self.loop)
        try:
            answer = future.result(timeout if timeout > 0 else None)
        except TimeoutError:
            future.cancel()  # the SDK tells the server the request is cancelled
            raise CallFailed(f"timed out after {timeout:g} s (tool_timeout)", "timeout") from None
        except _sdk_error() as error:
            from mcp.types import CONNECTION_CLOSED

            if error.error.code != CONNECTION_CLOSED:
                raise CallFailed(f"the server answered with an error: {error.error.message}") from None
            self._exited()
            raise CallFailed("the MCP server has exited", "crash") from None
        except Exception as error:  # noqa: BLE001 - whatever the client raised fails this call, counted
            raise CallFailed(f"{type(error).__name__}: {error}") from None
        return _text(answer.model_dump(by_alias=True, mode="json"))

    def close(self) -> None:
        """Stop the server (bounded by :data:`STOP_SECONDS`); its tools' calls fail after."""
        self._stop()

    def _exited(self) -> None:
        if not self.exited:
            self.exited = True
            say(f"mcp_server {self.command!r} exited during the run: its tools' calls fail from now on "
                f"(episode/tool_errors/crash){self.stderr.quoted(wait=1.0)}")

    def __reduce__(self) -> tuple[Any, ...]:
        return McpServer.start, (self.command,)

    def __deepcopy__(self, memo: dict[int, Any]) -> McpServer:
        return self


def _sdk_error() -> type[Exception]:
    """The SDK's exception for an error answer or a closed connection."""
    try:
        from mcp.shared.exceptions import MCPError
    except ImportError:  # mcp 1.x names it McpError
        from mcp.shared.exceptions import McpError as MCPError
    return MCPError


async def _serve(argv: list[str], stderr: BinaryIO, started: concurrent.futures.Future,
                 stopping: asyncio.Event) -> None:
    """Run the server's client session until ``stopping`` is set; ``started`` gets (the session, its tools)."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    parameters = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ), cwd=os.getcwd())
    try:
        async with stdio_client(parameters, errlog=stderr) as (read, write):
            stderr.close()  # the server holds its own copy: its exit ends the tail's reading
            async with ClientSession(read, write) as session:
                await session.initialize()
                started.set_result((session, await _list_tools(session)))
                await stopping.wait()
    finally:
        stderr.close()


async def _list_tools(session: Any) -> list[dict[str, Any]]:
    """Every tool the server lists, page by page, as JSON (the protocol's names: ``inputSchema``)."""
    from mcp.types import PaginatedRequestParams

    tools, cursor = [], None
    while True:
        page = (await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                ).model_dump(by_alias=True, mode="json")
        tools += page["tools"]
        cursor = page.get("nextCursor")
        if not cursor:
            return tools


def _text(answer: dict[str, Any]) -> str:
    """The text of a ``tools/call`` answer (JSON); CallFailed for an error or content without text."""
    content = answer.get("content") or []
    texts = [block["text"] for block in content if block.get("type") == "text"]
    if answer.get("isError"):
        raise CallFailed("\n".join(texts) or "the tool reported an error")
    if content and not texts:
        kinds = ", ".join(sorted({str(block.get("type")) for block in content}))
        raise CallFailed(f"it returned {kinds} content, not text", "not_text")
    return "\n".join(texts)


def _start_failure(served: concurrent.futures.Future, timed_out: bool, stderr: StderrTail) -> str:
    """Why a stopped server did not start: no such program; what its session raised, or that it ran out of time,
    with the last lines of its stderr."""
    if timed_out:
        return f"did not list its tools within {START_SECONDS:g} s{stderr.quoted(wait=2.0)}"
    error = served.exception()
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:  # the SDK's task groups
        error = error.exceptions[0]
    if isinstance(error, OSError):  # no process: nothing on stderr to quote
        return f"could not start: {error}"
    return f"stopped before it listed its tools ({type(error).__name__}: {error}){stderr.quoted(wait=2.0)}"


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, stopping: asyncio.Event,
               served: concurrent.futures.Future) -> None:
    """End the session (the SDK then stops the server), then the loop and its thread."""
    if threading.current_thread() is thread:  # dropped on the loop's own thread: it cannot wait for itself
        loop.call_soon(stopping.set)
        return
    if not loop.is_closed() and thread.is_alive():
        loop.call_soon_threadsafe(stopping.set)
        try:
            served.result(STOP_SECONDS)
        except Exception:  # noqa: BLE001 - a server that failed or will not stop: the loop stops anyway
            served.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_SECONDS)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()
