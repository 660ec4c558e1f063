"""The OpenAI chat-completions wire format, as posttrain's agent endpoint reads and writes it, and its server.

A user's agent calls ``POST /episodes/{episode}/v1/chat/completions`` with the JSON body the ``openai``
client sends. :func:`parse_request` reads it into a :class:`ChatRequest` (messages as :class:`Message`,
tools as their JSON schemas), or raises :class:`RequestError` with the HTTP status and a message that names
the field (``messages[2].tool_calls[0].function.arguments``). :func:`chat_response` writes the answer.
:class:`EndpointServer` is a local HTTP server whose handler threads hand each request to a function
(:class:`posttrain.rollout.agents.AgentGenerator` answers them in batches) and wait for its answer.

Fields the endpoint reads: ``messages``, ``tools``, ``tool_choice`` (``auto``, ``none``), ``n``, ``stop``,
``max_tokens`` / ``max_completion_tokens``, ``temperature`` and ``top_p`` (compared with the run's; the run's
are used, see :mod:`.agents`), ``stream`` (false only). Every other field (``model``, ``parallel_tool_calls``,
``seed``, ``user``, ...) is accepted and has no effect: any model name reaches the policy.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_CHOICES = 16
MAX_STOP_STRINGS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the endpoint cannot serve: ``status`` (400 malformed, 404 unknown episode, 410 episode over,
    422 valid but unsupported) and a message naming the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class FunctionCall:
    """One entry of an assistant message's ``tool_calls``: its id, the function's name, its arguments."""

    id: str
    name: str
    arguments: Any  # the parsed JSON object (the wire carries it as a string)


@dataclass(frozen=True)
class Message:
    """A chat message as the endpoint compares and renders it: its text (the content parts' texts joined;
    "" for none) and, for an assistant, its calls; for a tool result, the call it answers."""

    role: str
    content: str = ""
    tool_calls: tuple[FunctionCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def same_as(self, other: Message) -> bool:
        """Whether ``other`` says what this message says: role, text (up to surrounding white space) and calls
        (names and arguments; ids are the endpoint's own and clients keep them, but one that rewrites them
        still says the same)."""
        return (self.role == other.role and self.content.strip() == other.content.strip()
                and [(c.name, c.arguments) for c in self.tool_calls] == [(c.name, c.arguments)
                                                                          for c in other.tool_calls]
                and (self.role != "tool" or self.tool_call_id == other.tool_call_id))

    def for_template(self) -> dict[str, Any]:
        """The message as transformers' chat templates read it (a call's arguments as an object)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...] = ()
    """``{"type": "function", "function": {"name", "description", "parameters"}}`` each, as sent."""
    n: int = 1
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    model: str = "policy"

    def first_parameter(self, tool: str) -> str | None:
        """The name of ``tool``'s first parameter (its schema's first required, else first property): where a
        format that writes one positional argument (``inline``) puts it."""
        for schema in self.tools:
            function = schema.get("function", {})
            if function.get("name") == tool:
                parameters = function.get("parameters") or {}
                names = list(parameters.get("required") or []) or list(parameters.get("properties") or {})
                return names[0] if names else None
        return None


def parse_request(body: bytes) -> ChatRequest:
    """The chat-completions request in ``body``; a RequestError naming what is wrong."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(400, f"the body is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the body is a JSON {type(data).__name__}, not an object")
    if data.get("stream"):
        raise RequestError(422, "stream: streamed answers are not served; send stream false (the default)")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: a non-empty list of messages is required")
    parsed = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    tools = data.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError(400, f"tools: a list of tools, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError(400, f'tools[{i}]: a tool is {{"type": "function", "function": {{"name": ..., '
                                    '"parameters": {...}}}}')
    choice = data.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(422, f"tool_choice: {json.dumps(choice)} is not served; the policy decides whether to "
                                "call a tool (auto) or is given none (none)")
    if choice == "none":
        tools = []
    stop = data.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError(400, f"stop: a string or a list of up to {MAX_STOP_STRINGS} non-empty strings")
    n = _number(data, "n", int, 1, low=1, high=MAX_CHOICES)
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    max_tokens = None if limit is None else _number({"max_tokens": limit}, "max_tokens", int, None, low=1)
    return ChatRequest(parsed, tuple(tools), n, tuple(stop), max_tokens,
                       _number(data, "temperature", float, None, low=0.0),
                       _number(data, "top_p", float, None, low=0.0, high=1.0), str(data.get("model") or "policy"))


def _number(data: dict, key: str, kind: type, default: Any, *, low: float | None = None,
            high: float | None = None) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise RequestError(400, f"{key}: {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(400, f"{key}: {value} is outside [{low}, {high if high is not None else 'inf'}]")
    return kind(value)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or the texts of its parts; images and audio are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}.content: a string or a list of parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(422 if kind else 400, f"{where}.content[{i}]: only text parts are served, got "
                                                     f"{kind or type(part).__name__}")
        texts.append(part["text"])
    return "".join(texts)


def _message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise RequestError(400, f"{where}: a message is an object, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in ROLES:
        raise RequestError(400, f"{where}.role: got {json.dumps(role)}; use one of {', '.join(ROLES)}")
    calls = []
    for i, call in enumerate(raw.get("tool_calls") or []):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f'{at}: a call is {{"id": ..., "type": "function", "function": {{"name": ..., '
                                    '"arguments": "{...}"}}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as error:
                raise RequestError(400, f"{at}.function.arguments: not JSON ({error.msg} at column {error.colno})") from None
        calls.append(FunctionCall(str(call.get("id") or f"call_{i}"), function["name"], arguments))
    if role == "tool" and not isinstance(raw.get("tool_call_id"), str):
        raise RequestError(400, f"{where}.tool_call_id: a tool message names the call it answers")
    name = raw.get("name")
    return Message(role, _text(raw.get("content"), where), tuple(calls), raw.get("tool_call_id") if role == "tool"
                   else None, name if isinstance(name, str) else None)


def call_id() -> str:
    """A fresh id for a tool call the endpoint reports (9 alphanumerics after ``call_``, as Mistral needs 9)."""
    return "call_" + uuid.uuid4().hex[:9]


@dataclass
class Choice:
    """One sampled answer: the message the agent reads and why it ended (``stop``, ``tool_calls``, ``length``)."""

    message: Message
    finish_reason: str


def chat_response(request: ChatRequest, choices: list[Choice], prompt_tokens: int, completion_tokens: int) -> dict:
    """The ``chat.completion`` object of ``choices``."""
    def wire(message: Message) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for c in message.tool_calls]
        return out

    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model,
            "choices": [{"index": i, "message": wire(c.message), "finish_reason": c.finish_reason, "logprobs": None}
                        for i, c in enumerate(choices)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


Dispatch = Callable[[str, ChatRequest], dict]
"""``dispatch(episode, request) -> chat.completion``: answers one request (blocking), or raises RequestError."""

_PATH = re.compile(r"^/episodes/([A-Za-z0-9_-]+)/v1/(chat/completions|models)/?$")


class EndpointServer:
    """``http://127.0.0.1:PORT/episodes/{episode}/v1``: an OpenAI-compatible endpoint on a free local port,
    served by threads, each request answered by ``dispatch``. Closed with :meth:`close`."""

    def __init__(self, dispatch: Dispatch, host: str = "127.0.0.1"):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connection

            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                match = _PATH.match(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if match is None or match.group(2) != "chat/completions":
                    hint = (" (the OpenAI Agents SDK: give the Agent model=OpenAIChatCompletionsModel(..., "
                            "openai_client=client), or set_default_openai_api('chat_completions'))"
                            if self.path.rstrip("/").endswith("/responses") else "")
                    return self._send(404, error_body(404, f"no such endpoint: POST {self.path}; the agent endpoint "
                                                           "serves /episodes/{episode}/v1/chat/completions" + hint))
                try:
                    self._send(200, server.dispatch(match.group(1), parse_request(body)))
                except RequestError as error:
                    self._send(error.status, error_body(error.status, str(error)))
                except Exception as error:  # noqa: BLE001 - the agent reads a 500, the trainer's own error is raised there
                    self._send(500, error_body(500, f"the endpoint failed: {error!r}"))

            def do_GET(self) -> None:  # noqa: N802
                match = _PATH.match(self.path)
                if match is None or match.group(2) != "models":
                    return self._send(404, error_body(404, f"no such endpoint: GET {self.path}"))
                self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "posttrain"}]})

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the agent's client gave up (its own timeout)
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:  # the run's output is its own
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # every episode's client connects at once; the default 5 refuses some

        self.dispatch = dispatch
        self.httpd = Server((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="posttrain-agent-endpoint", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, episode: str) -> str:
        """What an agent's client is pointed at for one episode."""
        return f"{self.url}/episodes/{episode}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Pending:
    """A request waiting for the trainer's thread to answer it; its handler thread waits on ``done``."""

    episode: str
    request: ChatRequest
    done: threading.Event = field(default_factory=threading.Event)
    answer: dict | None = None
    error: RequestError | None = None

    def reply(self, answer: dict) -> None:
        self.answer = answer
        self.done.set()

    def fail(self, error: RequestError) -> None:
        self.error = error
        self.done.set()
