"""pipelines_port: put any agent under test on the Pipelines platform, stdlib only (Python 3.9+).

Copy this one file as it is into a sandbox upload, run it as a dispatch server, or read it while porting.  It
speaks the wire contract of CONTRACT.md (the § marks point there) in three parts, each opening with what it may
do: 1. THE CONTRACT, pure, what a porter reads alone; 2. THE PYTHON RUNTIME: one asyncio transport under both
drivers, the proxy client, the dispatch app and its servers, code mode; 3. CONVENIENCES.

Bytes are a budget (200,000 per file; a sandbox compiles it at each start): one mechanism per job, each rule
named here and explained in CONTRACT.md.

Map: each part and section, the line it starts on and its size in kB (tests/test_repo.py keeps both true)::

      120   0.2  PART 1 - THE CONTRACT
      128   2.7    Constants
      192   4.0    Errors and their HTTP statuses
      321  13.4    Envelope
      588  12.0    Inbound decisions (§2)
      823   5.9    Request encoding
      938   6.8    Reply interpretation
     1088  13.6    Response envelope (§4)
     1335   2.1    HTTP replies of a dispatch
     1383   0.8  PART 2 - THE PYTHON RUNTIME
     1413   2.6    Python data
     1483   6.0    Python values as JSON (§7.7)
     1624   1.6    Start-up settings
     1659   0.9    Context binding
     1684   1.8    Event loops for blocking callers
     1730  12.7    Transport
     2004  19.5    Proxy client (§3)
     2369   5.2    Running agents
     2504  13.3    The dispatch app (§2)
     2727   1.1    Server adapters
     2755  12.3    The built-in server
     3042   3.2    Starting a server
     3112   3.5    Code mode (§5)
     3177   0.1  PART 3 - CONVENIENCES
     3185   8.2    Agent-loop helpers
     3340  10.1    Tools from code
     3519  14.6    Framework bridges
     3785   6.3    MCP shim (§3.6)
     3899   9.5    Command line: serve, mcp

Importing this module does no I/O and starts nothing.
"""

from __future__ import annotations
import binascii
import contextlib
import contextvars
import enum
import functools
import json
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping  # faster in isinstance than typing.Mapping
from typing import (
    TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, Deque, Dict, FrozenSet, Generic, Iterable,
    Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, TypeVar, Union, cast,
)
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:  # imported lazily: it costs import time
    import ssl

if __name__ == "__main__":
    # run as a script: `import pipelines_port` must get this module, not a copy
    sys.modules.setdefault("pipelines_port", sys.modules[__name__])

__version__ = "0.1.0"

__all__ = [
    # part 1: the contract
    "PipelinesError", "RequestError", "EnvelopeError", "NotFoundError", "MethodNotAllowedError", "UnknownMethodError",
    "LengthRequiredError", "BodyTooLargeError", "UnsupportedTransferCodingError", "FramingError", "TargetTooLongError",
    "HeadersTooLargeError", "VersionNotSupportedError", "AuthError", "MisconfiguredError", "ShuttingDownError",
    "OverloadedError", "RequestTimeoutError", "RunTimeoutError", "AgentError", "ResponseError", "ProxyError",
    "ProxyRequestError", "ProxyTransportError", "StaleRunTokenError",
    "Envelope", "validate_proxy_url", "json_type",
    "check_credential", "is_ping", "request_body_length", "RequestHead", "parse_request_head", "connectivity_proxy_url",
    "Endpoint", "Decision", "decide",
    "validate_tool_name", "validate_actor_label", "encode_args", "ProxyRequest", "proxy_request", "tool_call_request",
    "trace_request", "handoff_event",
    "ProxyOutcome", "parse_retry_after", "error_fields", "interpret_reply", "RETRY_TABLE", "retry_decision",
    "RetryPolicy", "RetryStep", "RetryState", "TRACE_EVENT_TYPES",
    "response_envelope", "build_turn_reply", "validate_response", "MAX_JSON_DEPTH", "MAX_INT_DIGITS", "HttpReply",
    "json_reply", "error_reply", "describe_error", "redact",
    # part 2: the Python runtime
    "bind_envelope", "current_envelope", "ProxyClient", "set_default_client", "proxy_call", "aproxy_call", "Actor",
    "as_actor", "post_trace", "apost_trace", "post_handoff", "apost_handoff", "build_response", "DispatchApp",
    "probe_proxy", "aprobe_proxy", "wsgi_app", "asgi_app", "make_server", "SERVERS", "AsyncDispatchServer",
    "default_max_connections", "start_server", "serve", "code_mode", "check_run_timeout", "run_in_fresh_thread",
    "load_agent", "main",
    # part 3: conveniences
    "TOOL_FORMATS", "convert_tools", "load_tools_schema", "tools_schema_beside", "bound_output", "call_tools",
    "post_json", "HTTPStatusError", "Tool", "tool", "export_tools", "schema_for_type", "validate_args", "McpShim",
    "tools_schema_from", "proxied_tools", "response_from", "Handoffs", "MCP_PROTOCOL_VERSIONS",
]

class _Logger:  # logging imported at first use: 4 ms
    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:  # cached: found directly next time
        import logging

        setattr(self, attr, value := getattr(logging.getLogger(self.name), attr))
        return value


_log: Any = _Logger("pipelines_port")
_access_log: Any = _Logger("pipelines_port.access")  # a line per request

# ########################################
#
#   PART 1 - THE CONTRACT
#
#   What a port must agree on: data and pure functions, no I/O but reading ``os.environ``.
#
# ########################################


# ----------------------------------------
# Constants: the contract's names and numbers

# §2.1 headers (lower-case), §2.2 body fields, §3.5
HEADER_RUN_TOKEN = "x-pipelines-run-token"
HEADER_PROXY_URL = "x-pipelines-odyssey-proxy-url"
HEADER_PROXY_URL_LEGACY = "x-pipelines-pwsa-proxy-url"
HEADER_RUN_ID = "x-pipelines-run-id"
HEADER_TASK_ID = "x-pipelines-task-id"
HEADER_RUN_TOKEN_JTI = "x-pipelines-run-token-jti"
BODY_PROXY_URL = "odyssey_proxy_url"
BODY_PROXY_URL_LEGACY = "pwsa_proxy_url"
HEADER_ACTOR_ID = "X-Pipelines-Actor-Id"
# §5 code mode, §3.6, §3.1
ENV_PROXY_URL = "PIPELINES_ODYSSEY_PROXY_URL"
ENV_RUN_TOKEN = "PIPELINES_RUN_TOKEN"
ENV_RUN_TOKEN_JTI = "PIPELINES_RUN_TOKEN_JTI"
ENV_RUN_ID = "PIPELINES_RUN_ID"
ENV_TASK_ID = "PIPELINES_TASK_ID"
ENV_AGENT_ID = "PIPELINES_AGENT_ID"
ENV_API_URL = "PIPELINES_API_URL"
ENV_TASK_INPUT_JSON = "_PIPELINES_TASK_INPUT_JSON"
ENV_TASK_INPUT_B64 = "_PIPELINES_TASK_INPUT_B64"
ENV_TOOLS_SCHEMA_B64 = "PIPELINES_TOOLS_SCHEMA_B64"
ENV_TOOLS_SCHEMA_JSON = "PIPELINES_TOOLS_SCHEMA_JSON"
ENV_PROXY_TIMEOUT_S = "PIPELINES_PROXY_TIMEOUT_S"
ENV_PROXY_RATE_PER_MINUTE = "PIPELINES_PROXY_RATE_PER_MINUTE"
# §3.1, §3.5
TOOL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,127}")
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 20
DEFAULT_PROXY_TIMEOUT_S = 120.0
RATE_LIMIT_PER_MINUTE = 60
ACTOR_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
ACTOR_MAX_SEGMENTS = 8
ACTOR_MAX_LENGTH = 256
_CONTROL_CHARACTER = r"[\x00-\x08\x0a-\x1f\x7f]"  # but a tab; compiled by re at first use
# §3.3, §3.4
TRANSIENT_503_CLASSES = frozenset({"lock_contention", "context_store_unavailable", "trace_sequence_contended"})
STALE_TOKEN_CLASSES = frozenset({"run_token_expired", "run_token_invalid", "run_token_rejected"})
TRACE_EVENT_TYPES = frozenset({"assistant_message", "thinking", "system_prompt", "custom", "llm_payload", "handoff",
                               "subagent_message", "subagent_final"})
# §2, §7.1 the dispatch endpoint
DEFAULT_DISPATCH_PATH = "/dispatch"
HEALTH_PATH = "/healthz"
TOOLS_SCHEMA_PATH = "/tools_schema"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
DEFAULT_TOKEN_ENV = "AGENT_TOKEN"
DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_REQUEST_LINE_BYTES = 8 << 10
MAX_REQUEST_HEAD_BYTES = 64 << 10
MAX_REQUEST_FIELDS = 100
DEFAULT_RUN_TIMEOUT_S = 300.0
MAX_RUN_TIMEOUT_S = 1800.0
DETAIL_LIMIT = 500
# §4, §7.7
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
FINAL_RESPONSE_SOFT_LIMIT = 50_000
MAX_JSON_DEPTH = 100
MAX_INT_DIGITS = 4300  # CPython's default int_max_str_digits
_REDACTED = "[redacted]"
_USER_AGENT = "pipelines-port/" + __version__


# ----------------------------------------
# Errors and their HTTP statuses (§7.1 kit-error-statuses)

class PipelinesError(Exception):
    """Base of this module's errors; ``headers``: extra reply headers."""
    http_status: int = 500
    headers: Tuple[Tuple[str, str], ...] = ()

    def __init_subclass__(cls, status: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.http_status = status


class RequestError(PipelinesError, ValueError, status=400):
    """A bad request."""


class EnvelopeError(RequestError):
    """A dispatch envelope missing or malformed."""


class NotFoundError(RequestError, status=404):
    """No route for the path."""


class MethodNotAllowedError(RequestError, status=405):
    """A method the path does not take."""
    def __init__(self, message: str, allowed: Sequence[str]):
        super().__init__(message)
        self.headers = (("Allow", ", ".join(allowed)),)


class UnknownMethodError(RequestError, status=501):
    """A method HTTP does not define."""


class LengthRequiredError(RequestError, status=411):
    """No usable Content-Length."""


class BodyTooLargeError(RequestError, status=413):
    """A body over the endpoint's cap."""


class UnsupportedTransferCodingError(RequestError, status=501):
    """A Transfer-Encoding but chunked."""


class FramingError(RequestError):
    """A request head breaking RFC 9112: the connection closes."""


class TargetTooLongError(FramingError, status=414):
    """A request line too long."""


class HeadersTooLargeError(FramingError, status=431):
    """A request head too large."""


class VersionNotSupportedError(FramingError, status=505):
    """An HTTP version but 1.x."""


class RequestTimeoutError(RequestError, status=408):
    """A request not read in time."""


class AuthError(PipelinesError, status=401):
    """A missing or wrong credential."""
    def __init__(self, message: str, *, bearer: bool = True):
        super().__init__(message)
        self.headers = (("WWW-Authenticate", "Bearer"),) if bearer else ()


class MisconfiguredError(PipelinesError, status=503):
    """The agent token is unset."""


class ShuttingDownError(PipelinesError, status=503):
    """The server is draining."""


class OverloadedError(PipelinesError, status=503):
    """The server is at ``max_connections``."""


class RunTimeoutError(PipelinesError, status=504):
    """The agent overran ``run_timeout_s``."""


class AgentError(PipelinesError):
    """The agent raised; the original is ``__cause__``."""


class ResponseError(PipelinesError, ValueError):
    """A value that cannot become a response (§4); ``problems`` lists why."""
    def __init__(self, problems: str | Sequence[str]):
        self.problems: List[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class ProxyError(PipelinesError):
    """A failed proxy request (§3.3); ``status_code`` None: no reply."""
    def __init__(self, message: str, *, status_code: int | None = None, error_class: str | None = None,
                 body: Any = None, tool_name: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message, self.status_code, self.error_class = message, status_code, error_class
        self.body, self.tool_name, self.retry_after = body, tool_name, retry_after

    def to_value(self) -> JsonObject:
        """The failure as a tool result (§7.4 kit-errors-return)."""
        return {"error": self.message,
                **_without_none({"error_class": self.error_class or None, "status_code": self.status_code})}


class ProxyRequestError(ProxyError, ValueError):
    """A call refused before sending (§7.5)."""


class ProxyTransportError(ProxyError):
    """No usable reply: a timeout, refused or reset connection, TLS."""


class StaleRunTokenError(ProxyError):
    """The proxy refused the run token: the run is over (§3.3)."""


# ----------------------------------------
# Envelope (§2 dispatch, §5 code mode)

if TYPE_CHECKING:  # for annotations only
    Id = Union[int, str]
    HeadersLike = Union[Mapping[str, str], Iterable[Tuple[Any, Any]], None]
    HeaderFields = List[Tuple[str, str]]  # in order, names as sent
    JsonObject = Dict[str, Any]
    Agent = Callable[["Envelope"], Any]  # its value becomes the response (§4)
_ARRAY_TYPES = (list, tuple)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    return (headers.get(name) or "").strip() or None


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def validate_proxy_url(url: Any, where: str) -> str:
    """The proxy URL checked, trailing ``/`` dropped (§7.2 kit-proxy-url-checked)."""
    text = url.strip().rstrip("/") if isinstance(url, str) else ""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
        (parts.hostname or "").encode("idna")
    except ValueError:  # and UnicodeError
        parts = urlsplit("")
    if parts.scheme in ("http", "https") and parts.hostname and not (
            parts.query or parts.fragment or re.search("[\x00-\x20\x7f]", text)):
        return text
    raise EnvelopeError(f"proxy URL {_short(text)!r} from {where} must be an http:// or https:// URL with a host name, "
                        "no query, fragment or whitespace")


def _without_none(mapping: Mapping[str, Any]) -> JsonObject:
    return {k: v for k, v in mapping.items() if v is not None}


def _check_run_token(token: Any, where: str) -> str:
    text = token.strip() if isinstance(token, str) else ""
    if not text or re.search(_CONTROL_CHARACTER, text):  # it goes in a header
        raise EnvelopeError(f"run token from {where} is empty or has control characters")
    return text


def _env_id(value: str | None) -> Id | None:
    return _first_id(_content_length(value), value)  # §7.2 kit-env-ids-numeric


def _first_id(*candidates: Any) -> Id | None:
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):  # §7.2 kit-float-ids-absent
            return value
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _typed(source: Mapping[str, Any], key: str, kind: type) -> Any:
    return source[key] if isinstance(source.get(key), kind) else None


def _sub_agent_catalog(value: Any) -> Tuple[str, ...]:  # §7.2 kit-sub-agents-catalog
    labels = {"": None}
    for entry in value if isinstance(value, list) else ():
        with contextlib.suppress(ProxyRequestError):  # not a string, or not a label
            labels[validate_actor_label(entry.get("actor_id") if isinstance(entry, dict) else entry) or ""] = None
    return tuple(labels)[1:]


class Envelope:
    """One run's dispatch context (§2.2, §5), read-only (§7.2 kit-read-only-envelope)."""
    proxy_url: str
    run_token: str
    run_id: Id | None
    task_id: Id | None
    agent_id: Id | None
    run_token_jti: str | None
    user_instruction: str
    task_input: Mapping[str, Any]
    latest_user_prompt: str | None
    session_id: Id | None
    turn_id: Any | None
    messages: Sequence[Any] | None
    scenario_state: Mapping[str, Any] | None
    workspace: Mapping[str, Any] | None
    tools_schema: Sequence[Any] | None
    sub_agents: Tuple[str, ...]
    raw: Mapping[str, Any]  # the whole dispatch body
    __slots__ = tuple(__annotations__)

    def __init__(self, *, proxy_url: str, run_token: str, **fields: Any):  # the others by their names above
        unknown = set(fields).difference(self.__slots__[2:])
        if unknown:
            raise TypeError(f"Envelope() got an unexpected field {min(unknown)!r}")
        text = fields.get("user_instruction")
        fields.update(proxy_url=validate_proxy_url(proxy_url, "the proxy_url argument"),
                      run_token=_check_run_token(run_token, "the run_token argument"),
                      user_instruction=text if isinstance(text, str) else "",
                      task_input=dict(fields.get("task_input") or {}), raw=dict(fields.get("raw") or {}))
        sub_agents = _sub_agent_catalog(list(fields.pop("sub_agents", ())))
        self._fill(*[sub_agents if name == "sub_agents" else _freeze(fields.get(name)) for name in self.__slots__])

    def _fill(self, *values: Any) -> Envelope:
        for name, value in zip(self.__slots__, values):
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: Any = None) -> None:
        raise AttributeError("Envelope is read-only: use replace()")

    __delattr__ = __setattr__

    def __repr__(self) -> str:
        return (f"Envelope(run_id={self.run_id!r}, task_id={self.task_id!r}, agent_id={self.agent_id!r}, "
                f"run_token_jti={self.run_token_jti!r}, proxy_url={self.proxy_url!r}, run_token={_REDACTED!r})")

    def _fields(self) -> JsonObject:
        return {n: getattr(self, n) for n in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return self._fields() == other._fields() if isinstance(other, Envelope) else NotImplemented

    def __reduce__(self) -> Any:
        return functools.partial(Envelope, **self._fields()), ()

    def replace(self, **changes: Any) -> Envelope:
        """A copy with some fields changed."""
        return Envelope(**{**self._fields(), **changes})

    @property
    def api_url(self) -> str:
        """The proxy URL's origin (§5 ``PIPELINES_API_URL``)."""
        return "{0.scheme}://{0.netloc}".format(urlsplit(self.proxy_url))

    @property
    def is_multi_turn(self) -> bool:
        return self.session_id is not None or self.turn_id is not None

    def conversation(self) -> List[Dict[str, str]]:
        """This turn as chat messages."""
        turns = [{"role": m["role"], "content": m["content"]} for m in self.messages or () if isinstance(m, Mapping)
                 and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
                 and m["content"].strip()]
        prompt = self.latest_user_prompt or self.user_instruction or "(no instruction given)"
        if self.task_input and not self.latest_user_prompt:
            prompt += "\n\nTask input:\n" + json.dumps(self.task_input, indent=2)
        last = {"role": "user", "content": prompt}
        return turns if turns[-1:] == [last] else [*turns, last]

    def child_env(self, base: Mapping[str, str] | None = None) -> Dict[str, str]:
        """``base`` (default ``os.environ``) with this run's variables (§5)."""
        task = {"user_instruction": self.user_instruction, "input": _thaw(self.task_input), "task_id": self.task_id}
        values = {ENV_PROXY_URL: self.proxy_url, ENV_RUN_TOKEN: self.run_token, ENV_API_URL: self.api_url,
                  ENV_RUN_TOKEN_JTI: self.run_token_jti, ENV_RUN_ID: self.run_id, ENV_TASK_ID: self.task_id,
                  ENV_AGENT_ID: self.agent_id, ENV_TASK_INPUT_B64: None, ENV_TASK_INPUT_JSON: json.dumps(
                      _without_none(task), separators=(",", ":"))}
        if self.tools_schema is not None:
            schema = json.dumps(self.tools_schema, separators=(",", ":")).encode()
            import base64

            values[ENV_TOOLS_SCHEMA_B64] = base64.b64encode(schema).decode()
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in values}
        return {**env, **{k: str(v) for k, v in values.items() if v is not None}}

    @classmethod
    def from_dispatch(cls, body: Mapping[str, Any] | bytes | str, headers: HeadersLike = None) -> Envelope:
        """Read an HTTP dispatch (§2.2)."""
        if isinstance(body, (bytes, bytearray, str)):
            try:
                body = json.loads(body)
            except ValueError as exc:
                raise EnvelopeError(f"dispatch body is not valid JSON: {exc}") from None
        if not isinstance(body, Mapping):
            raise EnvelopeError(f"dispatch body must be a JSON object, got {json_type(body)}")
        h = _lower_headers(headers)
        found, token = _proxy_url_source(body, h), _header(h, HEADER_RUN_TOKEN)
        if found is None or token is None:
            missing = ["proxy URL (odyssey_proxy_url, pwsa_proxy_url, X-Pipelines-Odyssey-Proxy-Url)"] * (
                found is None) + ["run token (X-Pipelines-Run-Token)"] * (token is None)
            raise EnvelopeError("dispatch is missing " + " and ".join(missing))
        proxy_url = validate_proxy_url(found[1], found[0])
        return cls._read(body, proxy_url, _check_run_token(token, "header X-Pipelines-Run-Token"), h)

    @classmethod
    def from_run(cls, task_input: Mapping[str, Any] | None, *, proxy_url: str, run_token: str,
                 environ: Mapping[str, str] | None = None) -> Envelope:
        """Read code mode's ``run()`` arguments (§5)."""
        if not isinstance(task_input, (Mapping, type(None))):
            raise EnvelopeError(f"task_input must be a mapping, got {json_type(task_input)}")
        env = os.environ if environ is None else environ
        proxy_url = validate_proxy_url(proxy_url, "the proxy_url argument")
        run_token = _check_run_token(run_token, "the run_token argument")
        task = dict(task_input or {})
        raw = {"input": task, BODY_PROXY_URL: proxy_url, "task_id": _first_id(task.get("task_id"), _env_id(
            env.get(ENV_TASK_ID))), "run_id": _env_id(env.get(ENV_RUN_ID)), "agent_id": _env_id(env.get(ENV_AGENT_ID)),
               "run_token_jti": _header(env, ENV_RUN_TOKEN_JTI), "tools_schema": _tools_schema_from_env(env)}
        return cls._read(_without_none(raw), proxy_url, run_token, {})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Envelope:
        """Read the code-mode environment (§5)."""
        env = os.environ if environ is None else environ
        missing = [name for name in (ENV_PROXY_URL, ENV_RUN_TOKEN) if not _header(env, name)]
        if missing:
            raise EnvelopeError("environment is missing " + " and ".join(missing))
        url = validate_proxy_url(env[ENV_PROXY_URL], f"environment variable {ENV_PROXY_URL}")
        token = _check_run_token(env[ENV_RUN_TOKEN], f"environment variable {ENV_RUN_TOKEN}")
        task: Any = next((_env_json(env[n], n) for n in (ENV_TASK_INPUT_JSON, ENV_TASK_INPUT_B64) if _header(env, n)),
                         {})
        return cls.from_run(task, proxy_url=url, run_token=token, environ=env)

    @classmethod
    def _read(cls, body: Mapping[str, Any], proxy_url: str, run_token: str, headers: Mapping[str, str]) -> Envelope:
        raw = _freeze(body if isinstance(body, dict) else dict(body))  # §7.2: wrong types are absent
        task = _typed(raw, "input", dict) or {}
        return cls.__new__(cls)._fill(
            proxy_url, run_token, _first_id(raw.get("run_id"), _header(headers, HEADER_RUN_ID)),
            _first_id(raw.get("task_id"), task.get("task_id"), _header(headers, HEADER_TASK_ID)),
            _first_id(raw.get("agent_id")),
            _first_id(_typed(raw, "run_token_jti", str), _header(headers, HEADER_RUN_TOKEN_JTI)),
            _typed(task, "user_instruction", str) or "", _typed(task, "input", dict) or _FrozenDict(),
            _typed(task, "latest_user_prompt", str), _first_id(task.get("session_id")), task.get("turn_id"),
            _typed(task, "messages", list), _typed(task, "scenario_state", dict), _typed(task, "workspace", dict),
            _typed(raw, "tools_schema", list), _sub_agent_catalog(raw.get("sub_agents")), raw)


def _proxy_url_source(body: Mapping[str, Any], headers: Mapping[str, str]) -> Tuple[str, str] | None:
    for name in (BODY_PROXY_URL, BODY_PROXY_URL_LEGACY, HEADER_PROXY_URL, HEADER_PROXY_URL_LEGACY):
        value = (body if "_" in name else headers).get(name)
        if isinstance(value, str) and value.strip():
            return f"body field {name!r}" if "_" in name else f"header {name.title()}", value
    return None


def json_type(value: Any) -> str:
    """``value``'s JSON type as messages name it: ``"an object"``, ..."""
    for kinds, name in ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
                        (_ARRAY_TYPES, "an array"), (Mapping, "an object")):
        if isinstance(value, kinds):
            return name
    return type(value).__name__


def _env_json(text: str, name: str) -> Any:
    import base64

    try:
        return json.loads(base64.b64decode(text, validate=True) if name.endswith("_B64") else text)
    except (ValueError, binascii.Error) as exc:
        raise EnvelopeError(f"{name} is not valid JSON: {exc}") from None


def _tools_schema_from_env(env: Mapping[str, str]) -> List[Any] | None:  # §7.2 kit-tools-schema-wrapped
    for name in (ENV_TOOLS_SCHEMA_B64, ENV_TOOLS_SCHEMA_JSON):
        if text := _header(env, name):
            value = _env_json(text, name)
            if isinstance(value, dict) and isinstance(value.get("tools"), list):
                value = value["tools"]
            if not isinstance(value, list):
                raise EnvelopeError(f"{name} must be a JSON list, got {json_type(value)}")
            return value
    return None


# ----------------------------------------
# Inbound decisions (§2): what a request gets

def check_credential(headers: HeadersLike, expected: str, *, header_name: str = "Authorization") -> bool:
    """Whether the request carries the credential (§2 step 1, §7.1 kit-bearer-case)."""
    expected, name = (expected or "").strip(), header_name.lower()
    received = _lower_headers(headers).get(name)
    if not expected or received is None:
        return False
    scheme, _, received = received.strip().partition(" ") if name == "authorization" else ("bearer", "", received)
    try:  # servers give header bytes as latin-1 text
        sent = received.strip().encode("latin-1")
    except UnicodeEncodeError:
        sent = received.strip().encode("utf-8", "surrogateescape")
    import hmac  # at the first check: it loads OpenSSL (3 ms)

    return hmac.compare_digest(sent, expected.encode("utf-8", "surrogateescape")) and scheme.lower() == "bearer"


def is_ping(body: Any) -> bool:
    """True only for exactly ``{"ping": true}`` (§2 step 3)."""
    return isinstance(body, Mapping) and len(body) == 1 and body.get("ping") is True


def _content_length(value: str | None) -> int | None:
    value = (value or "").strip()  # ASCII digits, at most 18
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None


def request_body_length(headers: Mapping[str, str], max_body: int) -> int | None:
    """The body bytes to read; ``None``: none, then close (§7.1 kit-body-framing)."""
    if "content-length" not in headers and "transfer-encoding" not in headers:
        return 0
    try:
        return _body_length(headers, max_body)
    except RequestError:
        return None


def _body_length(headers: Mapping[str, str], max_body: int) -> int:
    coding, declared = headers.get("transfer-encoding"), headers.get("content-length")
    if coding is not None and coding.strip().lower() != "chunked":
        raise UnsupportedTransferCodingError(f"Transfer-Encoding {_short(coding, 60)!r} is not supported")
    if coding is not None or declared is None:
        raise LengthRequiredError("a Content-Length header is required, not chunked")
    digits = declared.strip()
    if _repeated(headers, "content-length", conflicting=True) or not (digits.isascii() and digits.isdigit()):
        raise RequestError(f"bad Content-Length {_short(declared, 40)!r}")
    if len(digits) > 18 or int(digits) > max_body:
        raise BodyTooLargeError(f"request body over the {max_body}-byte cap")
    return int(digits)


# RFC 9112 §5: a token, a colon, a value without control characters but HTAB
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"


@functools.cache  # compiled at first use
def _head_patterns() -> Tuple[re.Pattern[bytes], re.Pattern[bytes]]:  # the request line, a field line
    return (re.compile(rb"(%s) ([^\x00-\x20\x7f-\xff]+) HTTP/([0-9])\.([0-9])" % _TOKEN),
            re.compile(rb"(%s):([^\x00-\x08\x0a-\x1f\x7f]*)" % _TOKEN))


class RequestHead(NamedTuple):
    """A request line and its header fields."""
    method: str
    target: str
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    headers: HeaderFields  # names as sent

    def keep_alive(self) -> bool:
        """Whether the connection may carry another request (RFC 9112 §9.3)."""
        tokens = {t.strip().lower() for k, v in self.headers if k.lower() == "connection" for t in v.split(",")}
        return "close" not in tokens if self.version == "HTTP/1.1" else "keep-alive" in tokens


def parse_request_head(head: bytes) -> RequestHead:
    """Read a request head (§7.1 kit-strict-request-head)."""
    while head.startswith(b"\r\n"):
        head = head[2:]
    lines = head.split(b"\r\n")
    if len(lines[0]) > MAX_REQUEST_LINE_BYTES:
        raise TargetTooLongError("request line too long")
    if len(head) > MAX_REQUEST_HEAD_BYTES or len(lines) > MAX_REQUEST_FIELDS + 1:
        raise HeadersTooLargeError("request head too large")
    request_line, field_line = _head_patterns()
    request = request_line.fullmatch(lines[0])
    headers: HeaderFields = []
    names: List[str] = []
    lengths: List[str] = []
    for line in lines[1:] if request and request[3] == b"1" else ():
        field = field_line.fullmatch(line)
        if field is None:
            break
        name, value = field[1].decode("ascii"), field[2].strip(b" \t").decode("latin-1")
        headers.append((name, value))
        names.append(name.lower())
        if names[-1] == "content-length":
            lengths += map(str.strip, value.split(","))
    if request is None or request[3] != b"1" or len(headers) < len(lines) - 1:  # which rule broke, in RFC order
        if max(head.count(b"\r"), head.count(b"\n")) >= len(lines):  # a CR or LF outside a CRLF
            raise FramingError("bare CR or LF in the request head")
        if request is None:
            raise FramingError(f"malformed request line {_short(repr(lines[0]), 100)}")
        if request[3] != b"1":
            raise VersionNotSupportedError(f"HTTP/{request[3].decode()} is not supported")
        raise FramingError(f"header line {len(headers) + 1} is not a token, a colon and a value (no line folding, "
                           "no whitespace before the colon)")
    version = "HTTP/1.0" if request[4] == b"0" else "HTTP/1.1"  # 1.2 and up read as 1.1 (RFC 9110 §2.5)
    if version == "HTTP/1.1" and names.count("host") != 1:
        raise FramingError("an HTTP/1.1 request needs exactly one Host header")
    if lengths and (len(set(lengths)) != 1 or not (lengths[0].isascii() and lengths[0].isdigit())):
        raise FramingError(f"bad Content-Length {_short(', '.join(lengths), 60)!r}")
    if "transfer-encoding" in names and (lengths or version == "HTTP/1.0"):
        raise FramingError("Transfer-Encoding with a Content-Length or in HTTP/1.0")
    return RequestHead(request[1].decode("ascii"), request[2].decode("ascii"), version, headers)


class Endpoint(NamedTuple):
    """A dispatch endpoint's settings."""
    path: str = DEFAULT_DISPATCH_PATH
    auth_header: str = "Authorization"
    token_env: str | None = DEFAULT_TOKEN_ENV
    no_auth: bool = False
    max_body: int = DEFAULT_MAX_BODY_BYTES
    tools_schema: Sequence[Any] | None = None  # served at GET /tools_schema
    proxy_hosts: Tuple[str, ...] | None = None  # None: any host

    def allowed_methods(self, path: str) -> Tuple[str, ...] | None:
        """The methods routed at ``path``, or ``None`` (§7.1 kit-routes)."""
        if path == self.path:
            return ("POST",)
        tools = path == TOOLS_SCHEMA_PATH and self.tools_schema is not None
        return ("GET",) if path == HEALTH_PATH or tools else None


class Decision(NamedTuple):
    """What a request gets: ``"reply"``, ``"probe"`` (§3.7) or ``"run"``."""
    action: str
    reply: HttpReply | None = None
    proxy_url: str | None = None
    envelope: Envelope | None = None
    what: str = "rejected"


def decide(endpoint: Endpoint, method: str, target: str, headers: HeadersLike, body: bytes | None, *,
           expected_token: str | None) -> Decision:
    """What one request gets (§2.3); ``expected_token`` ``""``: its variable is unset."""
    try:
        method, headers = method.upper(), _lower_headers(headers)
        if method not in HTTP_METHODS:
            raise UnknownMethodError(f"unknown method {_short(method, 40)}")
        path = urlsplit(target).path.rstrip("/") or "/"
        allowed = endpoint.allowed_methods(path)
        if allowed is None:
            raise NotFoundError(f"no route for {_short(path, 100)}: use POST {endpoint.path}")
        if method not in allowed:
            raise MethodNotAllowedError(f"{method} is not allowed on {path}: use {' or '.join(allowed)}", allowed)
        if path == HEALTH_PATH:  # GET routes come before auth (kit-routes)
            return Decision("reply", json_reply(200, {"ok": True, "version": __version__}), what="health")
        if path == TOOLS_SCHEMA_PATH:
            return Decision("reply", json_reply(200, {"tools_schema": endpoint.tools_schema}), what="tools schema")
        name = endpoint.auth_header
        if not endpoint.no_auth:
            if not (expected_token or "").strip():
                raise MisconfiguredError(f"misconfigured: {endpoint.token_env} (the agent token) is not set")
            twice = _repeated(headers, name.lower())
            if twice or not check_credential(headers, expected_token or "", header_name=name):
                raise AuthError(f"{name} header sent more than once" if twice else
                                f"missing or invalid credential in the {name} header",
                                bearer=name.lower() == "authorization")
        length = _body_length(headers, endpoint.max_body)
        if body is None or len(body) < length:
            raise RequestError(f"request body truncated at {len(body or b'')} of {length} bytes")
        if len(body) > endpoint.max_body:
            raise BodyTooLargeError(f"request body over the {endpoint.max_body}-byte cap")
        try:
            payload = _json_from_bytes(body)
        except ValueError as exc:
            raise RequestError(f"body is not valid JSON: {_short(str(exc))}") from None
        if is_ping(payload):
            if json.loads(body, object_pairs_hook=len) != 1:  # the keys as sent: {"ping": false, "ping": true}
                raise RequestError("the ping body has 'ping' twice")
            return Decision("reply", json_reply(200, {"ok": True}), what="ping")
        if not isinstance(payload, dict):
            raise RequestError(f"body must be a JSON object, got {json_type(payload)}")
        probe = payload.get("connectivity_check") is True
        envelope = None if probe else Envelope.from_dispatch(payload, headers)
        proxy_url = envelope.proxy_url if envelope else connectivity_proxy_url(payload, headers)
        if not proxy_host_allowed(proxy_url, endpoint.proxy_hosts):
            raise EnvelopeError(f"proxy URL host {_short(str(urlsplit(proxy_url).hostname), 100)!r} is not on the "
                                f"allow-list: {', '.join(endpoint.proxy_hosts or ())}")
        return Decision("probe", proxy_url=proxy_url, what="connectivity check") if probe else Decision(
            "run", envelope=envelope, what="dispatch")
    except PipelinesError as exc:
        return Decision("reply", error_reply(exc))
    except RecursionError:  # JSON nested too deep to parse
        return Decision("reply", error_reply(RequestError("body is nested too deeply")))


# compiled by re at first use
_HOST_ENTRY = (r"(?P<name>\.?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?|\[[0-9A-Fa-f:.]+\])"
               r"(?::(?P<port>[0-9]{1,5}))?")


def _split_host_entry(entry: str) -> Tuple[str, int | None]:
    entry = entry.strip().lower()
    match = re.fullmatch(_HOST_ENTRY, entry)
    if match is None:
        return entry, None
    return match["name"].strip("[]").rstrip("."), int(match["port"]) if match["port"] else None


def proxy_host_allowed(proxy_url: str, allowed: Sequence[str] | None) -> bool:
    """Whether a proxy URL's host and port are allowed (``None``: any)."""
    if allowed is None:
        return True
    parts = urlsplit(proxy_url)
    host = (parts.hostname or "").rstrip(".")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    return any(entry_port in (None, port) and name and (host == name or (
        name[0] == "." and f".{host}".endswith(name))) for name, entry_port in map(_split_host_entry, allowed))


def connectivity_proxy_url(payload: Mapping[str, Any], headers: HeadersLike) -> str:
    """The proxy URL a connectivity check probes (§2 step 4)."""
    found = _proxy_url_source(payload, _lower_headers(headers))
    if found is None:
        raise EnvelopeError("connectivity_check needs a proxy URL")
    return validate_proxy_url(found[1], "the connectivity check")


# ----------------------------------------
# Request encoding (§3.1, §3.4, §3.5)

def validate_tool_name(name: Any) -> str:
    """``name``, checked (§3.1, §7.5 kit-local-tool-name)."""
    if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
        raise ProxyRequestError(f"invalid tool name {_short(repr(name), 80)}: must match ^{TOOL_NAME_RE.pattern}$",
                                tool_name=name if isinstance(name, str) else None)
    return name


def validate_actor_label(label: Any) -> str | None:
    """The actor label trimmed, ``None`` for an empty one (§3.5)."""
    if not isinstance(label, str):
        if label is None:
            return None
        problem = f"must be a string, got {type(label).__name__}"
    elif not (text := label.strip()):
        return None
    elif len(text) > ACTOR_MAX_LENGTH:
        problem = f"over {ACTOR_MAX_LENGTH} characters"
    elif text.count("/") >= ACTOR_MAX_SEGMENTS:  # one "/" fewer than segments
        problem = f"over {ACTOR_MAX_SEGMENTS} segments"
    elif bad := [segment for segment in text.split("/") if not ACTOR_SEGMENT_RE.fullmatch(segment)]:
        problem = f"segment {_short(repr(bad[0]), 80)} is not 1-64 characters of [A-Za-z0-9_.:-]"
    else:
        return text
    raise ProxyRequestError(f"invalid actor label {_short(repr(label), 80)}: {problem}", error_class="actor_id_invalid")


# made once: json.dumps with options makes one per call
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_STRICT_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_args(name: str, args: Any, *, what: str = "tool arguments") -> bytes:
    """A request body: a JSON object within the cap (§3.1, §7.5)."""
    if not isinstance(args, Mapping) and args is not None:
        raise ProxyRequestError(f"{what} for {name!r} must be a JSON object, got {json_type(args)}", tool_name=name)
    try:
        body = _STRICT_COMPACT_JSON.encode(args or {}).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ProxyRequestError(f"{what} for {name!r} are not JSON: {exc}", tool_name=name) from None
    if len(body) > MAX_REQUEST_BYTES:
        raise ProxyRequestError(f"{what} for {name!r} over the {MAX_REQUEST_BYTES}-byte cap", tool_name=name)
    return body


def _header_problem(headers: Mapping[str, str]) -> str | None:
    for name, value in headers.items():  # §7.5 kit-header-values
        if re.search(_CONTROL_CHARACTER, value):
            return f"header {name} has a line break or control character in its value"
    return None


class ProxyRequest(NamedTuple):
    """One proxy request, as sent on every attempt (§3.1, §3.4)."""
    kind: str  # "tools" | "traces"
    name: str  # the tool, or the trace event type
    url: Any  # urllib.parse.SplitResult
    path: str
    headers: Dict[str, str]
    body: bytes


def proxy_request(proxy_url: str, run_token: str, kind: str, name: str, body: bytes, *,
                  actor: str | None = None, idempotency_key: str | None = None) -> ProxyRequest:
    """``POST {proxy_url}/{kind}/{name}`` (§3.1, §3.5)."""
    url = urlsplit(proxy_url)
    if not idempotency_key:
        import uuid  # at the first call: it costs 2 ms

        idempotency_key = str(uuid.uuid4())
    headers = {"Content-Type": "application/json", "Accept": "application/json", "Authorization": "Bearer " + run_token,
               "Idempotency-Key": idempotency_key, "User-Agent": _USER_AGENT}
    if actor:
        headers[HEADER_ACTOR_ID] = actor
    quoted = name if TOOL_NAME_RE.fullmatch(name) else quote(name, safe="")
    return ProxyRequest(kind, name, url, f"{url.path.rstrip('/')}/{kind}/{quoted}", headers, body)


def tool_call_request(proxy_url: str, run_token: str, name: str, args: Any, *, actor: str | None = None,
                      idempotency_key: str | None = None) -> ProxyRequest:
    """A tool call, checked (§3.1, §3.5, §7.5)."""
    validate_tool_name(name)
    label = validate_actor_label(actor)
    return proxy_request(proxy_url, run_token, "tools", name, encode_args(name, args), actor=label,
                         idempotency_key=idempotency_key)


def trace_request(proxy_url: str, run_token: str, event_type: str, payload: Mapping[str, Any] | None, *,
                  occurred_at: str, actor: str | None = None) -> ProxyRequest:
    """A live trace event (§3.4)."""
    if event_type not in TRACE_EVENT_TYPES:
        raise ProxyRequestError(f"unknown trace event type {_short(repr(event_type), 60)}: use one of "
                                + ", ".join(sorted(TRACE_EVENT_TYPES)), tool_name=str(event_type))
    label = validate_actor_label(actor)
    if not isinstance(payload, Mapping) and payload is not None:
        raise ProxyRequestError(f"trace payload must be a JSON object, got {json_type(payload)}", tool_name=event_type)
    event = dict(payload or {})
    event.setdefault("__occurred_at", occurred_at)
    return proxy_request(proxy_url, run_token, "traces", event_type,
                         encode_args(event_type, event, what="trace payload"), actor=label)


def handoff_event(from_sub_agent: str, to_sub_agent: str, *, reason: str | None = None,
                  payload_preview: str | None = None) -> JsonObject | None:
    """A ``handoff`` event's payload (§3.4 handoff-shape), ``None`` for a self-handoff."""
    source, target = validate_actor_label(from_sub_agent), validate_actor_label(to_sub_agent)
    if not source or not target:
        raise ProxyRequestError("a handoff needs from and to labels", error_class="actor_id_invalid")
    return None if source == target else _without_none({"from_sub_agent": source, "to_sub_agent": target,
                                                        "reason": reason, "payload_preview": payload_preview})


# ----------------------------------------
# Reply interpretation (§3.2, §3.3) and retries

class ProxyOutcome(NamedTuple):
    """What one attempt came to; ``stale``: a pooled connection was closed."""
    kind: str  # "value" | "error" | "retry" | "transport"
    value: Any = None
    error: PipelinesError | None = None
    retry_after: float | None = None
    stale: bool = False


def _model_retry_after(headers: Any) -> float | None:
    lowered = _lower_headers(headers)  # OpenAI's retry-after-ms first
    try:
        seconds = float(lowered.get("retry-after-ms") or "") / 1000
    except ValueError:
        seconds = math.nan
    return seconds if seconds >= 0 else parse_retry_after(lowered.get("retry-after"))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header, else ``None``."""
    text = (value or "").strip()
    try:
        seconds = float(text)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:  # an unreadable date raises, or gives None (3.9)
            seconds = parsedate_to_datetime(text).timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError, AttributeError):
            return None
    return None if math.isnan(seconds) else max(0.0, seconds)


def error_fields(body: Any) -> Tuple[str | None, str | None]:
    """``(error_class, message)`` from an error body (§3.3 error-body-shapes)."""
    if not isinstance(body, dict):
        return None, None
    detail = body.get("detail")
    cls, msg = body.get("error_class"), body.get("message") or body.get("error")
    if isinstance(detail, dict):
        cls, msg = detail.get("error_class"), detail.get("message") or detail.get("detail")
    elif isinstance(detail, str):
        msg = detail
    elif detail is not None and msg is None:
        msg = json.dumps(detail)[:200]
    return (cls if isinstance(cls, str) else None), (msg if isinstance(msg, str) else None)


def _decode_body(body: bytes, content_type: str) -> Tuple[Any, bool]:
    if not body:
        return None, False
    try:
        return _json_from_bytes(body), True
    except ValueError:
        return body.decode("utf-8", "replace"), False


# §3.3: (status, error classes or None for any, outcome)
RETRY_TABLE: Tuple[Tuple[int, FrozenSet[str] | None, str], ...] = (
    (429, None, "retry"), (503, TRANSIENT_503_CLASSES, "retry"), (401, STALE_TOKEN_CLASSES, "stale"))


def retry_decision(status: int, error_class: str | None) -> str:
    """``"retry"``, ``"stale"`` or ``"fail"`` for a non-2xx proxy reply (§3.3)."""
    return next((outcome for table_status, classes, outcome in RETRY_TABLE
                 if status == table_status and (classes is None or error_class in classes)), "fail")


def interpret_reply(status: int, headers: HeadersLike, body: bytes, *, tool_name: str,
                    run_token: str | None = None) -> ProxyOutcome:
    """What a proxy reply means (§3.2, §3.3, §7.4 kit-legacy-whole-body)."""
    h = _lower_headers(headers)
    value, is_json = _decode_body(body, h.get("content-type", ""))
    if 200 <= status < 300:
        return ProxyOutcome("value", value["response"] if isinstance(value, dict) and "response" in value else value)
    value = redact(value, run_token)
    error_class, message = error_fields(value)
    if message is None:
        message = _short(value if isinstance(value, str) else json.dumps(value) if value is not None else "")
    if isinstance(value, str) and not is_json:
        value = _short(value)
    retry_after = parse_retry_after(h.get("retry-after"))
    decision = retry_decision(status, error_class)
    text = f"proxy call {tool_name!r} failed: HTTP {status}" + (f" {error_class}" if error_class else "") + (
        f": {message}" if message else "") + (" (the run is over)" if decision == "stale" else "")
    error = (StaleRunTokenError if decision == "stale" else ProxyError)(
        text, status_code=status, error_class=error_class, body=value, tool_name=tool_name, retry_after=retry_after)
    return ProxyOutcome("retry" if decision == "retry" else "error", error=error, retry_after=retry_after)


class RetryPolicy(NamedTuple):
    """The proxy requests' retry policy (§3.3, §7.4 kit-retry-numbers)."""
    max_attempts: int = 4
    base_delay_s: float = 0.5
    max_delay_s: float = 4.0
    jitter: float = 0.25
    max_retry_after_s: float = 60.0
    transport_retries: int = 2

    def delay(self, retry_number: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry ``retry_number`` (from 1)."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after_s)
        import random

        wait = self.base_delay_s * (2 ** (retry_number - 1)) * random.uniform(1 - self.jitter, 1 + self.jitter)
        return float(max(0.0, min(wait, self.max_delay_s)))


class RetryStep(NamedTuple):
    """What a driver does next: ``"return"``, ``"raise"`` or ``"retry"``."""
    action: str  # "return" | "raise" | "retry"
    value: Any = None
    error: PipelinesError | None = None
    wait_s: float | None = None


class RetryState:
    """One call's way through the retry policy (§3.3)."""
    __slots__ = ("policy", "attempts", "transport_failures")

    def __init__(self, policy: RetryPolicy):
        self.policy, self.attempts, self.transport_failures = policy, 0, 0

    def step(self, outcome: ProxyOutcome) -> RetryStep:
        """The next step after ``outcome``."""
        self.attempts += 1
        policy, error, wait = self.policy, outcome.error, outcome.retry_after
        if outcome.kind == "value":
            return RetryStep("return", outcome.value)
        if outcome.kind == "transport":
            self.transport_failures += 1
            if self.transport_failures <= policy.transport_retries:
                return RetryStep("retry", error=error, wait_s=None if outcome.stale else policy.delay(
                    self.transport_failures))
        elif outcome.kind == "retry" and (wait or 0) > policy.max_retry_after_s:
            error = error or ProxyError("proxy call failed", retry_after=wait)
            who = "the proxy" if isinstance(error, ProxyError) else "the server"
            text = f"{error} ({who} asked to wait {wait:g} s over the {policy.max_retry_after_s:g} s this client waits)"
            error.args = (text,)
            if isinstance(error, ProxyError):
                error.message = text
        elif outcome.kind == "retry" and self.attempts < policy.max_attempts:
            return RetryStep("retry", error=error, wait_s=policy.delay(self.attempts, wait))
        return RetryStep("raise", error=error)


# ----------------------------------------
# Response envelope (§4): built and checked

_FINAL_KEYS = ("final_response", "final_output", "output", "message")
_METADATA_TYPES: Tuple[Tuple[str, Any, str], ...] = (  # §7.7 kit-metadata-types
    ("model", str, "a string"), ("system_prompt_id", str, "a string"),
    ("total_input_tokens", int, "a non-negative integer"), ("total_output_tokens", int, "a non-negative integer"),
    ("agent_runtime_ms", (int, float), "a non-negative number"))


def _final_text(value: Any, key: str, strict: bool = True, notes: List[str] | None = None) -> str | None:
    if value is None or isinstance(value, str):  # §7.7 kit-result-shapes
        return value
    if key == "final_response" and strict:
        raise ResponseError(f"final_response must be a string, got {json_type(value)}")
    if isinstance(value, (dict, list, int, float, bool)):
        return json.dumps(_jsonable(value, key, [] if notes is None else notes), ensure_ascii=False)
    dump = getattr(value, "model_dump_json", None)  # pydantic
    return _safe_text(value, dump if callable(dump) else None)


def _unpack_result(value: Any, strict: bool, notes: List[str]) -> Tuple[str | None, Any, Any, JsonObject]:
    if value is None or isinstance(value, str):
        return value, None, None, {}
    mapping = isinstance(value, Mapping)
    if mapping and "final_response" in value:
        extra = {k: v for k, v in value.items() if k not in ("final_response", "messages", "metadata")}
        final = _final_text(value["final_response"], "final_response", strict, notes)
        return final, value.get("messages"), value.get("metadata"), extra
    for key in _FINAL_KEYS:
        found = value.get(key) if mapping else getattr(value, key, None)
        if found is not None and (mapping or not callable(found)):
            whole = key == "final_response"  # an envelope-shaped object
            return (_final_text(found, key, strict, notes), getattr(value, "messages", None) if whole else None,
                    getattr(value, "metadata", None) if whole else None, {})
    if mapping:
        return None, None, None, {}
    raise ResponseError(f"cannot build a response from {type(value).__name__}: return a string or a mapping with "
                        "'final_response'")


def _tool_call_name(call: Any) -> str | None:
    for holder in (call, call.get("function") if isinstance(call, Mapping) else None):
        if isinstance(holder, Mapping) and isinstance(holder.get("name"), str) and holder["name"]:
            return str(holder["name"])
    return None


def _normalise_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or "name" in call:
        return dict(call) if isinstance(call, Mapping) else call
    flat = {k: v for k, v in call.items() if k not in ("function", "type")}  # §7.7 kit-flat-tool-calls
    flat["name"] = function.get("name")
    if "arguments" in function:
        flat["arguments"] = function["arguments"]
    return flat


def _normalise_messages(messages: Any) -> Any:
    out = [dict(message) if isinstance(message, Mapping) else message for message in messages]
    for message in out:
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), _ARRAY_TYPES):
            message["tool_calls"] = list(map(_normalise_tool_call, message["tool_calls"]))
    return out


def _has_surrogates(text: str) -> bool:  # lone ones are not UTF-8
    return not text.isascii() and re.search("[\ud800-\udfff]", text) is not None


def _well_formed(text: str) -> str:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # lone surrogates as U+FFFD


def _as_the_platform_keeps(body: JsonObject, notes: List[str]) -> JsonObject:
    kept: List[str] = []
    body = _jsonable(body, "body", kept)
    notes += [note.removeprefix("body.") for note in kept]
    messages = body.get("messages")
    for i, message in enumerate(messages) if isinstance(messages, list) else ():
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            notes += [f"messages[{i}].tool_calls[{j}]: no resolvable tool name; dropped"
                      for j, call in enumerate(calls) if not _tool_call_name(call)]
            message["tool_calls"] = list(filter(_tool_call_name, calls))
    for key, problems in (("messages", _message_problems(messages, [])),
                          ("metadata", _metadata_problems(body.get("metadata"), []))):
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            notes.append(f"{problems[0]}{more}; {key} dropped, as the platform does")
            del body[key]
    return body


def response_envelope(value: Any, *, messages: Sequence[Mapping[str, Any]] | None = None,
                      metadata: Mapping[str, Any] | None = None, strict: bool = False,
                      multi_turn: bool = False) -> Tuple[JsonObject, List[str]]:
    """``(body, warnings)``: the response to an agent's result (§4, §7.7 kit-result-shapes)."""
    notes: List[str] = []
    turn_reply = isinstance(value, Mapping) and "message" in value and "session_done" in value and (
        "final_response" not in value)
    if turn_reply and multi_turn:  # sent as built, keys in order (kit-turn-reply-checked)
        body, key = dict(value), "message"
        if not strict:
            body["message"] = _final_text(body["message"], "message", notes=notes)
            if not isinstance(body["session_done"], bool):
                notes.append(f"session_done: must be a boolean, got {json_type(body['session_done'])}; sent false")
                body["session_done"] = False
    else:
        if turn_reply:
            value = {("final_response" if k == "message" else k): v for k, v in value.items() if k != "session_done"}
            notes.append("session_done: not a multi-turn dispatch; message sent as final_response")
        final, found_messages, found_metadata, extra = _unpack_result(value, strict, notes)
        body, key = {**extra, "final_response": final}, "final_response"
        messages = found_messages if messages is None else messages
        metadata = found_metadata if metadata is None else metadata
        if messages is not None:
            body["messages"] = _normalise_messages(messages) if isinstance(messages, _ARRAY_TYPES) else messages
        if metadata is not None:
            body["metadata"] = _copied(metadata) if isinstance(metadata, Mapping) else metadata
    if not strict:
        body = _as_the_platform_keeps(body, notes)
    warnings: List[str] = []
    errors = _body_problems(body, key, warnings, not strict)
    soft = [w[len("warning: "):] for w in warnings]
    if strict:  # a warning is an error too, but for the platform's own truncation
        errors += [w for w in soft if not w.startswith("final_response: ") or "truncates" not in w]
    if errors:
        raise ResponseError(errors)
    return body, notes + soft


def build_turn_reply(message: Any, *, metadata: Mapping[str, Any] | None = None,
                     session_done: bool = False) -> JsonObject:
    """A multi-turn reply (§4.2), checked strictly (§7.7 kit-turn-reply-checked)."""
    reply: JsonObject = {"message": _final_text(message, "message"), "session_done": session_done}
    if metadata is not None:
        reply["metadata"] = _copied(metadata) if isinstance(metadata, Mapping) else metadata
    return response_envelope(reply, strict=True, multi_turn=True)[0]


def validate_response(body: Any) -> List[str]:
    """A response body's problems, warnings last (§4.1, §7.7 kit-strict-transcript)."""
    if not isinstance(body, Mapping):
        return [f"body: must be a JSON object, got {json_type(body)}"]
    warnings: List[str] = []
    return _body_problems(body, "final_response", warnings, False) + warnings


def _body_problems(body: Mapping[str, Any], key: str, warnings: List[str], json_safe: bool) -> List[str]:
    text = body.get(key)  # final_response, or a turn reply's message
    problems: List[str] = []
    if text is None or (key == "message" and text == ""):
        problems.append(f"{key}: required, a non-empty string")
    elif not isinstance(text, str):
        problems.append(f"{key}: must be a string, got {json_type(text)}")
    elif not text:  # only final_response gets here
        problems.append(f"{key}: must not be empty (the judge has nothing to grade)")
    elif not text.strip():
        warnings.append(f"warning: {key}: blank")
    elif key == "final_response" and len(text) > FINAL_RESPONSE_SOFT_LIMIT:
        warnings.append(f"warning: final_response: {len(text)} characters; the platform truncates at "
                        f"{FINAL_RESPONSE_SOFT_LIMIT}")
    if key == "message" and not isinstance(body.get("session_done"), bool):
        problems.append(f"session_done: must be a boolean, got {json_type(body.get('session_done'))}")
    problems += _message_problems(body.get("messages"), warnings) + _metadata_problems(body.get("metadata"), warnings)
    unsendable = None if json_safe else _unsendable(body, "body")
    return [*problems, unsendable.removeprefix("body.")] if unsendable else problems


def _metadata_problems(metadata: Any, warnings: List[str]) -> List[str]:
    if metadata is None:
        return []
    if not isinstance(metadata, Mapping):
        return [f"metadata: must be an object or null, got {json_type(metadata)} (the platform drops it)"]
    try:
        warnings += [f"warning: metadata.{key}: should be {wanted}, got {_short(_safe_repr(value), 40)}"
                     for key, kind, wanted in _METADATA_TYPES for value in (metadata.get(key),)
                     if value is not None and not (isinstance(value, kind) and (kind is str or (
                         not isinstance(value, bool) and 0 <= value < math.inf)))]
    except Exception:  # noqa: BLE001 - _jsonable names a raising mapping
        pass
    return []


_MESSAGE_FIELDS = (  # each present field's types (§4.1)
    ("content", (str, list, tuple, type(None)), "a string, an array of parts or null"),
    ("tool_calls", _ARRAY_TYPES, "an array"), ("thinking", _ARRAY_TYPES, "an array of objects"),
    ("tool_call_id", str, "a string"))


def _message_problems(messages: Any, warnings: List[str]) -> List[str]:
    if messages is None:
        return []
    if not isinstance(messages, _ARRAY_TYPES):
        return [f"messages: must be an array or null, got {json_type(messages)} (the platform drops it)"]
    problems: List[str] = []
    call_ids: Set[str] = set()
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, Mapping):
            problems.append(f"{at}: must be an object, got {json_type(message)}")
            continue
        for key, kinds, wanted in _MESSAGE_FIELDS:
            if key in message and not isinstance(message[key], kinds):
                problems.append(f"{at}.{key}: must be {wanted}, got {json_type(message[key])}")
        role, calls, thinking = message.get("role"), message.get("tool_calls"), message.get("thinking")
        calls = calls if isinstance(calls, _ARRAY_TYPES) else ()
        if role not in MESSAGE_ROLES:
            problems.append(f"{at}.role: must be one of {', '.join(MESSAGE_ROLES)}, got {_short(repr(role), 40)}")
        if calls and role != "assistant":
            warnings.append(f"warning: {at}.tool_calls: on a {role!r} message, not an assistant's")
        for j, call in enumerate(calls):
            problems += _tool_call_problems(call, f"{at}.tool_calls[{j}]", call_ids, warnings)
        problems += [f"{at}.thinking[{j}]: must be an object, got {json_type(block)}"
                     for j, block in enumerate(thinking if isinstance(thinking, _ARRAY_TYPES) else ())
                     if not isinstance(block, Mapping)]
        call_id = message.get("tool_call_id", "")
        if role == "tool" and isinstance(call_id, str) and (not call_id or call_id not in call_ids):
            problems.append(f"{at}.tool_call_id: " + (f"{_short(repr(call_id), 60)} matches no earlier tool call"
                                                      if call_id else "required on role 'tool'"))
    return problems


def _tool_call_problems(call: Any, at: str, call_ids: Set[str], warnings: List[str]) -> List[str]:
    if not isinstance(call, Mapping):
        return [f"{at}: must be an object, got {json_type(call)}"]
    function: Any = call.get("function")  # the schema's oneOf: flat or nested
    flat, typed = isinstance(call.get("name"), str), call.get("type", "function") == "function"
    nested = isinstance(function, Mapping) and isinstance(function.get("name"), str) and typed
    if flat == nested:
        if flat:
            return [f"{at}: has both 'name' and 'function'"]
        if not typed and isinstance(function, Mapping):
            return [f"{at}.type: must be \"function\", got {_short(repr(call['type']), 40)}"]
        return [f"{at}.name: no resolvable tool name"]
    arguments = (call if flat else function).get("arguments")
    if arguments is not None and not isinstance(arguments, (Mapping, str)):
        warnings.append(f"warning: {at}.arguments: should be an object or a string, got {json_type(arguments)}")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        return [f"{at}.id: must be a string, got {json_type(call_id)}"]
    call_ids.add(call_id)
    return []


# ----------------------------------------
# HTTP replies of a dispatch endpoint

class HttpReply(NamedTuple):
    """What a dispatch endpoint answers."""
    status: int
    headers: HeaderFields
    body: bytes


def json_reply(status: int, payload: Any, extra_headers: Sequence[Tuple[str, str]] = ()) -> HttpReply:
    """``payload`` as compact JSON."""
    try:
        body = _COMPACT_JSON.encode(payload).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: sent as U+FFFD
        body = _COMPACT_JSON.encode(_jsonable(payload, "reply", [])).encode("utf-8")
    return HttpReply(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *extra_headers],
                     body)


def error_reply(exc: BaseException) -> HttpReply:
    """``{"detail": message}`` with ``exc.http_status``, else 500 (§7.1 kit-error-statuses)."""
    if isinstance(exc, PipelinesError):
        return json_reply(exc.http_status, {"detail": _short(str(exc), DETAIL_LIMIT - 1)}, exc.headers)
    return json_reply(500, {"detail": describe_error(exc)})


def describe_error(exc: BaseException, limit: int = DETAIL_LIMIT, *secrets: str | None) -> str:
    """``"TypeName: message"``: one line, at most ``limit`` characters, ``secrets`` redacted."""
    message = _safe_text(exc)
    text = _well_formed(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)
    return _short(" ".join(redact(text, *secrets).split()), limit - 1)  # with its "…": ``limit``


def redact(value: Any, *secrets: str | None) -> Any:
    """``value`` (a string or JSON value) with each secret as ``[redacted]``."""
    kept = list(filter(None, secrets))
    if isinstance(value, str):
        for secret in kept:
            value = value.replace(secret, _REDACTED)
    elif isinstance(value, dict) and kept:
        value = {redact(k, *kept): redact(v, *kept) for k, v in value.items()}
    elif isinstance(value, list) and kept:
        value = [redact(v, *kept) for v in value]
    return value


# ########################################
#
#   PART 2 - THE PYTHON RUNTIME
#
#   Part 1 carried out: sockets, threads, the environment, the log.
#
# ########################################


_T = TypeVar("_T")


class _Once(Generic[_T]):  # a lazy singleton
    def __init__(self, make: Callable[[], _T]):
        self._make, self._lock = make, threading.Lock()
        self._value: _T | None = None

    def __call__(self) -> _T:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = self._make()
        return self._value


def _json_from_bytes(data: bytes) -> Any:  # json.loads without its encoding sniff
    if data[:1] == b"{" and data[1:2] != b"\x00":
        return json.loads(data.decode("utf-8", "surrogatepass"))
    return json.loads(data)


# ----------------------------------------
# Python data: read-only JSON containers (§7.2), headers

def _read_only(*args: Any, **kwargs: Any) -> Any:  # as a method: the container first
    raise TypeError("envelope data is read-only; copy it first (copy.deepcopy(x))")


class _FrozenDict(dict[Any, Any]):  # dict[]: cheaper to import than Dict[]
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> Any:  # copies are plain, mutable containers
        return (dict, (dict(self),))


class _FrozenList(list[Any]):
    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only

    def __reduce__(self) -> Any:
        return (list, (list(self),))


_LEAVES = frozenset({str, int, float, bool, type(None), _FrozenDict, _FrozenList})  # what _freeze returns as is


def _freeze(value: Any) -> Any:
    if type(value) in _LEAVES:
        return value
    if isinstance(value, dict):
        return _FrozenDict({k: v if type(v) in _LEAVES else _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return _FrozenList([v if type(v) in _LEAVES else _freeze(v) for v in value])
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(zip(value, map(_thaw, value.values())))
    return list(map(_thaw, value)) if isinstance(value, (list, tuple)) else value


class _LowerHeaders(dict[str, str]):  # first values by lower-cased name; repeats: the others
    repeats: Dict[str, List[str]]


def _lower_headers(headers: HeadersLike) -> Dict[str, str]:  # from a mapping, a Message or pairs (bytes: latin-1)
    if isinstance(headers, _LowerHeaders):
        return headers
    out = _LowerHeaders()
    out.repeats = {}
    items = getattr(headers, "items", None)
    for name, value in cast("Iterable[Tuple[Any, Any]]", items() if callable(items) else headers or ()):
        key = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        if key in out:
            out.repeats.setdefault(key, []).append(text)
        else:
            out[key] = text
    return out


def _repeated(headers: Mapping[str, str], name: str, *, conflicting: bool = False) -> bool:
    extra = getattr(headers, "repeats", {}).get(name, ())
    if conflicting:
        return bool(set(map(str.strip, extra)) - {(headers.get(name) or "").strip()})
    return bool(extra)


# ----------------------------------------
# Python values as JSON (§7.7): converted with a note, or refused

class _Unsendable(Exception):
    pass


def _change(notes: List[str] | None, problem: str, sent: str, fix: str) -> None:
    if notes is None:
        raise _Unsendable(f"{problem}: {fix}")
    notes.append(f"{problem}; {sent}")


# each change noted; notes None: strict (a change raises)
def _jsonable(value: Any, path: str, notes: List[str] | None, depth: int = 0, active: Set[int] | None = None) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if not _has_surrogates(value):
            return value
        _change(notes, f"{path}: lone surrogates are not UTF-8", "sent as U+FFFD", "replace it")
        return _well_formed(value)
    if isinstance(value, int):
        if value.bit_length() < 14_000 or abs(value) < 10 ** MAX_INT_DIGITS:
            return int(value)
        _change(notes, f"{path}: an integer of more than {MAX_INT_DIGITS} digits", "sent as its decimal text",
                "send it as a string")
        return _int_text(int(value))
    if isinstance(value, float):
        if math.isfinite(value):
            return value if type(value) is float else float.__float__(value)  # a subclass's repr may raise
        _change(notes, f"{path}: {float.__repr__(value)} is not JSON", "sent as null", "send null or a string")
        return None
    if isinstance(value, (Mapping, list, tuple, set, frozenset)):
        return _jsonable_container(value, path, notes, depth, set() if active is None else active)
    if not callable(iso := getattr(value, "isoformat", None)):
        iso = None
    raw = iso is None and isinstance(value, (bytes, bytearray, memoryview))
    sent = "UTF-8 text" if raw else "text" if iso is None else "ISO text"
    _change(notes, f"{path}: {type(value).__name__} is not a JSON type", f"sent as its {sent}", "convert it")
    if raw:
        return bytes(value).decode("utf-8", "replace")
    return _jsonable(_safe_text(value, iso), path, notes, depth, active)


def _jsonable_container(value: Any, path: str, notes: List[str] | None, depth: int, active: Set[int]) -> Any:
    kind, ident = type(value).__name__, id(value)
    if ident in active:
        _change(notes, f"{_short(path)}: contains itself", "cut there", "send a copy without the back-reference")
        return "[cycle]"
    if depth >= MAX_JSON_DEPTH:
        _change(notes, f"{_short(path)}: nested more than {MAX_JSON_DEPTH} levels", "cut there", "flatten it")
        return "[nested too deeply]"
    active.add(ident)
    depth += 1
    try:
        if not isinstance(value, Mapping):
            if not isinstance(value, (list, tuple)):
                _change(notes, f"{path}: {kind} is not a JSON type", "sent as an array", "convert it")
                value = sorted(value, key=_safe_repr)
            return [_jsonable(item, f"{path}[{i}]", notes, depth, active) for i, item in enumerate(value)]
        out: JsonObject = {}
        taken = set(value)  # a name given out is well-formed text: never another key
        for key, item in value.items():
            if isinstance(key, str) and not _has_surrogates(key):
                name = str.__str__(key)  # a subclass's __str__ may raise
            elif isinstance(key, str):
                shown = _short(repr(_well_formed(key)), 40)
                text = _jsonable(str.__str__(key), f"{path}: key {shown}", notes)
                name = _free_name(text, taken)
                if name != text:
                    _change(notes, f"{path}: key {shown} would collide with another", f"sent as {name!r}", "")
            else:
                if key is None or isinstance(key, (bool, float)):
                    name = json.dumps(_jsonable(key, "key", []))
                else:
                    name = _int_text(int.__int__(key)) if isinstance(key, int) else _well_formed(_safe_text(key))
                sent = "sent as its text"
                if name in taken:
                    name = _free_name(f"{name} ({type(key).__name__})", taken)
                    sent = f"its text is taken: sent as {name!r}"
                _change(notes, f"{path}: key {_short(_safe_repr(key), 40)} is not a string", sent, "use string keys")
            taken.add(name)
            out[name] = _jsonable(item, f"{path}.{name}", notes, depth, active)
        return out
    except _Unsendable:
        raise
    except Exception as exc:  # noqa: BLE001
        _change(notes, f"{_short(path)}: reading its {kind} raised {type(exc).__name__}",
                "cut there", "send plain dicts and lists")
        return f"[unreadable {kind}]"
    finally:
        active.discard(ident)


def _unsendable(value: Any, path: str) -> str | None:
    try:
        _jsonable(value, path, None)
    except _Unsendable as exc:
        return str(exc)
    return None


def _free_name(name: str, taken: Set[str]) -> str:
    base, n = name, 2
    while name in taken:
        name, n = f"{base} {n}", n + 1
    return name


def _copied(mapping: Mapping[Any, Any]) -> Any:
    try:
        return dict(mapping)
    except Exception:  # noqa: BLE001
        return mapping


def _int_text(number: int) -> str:  # str() without its digit limit (640 at the least)
    if number < 0:
        return "-" + _int_text(-number)
    if number.bit_length() < 2000:
        return str(number)
    half = number.bit_length() * 30103 // 200000  # half its digits
    high, low = divmod(number, 10 ** half)
    return _int_text(high) + _int_text(low).zfill(half)


def _safe_text(value: Any, method: Callable[[], Any] | None = None) -> str:
    try:
        return str(value if method is None else method())
    except Exception:  # noqa: BLE001
        return _safe_repr(value) if method is None else _safe_text(value)


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__}>"


# ----------------------------------------
# Start-up settings

def check_run_timeout(run_timeout_s: Any) -> float:
    """``run_timeout_s`` as a float in (0, 1800] (§7.3 kit-run-timeout-range)."""
    if isinstance(run_timeout_s, bool) or not isinstance(run_timeout_s, (int, float)) or not (
            0 < run_timeout_s <= MAX_RUN_TIMEOUT_S):
        raise ValueError(f"run_timeout_s must be a number in (0, {MAX_RUN_TIMEOUT_S:g}], got {run_timeout_s!r}")
    return float(run_timeout_s)


def parse_proxy_hosts(text: str | None) -> Tuple[str, ...] | None:
    """The allow-list in ``text`` (``".pipelines.tech, 127.0.0.1:8080"``; §7.1 kit-proxy-host-allow-list)."""
    if text is None:
        return None
    entries = tuple(map(_normal_host_entry, filter(None, map(str.strip, text.split(",")))))
    if not entries:
        raise ValueError(f"the proxy host allow-list is set but empty ({text!r}): name hosts or unset it")
    return entries


def _normal_host_entry(entry: str) -> str:
    shown = _short(entry, 100)
    if entry.startswith("*."):
        entry = entry[1:]
    if entry.count(":") > 1 and not entry.startswith("["):  # a bare IPv6 address
        import ipaddress

        with contextlib.suppress(ValueError):
            return str(ipaddress.IPv6Address(entry))
    elif re.fullmatch(_HOST_ENTRY, entry) and ((port := _split_host_entry(entry)[1]) is None or 0 < port < 65536):
        return entry.lower()
    raise ValueError(f"proxy host {shown!r} must be a host name, IP or .suffix [:port], without scheme or path")


# ----------------------------------------
# Context binding: the running dispatch's envelope

_current: contextvars.ContextVar[Envelope | None] = contextvars.ContextVar("pipelines_port_envelope", default=None)


@contextlib.contextmanager
def bind_envelope(envelope: Envelope) -> Iterator[Envelope]:
    """Bind ``envelope`` to this context (thread or task) for the ``with`` block."""
    _check_envelope(envelope)
    token = _current.set(envelope)
    try:
        yield envelope
    finally:
        _current.reset(token)


def current_envelope() -> Envelope:
    """The envelope bound here, else the ``PIPELINES_*`` environment's (§5 child-env-explicit)."""
    if (envelope := _current.get()) is not None:
        return envelope
    if (os.environ.get(ENV_RUN_TOKEN) or "").strip():
        return Envelope.from_env()
    raise EnvelopeError(f"no dispatch envelope is bound here and {ENV_RUN_TOKEN} is not set: use bind_envelope()")

# ----------------------------------------
# Event loops for blocking callers

_server_loop: contextvars.ContextVar[Any] = contextvars.ContextVar("pipelines_port_server_loop", default=None)


def _start_loop() -> Any:
    import asyncio

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="pipelines-loop", daemon=True).start()
    return loop


_loop_thread = _Once(_start_loop)
if hasattr(os, "register_at_fork"):  # a forked child has no such thread
    os.register_at_fork(after_in_child=lambda: setattr(_loop_thread, "_value", None))


# on this thread's server loop, else the module's; an interrupted wait cancels it
def _on_loop(coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
    import asyncio
    import concurrent.futures

    loop, running = _server_loop.get(), asyncio._get_running_loop()
    if loop is None or not loop.is_running() or running is loop:
        loop = _loop_thread()
    try:
        if running is loop:
            try:
                return cast(_T, _on_fresh_thread(functools.partial(asyncio.run, coroutine), timeout))
            except _AgentRaised as raised:
                error = raised.error
            raise error  # outside the except: no _AgentRaised as its context
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        except RuntimeError:  # the server's loop closed after the check
            future = asyncio.run_coroutine_threadsafe(coroutine, _loop_thread())
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise
    except (_Overran, concurrent.futures.TimeoutError):
        raise TimeoutError(f"no result within {timeout:g} s") from None

# ----------------------------------------
# Transport: HTTP/1.1 on asyncio streams, keep-alive connections pooled per loop

class _TransportFailure(Exception):  # no usable reply (why: __cause__)
    pass


class _StaleConnection(_TransportFailure):  # a reused connection was closed before replying
    pass


class _ReplyTooLarge(Exception):
    def __init__(self, status: int, cap: int, length: int | None = None):
        self.status = status
        super().__init__(f"{f'is {length} bytes, over' if length else 'exceeds'} the {cap}-byte cap")


def _malformed(what: str, text: Any = "") -> ConnectionError:
    return ConnectionError(f"malformed HTTP reply: {what} {_short(repr(text), 80) if text else ''}".rstrip())


class _ClientConnection:
    __slots__ = ("reader", "writer", "idle_since", "received")  # received: a drop before it is a stale connection

    def __init__(self, reader: Any, writer: Any):
        self.reader, self.writer, self.idle_since, self.received = reader, writer, 0.0, False

    @property
    def closed(self) -> bool:
        return bool(self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        self.writer.close()

    # one reply, RFC 9112 framing, 1xx skipped; malformed: ConnectionError
    async def reply(self, max_reply: int) -> Tuple[int, HeaderFields, bytes, bool]:
        reader, self.received = self.reader, False
        while True:
            head = (await reader.readuntil(b"\r\n\r\n"))[:-4].decode("latin-1")
            self.received = True
            lines = head.replace("\r\n ", " ").replace("\r\n\t", " ").split("\r\n")  # obs-fold: a space
            version, _, code = lines[0].partition(" ")
            code = code[:3]
            if not version.startswith("HTTP/1.") or len(code) < 3 or not code.isdecimal() or code == "101":
                raise _malformed("status line", lines[0])
            status = int(code)
            if not 100 <= status < 200:
                break
        reply_headers: HeaderFields = []
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name.strip():
                raise _malformed("header line", line)
            reply_headers.append((name.strip(), value.strip()))
        lowered = _lower_headers(reply_headers)
        connection = set(map(str.strip, lowered.get("connection", "").lower().split(",")))
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        coding = lowered.get("transfer-encoding")
        reply = bytearray()
        if status in (204, 304):
            pass
        elif coding is not None and coding.split(",")[-1].strip().lower() == "chunked":
            while True:
                size_line = (await reader.readuntil(b"\r\n"))[:-2]
                size_text = size_line.split(b";", 1)[0].strip()
                if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                    raise _malformed("chunk size", size_line)
                size = int(size_text, 16)
                if len(reply) + size > max_reply:
                    raise _ReplyTooLarge(status, max_reply)
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                        pass
                    break
                chunk = await reader.readexactly(size + 2)
                if chunk[-2:] != b"\r\n":
                    raise _malformed("chunk longer than its size")
                reply += chunk[:-2]
        elif coding is None and "content-length" in lowered:
            length = _content_length(lowered["content-length"])
            if length is None or _repeated(lowered, "content-length", conflicting=True):
                raise _malformed("Content-Length", lowered["content-length"])
            if length > max_reply:
                raise _ReplyTooLarge(status, max_reply, length)
            reply += await reader.readexactly(length)
        else:  # the connection's end frames the body (RFC 9112 §6.3)
            keep_alive = False
            while chunk := await reader.read(1 << 16):
                if len(reply) + len(chunk) > max_reply:
                    raise _ReplyTooLarge(status, max_reply)
                reply += chunk
        if reader._buffer:  # bytes past the reply's end: nothing asked for them
            keep_alive = False
        return status, reply_headers, bytes(reply), keep_alive


class _Pool:  # one loop's idle connections
    def __init__(self, loop: Any, max_idle: int, idle_s: float):
        import weakref

        self._loop = weakref.proxy(loop)
        self._max_idle, self._idle_s = max_idle, idle_s
        self._idle: Dict[Tuple[str, str, int], List[_ClientConnection]] = {}
        self._reaper: Any = None

    def take(self, key: Tuple[str, str, int]) -> _ClientConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and self._loop.time() - conn.idle_since < self._idle_s:
                return conn
            conn.close()
        return None

    def give(self, key: Tuple[str, str, int], conn: _ClientConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if conn.closed or len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        idle.append(conn)
        if self._reaper is None:  # in a context of its own: it must not keep a dispatch's envelope alive
            self._reaper = contextvars.Context().run(self._loop.create_task, self._reap())

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        if self._reaper is not None:
            self._reaper.cancel()

    # closes stale idle ones; all as asyncio.run() ends the loop (they would keep it alive)
    async def _reap(self) -> None:
        import asyncio

        try:
            while any(self._idle.values()):
                await asyncio.sleep(self._idle_s / 2)
                cutoff = self._loop.time() - self._idle_s
                for conns in self._idle.values():
                    for conn in list(conns):
                        if conn.closed or conn.idle_since <= cutoff:
                            conn.close()
                            conns.remove(conn)
        except asyncio.CancelledError:
            self.close()
            raise
        finally:
            self._reaper = None


class _Transport:  # every outbound call's I/O
    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        import weakref

        self._ssl_context = ssl_context
        self._pools: weakref.WeakKeyDictionary[Any, _Pool] = weakref.WeakKeyDictionary()

    def _pool(self, loop: Any) -> _Pool:
        # made on its loop's thread: no race; idle 60 s at most (AWS ALB's)
        return self._pools.get(loop) or self._pools.setdefault(
            loop, _Pool(loop, max(64, min(4096, default_max_connections() // 2)), 60.0))

    def close(self) -> None:  # each pool on its loop's thread
        import asyncio

        for loop, pool in list(self._pools.items()):
            if asyncio._get_running_loop() is loop or not loop.is_running():
                pool.close()
            else:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(pool.close)

    def exchange(self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes, timeout: float,
                 max_reply: int) -> _Reply:
        import asyncio
        import concurrent.futures

        try:  # the margin is for a stopped loop
            return _on_loop(self.aexchange(base, method, path, headers, body, timeout, max_reply), timeout + 5.0)
        except (TimeoutError, asyncio.CancelledError, concurrent.futures.CancelledError) as exc:
            raise _TransportFailure() from exc

    # base: the split URL; timeout bounds it all by cancelling this task (cheaper than wait_for)
    async def aexchange(self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes,
                        timeout: float, max_reply: int) -> _Reply:
        import asyncio

        if problem := _header_problem(headers):
            raise ValueError(problem)
        loop = asyncio.get_running_loop()
        scheme, host = base.scheme.lower(), base.hostname
        default_port = 443 if scheme == "https" else 80
        port = base.port or default_port
        key = (scheme, host, port)
        started = loop.time()
        try:
            named = host if host.isascii() else host.encode("idna").decode("ascii")
            fields = "\r\n".join((*map(": ".join, headers.items()), f"Content-Length: {len(body)}"))
            request = (f"{method} {path} HTTP/1.1\r\nHost: {f'[{named}]' if ':' in named else named}"
                       f"{'' if port == default_port else f':{port}'}\r\n".encode("ascii")
                       + fields.encode("latin-1") + b"\r\n\r\n" + body)
        except UnicodeError as exc:
            raise _TransportFailure() from exc
        where = f"{host}:{port}{path.split('?')[0]}" if _log.isEnabledFor(10) else ""  # no query: keys
        if where:
            shown = ""  # secrets redacted; of the rest only the key and actor
            for name, value in headers.items():
                if (lower := name.lower()) in _SECRET_HEADERS or lower in ("idempotency-key", "x-pipelines-actor-id"):
                    shown += f", {name}: {_REDACTED if lower in _SECRET_HEADERS else value}"
            _log.debug("-> %s %s (%d bytes%s)", method, where, len(body), shown)
        pool = self._pool(loop)
        conn = pool.take(key)
        reused = conn is not None
        task = cast(Any, asyncio.current_task())
        expired: List[bool] = []
        timer = loop.call_at(started + timeout, lambda: expired.append(task.cancel()))
        try:
            if conn is None:
                conn = await self._connect(scheme, host, port)
            conn.writer.write(request)
            status, reply_headers, reply, keep_alive = await conn.reply(max_reply)
        except BaseException as exc:  # EOFError: IncompleteReadError
            received = conn is not None and conn.received
            if conn is not None:  # what is left of the reply must not meet the next request
                conn.writer.transport.abort()
            if isinstance(exc, asyncio.CancelledError) and expired and _uncancel(task) == 0:
                what = "connection" if conn is None else "complete reply"
                raise _TransportFailure() from TimeoutError(f"timed out: no {what} within {timeout:g} s")
            if isinstance(exc, EOFError):
                cut = "before the reply was complete" if received else "before replying"
                exc = ConnectionResetError(f"the proxy closed the connection {cut}")
            elif isinstance(exc, asyncio.LimitOverrunError):
                exc = _malformed("a line over 64 KiB")
            elif isinstance(exc, ConnectionError) and exc.errno:  # not asyncio's "Connect call failed (...)"
                exc = type(exc)(exc.errno, os.strerror(exc.errno))
            elif not isinstance(exc, (OSError, UnicodeError)):  # UnicodeError: a host IDNA refuses
                raise
            raise (_StaleConnection if reused and not received else _TransportFailure)() from exc
        finally:
            timer.cancel()
        if keep_alive:  # give() closes a closed one
            pool.give(key, conn)
        else:
            conn.close()
        if where:
            _log.debug("<- %s %s HTTP %d (%d bytes) in %.1f ms", method, where, status, len(reply),
                       (loop.time() - started) * 1000)
        return status, reply_headers, reply

    async def _connect(self, scheme: str, host: str, port: int) -> _ClientConnection:
        import asyncio

        context = (self._ssl_context or _default_tls_context()) if scheme == "https" else None
        return _ClientConnection(*await asyncio.open_connection(host, port, ssl=context))


_SECRET_HEADERS = frozenset({"authorization", "x-pipelines-run-token", "x-api-key", "api-key", "proxy-authorization"})


def _uncancel(task: Any) -> int:  # before 3.11, 0: a cancel as the deadline fires counts as the timeout
    return cast(int, task.uncancel()) if hasattr(task, "uncancel") else 0


@functools.cache
def _default_tls_context() -> ssl.SSLContext:  # one per process: loading the CAs is slow
    import ssl

    return ssl.create_default_context()


_shared_transport = _Once(_Transport)  # each ProxyClient has its own

# ----------------------------------------
# Proxy client (§3): tool calls, trace events, actors

if TYPE_CHECKING:
    _Reply = Tuple[int, HeaderFields, bytes]  # status, headers, body
    _Payload = Optional[Mapping[str, Any]]
    _Accepted = Optional[Dict[str, Any]]  # {"accepted": true, "sequence": N}


def _blocking(coroutine: Coroutine[Any, Any, _T]) -> _T:  # run here: it must not suspend
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(_T, done.value)
    coroutine.close()
    raise RuntimeError("a blocking call awaited something pending")


def _retry_loop(send: Callable[[], _Reply], interpret: Callable[[int, HeaderFields, bytes], ProxyOutcome],
                *, sleep: Callable[[float], Any], **options: Any) -> Any:
    return _blocking(_aretry_loop(send, interpret, sleep=lambda s: sleep(s) and None, **options))  # never awaited


# The one driver of RetryState (§3.3); transport_error names a failure without a reply
async def _aretry_loop(send: Callable[[], Any], interpret: Callable[[int, HeaderFields, bytes], ProxyOutcome],
                       *, policy: RetryPolicy, sleep: Callable[[float], Any],
                       transport_error: Callable[[BaseException], PipelinesError]) -> Any:
    state = RetryState(policy)
    while True:
        try:
            outcome = interpret(*await _awaited(send()))
        except _TransportFailure as failure:
            import socket
            import ssl

            cause = failure.__cause__ or failure
            error = transport_error(cause)
            error.__cause__ = cause
            outcome = ProxyOutcome("error" if isinstance(cause, (socket.gaierror, ssl.SSLCertVerificationError))
                                   else "transport", error=error,
                                   stale=isinstance(failure, _StaleConnection))
        step = state.step(outcome)
        if step.action == "return":
            return step.value
        if step.action == "raise":
            raise cast(PipelinesError, step.error)
        if outcome.stale:
            _log.info("%s (a stale connection); retrying", step.error)
        else:
            _log.warning("%s; retry %d in %.2f s", step.error, state.attempts, step.wait_s or 0.0)
        if step.wait_s is not None:
            await _awaited(sleep(step.wait_s))


async def _awaited(value: Any) -> Any:  # the value, or an awaitable's result
    return await value if hasattr(value, "__await__") else value


def _failed_before_reply(what: str, cause: BaseException) -> str:
    kind = type(cause).__name__
    return f"{what} failed before a reply arrived: {kind}: {_short(str(cause) or kind, 200)}"


def _env_float(name: str, default: float) -> float:
    text = (os.environ.get(name) or "").strip()
    with contextlib.suppress(ValueError):
        if 0 <= (value := float(text or default)) < math.inf:
            return value
    raise PipelinesError(f"environment variable {name} must be a non-negative number, got {_short(text, 40)!r}")


class _Pacer:  # §7.4 kit-pacing: at most limit requests per run token in any window_s
    def __init__(self, limit: int, window_s: float = 60.0):
        self.limit, self.window_s = limit, window_s
        self._log: OrderedDict[str, Deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def reserve(self, key: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            log = self._log[key] = self._log.pop(key) if key in self._log else deque(maxlen=self.limit)
            if len(self._log) > 4096:
                self._log.popitem(last=False)
            slot = now if len(log) < self.limit else max(now, log[0] + self.window_s)
            log.append(slot)
        if slot > now:
            _log.info("pacing proxy calls under %d/min: waiting %.2f s", self.limit, slot - now)
        return slot - now


class _DispatchStats:  # a dispatch's proxy calls, for its log line; cancelled: the run is over
    def __init__(self) -> None:
        self.proxy_calls, self.cancelled, self.lock = 0, False, threading.Lock()


_dispatch_stats: contextvars.ContextVar[_DispatchStats | None] = contextvars.ContextVar(
    "pipelines_port_dispatch_stats", default=None)


class ProxyClient:
    """The per-run proxy's client (§3, §7.4); ``timeout`` and ``rate_per_minute`` default to ``PIPELINES_PROXY_*``."""

    def __init__(self, *, timeout: float | None = None, retry: RetryPolicy = RetryPolicy(),
                 rate_per_minute: float | None = None, ssl_context: ssl.SSLContext | None = None,
                 sleep: Callable[[float], Any] | None = None) -> None:
        self.timeout = _env_float(ENV_PROXY_TIMEOUT_S, DEFAULT_PROXY_TIMEOUT_S) if timeout is None else float(timeout)
        if not self.timeout > 0:
            where = f"environment variable {ENV_PROXY_TIMEOUT_S}" if timeout is None else "timeout"
            raise PipelinesError(f"{where} must be a positive number of seconds, got {self.timeout:g}")
        if rate_per_minute is None:
            rate_per_minute = _env_float(ENV_PROXY_RATE_PER_MINUTE, RATE_LIMIT_PER_MINUTE)
        self.retry, self._sleep, self._transport = retry, sleep, _Transport(ssl_context)
        self._pacer = _Pacer(int(rate_per_minute)) if rate_per_minute >= 1 else None

    def call(self, envelope: Envelope, name: str, args: _Payload = None, *, actor: str | None = None,
             timeout: float | None = None, idempotency_key: str | None = None, errors: str = "raise") -> Any:
        """Call tool ``name``: the unwrapped ``response`` (§3.2); ``errors="return"``: §7.4 kit-errors-return."""
        return _blocking(self._call(envelope, name, args, actor, timeout, idempotency_key, errors, True))

    async def acall(self, envelope: Envelope, name: str, args: _Payload = None, *, actor: str | None = None,
                    timeout: float | None = None, idempotency_key: str | None = None, errors: str = "raise") -> Any:
        return await self._call(envelope, name, args, actor, timeout, idempotency_key, errors, False)

    def trace(self, envelope: Envelope | None, event_type: str, payload: _Payload = None, *,
              actor: str | None = None, timeout: float | None = None, best_effort: bool = False) -> _Accepted:
        """Post a live trace event (§3.4; ``envelope`` None: the bound one); ``best_effort``: a failure logged."""
        return _blocking(self._trace(envelope, event_type, payload, actor, timeout, best_effort, True))

    async def atrace(self, envelope: Envelope | None, event_type: str, payload: _Payload = None, *,
                     actor: str | None = None, timeout: float | None = None, best_effort: bool = False) -> _Accepted:
        return await self._trace(envelope, event_type, payload, actor, timeout, best_effort, False)

    def close(self) -> None:
        """Close the idle keep-alive connections."""
        self._transport.close()

    async def aclose(self) -> None:
        self.close()

    # seams: a subclass overrides them to observe or change the wire

    def exchange(self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes, timeout: float,
                 max_reply: int) -> _Reply:
        """One HTTP exchange with the proxy (``base``: its split URL)."""
        return self._transport.exchange(base, method, path, headers, body, timeout, max_reply)

    async def aexchange(self, base: Any, method: str, path: str, headers: Mapping[str, str], body: bytes,
                        timeout: float, max_reply: int) -> _Reply:
        return await self._transport.aexchange(base, method, path, headers, body, timeout, max_reply)

    def interpret(self, status: int, headers: HeadersLike, body: bytes, *, tool_name: str,
                  run_token: str | None = None) -> ProxyOutcome:
        """What one proxy reply means: :func:`interpret_reply`."""
        return interpret_reply(status, headers, body, tool_name=tool_name, run_token=run_token)

    # one coroutine for both drivers: under call() and trace() nothing suspends

    async def _call(self, envelope: Envelope, name: str, args: Any, actor: str | None, timeout: float | None,
                    idempotency_key: str | None, errors: str, blocking: bool) -> Any:
        try:
            if errors not in ("raise", "return"):
                raise ValueError("errors must be 'raise' or 'return'")
            _check_envelope(envelope)
            request = tool_call_request(envelope.proxy_url, envelope.run_token, name, args, actor=actor,
                                        idempotency_key=idempotency_key)
            if label := request.headers.get(HEADER_ACTOR_ID):
                _warn_if_undeclared(envelope, label)
            return await self._retried(envelope, request, timeout, blocking)
        except ProxyError as exc:
            return _call_failed(exc, name, errors)

    async def _trace(self, envelope: Envelope | None, event_type: str, payload: _Payload, actor: str | None,
                     timeout: float | None, best_effort: bool, blocking: bool) -> _Accepted:
        try:
            _check_envelope(envelope := envelope or current_envelope())
            now = time.time()
            request = trace_request(envelope.proxy_url, envelope.run_token, event_type, payload, actor=actor,
                                    occurred_at=time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(now))
                                    + f"{int(now % 1 * 1000):03d}Z")
            result = await self._retried(envelope, request, timeout, blocking)
            return result if isinstance(result, dict) else None
        except (ProxyError, EnvelopeError) as exc:
            if not best_effort:
                raise
            _log.warning("trace event %r not recorded: %s", event_type, exc)
        return None

    async def _retried(self, envelope: Envelope, request: ProxyRequest, timeout: float | None, blocking: bool) -> Any:
        name, pacer, stats = request.name, self._pacer, _dispatch_stats.get() or _DispatchStats()
        seconds = self.timeout if timeout is None else float(timeout)
        exchange = self.exchange if blocking else self.aexchange
        sleep = self._sleep or (time.sleep if blocking else sys.modules["asyncio"].sleep)  # a loop runs: it is loaded
        pause = (lambda s: sleep(s) and None) if blocking else sleep  # no loop to await
        with stats.lock:
            stats.proxy_calls += 1

        async def send() -> Any:
            if stats.cancelled:  # before every attempt: no retry runs a tool late
                raise ProxyError(f"proxy call {name!r} refused: its dispatch overran its run_timeout_s", tool_name=name)
            if pacer is not None and (wait := pacer.reserve(envelope.run_token)) > 0:
                await _awaited(pause(wait))
            return await _awaited(exchange(request.url, "POST", request.path, request.headers, request.body, seconds,
                                           MAX_REPLY_BYTES))

        try:
            return await _aretry_loop(
                send, functools.partial(self.interpret, tool_name=name, run_token=envelope.run_token),
                policy=self.retry, sleep=pause, transport_error=lambda cause: ProxyTransportError(
                    _failed_before_reply(f"proxy call {name!r}", cause), tool_name=name))
        except _ReplyTooLarge as big:
            raise ProxyError(f"proxy reply to {name!r} {big}", status_code=big.status, tool_name=name) from None


def _check_envelope(envelope: Any) -> None:
    if not isinstance(envelope, Envelope):
        raise TypeError(f"envelope must be an Envelope, got {type(envelope).__name__}")


def _call_failed(exc: ProxyError, name: str, errors: str) -> JsonObject:
    if errors == "raise" or isinstance(exc, StaleRunTokenError):  # a stale token: the run is over
        raise exc
    _log.info("tool %r failed, returned to the agent: %s", name, exc)
    return exc.to_value()


@functools.lru_cache(maxsize=4096)  # once per run and label
def _warn_undeclared(label: str, catalog: Tuple[str, ...], *run: Any) -> None:
    _log.warning("actor label %r is undeclared: not in this run's sub_agents %s", label, list(catalog))


def _warn_if_undeclared(envelope: Envelope, label: str) -> None:
    catalog = envelope.sub_agents
    if catalog and label not in catalog and label.rsplit("/", 1)[-1] not in catalog:
        _warn_undeclared(label, catalog, envelope.run_id, envelope.run_token_jti, envelope.proxy_url)


_default_client = _Once(ProxyClient)


def set_default_client(client: ProxyClient) -> ProxyClient:
    """Make ``client`` the one used when none is passed; returns the one it replaces."""
    if not isinstance(client, ProxyClient):
        raise TypeError(f"set_default_client() needs a ProxyClient, got {type(client).__name__}")
    previous = _default_client()
    _default_client._value = client
    return previous


def proxy_call(name: str, args: _Payload = None, *, envelope: Envelope | None = None, actor: str | None = None,
               timeout: float | None = None, idempotency_key: str | None = None, errors: str = "raise",
               client: ProxyClient | None = None) -> Any:
    """:meth:`ProxyClient.call` for ``envelope`` or the one bound here."""
    return (client or _default_client()).call(envelope or current_envelope(), name, args, actor=actor,
                                              timeout=timeout, idempotency_key=idempotency_key, errors=errors)


async def aproxy_call(name: str, args: _Payload = None, **options: Any) -> Any:
    """:func:`proxy_call` on the running loop, with its options."""
    return await (options.pop("client", None) or _default_client()).acall(
        options.pop("envelope", None) or current_envelope(), name, args, **options)


class Actor:
    """Calls and trace events as one sub-agent (§3.5); each method takes its module function's options."""

    __slots__ = ("label", "_envelope", "_client")

    def __init__(self, label: str, *, envelope: Envelope | None = None, client: ProxyClient | None = None):
        normalised = validate_actor_label(label)
        if not normalised:
            raise ProxyRequestError("actor label must not be empty", error_class="actor_id_invalid")
        self.label, self._envelope, self._client = normalised, envelope, client
        if envelope is not None:
            _warn_if_undeclared(envelope, normalised)

    def _options(self, options: Dict[str, Any], actor: bool = True) -> Dict[str, Any]:
        return {"envelope": self._envelope, "client": self._client, **({"actor": self.label} if actor else {}),
                **options}

    def call(self, name: str, args: _Payload = None, **options: Any) -> Any:
        """:func:`proxy_call` as this actor."""
        return proxy_call(name, args, **self._options(options))

    async def acall(self, name: str, args: _Payload = None, **options: Any) -> Any:
        return await aproxy_call(name, args, **self._options(options))

    def trace(self, event_type: str, payload: _Payload = None, **options: Any) -> _Accepted:
        """:func:`post_trace` as this actor."""
        return post_trace(event_type, payload, **self._options(options))

    async def atrace(self, event_type: str, payload: _Payload = None, **options: Any) -> _Accepted:
        return await apost_trace(event_type, payload, **self._options(options))

    def handoff_to(self, to_sub_agent: str, **options: Any) -> _Accepted:
        """:func:`post_handoff` from this actor to ``to_sub_agent``."""
        return post_handoff(self.label, to_sub_agent, **self._options(options, actor=False))

    async def ahandoff_to(self, to_sub_agent: str, **options: Any) -> _Accepted:
        return await apost_handoff(self.label, to_sub_agent, **self._options(options, actor=False))

    def actor(self, child: str) -> Actor:
        """A sub-actor one level down the call path (``parent/child``)."""
        return Actor(f"{self.label}/{child}", envelope=self._envelope, client=self._client)


def as_actor(label: str, *, envelope: Envelope | None = None, client: ProxyClient | None = None) -> Actor:
    """A handle whose calls carry ``X-Pipelines-Actor-Id: label``; validated now (§3.5)."""
    return Actor(label, envelope=envelope, client=client)


def post_trace(event_type: str, payload: _Payload = None, *, envelope: Envelope | None = None, actor: str | None = None,
               timeout: float | None = None, best_effort: bool = False, client: ProxyClient | None = None) -> _Accepted:
    """:meth:`ProxyClient.trace` for ``envelope`` or the one bound here."""
    return (client or _default_client()).trace(envelope, event_type, payload, actor=actor, timeout=timeout,
                                               best_effort=best_effort)


async def apost_trace(event_type: str, payload: _Payload = None, **options: Any) -> _Accepted:
    """:func:`post_trace` on the running loop, with its options."""
    return await (options.pop("client", None) or _default_client()).atrace(options.pop("envelope", None), event_type,
                                                                              payload, **options)


def post_handoff(from_sub_agent: str, to_sub_agent: str, *, reason: str | None = None,
                 payload_preview: str | None = None, **options: Any) -> _Accepted:
    """A ``handoff`` trace event (§3.4), a self-handoff dropped; ``options`` as for :func:`post_trace`."""
    event = _handoff(from_sub_agent, to_sub_agent, reason, payload_preview)
    return None if event is None else post_trace("handoff", event, **options)


async def apost_handoff(from_sub_agent: str, to_sub_agent: str, *, reason: str | None = None,
                        payload_preview: str | None = None, **options: Any) -> _Accepted:
    """:func:`post_handoff` on the running loop."""
    event = _handoff(from_sub_agent, to_sub_agent, reason, payload_preview)
    return None if event is None else await apost_trace("handoff", event, **options)


def _handoff(source: str, target: str, reason: str | None, payload_preview: str | None) -> _Accepted:
    event = handoff_event(source, target, reason=reason, payload_preview=payload_preview)
    if event is None:
        _log.info("dropping self-handoff %r -> %r", source, target)
    return event


ENV_STRICT = "PIPELINES_PORT_STRICT"


def build_response(value: Any, *, messages: Sequence[Mapping[str, Any]] | None = None,
                   metadata: Mapping[str, Any] | None = None, strict: bool | None = None) -> JsonObject:
    """The response envelope (§4, §7.7) for a result, warnings logged; ``strict`` (``ENV_STRICT``) raises."""
    return _built(value, messages=messages, metadata=metadata, strict=strict)


def _built(value: Any, *, messages: Sequence[Mapping[str, Any]] | None = None,
           metadata: Mapping[str, Any] | None = None, strict: bool | None = None,
           secrets: Sequence[str | None] = (), multi_turn: bool = False) -> JsonObject:
    # as the servers send it: no warning shows the secrets or the run token
    body, warnings = response_envelope(value, messages=messages, metadata=metadata, multi_turn=multi_turn,
                                       strict=_truthy(os.environ.get(ENV_STRICT)) if strict is None else strict)
    bound = _current.get()
    for warning in warnings:
        _log.warning("response: %s", redact(warning, *secrets, bound.run_token if bound else None))
    return body


# ----------------------------------------
# Running agents: sync on a fresh thread, async as a task, within a deadline

ENV_DEBUG = "PIPELINES_AGENT_SDK_DEBUG"
ENV_PROXY_ALLOWED_HOSTS = "PIPELINES_PROXY_ALLOWED_HOSTS"


class _Overran(RunTimeoutError):
    def __init__(self, timeout_s: float | None):
        super().__init__(f"agent did not finish within run_timeout_s={timeout_s:g} s")


class _AgentRaised(Exception):  # the agent's own, not a signal's
    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error


def _start_thread(fn: Callable[[], Any], done: Callable[[Tuple[Any, BaseException | None]], Any]) -> threading.Thread:
    def target() -> None:
        try:
            outcome: Tuple[Any, BaseException | None] = (fn(), None)
        except BaseException as exc:  # noqa: BLE001
            outcome = (None, _AgentRaised(exc))
        with contextlib.suppress(RuntimeError):  # loop closed
            done(outcome)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(target,), name="pipelines-agent",
                              daemon=True)
    thread.start()
    return thread


def _on_fresh_thread(fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
    outcome: List[Tuple[Any, BaseException | None]] = []
    _start_thread(fn, outcome.append).join(timeout_s)
    if not outcome:
        raise _Overran(timeout_s)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


class _RedactedError(Exception):
    pass


# exc's chain with no secret showing: each link cleaned, or replaced by a _RedactedError
def _redact_exception_chain(exc: BaseException | None, *secrets: str | None) -> BaseException | None:
    wanted = list(filter(None, secrets))
    seen: Dict[int, BaseException | None] = {}

    def clean(error: BaseException | None) -> BaseException | None:
        if error is None or not wanted or id(error) in seen:
            return seen.get(id(error), error)
        seen[id(error)] = error
        for name in (*vars(error), "args", "strerror", "filename", "filename2"):  # OSError's last
            with contextlib.suppress(Exception):
                value = getattr(error, name)
                setattr(error, name, tuple(redact(list(value), *wanted)) if type(value) is tuple else
                        redact(value, *wanted))
        for member in getattr(error, "exceptions", None) or ():
            if isinstance(member, BaseException):
                clean(member)
        error.__cause__, error.__context__ = clean(error.__cause__), clean(error.__context__)
        try:
            message = str(error)
            shown = f"{message}\n{error!r}"
        except Exception:  # noqa: BLE001
            message = shown = ""
        if redact(shown, *wanted) == shown:
            return error
        name = type(error).__name__
        stand_in = _RedactedError(f"{name}: {redact(message, *wanted)}" if message else name)
        stand_in.__cause__, stand_in.__context__ = error.__cause__, error.__context__
        stand_in.__suppress_context__ = error.__suppress_context__
        seen[id(error)] = stand_in.with_traceback(error.__traceback__)
        return stand_in

    return clean(exc)


def _call_agent(envelope: Envelope | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    with bind_envelope(envelope) if envelope is not None else contextlib.nullcontext():
        result = fn(*args, **kwargs)
        if hasattr(result, "__await__"):
            import asyncio

            result = asyncio.run(_awaited(result))
        return result


# agent(envelope) as a task or on a fresh thread: its result, _AgentRaised or _Overran
async def _run_agent(agent: Callable[..., Any], envelope: Envelope, timeout_s: float, is_async: bool) -> Any:
    import asyncio

    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    task: Any = None

    def settle(outcome: Tuple[Any, BaseException | None]) -> None:
        if not waiter.done():
            waiter.set_result(outcome[0]) if outcome[1] is None else waiter.set_exception(outcome[1])

    if is_async:
        async def run() -> None:
            _current.set(envelope)
            try:
                settle((await agent(envelope), None))
            except BaseException as exc:  # noqa: BLE001 - §7.3 kit-base-exception-500
                settle((None, _AgentRaised(exc)))

        task = loop.create_task(run())
    else:
        def run_sync() -> Any:
            _server_loop.set(loop)
            return _call_agent(envelope, agent, envelope)

        _start_thread(run_sync, lambda outcome: loop.call_soon_threadsafe(settle, outcome))
    timer = loop.call_later(timeout_s, settle, (None, _Overran(timeout_s)))
    try:
        return await waiter
    finally:
        timer.cancel()
        if task is not None:
            task.cancel()


def _without_run_token(body: JsonObject, envelope: Envelope, encoded: bytes) -> JsonObject:
    if envelope.run_token.encode() not in encoded:
        return body
    _log.warning("the run token in the agent's response was redacted")
    return redact(body, envelope.run_token)  # type: ignore[no-any-return]

# ----------------------------------------
# The dispatch app (§2): decide(), then probe the proxy or run the agent


class DispatchApp:
    """An agent at its endpoint (§2, §7.1): :meth:`ahandle`, WSGI, ASGI3."""

    def __init__(self, agent: Agent, *, path: str = DEFAULT_DISPATCH_PATH,
                 token: str | None = None, token_env: str | None = DEFAULT_TOKEN_ENV,
                 auth_header: str = "Authorization", no_auth: bool = False, max_body: int = DEFAULT_MAX_BODY_BYTES,
                 run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
                 tools_schema: Sequence[Any] | str | os.PathLike[str] | None = None,
                 proxy_hosts: Sequence[str] | str | None = None, strict: bool | None = None):
        if not callable(agent):
            raise TypeError(f"agent must be callable, got {type(agent).__name__}")
        for wrong, problem in (
                (not path.startswith("/"), f"path must start with '/', got {path!r}"),
                (no_auth and token, "no_auth=True contradicts a token: choose one"),
                (not (no_auth or token or token_env), "auth needs a token or a token_env, or no_auth=True"),
                (max_body < 1, f"max_body must be a positive number of bytes, got {max_body!r}"),
                (not re.fullmatch(r"[A-Za-z0-9-]+", auth_header),
                 f"auth_header must be an HTTP header name, got {auth_header!r}")):
            if wrong:
                raise ValueError(problem)
        self.run_timeout_s = check_run_timeout(run_timeout_s)
        self.agent, self.token, self.strict, self.no_auth = agent, token, strict, no_auth
        self.token_env = None if token else token_env  # kit-token-env-per-request
        if isinstance(tools_schema, (str, os.PathLike)):
            tools_schema = _read_tools_file(tools_schema)
        self.tools_schema: List[JsonObject] | None = None if tools_schema is None else _thaw(list(tools_schema))
        if self.tools_schema:
            convert_tools(self.tools_schema, "platform")  # checked; served as given
        if proxy_hosts is None:
            source, hosts = ENV_PROXY_ALLOWED_HOSTS, os.environ.get(ENV_PROXY_ALLOWED_HOSTS)
        else:
            source, hosts = "proxy_hosts", proxy_hosts if isinstance(proxy_hosts, str) else ",".join(proxy_hosts)
        try:
            allowed = parse_proxy_hosts(hosts)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        self.path, self.auth_header, self.max_body = path.rstrip("/") or "/", auth_header, int(max_body)
        self.endpoint = Endpoint(self.path, auth_header, self.token_env, no_auth, self.max_body, self.tools_schema,
                                 allowed)

    def describe_auth(self) -> str:
        """Auth, for a start-up line (never the token)."""
        if self.no_auth:
            return "DISABLED (no_auth): anyone can dispatch"
        bearer = "Bearer " if self.auth_header.lower() == "authorization" else ""
        line = f"{self.auth_header}: {bearer}<token> (token from {'token=' if self.token else f'${self.token_env}'})"
        unset = self.token_env and not os.environ.get(self.token_env)
        return line + (f"; {self.token_env} is NOT set: every request gets 503" if unset else "")

    def describe_proxy_hosts(self) -> str:
        """The allowed proxy hosts, for a start-up line."""
        hosts = self.endpoint.proxy_hosts
        return (f"any (no allow-list: set {ENV_PROXY_ALLOWED_HOSTS} or --proxy-hosts in production)" if hosts is None
                else ", ".join(hosts) or "none")

    def handle(self, method: str, target: str, headers: HeadersLike, body: bytes | None) -> HttpReply:
        """:meth:`ahandle` from a blocking thread."""
        return _on_loop(self.ahandle(method, target, headers, body))

    async def ahandle(self, method: str, target: str, headers: HeadersLike, body: bytes | None) -> HttpReply:
        """The reply to a request (``body`` as :func:`request_body_length` allowed), logged (kit-log-line)."""
        started, stats = time.monotonic(), _DispatchStats()
        try:
            headers = _lower_headers(headers)
            expected = None if self.no_auth else (self.token or os.environ.get(self.token_env or "") or "").strip()
            decision = decide(self.endpoint, method, target, headers, body, expected_token=expected)
            envelope, what = decision.envelope, decision.what
            if envelope:
                reply = await self.arun_agent(envelope, stats)
            elif decision.proxy_url:
                reply = await self.aconnectivity_check(decision.proxy_url)
            else:
                reply = cast(HttpReply, decision.reply)
            level = 10 if what in ("health", "ping") and reply.status < 400 else 20  # logging.DEBUG, logging.INFO
            if _access_log.isEnabledFor(level):
                ids = ((envelope.run_id, envelope.task_id, envelope.run_token_jti) if envelope else
                       (_header(headers, HEADER_RUN_ID), _header(headers, HEADER_TASK_ID),
                        _header(headers, HEADER_RUN_TOKEN_JTI)))
                if what != "dispatch" and reply.status >= 400:
                    what = "rejected: " + str(json.loads(reply.body).get("detail", ""))[:200]
                _access_log.log(
                    level, "%s %s status=%d run_id=%s task_id=%s jti=%s duration_ms=%.1f proxy_calls=%d%s", method,
                    urlsplit(target).path, reply.status, *ids, (time.monotonic() - started) * 1000, stats.proxy_calls,
                    "" if what == "dispatch" else f" ({what})")
            return reply
        except Exception as exc:  # noqa: BLE001
            _log.error("building the reply failed", exc_info=exc)
            name = type(exc).__name__.encode("ascii", "replace")  # json itself may be what failed
            body = b'{"detail":"internal error while building the reply: ' + name + b'"}'
            return HttpReply(500, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body)

    async def aconnectivity_check(self, proxy_url: str) -> HttpReply:
        """The reply to a connectivity check (§2 step 4, §3.7, kit-proxy-host-allow-list)."""
        probe = await aprobe_proxy(proxy_url)
        if self.endpoint.proxy_hosts is None and not probe["reachable"]:
            probe = {**dict.fromkeys(probe), "reachable": False, "error": "unreachable (no allow-list: no details)"}
        return json_reply(200, {"ok": True, "outbound": probe})

    @property
    def agent_is_async(self) -> bool:
        """Whether the agent is ``async def`` (through partials and ``__call__``)."""
        import inspect

        return inspect.iscoroutinefunction(self.agent) or inspect.iscoroutinefunction(type(self.agent).__call__)

    def run_agent(self, envelope: Envelope, stats: _DispatchStats | None = None) -> HttpReply:
        """:meth:`arun_agent` from a blocking thread."""
        return _on_loop(self.arun_agent(envelope, stats))

    async def arun_agent(self, envelope: Envelope, stats: _DispatchStats | None = None) -> HttpReply:
        """The reply to running the agent on ``envelope`` (§7.3)."""
        stats = stats or _DispatchStats()
        bound = _dispatch_stats.set(stats)
        secrets = self.secrets(envelope)
        try:
            result = await _run_agent(self.agent, envelope, self.run_timeout_s, self.agent_is_async)
            body = _built(result, strict=self.strict, secrets=secrets, multi_turn=envelope.is_multi_turn)
            reply = json_reply(200, body)
            clean = _without_run_token(body, envelope, reply.body)
            return reply if clean is body else json_reply(200, clean)
        except _Overran as overran:
            stats.cancelled = True
            _log.error("run %s: %s", envelope.run_id, overran)
            return error_reply(overran)
        except ResponseError as exc:
            return error_reply(ResponseError(redact(f"agent returned a value that cannot become a response: {exc}",
                                                    *secrets)))
        except Exception as exc:  # noqa: BLE001
            import traceback

            error = exc.error if isinstance(exc, _AgentRaised) else exc
            trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            _log.error("run %s: the agent raised:\n%s", envelope.run_id, redact(trace, *secrets))
            return error_reply(AgentError(describe_error(error, DETAIL_LIMIT, *secrets)))
        except BaseException:  # cancelled
            stats.cancelled = True
            _log.warning("run %s (jti %s) was cut by the shutdown", envelope.run_id, envelope.run_token_jti)
            raise
        finally:
            _dispatch_stats.reset(bound)

    def secrets(self, envelope: Envelope | None) -> Tuple[str | None, str | None]:
        """The run token and the agent token: no reply or log shows them."""
        return envelope.run_token if envelope else None, self.token or os.environ.get(self.token_env or "")

    def wsgi(self, environ: Dict[str, Any], start_response: Callable[..., Any]) -> List[bytes]:
        """The WSGI application (PEP 3333)."""
        from http import HTTPStatus

        headers = _lower_headers([(k.removeprefix("HTTP_").replace("_", "-"), v) for k, v in environ.items()
                                  if k.startswith("HTTP_") or (v and k in ("CONTENT_TYPE", "CONTENT_LENGTH"))])
        length = request_body_length(headers, self.max_body)
        body, need = bytearray(), length or 0
        while len(body) < need and (chunk := environ["wsgi.input"].read(min(need - len(body), 1 << 16))):
            body += chunk
        reply = self.handle(environ["REQUEST_METHOD"], environ.get("PATH_INFO") or "/", headers,
                            None if length is None else bytes(body))
        start_response(f"{reply.status} {HTTPStatus(reply.status).phrase}", reply.headers)  # PEP 3333: no Connection
        return [reply.body]

    async def __call__(self, scope: Dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        """The ASGI3 application (HTTP and lifespan)."""
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            raise ValueError(f"unsupported ASGI scope type {scope['type']!r}")
        headers = _lower_headers(scope.get("headers", []))
        length = request_body_length(headers, self.max_body)
        body, more = bytearray(), True
        while more and len(body) < (length or 0):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        reply = await self.ahandle(scope["method"], scope.get("path", "/"), headers,
                                   None if length is None else bytes(body))
        # kit-strict-request-head
        close = length is None or 400 <= reply.status < 500 or reply.status == 503
        sent = reply.headers + [("Connection", "close")] * close
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in sent]})
        await send({"type": "http.response.body", "body": reply.body})

    @property
    def asgi(self) -> Callable[..., Any]:
        """The ASGI3 application as an ``async def`` function."""
        async def asgi(scope: Dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            await self(scope, receive, send)  # three parameters: hosts count them

        return asgi


def probe_proxy(proxy_url: str, *, timeout: float = 10.0) -> JsonObject:
    """The §3.7 reachability probe, never raising: ``{reachable, status_code, latency_ms, error}``."""
    return _on_loop(aprobe_proxy(proxy_url, timeout=timeout))


async def aprobe_proxy(proxy_url: str, *, timeout: float = 10.0) -> JsonObject:
    """:func:`probe_proxy` on the running loop."""
    started, status = time.monotonic(), None
    try:
        request = proxy_request(validate_proxy_url(proxy_url, "the probe"), "fake-token", "tools",
                                "__reachability_probe__", b"{}")
        del request.headers["Idempotency-Key"], request.headers["Accept"]
        status = (await _shared_transport().aexchange(request.url, "POST", request.path, request.headers, request.body,
                                                      timeout, 1 << 16))[0]
        error = None if status in (401, 403) or 200 <= status < 300 else f"unexpected HTTP {status}"
    except (_TransportFailure, EnvelopeError, _ReplyTooLarge) as failure:
        status = getattr(failure, "status", None)
        cause = failure.__cause__ if isinstance(failure, _TransportFailure) else None
        error = describe_error(cause or failure, 200)
    return {"reachable": error is None, "status_code": status,
            "latency_ms": round((time.monotonic() - started) * 1000, 1), "error": error}

# ----------------------------------------
# Server adapters (WSGI, ASGI) and the built-in servers' settings


def wsgi_app(agent: Agent, **options: Any) -> Callable[..., List[bytes]]:
    """A WSGI application for ``agent``; ``options`` as for :class:`DispatchApp`."""
    return DispatchApp(agent, **options).wsgi


def asgi_app(agent: Agent, **options: Any) -> Callable[..., Any]:
    """An ASGI application for ``agent``; ``options`` as for :class:`DispatchApp`."""
    return DispatchApp(agent, **options).asgi


DEFAULT_READ_TIMEOUT_S = 30.0  # §7.1 kit-server-timeouts
DEFAULT_GRACE_S = 30.0
DEFAULT_KEEPALIVE_S = 75.0
SERVE_GC_THRESHOLD = 50_000  # CPython's 700 cost 25 % of the CPU in a fan-out


@functools.lru_cache(maxsize=64)
def _reply_head(status: int, second: int) -> str:  # the status line, Server and Date
    from http import HTTPStatus
    from wsgiref.handlers import format_date_time

    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nServer: pipelines-port/{__version__}\r\n"
            f"Date: {format_date_time(second)}")

# ----------------------------------------
# The built-in server: HTTP/1.1 on one asyncio loop, or a thread per connection


class _ServerConnection:
    transport: Any
    head: RequestHead | None = None
    headers: Mapping[str, str]
    length: int | None = 0  # of the body; None: unread, then a close
    task: Any = None
    deadline: float | None = None  # of the read or keep-alive timeout
    timer: Any = None  # due by the deadline, re-armed if early
    closing = eof = False
    jobs: Any = None  # server="threads": its thread's queue

    def __init__(self, server: AsyncDispatchServer):
        self.server, self.buffer = server, bytearray()

    def connection_made(self, transport: Any) -> None:
        self.transport, server = transport, self.server
        server.connections.add(self)
        if len(server.connections) <= server.max_connections:
            return self._arm(server.read_timeout_s)
        self._send(error_reply(OverloadedError(
            f"at the limit of {server.max_connections} open connections: retry shortly")), True)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._advance()
        elif len(self.buffer) > MAX_REQUEST_HEAD_BYTES:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        if self.task is None:
            self._advance()
        self.closing = self.task is None
        return not self.closing

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closing = True  # a running dispatch finishes unanswered
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.jobs is not None:
            self.jobs.put(None)

    def pause_writing(self) -> None:  # the transport buffers a reply
        pass

    resume_writing = pause_writing

    def _advance(self) -> None:
        buffer, server = self.buffer, self.server
        while self.task is None and not self.closing:
            if self.head is None:
                while buffer[:2] == b"\r\n":  # RFC 9112 §2.2
                    del buffer[:2]
                if not buffer:
                    return
                self._arm(server.read_timeout_s)
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    line_ended = buffer.find(b"\r\n", 0, MAX_REQUEST_LINE_BYTES + 2) >= 0
                    if b"\n\n" not in buffer and len(buffer) <= (
                            MAX_REQUEST_HEAD_BYTES if line_ended else MAX_REQUEST_LINE_BYTES):
                        return
                    end = len(buffer)  # a bare LF or past a limit: refused now
                try:
                    self.head = head = parse_request_head(bytes(buffer[:end]))
                except PipelinesError as exc:
                    _log.info("refused a request from %s: %s", self.transport.get_extra_info("peername"), exc)
                    return self._send(error_reply(exc), True)
                del buffer[:end + 4]
                self.headers = _lower_headers(head.headers)
                self.length = request_body_length(self.headers, server.app.max_body)
                if (self.length and len(buffer) < self.length
                        and self.headers.get("expect", "").lower() == "100-continue"):
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            need = self.length or 0
            if len(buffer) < need and not self.eof:
                return
            body = None if self.length is None else bytes(buffer[:need])
            del buffer[:need]
            head, self.head = self.head, None
            self.deadline = None
            if server.draining:
                self._send(error_reply(ShuttingDownError("server is shutting down: retry on another instance")), True)
            else:
                self.task = server.loop.create_task(self._run(head, body))
                server.tasks.add(self.task)

    async def _run(self, head: RequestHead, body: bytes | None) -> None:
        server = self.server
        try:
            reply = await server._answer(self, head, body)  # ahandle answers every Exception
        except BaseException:  # cancelled
            if not server.cutting:
                raise
            reply = error_reply(ShuttingDownError("shut down before this dispatch finished: retry it"))
        finally:
            server.tasks.discard(self.task)
            self.task = None
        self._send(reply, server.draining or self.eof or self.length is None or not head.keep_alive(), head)
        if not self.closing:
            self.transport.resume_reading()
            self._advance()

    def _send(self, reply: HttpReply, close: bool, request: RequestHead | None = None) -> None:
        if self.closing:
            return
        http10 = request is not None and request.version == "HTTP/1.0"
        head = "\r\n".join([_reply_head(reply.status, int(time.time())), *map(": ".join, reply.headers),
                          "Connection: close\r\n\r\n" if close else "Connection: keep-alive\r\n\r\n" if http10
                          else "\r\n"]).encode("latin-1")
        self.transport.write(head if request is not None and request.method == "HEAD" else head + reply.body)
        if close:
            self.cut()
        elif not self.buffer:
            self._arm(self.server.keepalive_s)

    def _arm(self, seconds: float) -> None:
        server = self.server
        due = server.loop.time() + seconds
        if self.deadline is None or self.deadline > due:  # only sooner: a trickled head gets no more time
            self.deadline = due
        if self.timer is None:
            self.timer = server.loop.call_later(min(seconds, server.read_timeout_s, server.keepalive_s),
                                                self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.deadline is None:
            return
        if (left := self.deadline - self.server.loop.time()) > 0:
            return self._arm(left)
        if not (self.buffer or self.head):
            return self.cut()
        self._send(error_reply(RequestTimeoutError(
            f"request incomplete after {self.server.read_timeout_s:g} s")), True)

    def cut(self) -> None:
        if self.task is None and not self.closing:  # a running dispatch gets the grace period
            self.closing = True
            self.transport.close()


def default_max_connections() -> int:
    """Open connections the built-in server takes: 10,000, or half the file limit."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # Windows
        return 1000
    return 10_000 if soft == resource.RLIM_INFINITY else max(16, min(10_000, (soft - 32) // 2))


class AsyncDispatchServer:
    """The built-in dispatch server: HTTP/1.1 on one asyncio loop, bound when made."""

    loop: Any = None
    draining = cutting = False
    _listener: Any = None
    _stop: Any
    _thread: threading.Thread | None = None

    def __init__(self, app: DispatchApp, host: str = "127.0.0.1", port: int = 8080, *,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 max_connections: int | None = None, backlog: int = 4096):
        import socket

        for name, value in (("read_timeout_s", read_timeout_s), ("keepalive_s", keepalive_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.app, self.read_timeout_s, self.keepalive_s = app, float(read_timeout_s), float(keepalive_s)
        self.max_connections = max_connections or default_max_connections()
        self.connections: Set[_ServerConnection] = set()
        self.tasks: Set[Any] = set()
        self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                           backlog=backlog)
        self.server_address: Tuple[Any, ...] = self.socket.getsockname()
        self._backlog, self._lock = backlog, threading.Lock()

    @property
    def url(self) -> str:
        host = str(self.server_address[0])
        return f"http://{f'[{host}]' if ':' in host else host}:{self.server_address[1]}{self.app.path}"

    @property
    def in_flight(self) -> int:
        """Dispatches and probes running now."""
        return len(self.tasks)

    def _answer(self, conn: _ServerConnection, head: RequestHead, body: bytes | None) -> Awaitable[HttpReply]:
        return self.app.ahandle(head.method, head.target, conn.headers, body)

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve on this thread, on a loop of its own, until :meth:`close`."""
        import asyncio

        try:
            asyncio.run(self._serve())
        finally:
            self.socket.close()

    async def _serve(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        with self._lock:
            if self.draining:  # close() came first
                return
            self._listener = await self.loop.create_server(
                functools.partial(_ServerConnection, self), sock=self.socket, backlog=self._backlog)
        await self._stop.wait()

    def close(self, grace_s: float = 5.0) -> bool:
        """:meth:`aclose` from any thread but the server's own."""
        import asyncio

        with self._lock:
            first, self.draining = not self.draining, True
        if first and self._listener is None:
            self.socket.close()
        elif first and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.aclose(grace_s), self.loop).result()
        if self._thread is not None:
            self._thread.join(10)
        return not self.cutting

    def shutdown(self) -> None:
        """:meth:`close` with no grace period."""
        self.close(0)

    server_close = shutdown

    async def aclose(self, grace_s: float = 5.0) -> bool:
        """Drain (§7.1 kit-server-timeouts) for up to ``grace_s``: True if no dispatch was cut."""
        import asyncio

        self.draining = True
        self._listener.close()
        for conn in self.connections:  # each closed later, by the loop
            conn.cut()
        pending = (await asyncio.wait(self.tasks, timeout=grace_s))[1] if self.tasks else set()
        if pending:
            self.cutting = True
            _log.warning("grace period of %g s over with %d dispatches still running: 503", grace_s, len(pending))
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=5)
        for conn in self.connections:
            conn.transport.close()
        self._stop.set()
        return not self.cutting


class _ThreadsServer(AsyncDispatchServer):
    async def _answer(self, conn: _ServerConnection, head: RequestHead, body: bytes | None) -> HttpReply:
        import asyncio

        if conn.jobs is None:
            import queue

            conn.jobs = queue.SimpleQueue()
            threading.Thread(target=_work, args=(conn.jobs,), daemon=True).start()
        future, headers = self.loop.create_future(), conn.headers
        conn.jobs.put(lambda: self.loop.call_soon_threadsafe(
            future.set_result, self.app.handle(head.method, head.target, headers, body)))
        try:
            return cast(HttpReply, await asyncio.shield(future))  # never cancelled: settable
        except BaseException:  # cut by a drain: the thread runs on
            run_id = _header(headers, HEADER_RUN_ID)
            with contextlib.suppress(ValueError, LookupError, TypeError):
                run_id = json.loads(body or b"{}")["run_id"]
            _log.warning("run %s was cut by the shutdown", _short(str(run_id), 40))
            raise


def _work(jobs: Any) -> None:
    for job in iter(jobs.get, None):
        with contextlib.suppress(RuntimeError):  # loop closed
            job()

# ----------------------------------------
# Starting a server: make_server, start_server, serve (signals, the drain)

def _raise_file_limit() -> None:
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


SERVERS = ("asyncio", "threads")


def make_server(agent: DispatchApp | Agent, *, host: str = "127.0.0.1", port: int = 8080,
                server: str = "asyncio", read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                keepalive_s: float = DEFAULT_KEEPALIVE_S, max_connections: int | None = None,
                **options: Any) -> AsyncDispatchServer:
    """A bound dispatch server, not yet serving; ``options`` as for :class:`DispatchApp`."""
    if server not in SERVERS:
        raise ValueError(f"server must be one of {', '.join(SERVERS)}, got {server!r}")
    app = agent if isinstance(agent, DispatchApp) else DispatchApp(agent, **options)
    if app is agent and options:
        raise TypeError(f"options {sorted(options)} need an agent, not a DispatchApp")
    if app.no_auth:
        _log.warning("auth is DISABLED: anyone can dispatch")
    return (AsyncDispatchServer if server == "asyncio" else _ThreadsServer)(
        app, host, port, read_timeout_s=read_timeout_s, keepalive_s=keepalive_s, max_connections=max_connections)


def start_server(agent: DispatchApp | Agent, *, host: str = "127.0.0.1", port: int = 0,
                 **options: Any) -> AsyncDispatchServer:
    """:func:`make_server`'s server, serving on a background thread."""
    server = make_server(agent, host=host, port=port, **options)
    server._thread = threading.Thread(target=server.serve_forever, name="pipelines-server", daemon=True)
    server._thread.start()
    return server


def serve(agent: DispatchApp | Agent, *, host: str = "127.0.0.1", port: int = 8080,
          grace_s: float = DEFAULT_GRACE_S, ready: Callable[[Any], None] | None = None,
          gc_threshold: int = SERVE_GC_THRESHOLD, **options: Any) -> int:
    """Serve until SIGTERM/SIGINT, then drain up to ``grace_s``: 0 if no dispatch was cut, else 1."""
    import gc
    import signal

    _raise_file_limit()
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = start_server(agent, host=host, port=port, **options)
        if gc_threshold > 0 and gc.isenabled():
            gc.freeze()  # the agent and its imports are never garbage
            first = gc.get_threshold()[0]
            gc.set_threshold(first and max(first, gc_threshold))
        if ready is not None:
            ready(server)
        while not stop.wait(0.5):
            pass
        _log.info("shutting down: draining for up to %g s", grace_s)
        if server.close(grace_s):
            return 0
        _log.warning("grace period over: exiting anyway")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

# ----------------------------------------
# Code mode (§5): the sandbox's run() entrypoint


def run_in_fresh_thread(fn: Callable[..., Any], *args: Any, envelope: Envelope | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a new thread with ``envelope`` bound, its run token kept out of errors."""
    envelope = envelope or _current.get()
    try:
        return _on_fresh_thread(functools.partial(_call_agent, envelope, fn, *args, **kwargs))
    except _AgentRaised as raised:
        error = raised.error
    raise cast(BaseException, _redact_exception_chain(error, envelope.run_token if envelope else None))


def _run_argument(value: str | None, argument: str, variable: str) -> str:
    if value is None and not (value := os.environ.get(variable, "")).strip():
        raise EnvelopeError(f"run() got no {argument}, and {variable} is not set")
    return value or ""


def code_mode(agent: Agent, *, strict: bool | None = None,
              run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> Callable[..., JsonObject]:
    """The sandbox entrypoint ``run(task_input, *, proxy_url, run_token) -> dict`` for ``agent`` (§5, §7.8)."""
    limit = check_run_timeout(run_timeout_s)

    def run(task_input: Mapping[str, Any] | None = None, *, proxy_url: str | None = None,
            run_token: str | None = None) -> JsonObject:
        if proxy_url is None and run_token is None and task_input is None:
            envelope = Envelope.from_env()
        else:
            envelope = Envelope.from_run(task_input, proxy_url=_run_argument(proxy_url, "proxy_url", ENV_PROXY_URL),
                                         run_token=_run_argument(run_token, "run_token", ENV_RUN_TOKEN))
        stats, token = _DispatchStats(), envelope.run_token
        bound = _dispatch_stats.set(stats)  # copied into the agent's thread
        try:
            result = _on_fresh_thread(functools.partial(_call_agent, envelope, agent, envelope), limit)
        except _AgentRaised as raised:
            error = raised.error
            failure = cast(BaseException, _redact_exception_chain(error, token))
            if isinstance(error, Exception) and not isinstance(error, PipelinesError):  # else: a stale token
                cause, failure = failure, AgentError(f"agent raised {describe_error(error, DETAIL_LIMIT, token)}")
                failure.__cause__ = cause
        except BaseException as exc:  # _Overran or an interrupt: the agent runs on, its proxy calls refused
            stats.cancelled = True
            if not isinstance(exc, _Overran):
                raise
            failure = RunTimeoutError(*exc.args)
        else:
            try:
                body = _built(result, strict=strict, secrets=(token,), multi_turn=envelope.is_multi_turn)
                return _without_run_token(body, envelope,
                                          json.dumps(body, ensure_ascii=False, allow_nan=False).encode())
            except ResponseError as exc:
                raise ResponseError(redact(exc.problems, token)) from None
            except Exception as exc:  # noqa: BLE001
                raise ResponseError("the response cannot be sent as JSON: "
                                    + describe_error(exc, DETAIL_LIMIT, token)) from None
        finally:
            _dispatch_stats.reset(bound)
        raise failure  # outside the except clauses: no context shows the original

    run.agent = agent  # type: ignore[attr-defined]
    return run

# ########################################
#
#   PART 3 - CONVENIENCES
#
#   Helpers for writing an agent; last, the command line.
#
# ########################################


# ----------------------------------------
# Agent-loop helpers: tool formats (§3.6), tool calls, bounded output, post_json

TOOL_FORMATS = ("platform", "openai_chat", "openai_responses", "anthropic")


def convert_tools(tools: Iterable[Any], to: str) -> List[JsonObject]:
    """Tools in any of :data:`TOOL_FORMATS` as format ``to`` (§3.6, kit-model-tool-names)."""
    if to not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {to!r}: expected one of {', '.join(TOOL_FORMATS)}")
    out: List[JsonObject] = []
    seen: Set[str] = set()
    for i, entry in enumerate(tools):
        spec = entry["function"] if isinstance(entry, Mapping) and isinstance(entry.get("function"), Mapping) else entry
        if not isinstance(spec, Mapping):
            raise ValueError(f"tools[{i}]: must be an object, got {json_type(spec)}")
        name, schema = spec.get("name"), spec.get("input_schema", spec.get("parameters"))
        if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
            raise ValueError(f"tools[{i}].name: {_short(repr(name), 60)} must match ^{TOOL_NAME_RE.pattern}$")
        problem = ("input_schema must be an object" if not isinstance(schema, (Mapping, type(None)))
                   else "declared twice" if name in seen
                   else "model APIs take at most 64 characters" if to != "platform" and len(name) > 64
                   else "")
        if problem:
            raise ValueError(f"tools[{i}] ({name}): {problem}")
        seen.add(name)
        tool: JsonObject = {"name": name, "description": str(spec.get("description") or "")}
        schema = _thaw(schema) if schema is not None else {"type": "object", "properties": {}}
        if to == "openai_chat":
            tool = {"type": "function", "function": {**tool, "parameters": schema}}
        elif to == "openai_responses":  # strict on would make every property required
            tool = {"type": "function", **tool, "parameters": schema, "strict": False}
        else:
            tool["input_schema"] = schema
            for key, value in entry.items() if to == "platform" else ():
                if key in ("output_schema", "default_execution_mode", "passthrough_binding"):
                    tool[key] = _thaw(value)
        out.append(tool)
    return out


def load_tools_schema(source: str | os.PathLike[str] | None = None) -> List[JsonObject]:
    """The platform tool list from a JSON file, else from the environment (§3.6)."""
    tools = _tools_schema_from_env(os.environ) if source is None else _read_tools_file(source)
    if tools is None:
        raise ValueError(f"no tools schema: set {ENV_TOOLS_SCHEMA_B64} or {ENV_TOOLS_SCHEMA_JSON}, or pass a file")
    try:
        return convert_tools(tools, "platform")
    except ValueError as exc:
        raise ValueError(f"tools schema {'the environment' if source is None else os.fspath(source)}: {exc}") from None


def _read_tools_file(source: str | os.PathLike[str]) -> List[Any]:
    where = os.fspath(source)
    try:
        with open(source, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read tools schema {where}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"tools schema {where} is not valid JSON: {exc}") from None
    if isinstance(tools, dict):
        tools = tools.get("tools_schema", tools.get("tools", tools))
    if not isinstance(tools, list):
        raise ValueError(f"tools schema {where} must be a JSON list of tools, got {json_type(tools)}")
    return tools


def tools_schema_beside(agent_spec: str) -> str | None:
    """The ``tools_schema.json`` beside the agent file of ``PATH.py:NAME``, or None."""
    where = agent_spec.rpartition(":")[0]
    beside = os.path.join(os.path.dirname(os.path.abspath(where)), "tools_schema.json")
    return beside if where.endswith(".py") and os.path.isfile(beside) else None


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def bound_output(text: Any, limit: int = 8000) -> str:
    """``text`` (JSON if not a string) cut to about ``limit`` characters, head and tail kept."""
    shown = _as_text(text)
    if len(shown) <= limit:
        return shown
    keep = max(limit - 40, 2)
    tail = keep // 2
    return f"{shown[:keep - tail]}\n...[{len(shown) - keep} characters truncated]...\n{shown[-tail:]}"


def call_tools(calls: Iterable[Tuple[str, Mapping[str, Any] | str | None]], *, max_concurrency: int = 8,
               errors: str = "return", **options: Any) -> List[Any]:
    """A model turn's tool calls by :func:`proxy_call`, ``max_concurrency`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    calls = list(calls)

    def one(name: str, args: Any) -> Any:
        if isinstance(args, (str, bytes)):
            try:
                args = json.loads(args or "{}")
            except ValueError as exc:
                problem = f"arguments for {name!r} must be a JSON object, got invalid JSON: {exc}"
                return _call_failed(ProxyRequestError(problem, tool_name=name), name, errors)
        return proxy_call(name, args, errors=errors, **options)

    context = contextvars.copy_context()  # the caller's: its bound envelope
    with ThreadPoolExecutor(max(1, min(max_concurrency, len(calls))), "pipelines-tool") as pool:
        return list(pool.map(lambda call: context.copy().run(one, *call), calls))


class HTTPStatusError(PipelinesError):
    """A JSON API answered an error status after retries, or no JSON."""

    def __init__(self, message: str, *, status_code: int | None = None, body: Any = None):
        super().__init__(message)
        self.status_code, self.body = status_code, body


def post_json(url: str, payload: Mapping[str, Any] | None, *, headers: Mapping[str, str] | None = None,
              timeout: float = 300.0,
              retry: RetryPolicy = RetryPolicy(max_attempts=5, base_delay_s=1.0, max_delay_s=20.0, transport_retries=2),
              max_reply_bytes: int = 64 << 20, sleep: Callable[[float], None] = time.sleep,
              method: str = "POST") -> Any:
    """``payload`` (None: no body) sent by ``method`` to a JSON API; its JSON reply, retried."""
    try:
        base = urlsplit(url)
        port = f":{base.port}" if base.port else ""
        if base.scheme.lower() not in ("http", "https") or not base.hostname:
            raise ValueError("must be http:// or https:// with a host")
    except ValueError as exc:
        raise ValueError(f"URL {_short(url)!r}: {exc}") from None
    path = (base.path or "/") + (f"?{base.query}" if base.query else "")
    body = b"" if payload is None else json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    sent = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": _USER_AGENT,
            **(headers or {})}
    where = f"{method} {base.scheme}://{base.hostname}{port}{base.path}"  # no userinfo or query: they may hold keys

    def interpret(status: int, reply_headers: HeaderFields, reply: bytes) -> ProxyOutcome:
        value, is_json = _decode_body(reply, "")
        ok = 200 <= status < 300
        if ok and is_json:
            return ProxyOutcome("value", value)
        text = json.dumps(value)[:500] if is_json else _short(str(value or ""), 500)
        error = HTTPStatusError(f"{where}: HTTP {status}{', not JSON' if ok else ''}: {text}",
                                status_code=status, body=value)
        return ProxyOutcome("retry" if status in (408, 409, 425, 429, 500, 502, 503, 504, 529) else "error",
                            error=error, retry_after=_model_retry_after(reply_headers))

    send = functools.partial(_shared_transport().exchange, base, method, path, sent, body, timeout, max_reply_bytes)
    try:
        return _retry_loop(send, interpret, policy=retry, sleep=sleep,
                           transport_error=lambda cause: HTTPStatusError(_failed_before_reply(where, cause)))
    except _ReplyTooLarge as big:
        raise HTTPStatusError(f"{where}: reply {big}", status_code=big.status) from None

# ----------------------------------------
# Tools from code: a signature's JSON Schema, arguments checked and proxied (§3.6)

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null", None: "null"}
# keyword: the JSON type it bounds, strings and arrays by their length
_BOUNDS = {"minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
           "minLength": "string", "maxLength": "string", "minItems": "array", "maxItems": "array"}
_JSON_TYPE_NAMES = frozenset((*_JSON_TYPES.values(), "array", "object"))


def validate_args(schema: Mapping[str, Any], value: Any, path: str = "args") -> List[str]:
    """Every way ``value`` breaks ``schema`` (the keywords tool schemas use)."""
    if not isinstance(schema, Mapping):
        return []
    actual = json_type(value).split()[-1]
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        fits = {actual, "integer" if actual == "number" and value % 1 == 0 else actual}
        if set(kinds) <= _JSON_TYPE_NAMES - fits:  # a type this check does not know passes
            return [f"{path}: expected {' or '.join(kinds)}, got {json_type(value)}"]
    problems: List[str] = []
    if value not in schema.get("enum", [value]) or ("const" in schema and schema["const"] != value):
        problems.append(f"{path}: not in {json.dumps(schema.get('enum', [schema.get('const')]))}")
    for key, kind in _BOUNDS.items():
        if actual == kind and key in schema and json_type(schema[key]) == "a number":
            measure, bound = value if kind == "number" else len(value), schema[key]
            if (measure < bound if "min" in key.lower() else measure > bound) or (measure == bound and "exc" in key):
                problems.append(f"{path}: {measure} breaks {key} {bound}")
    if actual == "array" and "items" in schema:
        for i, item in enumerate(value):
            problems += validate_args(schema["items"], item, f"{path}[{i}]")
    if actual == "object":
        properties: Mapping[str, Any] = schema["properties"] if isinstance(schema.get("properties"), Mapping) else {}
        for name in schema.get("required") or ():
            if name not in value:
                problems.append(f"{path}.{name}: required")
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties or isinstance(extra, Mapping):
                problems += validate_args(properties.get(name, extra), item, f"{path}.{name}")
            elif extra is False:
                problems.append(f"{path}.{name}: not allowed")
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            matches = 0
            for option in options:
                matches += not validate_args(option, value, path)
            if matches == 0 or (key == "oneOf" and matches > 1):
                problems.append(f"{path}: matches {matches} of the {key} alternatives")
    return problems


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def schema_for_type(annotation: Any) -> JsonObject:
    """The JSON Schema of a type hint (JSON's, Any, Union, containers, Literal, Enum)."""
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return {}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is typing.Literal or (isinstance(annotation, type) and issubclass(annotation, enum.Enum)):
        values = list(args if origin is typing.Literal else map(_enum_value, annotation))
        kinds = set(map(_JSON_TYPES.get, map(type, values)))
        return {"enum": values, **({"type": kinds.pop()} if len(kinds) == 1 and None not in kinds else {})}
    if origin is Union or type(annotation).__name__ == "UnionType":
        members = [schema_for_type(a) for a in args if a is not type(None)]
        null = [{"type": "null"}] if len(members) < len(args) else []
        if len(members) == 1 and null and set(members[0]) == {"type"} and isinstance(members[0]["type"], str):
            return {"type": [members[0]["type"], "null"]}
        return {"anyOf": members + null}
    if (origin or annotation) in (list, tuple, set, frozenset):
        items = [schema_for_type(a) for a in dict.fromkeys(args) if a is not Ellipsis]  # a tuple's: any of its types
        return {"type": "array", **({"items": items[0] if len(items) == 1 else {"anyOf": items}} if items else {})}
    if (origin or annotation) is dict:
        values_schema = schema_for_type(args[1]) if len(args) == 2 else None  # Any's: {}
        return {"type": "object", **({"additionalProperties": values_schema} if values_schema else {})}
    raise TypeError(f"no JSON Schema for type {annotation!r}")


class Tool:
    """A function as a tool: in a dispatch a call is checked and proxied; outside, it runs."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 default_execution_mode: str | None = None):
        import inspect
        import typing

        if default_execution_mode not in (None, "sandbox", "passthrough"):
            raise ValueError("default_execution_mode must be 'sandbox' or 'passthrough'")
        self.fn, self.default_execution_mode = fn, default_execution_mode
        self.name = validate_tool_name(name or fn.__name__)
        summary: List[str] = []  # the docstring's, Google or Sphinx style
        param_docs: Dict[str, str] = {}
        section = current = None
        for line in inspect.cleandoc(fn.__doc__ or "").splitlines():
            text = line.strip()
            found = re.match(r":param\s+(?:[^:]*\s)?(\w+):\s*(.*)", text) or (
                section in ("Args", "Arguments", "Parameters")
                and re.match(r" {4}(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line))
            if found:
                section, current = section or ":param", found[1]
                param_docs[current] = found[2]
            elif re.fullmatch(r"(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?|Notes?):|:.*", text):
                section, current = text[:-1], None
            elif current and text and line[:1] == " ":
                param_docs[current] = f"{param_docs[current]} {text}".lstrip()
            elif section is None:
                summary.append(line)
        if description is None:
            description = re.sub(r"\s*\n\s*\n\s*", "\n\n", "\n".join(summary).strip())
        self.description = description
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"tool {self.name!r}: cannot resolve its type hints: {exc}") from None
        properties: JsonObject = {}
        required: List[str] = []
        for argument, param in self.signature.parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name!r}: *{argument} is not a named argument")
            try:
                prop = properties[argument] = schema_for_type(hints.get(argument, Any))
            except TypeError as exc:
                raise TypeError(f"tool {self.name!r}, argument {argument!r}: {exc}") from None
            if param_docs.get(argument):
                prop["description"] = param_docs[argument]
            if param.default is param.empty:
                required.append(argument)
            else:
                with contextlib.suppress(TypeError, ValueError):
                    prop["default"] = json.loads(json.dumps(_enum_value(param.default)))
        self.input_schema: JsonObject = {"type": "object", "properties": properties, "additionalProperties": False,
                                             **({"required": required} if required else {})}
        functools.update_wrapper(self, fn)

    @property
    def schema(self) -> JsonObject:
        """This tool as a tools_schema entry."""
        return {"name": self.name, "description": self.description, "input_schema": _thaw(self.input_schema),
                **({"default_execution_mode": self.default_execution_mode} if self.default_execution_mode else {})}

    def validate(self, arguments: Mapping[str, Any]) -> List[str]:
        """Every way ``arguments`` break the input schema."""
        return validate_args(self.input_schema, arguments)

    def arguments(self, *args: Any, **kwargs: Any) -> JsonObject:
        """The JSON arguments a call sends."""
        bound = self.signature.bind(*args, **kwargs)
        return dict(zip(bound.arguments, map(_enum_value, bound.arguments.values())))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _current.get() is None:
            return self.fn(*args, **kwargs)
        arguments = self.arguments(*args, **kwargs)
        if problems := self.validate(arguments):
            raise ProxyRequestError(f"arguments for tool {self.name!r}: " + "; ".join(problems), tool_name=self.name)
        return (aproxy_call if self.is_async else proxy_call)(self.name, arguments)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         default_execution_mode: str | None = None) -> Any:
    """``@tool`` or ``@tool(name=...)``: a :class:`Tool` from hints and docstring."""
    make = functools.partial(Tool, name=name, description=description, default_execution_mode=default_execution_mode)
    return make(fn) if fn is not None else make


def export_tools(tools: Iterable[Any], to: str = "platform") -> List[JsonObject]:
    """Tools and tools_schema entries as one tool list in format ``to``."""
    return convert_tools([t.schema if isinstance(t, Tool) else t for t in tools], to)

# ----------------------------------------
# Framework bridges (kit-framework-bridges): tools in and out, a run's response

def _tools_of(source: Any) -> List[Any]:
    tools = source if isinstance(source, (list, tuple)) else getattr(source, "tools", None)
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"expected a list of tools or an agent with .tools, got {type(source).__name__}")
    return list(tools)


def tools_schema_from(source: Any) -> List[JsonObject]:
    """The ``tools_schema`` (§3.6) of a framework's tools or agent."""
    entries: List[Any] = []
    for tool in _tools_of(source):
        if isinstance(tool, Mapping):
            entries.append(tool)
            continue
        name, description = getattr(tool, "name", None), getattr(tool, "description", "")
        spec = getattr(tool, "tool_spec", None)  # Strands: {"name", "description", "inputSchema": {"json": schema}}
        schema = getattr(tool, "params_json_schema", None)  # OpenAI Agents
        mcp_schema = getattr(tool, "inputSchema", None) or getattr(tool, "input_schema", None)
        if isinstance(schema, Mapping):
            pass
        elif isinstance(spec, Mapping):
            name, description, schema = spec.get("name"), spec.get("description"), spec.get("inputSchema")
            schema = schema.get("json", schema) if isinstance(schema, Mapping) else {}
        elif isinstance(mcp_schema, Mapping):
            schema = mcp_schema
        elif hasattr(tool, "args_schema") or hasattr(tool, "get_input_schema"):  # LangChain
            schema = getattr(tool, "args_schema", None)
            if not isinstance(schema, Mapping):
                schema = (getattr(tool, "tool_call_schema", None) or tool.get_input_schema()).model_json_schema()
            schema = dict(schema)
            schema.pop("title", None)
            schema.pop("description", None)
        else:
            raise TypeError(f"not a tool this module knows: {type(tool).__name__} (OpenAI Agents, LangChain, "
                            "Strands, MCP)")
        entries.append({"name": str(name), "description": str(description or ""), "input_schema": dict(schema),
                        "default_execution_mode": "sandbox"})
    return convert_tools(entries, "platform")


def proxied_tools(source: Any, *, actor: str | None = None) -> List[Any]:
    """The same framework tools, each body a :func:`proxy_call` to the run bound here."""
    envelope = _current.get()  # a framework may call tools on threads of its own
    proxied = functools.partial(_proxied_tool, actor=actor, errors="return", envelope=envelope)
    return list(map(proxied, _tools_of(source)))


def _proxied_tool(tool: Any, **options: Any) -> Any:
    import importlib  # the tool's framework: loaded already

    acall: Callable[..., Any] = functools.partial(aproxy_call, getattr(tool, "name", ""), **options)
    if hasattr(tool, "on_invoke_tool") and hasattr(tool, "params_json_schema"):  # OpenAI Agents
        import dataclasses

        async def on_invoke_tool(context: Any, arguments: str) -> str:
            return _as_text(await acall(json.loads(arguments.strip() or "{}")))

        return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool)
    if hasattr(tool, "args_schema") and hasattr(tool, "invoke"):  # LangChain
        def sync_body(**kwargs: Any) -> str:
            return _as_text(proxy_call(tool.name, _jsonable_args(kwargs), **options))

        async def async_body(**kwargs: Any) -> str:
            return _as_text(await acall(_jsonable_args(kwargs)))

        return importlib.import_module("langchain_core.tools").StructuredTool.from_function(
            func=sync_body, coroutine=async_body, name=tool.name, description=tool.description,
            args_schema=tool.args_schema if tool.args_schema is not None else tool.get_input_schema(),
            return_direct=getattr(tool, "return_direct", False))
    if isinstance(getattr(tool, "tool_spec", None), Mapping) and hasattr(tool, "stream"):  # Strands
        async def tool_func(tool_use: Mapping[str, Any], **invocation_state: Any) -> JsonObject:
            result = await aproxy_call(tool.tool_spec["name"], tool_use.get("input") or {}, **options)
            failed = isinstance(result, Mapping) and "error" in result
            return {"toolUseId": tool_use.get("toolUseId"), "status": "error" if failed else "success",
                    "content": [{"text": _as_text(result)}]}

        return importlib.import_module("strands.tools.tools").PythonAgentTool(
            tool.tool_name, dict(tool.tool_spec), tool_func)
    raise TypeError(f"cannot proxy a {type(tool).__name__}")


def _jsonable_args(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return dict(zip(map(str, value), map(_jsonable_args, value.values())))
    return list(map(_jsonable_args, value)) if isinstance(value, (list, tuple)) else value


class Handoffs:
    """A run's ``handoff`` trace events (§3.4), one per change of sub-agent, best-effort."""

    def __init__(self, first: str | None = None, *, envelope: Envelope | None = None):
        self.current = validate_actor_label(first)
        self._envelope = envelope or _current.get()
        self._lock = threading.Lock()

    def enter(self, label: str, reason: str | None = None) -> None:
        """``label`` acts from now on."""
        for moved in self._moves(label):
            post_handoff(*moved, reason=reason, envelope=self._envelope, best_effort=True)

    async def aenter(self, label: str, reason: str | None = None) -> None:
        """:meth:`enter` on the running loop."""
        for moved in self._moves(label):
            await apost_handoff(*moved, reason=reason, envelope=self._envelope, best_effort=True)

    def _moves(self, label: str) -> List[Tuple[str, str]]:
        label = validate_actor_label(label)  # type: ignore[assignment]
        with self._lock:
            previous, self.current = self.current, label
        return [(previous, label)] if previous and previous != label else []

    def node(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a LangGraph node entering ``label`` before each call."""
        import inspect

        async def async_node(*args: Any, **kwargs: Any) -> Any:
            await self.aenter(label)
            return await fn(*args, **kwargs)

        def sync_node(*args: Any, **kwargs: Any) -> Any:
            self.enter(label)
            return fn(*args, **kwargs)

        return functools.wraps(fn)(async_node if inspect.iscoroutinefunction(fn) else sync_node)

    def agents_hooks(self) -> Any:
        """OpenAI Agents SDK ``RunHooks`` entering each agent that starts."""
        import importlib

        handoffs = self

        class _Hooks(importlib.import_module("agents").RunHooks):  # type: ignore[misc]
            async def on_agent_start(self, context: Any, agent: Any) -> None:
                await handoffs.aenter(agent.name)

        return _Hooks()


def response_from(result: Any, **fields: Any) -> JsonObject:
    """The response envelope (§4) of a framework's run, else :func:`build_response`."""
    keys = ("input_tokens", "output_tokens")
    if hasattr(result, "new_items") and hasattr(result, "final_output"):  # OpenAI Agents
        final = result.final_output
        messages = [{"role": "user", "content": result.input}] if isinstance(result.input, str) else []
        thinking: List[JsonObject] = []
        for item in result.new_items:
            kind, raw = getattr(item, "type", ""), getattr(item, "raw_item", None)
            if kind == "reasoning_item":
                for summary in _field(raw, "summary") or ():
                    thinking.append({"type": "text", "text": getattr(summary, "text", "")})
            elif kind in ("tool_call_output_item", "handoff_output_item"):
                output = getattr(item, "output", None) if kind == "tool_call_output_item" else _field(raw, "output")
                messages.append({"role": "tool", "tool_call_id": _field(raw, "call_id"), "content": _as_text(output)})
            elif kind in ("message_output_item", "tool_call_item", "handoff_call_item"):  # handoff: transfer_to_X
                text = "".join(filter(None, map(functools.partial(_field, key="text"), _field(raw, "content") or ())))
                message: JsonObject = {"role": "assistant", "content": text or None}
                if kind != "message_output_item":
                    message["tool_calls"] = [{"id": _field(raw, "call_id") or _field(raw, "id"),
                                              "name": _field(raw, "name"),
                                              "arguments": _field(raw, "arguments") or "{}"}]
                if thinking:
                    message["thinking"] = thinking
                    thinking = []
                messages.append(message)
        model = getattr(getattr(result, "last_agent", None), "model", None)
        model = getattr(model, "model", model)  # a name, or a model object's
        usages: List[Any] | None = list(map(functools.partial(_field, key="usage"),
                                            getattr(result, "raw_responses", ()) or ()))
    else:
        strands = hasattr(result, "tool_registry") and isinstance(getattr(result, "messages", None), list)
        items = result.messages if strands else result
        if isinstance(items, Mapping):
            items = items.get("messages", items)
        read = _conversation(items) if isinstance(items, (list, tuple)) and (items or strands) else None
        if read is None:
            return build_response(result, **fields)
        final, messages, usages, model = read
        if strands:
            usage = getattr(getattr(result, "event_loop_metrics", None), "accumulated_usage", None)
            usages = [usage] if isinstance(usage, Mapping) else None
            model = (getattr(getattr(result, "model", None), "config", None) or {}).get("model_id")
            keys = ("inputTokens", "outputTokens")
    metadata: JsonObject = {} if usages is None else {"total_input_tokens": 0, "total_output_tokens": 0}
    for usage in usages or ():
        for total, key in zip(metadata, keys):
            metadata[total] += int(_field(usage, key) or 0)
    if isinstance(model, str) and model:
        metadata["model"] = model
    return build_response(final, **{"messages": messages, "metadata": metadata, **fields})


def _field(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)


_BEDROCK_BLOCKS = {"toolUse": "tool_use", "toolResult": "tool_result", "reasoningContent": "reasoning"}
_LANGCHAIN_ROLES = {"human": "user", "ai": "assistant", "AIMessageChunk": "assistant", "tool": "tool",
                    "system": "system"}


def _conversation(items: Sequence[Any]) -> Tuple[str, List[JsonObject], List[Any], Any] | None:
    # Anthropic Messages, Bedrock Converse (Strands) or LangChain messages: the final text, the platform's
    # messages, each message's usage and the model; None for any other list
    messages: List[JsonObject] = []
    final, usages, model = "", [], None
    for item in items:
        if hasattr(item, "model_dump"):
            item = item.model_dump()
        if not isinstance(item, Mapping) or not isinstance(item.get("content"), (str, list)):
            return None
        langchain = "role" not in item  # LangChain's: {"type": "human", "content": ...}
        role = _LANGCHAIN_ROLES.get(item.get("type", "")) if langchain else item["role"]
        if role is None or (not langchain and role not in ("user", "assistant")):
            return None
        usages.append(item.get("usage", item.get("usage_metadata")))
        model = item.get("model") or (item.get("response_metadata") or {}).get("model_name") or model
        content, start = item["content"], len(messages)
        text, calls, thinking = [content] if isinstance(content, str) else [], [], []
        for block in () if isinstance(content, str) else content:
            if not isinstance(block, Mapping):
                continue
            kind = block.get("type")
            for key in _BEDROCK_BLOCKS:  # Bedrock's {"toolUse": {...}}
                if isinstance(block.get(key), Mapping):
                    kind, block = _BEDROCK_BLOCKS[key], block[key]
            call_id = block.get("id", block.get("toolUseId"))
            if kind == "tool_use":
                calls.append({"id": call_id, "name": block.get("name"), "arguments": block.get("input") or {}})
            elif kind == "tool_result" and role != "assistant":
                out = block.get("content")
                if isinstance(out, list):  # text parts, or Bedrock's {"json": value}
                    out = "".join(_as_text(p.get("json", p.get("text") or "")) for p in out if isinstance(p, Mapping))
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id", call_id),
                                 "content": _as_text(out)})
            elif kind in ("thinking", "reasoning"):
                thought = block.get("thinking") or block.get("text") or (block.get("reasoningText") or {}).get("text")
                if thought:  # LangChain's and Bedrock's are plain text
                    thinking.append({"type": "thinking" if kind == "thinking" and not langchain else "text",
                                     "text": thought})
            elif kind == "text" or (kind is None and isinstance(block.get("text"), str)):
                text.append(str(block.get("text") or ""))
        said = "".join(text)
        if langchain and role == "tool":
            messages.append({"role": "tool", "tool_call_id": item.get("tool_call_id"), "content": said})
        elif role != "assistant":
            if said or len(messages) == start:  # text, or no tool result to carry
                messages.append({"role": role, "content": said})
        else:
            message: JsonObject = {"role": "assistant", "content": said or None}
            if langchain:
                calls = [{"id": c.get("id"), "name": c.get("name"), "arguments": c.get("args") or {}}
                         for c in item.get("tool_calls") or ()]
            if calls:
                message["tool_calls"] = calls
            elif said:
                final = said
            if thinking:
                message["thinking"] = thinking
            messages.append(message)
    return final, messages, usages, model

# ----------------------------------------
# MCP shim (§3.6): a stdio MCP server whose tools go through the proxy

MCP_PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")


class _RpcError(Exception):  # (code, message)
    pass


class McpShim:
    """A stdio MCP server (kit-mcp-shim) whose tools are called through the proxy."""

    def __init__(self, *, environ: Mapping[str, str] | None = None, client: ProxyClient | None = None):
        self.environ = dict(os.environ if environ is None else environ)
        self.client = client
        self._tools: List[JsonObject] | None = None
        self._envelope: Envelope | None = None

    def handle_line(self, line: str) -> str | None:
        """The reply line to one input line, or ``None``."""
        request_id = method = None
        try:
            try:
                message = json.loads(line) if line.strip() else {}
            except ValueError as exc:
                raise _RpcError(-32700, f"parse error: {exc}") from None
            given = message.get("id") if isinstance(message, dict) else False
            if isinstance(given, bool) or not isinstance(given, (str, int, type(None))):
                raise _RpcError(-32600, "expected a JSON object, its id a string or a number")
            method, params = message.get("method"), message.get("params", {})
            if "id" not in message or (method is None and ("result" in message or "error" in message)):
                return None
            request_id = given
            if message.get("jsonrpc") != "2.0" or not isinstance(method, str):
                raise _RpcError(-32600, 'expected {"jsonrpc": "2.0", "method": ...}')
            if not isinstance(params, dict):
                raise _RpcError(-32602, "params must be an object")
            if method == "initialize":
                asked = params.get("protocolVersion")
                result = {"protocolVersion": asked if asked in MCP_PROTOCOL_VERSIONS else MCP_PROTOCOL_VERSIONS[0],
                          "capabilities": {"tools": {"listChanged": False}},
                          "serverInfo": {"name": "pipelines_port", "version": __version__}}
            elif method == "tools/list":
                result = {"tools": [{"name": t["name"], "description": t["description"],
                                     "inputSchema": t["input_schema"]} for t in self.tools()]}
            elif method == "tools/call":
                name, arguments = params.get("name"), params.get("arguments")
                if not isinstance(name, str) or not isinstance(arguments, (dict, type(None))):
                    raise _RpcError(-32602, "tools/call needs a string name and object arguments")
                result = self.call_tool(name, arguments or {})
            elif method == "ping":
                result = {}
            else:
                raise _RpcError(-32601, f"method not found: {_short(method, 80)}")
            reply: JsonObject = {"result": result}
        except Exception as exc:  # noqa: BLE001
            token = self._envelope.run_token if self._envelope else None
            if not isinstance(exc, (_RpcError, HTTPStatusError, ValueError)):  # setup problems: no traceback
                _log.error("mcp: %s failed", method, exc_info=_redact_exception_chain(exc, token))
            code, text = exc.args if isinstance(exc, _RpcError) else (-32603, describe_error(exc, DETAIL_LIMIT, token))
            reply = {"error": {"code": code, "message": text}}
        return json.dumps({"jsonrpc": "2.0", "id": request_id, **reply}, ensure_ascii=False)

    def envelope(self) -> Envelope:
        """The run this shim serves, read once from its environment."""
        if self._envelope is None:  # two threads reading it read the same run
            self._envelope = Envelope.from_env(self.environ)
        return self._envelope

    def tools(self) -> List[JsonObject]:
        """The platform tool list, read once: from the environment, else the platform."""
        if self._tools is None:
            tools = _tools_schema_from_env(self.environ)
            if tools is None:  # the platform's
                if not (agent_id := _header(self.environ, ENV_AGENT_ID)):
                    raise ValueError(f"no tools schema: set {ENV_TOOLS_SCHEMA_B64} or {ENV_AGENT_ID}")
                envelope = self.envelope()
                api = validate_proxy_url(_header(self.environ, ENV_API_URL) or envelope.api_url, ENV_API_URL)
                reply = post_json(f"{api}/api/agents/{quote(agent_id, safe='')}/tools-schema", None, method="GET",
                                  headers={"Authorization": "Bearer " + envelope.run_token}, timeout=30.0,
                                  retry=RetryPolicy())  # the proxy's: a few seconds at most
                if not isinstance(reply, dict) or not isinstance(reply.get("tools"), list):
                    raise ValueError("the tools schema reply has no tools list")
                tools = reply["tools"]
            self._tools = convert_tools(tools, "platform")
        return self._tools

    def call_tool(self, name: str, arguments: JsonObject) -> JsonObject:
        """One ``tools/call`` through the proxy, as an MCP result."""
        try:
            value, failed = proxy_call(name, arguments, envelope=self.envelope(), client=self.client), False
        except ProxyError as exc:
            value, failed = str(exc), True
        return {"content": [{"type": "text", "text": _as_text(value)}], "isError": failed,
                **({"structuredContent": value} if isinstance(value, dict) else {})}

    def serve(self, stdin: Any = None, stdout: Any = None, *, max_concurrency: int = 8) -> int:
        """Answer lines until EOF, ``tools/call`` concurrently."""
        from concurrent.futures import ThreadPoolExecutor

        out, write_lock = stdout or sys.stdout, threading.Lock()

        def answer(line: str) -> None:
            reply = self.handle_line(line)
            if reply is not None:
                with write_lock:
                    print(reply, file=out, flush=True)

        with ThreadPoolExecutor(max_concurrency, "pipelines-mcp") as pool:
            for line in stdin or sys.stdin:
                pool.submit(answer, line) if '"tools/call"' in line else answer(line)
        return 0

# ----------------------------------------
# Command line: serve, mcp

def load_agent(spec: str) -> Callable[..., Any]:
    """The callable ``PATH.py:NAME`` or ``package.module:NAME`` names."""
    import importlib.machinery
    import importlib.util

    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ValueError(f"expected PATH_OR_MODULE:FUNCTION, got {spec!r}")
    path = os.path.abspath(where)
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    if is_file and not os.path.isfile(path):
        raise ValueError(f"no such file: {where}")
    directory, name = os.path.split(path) if is_file else (os.getcwd(), where)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        if not is_file:
            module = importlib.import_module(where)
        else:
            name = name.removesuffix(".py")
            if name in sys.modules and getattr(sys.modules[name], "__file__", None) != path:
                name = f"_pipelines_agent_{name}"  # another module has this name
            loader = importlib.machinery.SourceFileLoader(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(
                importlib.util.spec_from_file_location(name, path, loader=loader))  # type: ignore[arg-type]
            loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        import traceback

        sys.modules.pop(name, None)  # a module half run
        if isinstance(exc, SyntaxError):
            raise ValueError(f"{where} has a syntax error: {exc.msg} (line {exc.lineno})") from None
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raised = f"{describe_error(exc, 300)} ({os.path.basename(frame.filename)}, line {frame.lineno})"
        raise ValueError(f"cannot import {where}: it raised {raised}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            hint = (" (it has `agent`: add `run = pp.code_mode(agent)`)"
                    if attr == "run" and "agent" in vars(module) else "")
            raise ValueError(f"{where} has no function {attr!r}{hint}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{where}:{attr} is a {type(target).__name__}, not a function")
    return target  # type: ignore[no-any-return]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _option_type(convert: Callable[[str], Any], expected: str, low: float = 0, high: float = math.inf
                 ) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        import argparse

        value = None
        with contextlib.suppress(ValueError):
            value = convert(text)
        if value is None or not low < value < high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


def _refuse_token(text: str) -> None:
    import argparse

    raise argparse.ArgumentTypeError("--token is not accepted (ps shows it): use --token-env NAME")


_SECONDS = _option_type(float, "a positive number of seconds")  # not nan, not inf
_POSITIVE = _option_type(_content_length, "a positive whole number")  # digits: no -5 or 1_000
# (flag, type, default, metavar, help): type None is a switch, a tuple the choices
_SERVE_OPTIONS = (
    ("--host", str, "127.0.0.1", None, "interface to listen on"),
    ("--port", _option_type(_content_length, "a port number from 0 to 65535", -1, 65536), 8080, None,
     "port, 0: any free"),
    ("--path", str, DEFAULT_DISPATCH_PATH, None, "dispatch path"),
    ("--token-env", str, DEFAULT_TOKEN_ENV, "NAME", "agent token's variable"),
    ("--auth-header", str, "Authorization", "NAME", "token header"),
    ("--no-auth", None, False, None, "no inbound auth"),
    ("--max-body", _POSITIVE, DEFAULT_MAX_BODY_BYTES, "BYTES", "largest body"),
    ("--timeout", _SECONDS, DEFAULT_RUN_TIMEOUT_S, "SECONDS", "run_timeout_s"),
    ("--grace", _SECONDS, DEFAULT_GRACE_S, "SECONDS", "drain time on SIGTERM"),
    ("--server", SERVERS, "asyncio", None, "one event loop, or a thread per connection"),
    ("--read-timeout", _SECONDS, DEFAULT_READ_TIMEOUT_S, "SECONDS", "read limit, then 408"),
    ("--keepalive", _SECONDS, DEFAULT_KEEPALIVE_S, "SECONDS", "idle connection timeout"),
    ("--max-connections", _POSITIVE, None, "N", "open connections, then 503"),
    ("--strict", None, False, None, f"500, not a softened response (or {ENV_STRICT}=1)"),
    ("--proxy-hosts", str, None, "HOSTS", f"proxy hosts allowed (or ${ENV_PROXY_ALLOWED_HOSTS})"),
    ("--tools-schema", str, None, "FILE", "served at GET /tools_schema"),
    ("--debug", None, False, None, f"log proxy traffic (or {ENV_DEBUG}=1)"),
    ("--no-access-log", None, False, None, "no line per request"),
    ("--gc-threshold", _option_type(_content_length, "a whole number, 0 or more", -1),
     SERVE_GC_THRESHOLD, "N", "gen-0 GC threshold, 0: Python's"),
)


def _configure_logging(debug: bool, level: int) -> None:
    import logging

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _log.setLevel(logging.DEBUG if debug or _truthy(os.environ.get(ENV_DEBUG)) else level)


def _cmd_serve(args: Any) -> int:
    _configure_logging(args.debug, 20)
    if args.no_access_log:
        _access_log.setLevel(30)
    agent = load_agent(args.agent)  # a ValueError is a usage error (main)
    app = agent if isinstance(agent, DispatchApp) else DispatchApp(
        agent, path=args.path, token_env=args.token_env, auth_header=args.auth_header, no_auth=args.no_auth,
        max_body=args.max_body, run_timeout_s=args.timeout, proxy_hosts=args.proxy_hosts,
        tools_schema=args.tools_schema or tools_schema_beside(args.agent), strict=args.strict or None)

    def ready(server: Any) -> None:
        say = functools.partial(print, "pipelines_port serve:", flush=True)
        say(f"listening on {server.url}")
        say(f"auth: {app.describe_auth()}")
        if app.tools_schema is not None:
            say(f"{len(app.tools_schema)} tools declared (GET /tools_schema)")
        say(f"proxy hosts: {app.describe_proxy_hosts()}")
        if _header(os.environ, ENV_RUN_TOKEN):  # §5 child-env-explicit
            say(f"WARNING: {ENV_RUN_TOKEN} is set: proxy calls outside a dispatch would use that run")

    try:
        status = serve(app, host=args.host, port=args.port, grace_s=args.grace, ready=ready, server=args.server,
                       read_timeout_s=args.read_timeout, keepalive_s=args.keepalive,
                       max_connections=args.max_connections, gc_threshold=args.gc_threshold)
    except OSError as exc:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    if status:  # dispatches outlived the grace period: do not wait for their threads
        import logging

        logging.shutdown()
        sys.stdout.flush()
        os._exit(status)
    return status


def _cmd_mcp(args: Any) -> int:
    _configure_logging(args.debug, 30)
    return McpShim().serve()


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """The command line (``serve``, ``mcp``); returns the exit status."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("init", "doctor", "check", "dataset", "simulate", "demo"):
        print(f"{argv[0]} is a kit command: `pipelines-port {argv[0]}`", file=sys.stderr)
        return 2
    # allow_abbrev=False: `--token SECRET` taken for `--token-env SECRET` would print the secret
    parser = argparse.ArgumentParser(prog=prog or "python3 -m pipelines_port", allow_abbrev=False,
                                     description="Put an agent under test on Pipelines.")
    parser.add_argument("--version", action="version", version=f"pipelines_port {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_ = commands.add_parser("serve", help="serve agent(envelope) as a dispatch endpoint", allow_abbrev=False)
    serve_.add_argument("agent", metavar="PATH_OR_MODULE:FUNCTION")
    for flag, kind, default, metavar, text in _SERVE_OPTIONS:
        how: Dict[str, Any] = ({"action": "store_true"} if kind is None else {"choices": kind}
                               if isinstance(kind, tuple) else {"type": kind, "metavar": metavar})
        serve_.add_argument(flag, default=default, help=f"{text} (default %(default)s)" if default else text, **how)
    serve_.add_argument("--token", type=_refuse_token, help=argparse.SUPPRESS)
    serve_.set_defaults(run=_cmd_serve)
    about = "MCP server on stdio, tools called through the proxy"
    mcp_ = commands.add_parser("mcp", help=about, description=about, allow_abbrev=False)
    mcp_.add_argument("--debug", action="store_true", help="log proxy traffic")
    mcp_.set_defaults(run=_cmd_mcp)

    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)  # type: ignore[no-any-return]
    except ValueError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(prog="pipelines_port.py" if __spec__ is None else None))  # `python3 -m` sets __spec__
