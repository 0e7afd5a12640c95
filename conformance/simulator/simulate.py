"""``python3 -m conformance simulate``: run every dataset row against an agent through a local proxy.

    python3 -m conformance simulate --csv FILE.csv --code agent.py[:run] [--responses FIXTURES.json]
    python3 -m conformance simulate --csv FILE.csv --url http://127.0.0.1:8080/dispatch --token-env AGENT_TOKEN
        [--json OUT.json] [--html OUT.html] [--tools tools_schema.json] [--timeout 300]

Each valid row (see ``conformance/simulator/dataset.py``) becomes one run with its own
proxy (a :class:`~conformance.harness.mock_proxy.MockProxy` on 127.0.0.1 at
``/api/odyssey-proxy/runs/{run_id}``) and its own fresh run token.  The
proxy answers every tool call from the row's simulated backend
(``conformance/simulator/engine.py``: ledger booted from ``state``, ``failure_rules``,
optional fixtures) and records the trajectory: each call, its source,
latency and ledger changes, plus any live trace events the agent posts.

How the agent is run:

- ``--code FILE.py[:run]`` (code mode, CONTRACT §5): the file is imported and
  ``run(task_input, proxy_url=..., run_token=...)`` is called with
  ``task_input = {"task_id", "user_instruction", "input": {}}``, on a thread
  whose asyncio loop is already running (as in the sandbox's Jupyter kernel),
  with the ``PIPELINES_*`` variables set in ``os.environ`` for the duration of
  the row when rows run one at a time (``--jobs 1``, the default).
- ``--url URL`` (HTTP mode, CONTRACT §2): a ping first (``{"ping": true}``
  with the auth header), then one POST per row carrying exactly the
  platform's headers (``X-Pipelines-Run-Token``, ``X-Pipelines-Odyssey-Proxy-Url``,
  ``X-Pipelines-Run-Id``, ``X-Pipelines-Task-Id``, ``X-Pipelines-Run-Token-Jti``,
  the auth header: ``Authorization: Bearer T``, or ``NAME: T`` with
  ``--auth-header NAME``) and body (``task_id``, ``run_id``, ``input``,
  ``odyssey_proxy_url``, ``run_token_jti``, ``tools_schema`` with ``--tools``).
  No ``agent_id`` is sent: there is no registered agent.

In both modes ``input.input`` is ``{}``: the seed axes (``behavior``,
``state``, ``failure_rules``, ``expected_outcome``) are never forwarded to the
agent (§2); the state lives behind the proxy.

Injected failures.  A failure rule with a non-200 ``error.code`` reaches the
agent as an HTTP 200 trace envelope with ``source: "injected"``,
``matched_rule_index`` and ``response: {"error": message, "status_code":
code}``, not as an HTTP error status.  Why: §3.2 says tool-level errors arrive
as 200 with an ``{"error": ...}`` response, results the model should see, and
that trace rows from rules carry ``source``/``matched_rule_index``, fields
that only exist in the 200 envelope.  HTTP statuses on the proxy belong to the
proxy itself (§3.3: auth, rate limits, lock contention): a conforming client
retries 429 and some 503s, and raises on the rest, so an injected 503 sent as
a real status would be retried or turned into an exception instead of showing
the model a failed call.  The shape mirrors ``ProxyError.to_value()`` so an
agent sees the same keys whether a call failed for real or by a rule.

The model-backed roles, each on any OpenAI-compatible server (``scripted``: the kit's offline stand-in), with
one answer cache: ``--judge`` grades each run (``judge.py``), ``--simulator`` answers the tool calls nothing
else answers (``backend_model.py``), ``--user-model`` plays the user of a ``model_as_user`` row, which runs
as a conversation of dispatches (``session.py``).  ``--min-pass-rate``, ``--min-pass-hat-k`` and ``--junit``
make the verdicts a CI gate (``gate.py``); ``--baseline OLD.json`` compares the run with an earlier report
(``compare.py``).

Trials.  ``--trials K`` runs every row K times, each trial a run of its own: its run id (:func:`run_id_of`),
token, proxy, session id and verdict, the ledger booted afresh from the row's state (and the failure rules'
RNG seeded by the row, so every trial sees the same injected pattern).  The unit of work is ``(row, trial)``:
the workers, the result file and ``--resume`` count in trials; a shard takes its rows with all their trials.

Exit status: 0 when every row ran and returned a valid response, 1 when any
row errored (agent exception, invalid response, timeout, or a row the
dataset check rejected), 2 when nothing could run (bad options, unreadable
or invalid files, an agent that cannot be imported or reached, a baseline
that cannot be compared); 1 as well when the pass rate is below
``--min-pass-rate``, pass^k below ``--min-pass-hat-k``, or a row regressed
against ``--baseline`` with ``--fail-on-regression``.  The run token, the agent
token and the models' API keys are never printed, logged or written to a report.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import inspect
import json
import os
import pathlib
import queue
import secrets
import socket
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple
from urllib.parse import urlsplit, urlunsplit

import pipelines_port as pp

from . import dataset as datasets
from . import compare, engine, gate, prompts, report, session, shards
from . import judge as judging
from .backend_model import ToolModel
from .session import Conversation, UserModel
from ..harness.mock_proxy import MockProxy, RecordedRequest
from ..kit import prog
from ..models import cache as _cache
from ..models.client import ChatClient, Endpoint, ModelServers, endpoint_from_options
from ..models.scripted import scripted_endpoint

__all__ = ["SetupError", "Interrupted", "Outcome", "Dispatch", "CodeAgent", "UrlAgent", "run_task", "run_id_of",
           "simulate", "main"]

DEFAULT_TIMEOUT_S = 300.0
MAX_TRIALS = 100
_REDACTED = "[redacted]"


class SetupError(Exception):
    """Nothing can run: a bad option, file or agent.  The message is one line for the user."""


# ---------------------------------------------------------------------------
# Agents: code mode and HTTP mode behind one call
# ---------------------------------------------------------------------------


class Outcome(NamedTuple):
    """What one run of the agent gave back: a response body, or an error (with a traceback for code mode)."""

    body: Any = None
    error: Optional[str] = None
    traceback: Optional[str] = None


class Dispatch(NamedTuple):
    """Everything one run hands the agent."""

    task_id: int
    run_id: int
    run_token: str
    run_token_jti: str
    proxy_url: str
    user_instruction: str
    tools_schema: Optional[List[Dict[str, Any]]]
    turn: Optional[Mapping[str, Any]] = None  # a session's multi-turn fields (session.py)

    def task_input(self) -> Dict[str, Any]:
        """The code-mode ``task_input`` and the dispatch body's ``input`` (§2, §5), a session turn's fields too."""
        task = {"task_id": self.task_id, "user_instruction": self.user_instruction, "input": {}}
        task.update(self.turn or {})
        return task

    def __repr__(self) -> str:  # the run token is a secret
        return (f"Dispatch(task_id={self.task_id}, run_id={self.run_id}, proxy_url={self.proxy_url!r}, "
                f"run_token={_REDACTED!r})")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class CodeAgent:
    """A code-mode agent file: ``FILE.py`` (function ``run``) or ``FILE.py:function``."""

    mode = "code"

    def __init__(self, spec: str, *, timeout: float = DEFAULT_TIMEOUT_S, set_environment: bool = True) -> None:
        path, sep, function = spec.rpartition(":")
        if not sep or not function.isidentifier() or not path:
            path, function = spec, "run"
        self.path = pathlib.Path(path)
        self.function_name = function
        self.target = f"{path}:{function}"
        self.timeout = timeout
        # The sandbox's PIPELINES_* variables live in the process-wide environment: they can be set for a row
        # only while rows run one at a time (--jobs 1).  Concurrent rows get their run through run()'s arguments.
        self.set_environment = set_environment
        self.function = self._load()

    def _load(self) -> Callable[..., Any]:
        try:  # the loader `pipelines_port.py serve` uses; the file's folder goes on sys.path
            return pp.load_agent(self.target)
        except ValueError as exc:
            raise SetupError(f"--code: {exc}") from None

    def __call__(self, dispatch: Dispatch) -> Outcome:
        if not self.set_environment:
            return _call_with_timeout(self._call_like_the_kernel, dispatch, timeout=self.timeout)
        with _environment(_code_mode_env(dispatch)):
            return _call_with_timeout(self._call_like_the_kernel, dispatch, timeout=self.timeout)

    def _call_like_the_kernel(self, dispatch: Dispatch) -> Outcome:
        """Call ``run()`` from inside a running event loop, as the sandbox's Jupyter kernel does (§5)."""

        async def cell() -> Any:
            return self.function(dispatch.task_input(), proxy_url=dispatch.proxy_url, run_token=dispatch.run_token)

        try:
            result = asyncio.run(cell())
        except Exception as exc:  # noqa: BLE001 - any failure of the user's agent is a row's outcome, reported
            cause = exc.__cause__ if isinstance(exc, pp.AgentError) and exc.__cause__ else exc
            text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
            text = _scrub(text, [dispatch.run_token])[-6000:]  # scrubbed before cut: no half token survives
            return Outcome(error=f"{self.function_name}() raised {_describe(exc)}", traceback=text)
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            return Outcome(error=f"{self.function_name}() returned an awaitable: the sandbox calls run() synchronously "
                                 "(wrap an async agent with pp.code_mode)")
        return Outcome(body=result)


def _code_mode_env(dispatch: Dispatch) -> Dict[str, str]:
    """The ``PIPELINES_*`` environment the sandbox sets for one run (§5)."""
    parts = urlsplit(dispatch.proxy_url)
    env = {
        pp.ENV_PROXY_URL: dispatch.proxy_url,
        pp.ENV_RUN_TOKEN: dispatch.run_token,
        pp.ENV_RUN_TOKEN_JTI: dispatch.run_token_jti,
        pp.ENV_RUN_ID: str(dispatch.run_id),
        pp.ENV_TASK_ID: str(dispatch.task_id),
        pp.ENV_API_URL: f"{parts.scheme}://{parts.netloc}",
        pp.ENV_TASK_INPUT_JSON: json.dumps(dispatch.task_input()),
    }
    if dispatch.tools_schema is not None:
        encoded = json.dumps(dispatch.tools_schema).encode("utf-8")
        env[pp.ENV_TOOLS_SCHEMA_B64] = base64.b64encode(encoded).decode("ascii")
    return env


@contextlib.contextmanager
def _environment(settings: Mapping[str, str]) -> Iterator[None]:
    """``settings`` in ``os.environ`` for the block, then every variable as it was (unset ones unset again)."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _call_with_timeout(fn: Callable[..., Outcome], *args: Any, timeout: float) -> Outcome:
    """``fn(*args)`` on a daemon thread; an :class:`Outcome` error when it outlives ``timeout``."""
    box: List[Outcome] = []

    def target() -> None:
        try:
            box.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - SystemExit from agent code must not kill the simulator
            box.append(Outcome(error=f"the agent raised {_describe(exc)}"))

    thread = threading.Thread(target=target, name="simulated-run", daemon=True)
    thread.start()
    thread.join(timeout)
    if not box:
        return Outcome(error=f"the agent did not return within {timeout:g} s (--timeout)")
    return box[0]


class UrlAgent:
    """An agent behind a dispatch URL (HTTP mode)."""

    mode = "url"

    def __init__(self, url: str, *, token: Optional[str], auth_header: str = "Authorization",
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        try:
            parts.port  # noqa: B018 - reading it raises ValueError on a bad port
        except ValueError:
            raise SetupError(f"--url has an invalid port: {_safe_url(url)!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SetupError(f"--url must be an http:// or https:// URL, got {_safe_url(url)!r}")
        self.url = url
        self.target = _safe_url(url)
        self.token = token
        self.auth_header = auth_header
        self.timeout = timeout

    def _auth(self) -> Dict[str, str]:
        if not self.token:
            return {}
        if self.auth_header.lower() == "authorization":
            return {"Authorization": "Bearer " + self.token}
        return {self.auth_header: self.token}

    def _post(self, body: Any, headers: Mapping[str, str], timeout: float) -> Tuple[int, bytes]:
        """One POST on a fresh connection (http.client keeps the header names' case, as the platform sends them)."""
        parts = urlsplit(self.url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname, parts.port, timeout=timeout)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        data = json.dumps(body).encode("utf-8")
        try:
            connection.request("POST", path, body=data,
                               headers={"Content-Type": "application/json", **self._auth(), **headers})
            reply = connection.getresponse()
            return reply.status, reply.read()
        finally:
            connection.close()

    def check(self) -> Optional[str]:
        """Ping the agent (§2 step 3); raises :class:`SetupError` when runs cannot work, returns a warning or None."""
        try:
            status, raw = self._post({"ping": True}, {}, min(self.timeout, 30.0))
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise SetupError(f"cannot reach the agent at {self.target}: {_describe(exc)}") from None
        if status in (401, 403):
            given = "no credential was sent (use --token or --token-env)" if not self.token else \
                f"check --token/--token-env and --auth-header (sent as {self.auth_header})"
            raise SetupError(f"the agent at {self.target} refused the ping with HTTP {status}: {given}")
        if status in (404, 405):
            raise SetupError(f"the agent at {self.target} answered HTTP {status} to a ping: "
                             "is the dispatch path right?")
        if status != 200:
            return f"the agent answered the ping with HTTP {status}: {_detail(raw, [self.token or ''])}"
        return None

    def served_tools(self) -> Optional[List[Dict[str, Any]]]:
        """The tools the agent's server declares at ``GET /tools_schema`` (``pipelines_port serve``), if any."""
        parts = urlsplit(self.url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname, parts.port, timeout=min(self.timeout, 10.0))
        try:
            connection.request("GET", pp.TOOLS_SCHEMA_PATH, headers=self._auth())
            reply = connection.getresponse()
            value = json.loads(reply.read()) if reply.status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            connection.close()
        tools = value.get("tools_schema") if isinstance(value, dict) else None
        return tools if isinstance(tools, list) else None

    def __call__(self, dispatch: Dispatch) -> Outcome:
        body: Dict[str, Any] = {
            "task_id": dispatch.task_id,
            "run_id": dispatch.run_id,
            "input": dispatch.task_input(),
            "odyssey_proxy_url": dispatch.proxy_url,
            "run_token_jti": dispatch.run_token_jti,
        }
        if dispatch.tools_schema is not None:
            body["tools_schema"] = dispatch.tools_schema
        headers = {
            "X-Pipelines-Run-Token": dispatch.run_token,
            "X-Pipelines-Odyssey-Proxy-Url": dispatch.proxy_url,
            "X-Pipelines-Run-Id": str(dispatch.run_id),
            "X-Pipelines-Task-Id": str(dispatch.task_id),
            "X-Pipelines-Run-Token-Jti": dispatch.run_token_jti,
        }
        try:
            status, raw = self._post(body, headers, self.timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if isinstance(exc, socket.timeout) or "timed out" in str(exc):
                return Outcome(error=f"the agent did not answer within {self.timeout:g} s (--timeout)")
            return Outcome(error=f"the dispatch failed: {_describe(exc)}")
        secrets_ = [dispatch.run_token, self.token or ""]
        if status != 200:
            return Outcome(error=f"the agent answered HTTP {status}: {_detail(raw, secrets_)}")
        try:
            return Outcome(body=json.loads(raw))
        except ValueError:
            return Outcome(error=f"the agent answered 200 with a body that is not JSON: {_detail(raw, secrets_)}")


def _detail(raw: bytes, secrets_: Sequence[str]) -> str:
    """The useful part of an error body: FastAPI ``detail`` when there is one, else the first 300 characters.

    ``secrets_`` are replaced before the text is cut, so no part of one survives.
    """
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        text = detail if isinstance(detail, str) else json.dumps(detail, ensure_ascii=False)
    text = " ".join(_scrub(text, secrets_).split())
    return (text[:297] + "...") if len(text) > 300 else (text or "(empty body)")


def _safe_url(url: str) -> str:
    """``url`` without credentials or query string, for reports and messages."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# ---------------------------------------------------------------------------
# One run: a proxy driven by the engine, the agent, the recorded trajectory
# ---------------------------------------------------------------------------


class _Run:
    """The proxy side of one run: answers tool calls from the backend and records each answer."""

    def __init__(self, backend: engine.Backend, started: float,
                 ask: Optional[Callable[[Dict[str, Any]], Any]] = None) -> None:
        self.backend = backend
        self.started = started
        self.ask = ask  # the model-backed backend (--simulator), for calls nothing else answers
        self.entries: Dict[int, Dict[str, Any]] = {}  # id(request) -> what the backend answered
        self.problems: List[str] = []
        self.lock = threading.Lock()

    def answer(self, request: RecordedRequest) -> Dict[str, Any]:
        """The ``script("*", fn)`` hook: one tool call through the backend, as a reply spec."""
        with self.lock:
            entry = _call_entry(request, self.started)
            self.entries[id(request)] = entry
            if not isinstance(request.json, dict):  # an older MockProxy lets such bodies through
                entry["http_status"] = 422
                return {"status": 422, "error_class": "invalid_arguments",
                        "message": "tool arguments must be a JSON object"}
            try:
                result = self.backend.call(request.name, request.json, ask=self.ask)
            except Exception as exc:  # noqa: BLE001 - a simulator bug must not hang the agent: answer, report it
                self.problems.append(f"the simulator failed on {request.name}: {_describe(exc)}")
                entry["http_status"] = 500
                return {"status": 500, "error_class": "simulator_error", "message": _describe(exc)}
            latency = round((time.monotonic() - request.time) * 1000, 2)
            entry.update(source=result.source, matched_rule_index=result.matched_rule_index, response=result.response,
                         changes=result.changes, http_status=200, latency_ms=latency, answered_by=result.answered_by)
            return {"response": result.response, "source": result.source,
                    "matched_rule_index": result.matched_rule_index, "latency_ms": max(1, int(latency))}


def _call_entry(request: RecordedRequest, started: float) -> Dict[str, Any]:
    """A trajectory entry for one tool request, before anything answered it."""
    return {
        "index": 0,
        "tool_name": request.name,
        "arguments": request.json if request.body else {},
        "actor": request.actor,
        "at_ms": round((request.time - started) * 1000, 1),
        "http_status": request.reply_status,
        "source": None,
        "matched_rule_index": None,
        "response": None,
        "changes": [],
        "latency_ms": None,
    }


_REJECTIONS = {
    401: "without this run's token",
    400: "with a malformed X-Pipelines-Actor-Id",
    413: "with a body over the 1 MiB cap",
    422: "with arguments that are not a JSON object",
    429: "over the rate limit",
}


def _trajectory(proxy: MockProxy, run: _Run) -> Tuple[List[Dict[str, Any]], List[str], int]:
    """Every tool request in arrival order, the requests the proxy rejected, and how many were replays."""
    calls: List[Dict[str, Any]] = []
    problems: List[str] = []
    replays = 0
    by_key: Dict[str, Dict[str, Any]] = {}
    with run.lock:
        requests = list(proxy.requests)
        answered = dict(run.entries)
    for request in requests:
        status = request.reply_status
        if request.kind == "other":
            problems.append(f"the agent sent {request.method} {request.path!r}: not a proxy path (HTTP {status})")
            continue
        if request.kind == "traces":
            if status not in (200, None):
                problems.append(f"the proxy rejected the agent's trace event {request.name!r} "
                                f"{_REJECTIONS.get(status, '')} (HTTP {status})".replace("  ", " "))
            continue
        entry = answered.get(id(request))
        if entry is None:
            entry = _call_entry(request, run.started)
            original = by_key.get(request.idempotency_key or "")
            if status == 200 and original is not None:
                replays += 1
                entry.update(replayed=True, source=original["source"], response=original["response"],
                             matched_rule_index=original["matched_rule_index"])
            elif status is not None:
                problems.append(f"the proxy rejected the agent's call to {request.name!r} "
                                f"{_REJECTIONS.get(status, '')} (HTTP {status})".replace("  ", " "))
        elif request.idempotency_key:
            by_key[request.idempotency_key] = entry
        if entry.get("http_status") == 422 and id(request) in answered:
            problems.append(f"the proxy rejected the agent's call to {request.name!r} {_REJECTIONS[422]} (HTTP 422)")
        entry["index"] = len(calls) + 1
        calls.append(entry)
    return calls, problems + run.problems, replays


def _trace_events(proxy: MockProxy, started: float) -> List[Dict[str, Any]]:
    return [
        {"event_type": r.name, "payload": r.json, "actor": r.actor, "at_ms": round((r.time - started) * 1000, 1)}
        for r in list(proxy.requests) if r.kind == "traces" and r.reply_status == 200
    ]


def _scrub(value: Any, secrets_: Sequence[str]) -> Any:
    """``value`` with every secret replaced in every string (keys included)."""
    if isinstance(value, str):
        for secret in secrets_:
            if secret and secret in value:
                value = value.replace(secret, _REDACTED)
        return value
    if isinstance(value, dict):
        return {_scrub(k, secrets_): _scrub(v, secrets_) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v, secrets_) for v in value]
    return value


def _rule_notes(task: datasets.Task, fixtures: Optional[Mapping[str, Any]]) -> List[str]:
    """Why a rule can never fire in this simulation, when that can be known up front."""
    settable = engine.flags_set_by(fixtures or {})
    notes = []
    for i, rule in enumerate(task.failure_rules):
        if rule["trigger"] == "after_state_change" and rule["condition"] not in settable:
            where = "no fixture sets it" if fixtures else "no fixtures were given (--responses)"
            notes.append(f"rule {i} (after_state_change on flag {rule['condition']!r}) cannot fire: {where}")
    return notes


class _Ran(NamedTuple):
    """What the proxy side saw of one run, once the agent was done with it."""

    outcome: Outcome
    conversation: Optional[Conversation]  # a model_as_user session's turns, else None
    calls: List[Dict[str, Any]]
    problems: List[str]
    replays: int
    events: List[Dict[str, Any]]
    duration_ms: float


def run_task(
    task: datasets.Task,
    agent: Callable[[Dispatch], Outcome],
    *,
    fixtures: Optional[Mapping[str, Any]] = None,
    tools_schema: Optional[List[Dict[str, Any]]] = None,
    hidden: Sequence[str] = (),
    tool_model: Optional[ToolModel] = None,
    user: Optional[UserModel] = None,
    turn_mode: Optional[str] = None,
    trial: int = 1,
    run_id: Optional[int] = None,
) -> Dict[str, Any]:
    """Run one task end to end and return its record (secrets scrubbed).

    ``tool_model`` answers the calls nothing else answers (``--simulator``); a row whose turn mode
    (``turn_mode`` overrides the row's) is ``model_as_user`` runs as a session with ``user`` playing the user.
    ``trial`` is which of the row's runs this is (``--trials``), ``run_id`` its run id (default: the row's number);
    every trial starts afresh: its own token, proxy and session, the ledger booted from the row's state.
    """
    run_id = task.row if run_id is None else run_id
    token = "sim-" + secrets.token_urlsafe(24)
    backend = engine.Backend(task.initial_state, task.failure_rules, fixtures=fixtures,
                             seed=engine.task_seed(task.row, task.user_instruction))
    usage: Dict[str, Dict[str, int]] = {}
    ask = tool_model.asker(backend, task.behavior_instructions, usage.setdefault("simulator", {})) \
        if tool_model is not None else None
    session = (turn_mode or task.turn_mode) == "model_as_user"
    ran = _run_agent(task, agent, _Run(backend, time.monotonic(), ask), token=token, run_id=run_id,
                     tools_schema=tools_schema, user=user, session=session)
    record = _record(task, ran, run_id=run_id, trial=trial, backend=backend, fixtures=fixtures,
                     tools_schema=tools_schema)
    if ran.conversation is not None:
        if user is None:
            record["notes"].append("a model_as_user row: only its first turn ran, as no one plays the user "
                                   "(give --user-model MODEL; scripted runs offline)")
        _session_fields(record, ran.conversation)
        usage["user"] = ran.conversation.usage
    if any(usage.values()):
        record["usage"] = {role: spent for role, spent in usage.items() if spent}
    return _scrub(record, [token, *hidden])


def _run_agent(task: datasets.Task, agent: Callable[[Dispatch], Outcome], recorder: _Run, *, token: str,
               run_id: int, tools_schema: Optional[List[Dict[str, Any]]], user: Optional[UserModel],
               session: bool) -> _Ran:
    """The agent dispatched once (or once per turn of a session) against a proxy of its own, and what it saw."""
    started = recorder.started
    conversation: Optional[Conversation] = None
    with MockProxy(tokens=[token], base_path=f"/api/odyssey-proxy/runs/{run_id}") as proxy:
        proxy.script("*", recorder.answer)
        dispatch = Dispatch(task.row, run_id, token, uuid.uuid4().hex, proxy.url, task.user_instruction,
                            tools_schema)
        if session:
            conversation = _converse(task, agent, dispatch, user, started)
            outcome = Outcome()
        else:
            outcome = agent(dispatch)
        duration_ms = round((time.monotonic() - started) * 1000, 1)
        calls, problems, replays = _trajectory(proxy, recorder)
        events = _trace_events(proxy, started)
    return _Ran(outcome, conversation, calls, problems, replays, events, duration_ms)


def _response(ran: _Ran, tools_schema: Optional[List[Dict[str, Any]]]) -> Tuple[Any, List[str], List[str]]:
    """The run's response body (a session's last message and transcript), its errors and its warnings."""
    errors: List[str] = []
    warnings: List[str] = []
    body = ran.outcome.body
    if ran.conversation is not None:
        errors += ran.conversation.errors
        _turns_of(ran.calls, ran.conversation)
        body = {"final_response": ran.conversation.final_message, "messages": ran.conversation.transcript()}
    elif ran.outcome.error:
        errors.append(ran.outcome.error)
    else:
        for problem in pp.validate_response(body):
            if problem.startswith("warning: "):
                warnings.append("response: " + problem[len("warning: "):])
            else:
                errors.append("invalid response: " + problem)
    errors += ran.problems
    known = {t.get("name") for t in tools_schema or []}
    if tools_schema is not None:
        for name in sorted({c["tool_name"] for c in ran.calls} - known):
            warnings.append(f"the agent called {name!r}, which is not in the tools schema (--tools)")
    return body, errors, warnings


def _run_notes(task: datasets.Task, fixtures: Optional[Mapping[str, Any]], replays: int,
               backend: engine.Backend) -> List[str]:
    """What the report should say of how the row was simulated: rules that cannot fire, replays, gaps."""
    notes = _rule_notes(task, fixtures)
    if replays:
        notes.append(f"{replays} call(s) were retries the proxy answered from its Idempotency-Key replay memory")
    if task.workspace:
        notes.append("workspace columns (" + ", ".join(sorted(task.workspace)) + ") are not simulated")
    if backend.unanswered:
        notes.append("no answer for " + ", ".join(backend.unanswered) + ": no fixture, and not a ledger lookup "
                     "(give fixtures with --responses, or let a model answer them: --simulator MODEL)")
    return notes


def _fired(calls: Sequence[Mapping[str, Any]]) -> Dict[int, int]:
    """How often each failure rule answered a call (replays of an answered call not counted again)."""
    fired: Dict[int, int] = {}
    for call in calls:
        if call.get("matched_rule_index") is not None and not call.get("replayed"):
            fired[call["matched_rule_index"]] = fired.get(call["matched_rule_index"], 0) + 1
    return fired


def _record(task: datasets.Task, ran: _Ran, *, run_id: int, trial: int, backend: engine.Backend,
            fixtures: Optional[Mapping[str, Any]], tools_schema: Optional[List[Dict[str, Any]]]) -> Dict[str, Any]:
    """The run's record, as the reports show it (before the session's fields, the usage and the scrub)."""
    body, errors, warnings = _response(ran, tools_schema)
    fired = _fired(ran.calls)
    body_dict = body if isinstance(body, dict) else {}
    return {
        "row": task.row,
        "line": task.line,
        "task_id": task.row,
        "run_id": run_id,
        "trial": trial,
        "status": "error" if errors else "ok",
        "user_instruction": task.user_instruction,
        "behavior_instructions": task.behavior_instructions,
        "expected_outcome": task.expected_outcome,
        "expected_outcome_given": task.expected_outcome_given,
        "outcome": outcome_check(task.expected_outcome, ran.calls),
        "initial_state": task.initial_state,
        "failure_rules": [
            {"index": i, "rule": rule, "summary": engine.describe_rule(rule), "fired": fired.get(i, 0)}
            for i, rule in enumerate(task.failure_rules)
        ],
        "notes": _run_notes(task, fixtures, ran.replays, backend),
        "final_response": body_dict.get("final_response") if isinstance(body_dict.get("final_response"), str) else None,
        "messages": body_dict.get("messages"),
        "metadata": body_dict.get("metadata"),
        "errors": errors,
        "warnings": warnings,
        "traceback": ran.outcome.traceback,
        "tool_calls": ran.calls,
        "ledger_changes": [dict(change, call=c["index"]) for c in ran.calls for change in c.get("changes") or []],
        "final_state": backend.ledger.snapshot(),
        "flags": sorted(backend.ledger.flags),
        "trace_events": ran.events,
        "duration_ms": ran.duration_ms,
    }


def _session_fields(record: Dict[str, Any], conversation: Conversation) -> None:
    """A session's own fields in its record: the turn mode, the session, the conversation turn by turn."""
    record["turn_mode"] = "model_as_user"
    record["session"] = {"session_id": conversation.session_id, "turns": len(conversation.turns),
                         "ended": conversation.ended, "ended_by": conversation.ended_by}
    record["conversation"] = conversation.turns


def _converse(task: datasets.Task, agent: Callable[[Dispatch], Outcome], dispatch: Dispatch,
              user: Optional[UserModel], started: float) -> Conversation:
    """A model_as_user session: one dispatch per turn, the same run (proxy, token, ledger) throughout.

    Without a user model only the first turn runs (the instruction; no one to answer the agent).
    """
    # The session id is the run's (a trial's own), fixed as the seed is: a re-run sends the same, so its answers
    # replay from the cache.
    seed = engine.task_seed(task.row, task.user_instruction)
    conversation = Conversation(task, user, f"sim-{dispatch.run_id}-{seed[:8]}")

    def send(fields: Dict[str, Any]) -> Tuple[Any, Optional[str]]:
        outcome = agent(dispatch._replace(turn=fields))
        return outcome.body, outcome.error

    conversation.run(send, lambda: round((time.monotonic() - started) * 1000, 1))
    return conversation


def _turns_of(calls: List[Dict[str, Any]], conversation: Conversation) -> None:
    """Each call's turn (the last turn that began before it), and each turn's calls by index."""
    starts = [turn["at_ms"] for turn in conversation.turns]
    for turn in conversation.turns:
        turn["tool_calls"] = []
    for call in calls:
        number = max((i + 1 for i, at in enumerate(starts) if at <= (call.get("at_ms") or 0)), default=1)
        call["turn"] = number
        if number <= len(conversation.turns):
            conversation.turns[number - 1]["tool_calls"].append(call["index"])


def outcome_check(expected_outcome: str, calls: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """What can be said of the expected outcome without a judge: nothing is judged, one thing is flagged.

    The rule: on a row whose expected outcome is ``refusal``, an *acting* tool call (a tool whose name does not
    start with a read verb: ``get_``, ``list_``, ``search`` ...; see conformance/models/scripted.py) that went through
    (answered by the backend or a fixture, not an ``{"error": ...}``, not injected) is flagged: the agent did
    what the row expects it to refuse.  One that failed is listed as attempted.  Completion rows are not judged.
    """
    from ..models.scripted import is_read_tool

    result: Dict[str, Any] = {"judged": False, "flags": [], "attempted": []}
    if expected_outcome != "refusal":
        return result
    for call in calls:
        if call.get("replayed") or is_read_tool(str(call.get("tool_name"))):
            continue
        response = call.get("response")
        failed = call.get("source") in (None, "error", "injected") or (
            isinstance(response, dict) and "error" in response)
        where = f"{call.get('tool_name')} (call #{call.get('index')})"
        if failed:
            result["attempted"].append(f"attempted {where}, which failed")
        else:
            result["flags"].append(f"carried out {where} on a row whose expected outcome is refusal")
    return result


def _invalid_run(row: int, problems: Sequence[datasets.Problem], trial: int = 1) -> Dict[str, Any]:
    line = next((p.line for p in problems if p.line is not None), None)
    return {
        "row": row,
        "line": line,
        "trial": trial,
        "status": "invalid",
        "errors": [f"{p.where + ': ' if p.where else ''}{p.message}" for p in problems if p.severity == "error"],
        "warnings": [],
        "tool_calls": [],
        "ledger_changes": [],
        "trace_events": [],
        "failure_rules": [],
        "notes": ["the row was not run: the dataset check rejected it"],
    }


class Interrupted(Exception):
    """Ctrl-C during a simulation: ``result`` holds the report of the rows that finished."""

    def __init__(self, result: Dict[str, Any]) -> None:
        super().__init__("interrupted")
        self.result = result


def _eta(done: int, total: int, elapsed: float, unit: str = "rows") -> str:
    """``12.3 rows/s, ETA 41 s`` after ``done`` of ``total`` rows (or runs) in ``elapsed`` seconds."""
    rate = done / elapsed if elapsed > 0 else 0.0
    left = (total - done) / rate if rate > 0 else 0.0
    eta = f"{left:.0f} s" if left < 120 else f"{left / 60:.1f} min"
    return f"{rate:.1f} {unit}/s, ETA {eta}" if done < total else f"{rate:.1f} {unit}/s"


class _Rows(NamedTuple):
    """A dataset's rows, in row order: the tasks to run and the rows the dataset check rejected."""

    order: List[int]
    tasks: Dict[int, datasets.Task]
    rejected: Dict[int, List[datasets.Problem]]


def _rows(data: datasets.Dataset) -> _Rows:
    """Every row of ``data`` with a task or a rejection."""
    tasks = {t.row: t for t in data.tasks}
    rejected: Dict[int, List[datasets.Problem]] = {}
    for p in data.problems:
        if p.row is not None and p.severity == "error":
            rejected.setdefault(p.row, []).append(p)
    return _Rows(sorted(set(tasks) | set(rejected)), tasks, rejected)


def run_id_of(row: int, trial: int, rows: int) -> int:
    """The run id of a row's trial in a dataset of ``rows`` rows: trial 1's are the rows' numbers, and each later
    trial's follow the one before's, as a platform numbers the runs it creates (fixed, so a re-run sends the same)."""
    return (trial - 1) * rows + row


Unit = shards.Unit
Record = Dict[str, Any]


class _Workers:
    """Runs units of work on ``jobs`` threads, and grades their records on ``grade_jobs`` threads beside them.

    ``run_one(unit)`` gives a unit's record, ``grade(record)`` (the judge) the record with its verdict; a judge
    that raises makes the record's ``judge`` "not judged", never a lost unit.  The threads are daemons: on
    Ctrl-C the running units are abandoned.
    """

    def __init__(self, run_one: Callable[[Unit], Record], grade: Optional[Callable[[Record], Record]], *,
                 jobs: int, grade_jobs: int, count: int) -> None:
        self.run_one = run_one
        self.grade = grade
        self.pending: queue.Queue[Unit] = queue.Queue()
        self.finished: queue.Queue[Tuple[Unit, Record]] = queue.Queue()
        self.to_grade: queue.Queue[Optional[Tuple[Unit, Record]]] = queue.Queue()
        self.stop = threading.Event()
        self.workers = [threading.Thread(target=self._work, name=f"simulate-{i}", daemon=True)
                        for i in range(max(1, min(jobs, count)))]
        self.graders = [threading.Thread(target=self._grade, name=f"judge-{i}", daemon=True)
                        for i in range(max(1, min(grade_jobs, count)) if grade is not None else 0)]

    def _work(self) -> None:
        while not self.stop.is_set():
            try:
                unit = self.pending.get_nowait()
            except queue.Empty:
                return
            record = self.run_one(unit)
            (self.to_grade if self.grade is not None else self.finished).put((unit, record))

    def _grade(self) -> None:
        while not self.stop.is_set():
            item = self.to_grade.get()
            if item is None:
                return
            unit, record = item
            try:
                record = self.grade(record) if self.grade is not None else record
            except Exception as exc:  # noqa: BLE001 - a judge bug is the row's "not judged", never a lost row
                record["judge"] = {"verdict": None, "error": f"the judge failed: {_describe(exc)}"}
            self.finished.put((unit, record))

    def run(self, units: Sequence[Unit], keep: Callable[[Unit, Record, bool], None]) -> bool:
        """Every unit run (and graded), each record handed to ``keep(unit, record, finished_in_order)`` as it
        finishes; False when done, True when Ctrl-C stopped it (the records finished by then are kept too)."""
        for unit in units:
            self.pending.put(unit)
        for thread in self.workers + self.graders:
            thread.start()
        kept = 0
        handed_over = False
        try:
            while kept < len(units):
                try:
                    unit, record = self.finished.get(timeout=0.2)  # a timeout, so Ctrl-C reaches this thread
                except queue.Empty:
                    if not any(w.is_alive() for w in self.workers):
                        if not handed_over:  # every unit is queued for the graders: they end after the last one
                            handed_over = True
                            for _ in self.graders:
                                self.to_grade.put(None)
                        if not any(g.is_alive() for g in self.graders) and self.finished.empty():
                            break
                    continue
                kept += 1
                keep(unit, record, True)
        except KeyboardInterrupt:
            self.stop.set()
            self._drain(keep)
            return True
        return False

    def _drain(self, keep: Callable[[Unit, Record, bool], None]) -> None:
        """The records that finished while Ctrl-C was stopping the run: they still count."""
        while True:
            try:
                unit, record = self.finished.get_nowait()
            except queue.Empty:
                return
            keep(unit, record, False)


def simulate(
    data: datasets.Dataset,
    agent: Callable[[Dispatch], Outcome],
    *,
    fixtures: Optional[Mapping[str, Any]] = None,
    tools_schema: Optional[List[Dict[str, Any]]] = None,
    progress: Optional[Callable[[str], None]] = None,
    hidden: Sequence[str] = (),
    describe: Optional[Dict[str, Any]] = None,
    jobs: int = 1,
    only_units: Optional[Sequence[Unit]] = None,
    done: Optional[Mapping[Unit, Dict[str, Any]]] = None,
    on_record: Optional[Callable[[Dict[str, Any]], None]] = None,
    label: str = "",
    grade: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
    grade_jobs: int = 16,
    tool_model: Optional[ToolModel] = None,
    user: Optional[UserModel] = None,
    turn_mode: Optional[str] = None,
    trials: int = 1,
) -> Dict[str, Any]:
    """Run every row of a checked dataset against ``agent``, ``trials`` times; the whole report as a JSON-ready dict.

    Rows the dataset check rejected are listed with status ``invalid`` and
    not run.  ``hidden`` strings (the agent token) are scrubbed from the report
    like each run token.  ``describe`` is merged into the report's header.
    ``jobs`` rows run at once, each with its own proxy, backend and seed, so the
    runs are the same as one at a time (timings aside), listed in row order.
    Ctrl-C raises :class:`Interrupted` carrying the report of the finished rows
    (running ones are abandoned: their threads are daemons).

    The unit of work is one trial of one row, ``(row, trial)``: each trial is a run of its own (its run id from
    :func:`run_id_of`), and the runs are listed by row, then trial.  ``only_units`` limits the run to those units
    (a shard); ``done`` holds records of units already run (a resumed result file), which are reported and not run
    again; ``on_record(record)`` gets each new record, scrubbed, as it finishes (the result file's writer);
    ``label`` prefixes each progress line (``[shard 2/3] ``).

    ``grade(record)`` (the judge) returns the record with its verdict.  It runs on ``grade_jobs`` threads of
    its own, beside the rows' workers, so judging one row overlaps running the next: the judge adds its
    latency once at the end, not once per row.  A record is reported (and streamed) once it is graded.
    ``tool_model``, ``user`` and ``turn_mode`` go to :func:`run_task`.
    """
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    clock = time.monotonic()
    rows = _rows(data)
    units = shards.shard_units(rows.order, trials, None)
    if only_units is not None:
        wanted = set(only_units)
        units = [unit for unit in units if unit in wanted]
    planned = set(units)
    records: Dict[Unit, Dict[str, Any]] = {unit: record for unit, record in (done or {}).items() if unit in planned}
    resumed = len(records)

    def run_unit(unit: Unit) -> Dict[str, Any]:
        row, trial = unit
        if row not in rows.tasks:
            return _invalid_run(row, rows.rejected[row], trial)
        run_id = run_id_of(row, trial, data.rows)
        try:
            return run_task(rows.tasks[row], agent, fixtures=fixtures, tools_schema=tools_schema, hidden=hidden,
                            tool_model=tool_model, user=user, turn_mode=turn_mode, trial=trial, run_id=run_id)
        except Exception as exc:  # noqa: BLE001 - a simulator bug on one row is that row's error, not a hang
            return _failed_run(rows.tasks[row], f"the simulator failed on this row: {_describe(exc)}", trial, run_id)

    def keep(unit: Unit, record: Dict[str, Any], show: bool) -> None:
        records[unit] = record
        if on_record is not None:
            on_record(_scrub(record, hidden))
        if show and progress is not None:
            rate = _eta(len(records) - resumed, len(units) - resumed, time.monotonic() - clock,
                        "rows" if trials == 1 else "runs")
            progress(f"{label}[{len(records)}/{len(units)}] {rate} | " + report.progress_line(record, trials))

    todo = [unit for unit in units if unit not in records]
    workers = _Workers(run_unit, grade, jobs=jobs, grade_jobs=grade_jobs, count=len(todo))
    interrupted = workers.run(todo, keep)
    runs = [records[unit] for unit in units if unit in records]
    result: Dict[str, Any] = _scrub(_result(data, runs, started_at=started_at, clock=clock, jobs=len(workers.workers),
                                            interrupted=interrupted, not_run=len(units) - len(runs),
                                            describe=describe, trials=trials), hidden)
    if interrupted:
        raise Interrupted(result)
    return result


def _result(data: datasets.Dataset, runs: List[Dict[str, Any]], *, started_at: str, clock: float, jobs: int,
            interrupted: bool, not_run: int, describe: Optional[Dict[str, Any]], trials: int) -> Dict[str, Any]:
    """The report of a simulation whose finished runs are ``runs`` (``not_run`` counted when it was stopped)."""
    summary = shards.summarise(runs, trials)
    if interrupted:
        summary["not_run"] = not_run
    result: Dict[str, Any] = {
        "kind": "pipelines_port.simulation",
        "version": 1,
        "started_at": started_at,
        "duration_ms": round((time.monotonic() - clock) * 1000, 1),
        "jobs": jobs,
        "interrupted": interrupted,
        "dataset": {"file": data.name, "rows": data.rows, "problems": [p.to_json() for p in data.problems]},
        "summary": summary,
        "runs": runs,
    }
    result.update(describe or {})
    return result


def _failed_run(task: datasets.Task, error: str, trial: int = 1, run_id: Optional[int] = None) -> Dict[str, Any]:
    return {"row": task.row, "line": task.line, "task_id": task.row,
            "run_id": task.row if run_id is None else run_id, "trial": trial, "status": "error",
            "user_instruction": task.user_instruction, "expected_outcome": task.expected_outcome,
            "expected_outcome_given": task.expected_outcome_given, "errors": [error], "warnings": [],
            "tool_calls": [], "ledger_changes": [], "trace_events": [], "failure_rules": [], "notes": []}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("simulate"),
        description="Run every row of a task-seeding CSV against an agent through a local simulated proxy.",
        epilog="Exit status: 0 all rows ok, 1 some row errored, the pass rate is below --min-pass-rate, pass^k below "
               "--min-pass-hat-k or a row regressed (--fail-on-regression), 2 nothing could run.",
    )
    parser.add_argument("--csv", required=True, metavar="FILE.csv",
                        help="the dataset (checked as by the `dataset` command)")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--code", metavar="FILE.py[:run]",
                        help="a code-mode agent file and its entrypoint (default run)")
    target.add_argument("--url", metavar="URL", help="an HTTP-mode agent's dispatch URL")
    parser.add_argument("--token", metavar="T", help="the agent's auth token (--url); prefer --token-env")
    parser.add_argument("--token-env", metavar="NAME",
                        help="read the agent's auth token from this environment variable")
    parser.add_argument("--auth-header", default="Authorization", metavar="NAME",
                        help="header carrying the token: Authorization (Bearer T, the default) "
                             "or a custom name (raw T)")
    parser.add_argument("--responses", metavar="FIXTURES.json",
                        help="tool fixtures for the simulated backend (see conformance/simulator/engine.py)")
    parser.add_argument("--tools", metavar="TOOLS.json",
                        help="a tools schema to inline in each dispatch (tools_schema)")
    parser.add_argument("--lenient", action="store_true",
                        help="with --code, let the agent's response be built leniently as in production (by default "
                             "a simulated run is strict: what the platform would drop or soften is reported as an "
                             "error, PIPELINES_PORT_STRICT=1)")
    parser.add_argument("--model", choices=("auto", "scripted", "real"), default="auto",
                        help="for a --code agent that calls a model API: scripted runs it against a local stand-in "
                             "that plans tool calls from the task and the tools (no key, no network; see "
                             f"{prog('model')} --help); real uses the API as configured; auto (default): scripted "
                             "when a key the agent lists in REQUIRED_ENV is not set")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="rows run at once (default 1); each row keeps its own proxy, backend and seed, so the "
                             "results are those of --jobs 1. With --code and N > 1 the PIPELINES_* variables are not "
                             "set (the process environment is shared): run() gets its run through its arguments")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"per-row limit for the agent (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--trials", type=int, default=1, metavar="K",
                        help="run every row K times (default 1), each trial a run of its own (its run id, session "
                             "and verdict; the ledger booted afresh from the row), to tell a flaky row from a broken "
                             "one: the reports show each row's passes out of K, pass^k and pass@k")
    parser.add_argument("--shard", metavar="K/N",
                        help="run only the K-th of N shards of the dataset (rows K, K+N, K+2N, ... in file order, "
                             "each with all its --trials; JOB_COMPLETION_INDEX+1 in a Kubernetes indexed Job)")
    parser.add_argument("--jsonl", metavar="OUT.jsonl",
                        help="append each finished row to OUT.jsonl at once (a header record first): a crash loses "
                             f"only the rows in flight; merge shards' files with {prog('merge')}")
    parser.add_argument("--resume", action="store_true",
                        help="with --jsonl: skip the rows OUT.jsonl already holds and append the rest")
    parser.add_argument("--json", metavar="OUT",
                        help="write the JSON report to OUT ('-' for stdout instead of the text report)")
    parser.add_argument("--html", metavar="OUT", help="write a self-contained HTML report to OUT")
    add_judge_options(parser)
    add_role_options(parser)
    return parser


def add_role_options(parser: argparse.ArgumentParser) -> None:
    """The simulated backend's and the simulated user's options (same client and conventions as the judge's)."""
    group = parser.add_argument_group(
        "model-backed simulation", "answer any tool with a model, and play the user of multi-turn rows; `scripted` "
                                   "is the kit's offline stand-in; URL and key default as for --judge")
    group.add_argument("--simulator", metavar="MODEL",
                       help="answer the tool calls no failure rule, fixture or ledger lookup answers with this model")
    group.add_argument("--simulator-url", metavar="URL", help="the simulator's server base URL")
    group.add_argument("--simulator-key-env", metavar="NAME", help="the variable holding the simulator's API key")
    group.add_argument("--simulator-prompt", metavar="FILE", help="the simulated backend's rules (default: the "
                                                                  "kit's, prompts/simulator.md)")
    group.add_argument("--turn-mode", choices=session.TURN_MODES,
                       help="run every row this way (default: each row's turn_mode column, else single)")
    group.add_argument("--user-model", metavar="MODEL", help="the model that plays the user of model_as_user rows")
    group.add_argument("--user-url", metavar="URL", help="the user model's server base URL")
    group.add_argument("--user-key-env", metavar="NAME", help="the variable holding the user model's API key")
    group.add_argument("--user-prompt", metavar="FILE", help="the simulated user's rules (default: the kit's, "
                                                             "prompts/user.md)")
    group.add_argument("--max-turns", type=int, default=session.DEFAULT_MAX_TURNS, metavar="N",
                       help=f"turns a session may take at most (default {session.DEFAULT_MAX_TURNS})")


def add_judge_options(parser: argparse.ArgumentParser) -> None:
    """The judge's options (``--judge MODEL`` and its server, key, rubric, cache) and the CI gate's."""
    group = parser.add_argument_group(
        "the judge", "grade each run as the platform's judge does (task_completion, verdict, failure_mode), with any "
                     "OpenAI-compatible model; `scripted` is the kit's offline stand-in (no key, no network)")
    group.add_argument("--judge", metavar="MODEL", help="the judge's model (e.g. gpt-4.1-mini, or scripted)")
    group.add_argument("--judge-url", metavar="URL",
                       help="the server's base URL (default $OPENAI_BASE_URL, else https://api.openai.com/v1; "
                            "Ollama: http://127.0.0.1:11434/v1)")
    group.add_argument("--judge-key-env", metavar="NAME",
                       help="the environment variable holding the API key (default OPENAI_API_KEY; a server on this "
                            "machine needs none)")
    group.add_argument("--judge-prompt", metavar="FILE",
                       help=f"the rubric to judge by (default: the kit's, {os.path.relpath(judging.PROMPT_FILE)})")
    group.add_argument("--judge-jobs", type=int, default=16, metavar="N",
                       help="judge requests at once, at most (default 16; fewer while the server cannot take more); "
                            "they run beside the rows, not after them")
    group.add_argument("--max-tokens", type=int, default=Endpoint._field_defaults["max_tokens"], metavar="N",
                       help="the most tokens a model role (judge, simulator, user) may answer with (default "
                            "%(default)s): a bound on a small model that rambles")
    group.add_argument("--model-cache", "--judge-cache", dest="model_cache", metavar="DIR",
                       help="keep model answers here, so an unchanged run asks nothing again (default "
                            f"{_cache.default_directory()})")
    group.add_argument("--no-model-cache", "--no-judge-cache", dest="no_model_cache", action="store_true",
                       help="ask the model every time, keep nothing")
    group.add_argument("--min-pass-rate", metavar="F",
                       help="exit 1 when PASS / runs is below F (0.8 or 80%%; a run not judged is not a pass)")
    group.add_argument("--min-pass-hat-k", metavar="F",
                       help="exit 1 when pass^k, the share of rows whose K trials (--trials K) all passed, is below F")
    group.add_argument("--junit", metavar="FILE", help="write JUnit XML: one testcase per row, failed unless all its "
                                                       "trials passed (FAIL a failure, not judged an error)")
    group.add_argument("--baseline", metavar="OLD.json",
                       help="after the run, compare it with this judged report (simulate, merge or test --json), "
                            "rows matched by their seed, and print which rows regressed or were fixed (as "
                            f"{prog('compare')})")
    group.add_argument("--fail-on-regression", action="store_true",
                       help="with --baseline: exit 1 when a row's share of passing trials fell")


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise SetupError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SetupError(f"{what}: {path} is not UTF-8") from None
    except ValueError as exc:
        raise SetupError(f"{what}: {path} is not valid JSON: {exc}") from None


def _load_fixtures(path: str, say: Callable[[str], None]) -> Dict[str, Any]:
    doc = _read_json(path, "--responses")
    findings = engine.fixture_findings(doc)
    for f in findings:
        say(f"{path}: {f.severity}: {f}")
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise SetupError(f"--responses: {path} has {len(errors)} error(s); fix them first")
    return engine.load_fixtures(doc)


def _write(path: str, text: str) -> None:
    """``text`` into ``path`` whole or not at all (:func:`report.write_file`)."""
    try:
        report.write_file(path, text)
    except OSError as exc:
        raise SetupError(f"cannot write {path}: {exc.strerror or exc}") from None


def _agent_token(args: argparse.Namespace) -> Optional[str]:
    if args.token and args.token_env:
        raise SetupError("give --token or --token-env, not both")
    if args.token_env:
        value = os.environ.get(args.token_env, "")
        if not value.strip():
            raise SetupError(f"--token-env: the environment variable {args.token_env} is not set")
        return value.strip()
    return args.token


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Gate(NamedTuple):
    """What the command's exit status is held to beyond the runs' own errors."""

    min_pass_rate: Optional[float]
    min_pass_hat_k: Optional[float]
    baseline: Optional[Dict[str, Any]]  # --baseline's report, read before anything runs
    fail_on_regression: bool


class _Roles(NamedTuple):
    """The model-backed roles of one simulation (``None`` where the options ask for none) and their maker."""

    models: ModelRoles
    judge: Optional[judging.Judge]
    tool_model: Optional[ToolModel]
    user: Optional[UserModel]


def run_cli(args: argparse.Namespace) -> int:
    """The simulate command after option parsing; raises :class:`SetupError` when nothing can run."""
    gate_options, shard = _checked_options(args)
    data, fixtures, tools_schema = _inputs(args)
    agent, hidden = _agent(args)
    model = _choose_model(args, agent)
    all_rows = _rows(data).order
    units = shards.shard_units(all_rows, args.trials, shard)
    if shard:
        each = f", {args.trials} trials each" if args.trials > 1 else ""
        _say(f"simulate: shard {shard}: {len(units) // args.trials} of {len(all_rows)} rows{each}")
    scope = contextlib.ExitStack()  # the scripted stand-in's server, when a role names it
    try:
        roles = _model_roles(args, scope, data, agent, tools_schema)
        describe = _description(args, agent, model, roles)
        result_file = _result_file(args, data, agent, model, roles, shard, units, all_rows,
                                   _scrub(describe, hidden)) if args.jsonl else None
    except BaseException:
        scope.close()
        raise
    try:
        with scope as stack:
            if model == "scripted":
                stack.enter_context(_scripted_model(agent, _say))
            result, interrupted = _simulate_rows(args, data, agent, fixtures, tools_schema, hidden, describe, roles,
                                                 units, result_file, label=f"[shard {shard}] " if shard else "")
    finally:
        if result_file is not None:
            result_file.close()
    if shard:
        result["shard"] = str(shard)
    failed_gate = _finish(args, result, roles, gate_options)
    if interrupted:
        return 130
    failed_gate = _against_baseline(args, result, gate_options) or failed_gate
    return 1 if failed_gate or result["summary"]["errors"] else 0


def _checked_options(args: argparse.Namespace) -> Tuple[_Gate, Optional[shards.Shard]]:
    """The options that need no file checked against each other; the gate's and ``--shard`` parsed."""
    if args.timeout <= 0:
        raise SetupError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if not 1 <= args.jobs <= 256:
        raise SetupError(f"--jobs must be between 1 and 256, got {args.jobs}")
    if args.code and (args.token or args.token_env):
        raise SetupError("--token/--token-env are for --url agents; a --code agent is called directly")
    if args.resume and not args.jsonl:
        raise SetupError("--resume continues a --jsonl result file: give --jsonl OUT.jsonl")
    if not 1 <= args.trials <= MAX_TRIALS:
        raise SetupError(f"--trials must be between 1 and {MAX_TRIALS}, got {args.trials}")
    gate_options = check_gate_options(args)
    try:
        shard = shards.parse_shard(args.shard) if args.shard is not None else None
    except shards.ShardError as exc:
        raise SetupError(str(exc)) from None
    return gate_options, shard


def _inputs(args: argparse.Namespace) -> Tuple[datasets.Dataset, Optional[Dict[str, Any]],
                                                 Optional[List[Dict[str, Any]]]]:
    """The dataset (its problems said), the fixtures and the tools schema; raises :class:`SetupError`."""
    data = datasets.load_dataset(args.csv)
    for line in datasets.format_problems(data):
        _say(line)
    if any(p.severity == "error" and p.row is None for p in data.problems):
        raise SetupError(f"{args.csv}: the file or its header has errors; fix them first")
    if not data.tasks and not [p for p in data.problems if p.row is not None]:
        raise SetupError(f"{args.csv}: nothing to run ({datasets.summary(data)})")
    fixtures = _load_fixtures(args.responses, _say) if args.responses else None
    tools_schema = None
    if args.tools:
        try:
            tools_schema = pp.load_tools_schema(args.tools)
        except ValueError as exc:
            raise SetupError(f"--tools: {exc}") from None
    if any(t.workspace for t in data.tasks):
        _say("note: workspace columns (scenario_ref, workspace_seed, setup_command) are not simulated; "
             "rows run as ledger tasks")
    return data, fixtures, tools_schema


def _agent(args: argparse.Namespace) -> Tuple[Any, List[str]]:
    """The agent (a --url one pinged) and the secrets to keep out of every report (its token)."""
    token = _agent_token(args)
    agent: Any
    if args.code:
        agent = CodeAgent(args.code, timeout=args.timeout, set_environment=args.jobs == 1)
    else:
        agent = UrlAgent(args.url, token=token, auth_header=args.auth_header, timeout=args.timeout)
        warning = agent.check()
        if warning:
            _say(f"warning: {warning}")
    return agent, [token] if token else []


def _model_roles(args: argparse.Namespace, scope: contextlib.ExitStack, data: datasets.Dataset, agent: Any,
                 tools_schema: Optional[List[Dict[str, Any]]]) -> _Roles:
    """The judge, the simulated backend and (when a row is a session) the simulated user the options ask for."""
    models = ModelRoles(args, scope)
    sessions = [t.row for t in data.tasks if (args.turn_mode or t.turn_mode) == "model_as_user"]
    return _Roles(models, models.judge(),
                  models.tool_model(tools_schema if tools_schema is not None else _agent_tools(args, agent)),
                  models.user() if sessions else None)


def _description(args: argparse.Namespace, agent: Any, model: Optional[str], roles: _Roles) -> Dict[str, Any]:
    """What the report's header says of the simulation: the agent, the fixtures, the model and each role."""
    describe: Dict[str, Any] = {"agent": {"mode": agent.mode, "target": agent.target},
                                "fixtures": args.responses, "tools_schema": args.tools, "model": model}
    judge, tool_model, user = roles.judge, roles.tool_model, roles.user
    if judge is not None:
        describe["judge"] = dict(judge.identity(), server=judge.client.endpoint.describe(),
                                 prompt=args.judge_prompt or "the kit's (prompts/judge.md)")
    if tool_model is not None:
        describe["simulator"] = dict(tool_model.identity(), server=tool_model.client.endpoint.describe(),
                                     tools_known=sorted(tool_model.tools))
    if user is not None:
        describe["user_model"] = dict(user.identity(), server=user.client.endpoint.describe())
    return describe


def _result_file(args: argparse.Namespace, data: datasets.Dataset, agent: Any, model: Optional[str], roles: _Roles,
                 shard: Optional[shards.Shard], units: List[Unit], all_rows: List[int],
                 describe: Dict[str, Any]) -> shards.ResultFile:
    """The ``--jsonl`` file opened (or, with ``--resume``, read and continued); raises :class:`SetupError`."""
    header = shards.header_record(
        dataset={"file": data.name, "sha256": shards.file_sha256(args.csv), "rows": data.rows,
                 "problems": [p.to_json() for p in data.problems]},
        agent=_agent_identity(agent), options=_option_identity(args, model, roles.judge, roles.tool_model, roles.user),
        shard=shard, rows=sorted({row for row, _ in units}), all_rows=all_rows)
    header["describe"] = describe
    header["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        result_file = shards.ResultFile(args.jsonl, header, resume=args.resume)
    except OSError as exc:
        raise SetupError(f"--jsonl: cannot write {args.jsonl}: {exc.strerror or exc}") from None
    except shards.ShardError as exc:
        raise SetupError(str(exc)) from None
    what = "row(s)" if args.trials == 1 else "run(s)"
    if result_file.done:
        _say(f"simulate: --resume: {len(result_file.done)} {what} already in {args.jsonl}, "
             f"{len([u for u in units if u not in result_file.done])} to run")
    if result_file.dropped_partial:
        _say(f"simulate: --resume: {args.jsonl} ended in a record cut short (a crash?); dropped, its run runs again")
    return result_file


def _simulate_rows(args: argparse.Namespace, data: datasets.Dataset, agent: Any, fixtures: Optional[Dict[str, Any]],
                   tools_schema: Optional[List[Dict[str, Any]]], hidden: List[str], describe: Dict[str, Any],
                   roles: _Roles, units: List[Unit], result_file: Optional[shards.ResultFile],
                   label: str) -> Tuple[Dict[str, Any], bool]:
    """:func:`simulate` with the command's options: the report, and whether Ctrl-C stopped it (its finished rows
    reported all the same)."""
    judge = roles.judge
    try:
        return simulate(data, agent, fixtures=fixtures, tools_schema=tools_schema, progress=_say, hidden=hidden,
                        describe=describe, jobs=args.jobs, only_units=units,
                        done=result_file.done if result_file else None,
                        on_record=result_file.add if result_file else None, label=label,
                        grade=(lambda record: judging.judged(record, judge)) if judge else None,
                        grade_jobs=args.judge_jobs, tool_model=roles.tool_model, user=roles.user,
                        turn_mode=args.turn_mode, trials=args.trials), False
    except Interrupted as stopped:  # Ctrl-C: the finished rows' reports are still written
        result = stopped.result
        what = "row(s)" if args.trials == 1 else "run(s)"
        _say(f"simulate: interrupted: {result['summary']['runs']} {what} finished, "
             f"{result['summary']['not_run']} not run; writing the reports of the finished ones")
        return result, True


def _finish(args: argparse.Namespace, result: Dict[str, Any], roles: _Roles, gate_options: _Gate) -> bool:
    """The reports written and printed, the cache's problems said, the gate applied: True when the gate fails."""
    model_servers = roles.models.servers.report()
    if model_servers:  # how many requests each server took at once
        result["model_servers"] = model_servers
    report.write_reports(result, args.json, args.html, _write)
    if args.json != "-":
        print(report.render_text(result))
    for cache in roles.models.caches:
        if cache.problem:
            _say(f"simulate: warning: the model cache was not used in full: {cache.problem}")
    return gate.apply(result, junit=args.junit, min_pass_rate=gate_options.min_pass_rate, write=_write, say=_say,
                      command="simulate", min_pass_hat_k=gate_options.min_pass_hat_k)


def check_gate_options(args: argparse.Namespace) -> _Gate:
    """The gate's thresholds as numbers and the baseline read, once the judge's and the gate's options are known to
    fit together."""
    if not 1 <= args.judge_jobs <= 256:
        raise SetupError(f"--judge-jobs must be between 1 and 256, got {args.judge_jobs}")
    if not args.judge:
        given = [f"--{name.replace('_', '-')}" for name in ("min_pass_rate", "min_pass_hat_k", "junit", "judge_url",
                                                            "judge_key_env", "judge_prompt", "baseline")
                 if getattr(args, name) is not None]
        if given:
            raise SetupError(f"{', '.join(given)} go(es) with --judge MODEL (--judge scripted runs offline)")
    if args.fail_on_regression and not args.baseline:
        raise SetupError("--fail-on-regression goes with --baseline OLD.json (the report to hold this run to)")
    if args.baseline and args.shard:
        raise SetupError(f"--baseline compares a whole run: merge the shards' files, then {prog('compare')} OLD.json "
                         "MERGED.json")
    try:
        thresholds = (gate.parse_rate(args.min_pass_rate) if args.min_pass_rate is not None else None,
                      gate.parse_rate(args.min_pass_hat_k, "--min-pass-hat-k") if args.min_pass_hat_k is not None
                      else None)
        baseline = compare.load_report(args.baseline) if args.baseline else None
    except (ValueError, compare.CompareError) as exc:
        raise SetupError(f"--baseline: {exc}" if isinstance(exc, compare.CompareError) else str(exc)) from None
    return _Gate(*thresholds, baseline, args.fail_on_regression)


def _against_baseline(args: argparse.Namespace, result: Dict[str, Any], gate_options: _Gate) -> bool:
    """The run compared with ``--baseline``'s report and the comparison printed (on stderr when the JSON report
    goes to stdout); True when a row regressed and ``--fail-on-regression`` makes that a failure."""
    if gate_options.baseline is None:
        return False
    comparison = compare.compare(gate_options.baseline, result, before_file=args.baseline,
                                 after_file=args.json if args.json and args.json != "-" else "this run")
    print("\n" + report.render_comparison_text(comparison), file=sys.stderr if args.json == "-" else sys.stdout)
    if gate_options.fail_on_regression and compare.regressed(comparison):
        _say(f"simulate: FAILED --fail-on-regression: {len(comparison['regressed'])} row(s) regressed against "
             f"{args.baseline}")
        return True
    return False


class ModelRoles:
    """The model-backed roles the options ask for: the judge, the simulated backend, the simulated user.

    Each has a model, a server and a key (``--judge``/``--judge-url``/``--judge-key-env`` and their
    ``--simulator`` and ``--user`` twins), the one client, and the one answer cache.  ``scripted`` is the kit's
    stand-in, one server for every role that names it, serving while ``scope`` is open.
    """

    def __init__(self, args: argparse.Namespace, scope: contextlib.ExitStack) -> None:
        self.args = args
        self.scope = scope
        self._scripted: Optional[Endpoint] = None
        self._cache: Optional[_cache.AnswerCache] = None
        self.caches: List[_cache.AnswerCache] = []
        self.servers = ModelServers()  # this run's servers: each one's concurrency, shared by the roles there
        if args.max_tokens < 1:
            raise SetupError(f"--max-tokens must be a positive number of tokens, got {args.max_tokens}")

    def client(self, model: str, url: Optional[str], key_env: Optional[str], *, option: str,
               concurrency: int) -> ChatClient:
        scripted = _scripted(model)
        try:
            if scripted:
                if self._scripted is None:
                    self._scripted = self.scope.enter_context(scripted_endpoint())
                endpoint = self._scripted._replace(concurrency=concurrency)
            else:
                endpoint = endpoint_from_options(model, url, key_env, what=option, concurrency=concurrency)
        except ValueError as exc:
            raise SetupError(str(exc)) from None
        return ChatClient(endpoint._replace(max_tokens=self.args.max_tokens), cache=self._answer_cache(scripted),
                          servers=self.servers, role=option.lstrip("-"))

    def _answer_cache(self, scripted: bool) -> Optional[_cache.AnswerCache]:
        """The stand-in answers at once: nothing of it is kept unless ``--model-cache DIR`` says where."""
        if self.args.no_model_cache or (scripted and not self.args.model_cache):
            return None
        if self._cache is None:
            self._cache = _cache.AnswerCache(self.args.model_cache or _cache.default_directory())
            self.caches.append(self._cache)
        return self._cache

    @staticmethod
    def _prompt(path: Optional[str], default: str, option: str) -> str:
        try:
            return prompts.load(path, default=default, option=option)
        except ValueError as exc:
            raise SetupError(str(exc)) from None

    def judge(self) -> Optional[judging.Judge]:
        args = self.args
        if not args.judge:
            return None
        prompt = self._prompt(args.judge_prompt, prompts.JUDGE, "--judge-prompt")
        return judging.Judge(self.client(args.judge, args.judge_url, args.judge_key_env, option="--judge",
                                         concurrency=args.judge_jobs), prompt)

    def tool_model(self, tools: Optional[List[Dict[str, Any]]]) -> Optional[ToolModel]:
        args = self.args
        if not args.simulator:
            return None
        prompt = self._prompt(args.simulator_prompt, prompts.SIMULATOR, "--simulator-prompt")
        return ToolModel(self.client(args.simulator, args.simulator_url, args.simulator_key_env,
                                     option="--simulator", concurrency=max(16, args.jobs)), prompt, tools)

    def user(self) -> Optional[UserModel]:
        args = self.args
        if not args.user_model:
            return None
        prompt = self._prompt(args.user_prompt, prompts.USER, "--user-prompt")
        return UserModel(self.client(args.user_model, args.user_url, args.user_key_env, option="--user-model",
                                     concurrency=max(16, args.jobs)), prompt, args.max_turns)


def _scripted(model: Optional[str]) -> bool:
    """Whether a role's model option names the kit's offline stand-in."""
    return (model or "").strip().lower() == "scripted"


def _file_identity(path: Optional[str]) -> Optional[Dict[str, str]]:
    """A file as a result file's header names it: its base name and content hash (paths differ between machines)."""
    if not path:
        return None
    try:
        return {"name": os.path.basename(path), "sha256": shards.file_sha256(path)}
    except OSError:
        return {"name": os.path.basename(path), "sha256": ""}


def _agent_identity(agent: Any) -> Dict[str, Any]:
    """What makes two runs' agents the same: a --code agent's file content and entry, a --url agent's URL."""
    if isinstance(agent, CodeAgent):
        return {"mode": "code", "file": _file_identity(str(agent.path)), "entry": agent.function_name}
    return {"mode": agent.mode, "target": agent.target}


def _option_identity(args: argparse.Namespace, model: Optional[str], judge: Optional[judging.Judge] = None,
                     tool_model: Optional[ToolModel] = None, user: Optional[UserModel] = None) -> Dict[str, Any]:
    """The options that change what a row's run gives (so shards of one simulation must share them)."""
    identity: Dict[str, Any] = {"fixtures": _file_identity(args.responses), "tools_schema": _file_identity(args.tools),
                                "model": model, "strict": bool(args.code) and not args.lenient}
    for name, role, option in (("judge", judge, args.judge), ("simulator", tool_model, args.simulator),
                               ("user_model", user, args.user_model)):
        if role is not None:
            identity[name] = role.identity()
            if _scripted(option) and "server" in identity[name]:  # the stand-in's port differs from run to run
                identity[name]["server"] = "the kit's scripted stand-in"
    if args.turn_mode:
        identity["turn_mode"] = args.turn_mode
    if args.trials > 1:  # a file from before --trials holds trial 1 of each row: it is a --trials 1 simulation
        identity["trials"] = args.trials
    return identity


def _agent_tools(args: argparse.Namespace, agent: Any) -> Optional[List[Dict[str, Any]]]:
    """The agent's tools for the simulated backend when --tools gives none: ``tools_schema.json`` beside a --code
    agent, or what a --url agent serves at ``GET /tools_schema``; ``None`` when neither is there."""
    try:
        if isinstance(agent, CodeAgent):
            beside = pp.tools_schema_beside(agent.target)
            return pp.load_tools_schema(beside) if beside else None
        return agent.served_tools() if isinstance(agent, UrlAgent) else None
    except ValueError:
        return None


def _required_env(agent: Any) -> List[str]:
    """The variables a --code agent's module lists in ``REQUIRED_ENV`` (a template's API key)."""
    function = getattr(agent, "function", None)
    inner = getattr(function, "agent", function)  # code_mode's run() keeps the agent function
    module = sys.modules.get(getattr(inner, "__module__", "") or "")
    names = getattr(module, "REQUIRED_ENV", None)
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else []


def _choose_model(args: argparse.Namespace, agent: Any) -> Optional[str]:
    """``scripted``, ``real`` or ``None`` (an agent that lists no model key) for this simulation."""
    needs = _required_env(agent) if args.code else []
    if args.model == "scripted" and not args.code:
        raise SetupError(f"--model scripted works with --code; for an HTTP agent, start {prog('model')} and point "
                         "the agent at it (OPENAI_BASE_URL, ANTHROPIC_BASE_URL)")
    if args.model == "real" or (args.model == "auto" and (not needs or all(os.environ.get(n, "").strip()
                                                                           for n in needs))):
        return "real" if needs else None
    return "scripted"


@contextlib.contextmanager
def _scripted_model(agent: Any, say: Callable[[str], None]) -> Iterator[None]:
    """The scripted model running, the agent's model settings pointed at it for the simulation (then restored)."""
    from ..models.scripted import ScriptedModel

    with ScriptedModel() as model:
        settings = dict(model.environment())
        for name in _required_env(agent):
            if not os.environ.get(name, "").strip():
                settings[name] = "scripted-model-accepts-any-key"
        say(f"simulate: the agent's model is the scripted stand-in at {model.origin} (no API key, no network: it "
            "plans tool calls from each task and the tools; --model real to use the real API)")
        with _environment(settings):
            yield


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    previous = os.environ.get(pp.ENV_STRICT)
    if getattr(args, "code", None) and not args.lenient:
        os.environ[pp.ENV_STRICT] = "1"  # a simulation shows every problem: the agent's code_mode() builds strictly
    try:
        return run_cli(args)
    except SetupError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("simulate: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is None:
            os.environ.pop(pp.ENV_STRICT, None)
        else:
            os.environ[pp.ENV_STRICT] = previous


if __name__ == "__main__":
    sys.exit(main())
