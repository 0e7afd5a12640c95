"""One client for OpenAI-compatible Chat Completions: every model-backed role of the kit asks through it.

The judge, the simulated tools and the simulated user each name an :class:`Endpoint` (base URL, model, the
environment variable holding the key) and ask :meth:`ChatClient.ask_json` for one JSON object of a schema.
Any server that speaks ``POST {base}/chat/completions`` will do: OpenAI, the vendors' compatible endpoints,
LiteLLM, Ollama, llama.cpp's server, vLLM, LM Studio, and the kit's scripted stand-in (``scripted.py``).

How an answer is got:

1. **The form.**  Servers differ in how they take a schema, so the client tries, per endpoint (a base URL and
   a model), in order: ``response_format`` ``json_schema`` (OpenAI's structured outputs, vLLM's, Ollama's,
   llama.cpp's own server's); the same with the schema's ``anyOf`` root made one object (:func:`object_root`:
   OpenAI's strict mode wants an object at the root), tried only after an HTTP 400 or 422 refused that
   schema; ``json_object`` with a ``schema`` beside it (``llama-cpp-python``'s server, which refuses
   ``json_schema`` with an HTTP 500 and constrains sampling to this); ``json_object`` alone; no
   ``response_format``.  A form the server refuses (an HTTP 400, 422 or 500 whose body names
   ``response_format`` or the schema; a 500 only after the retries, as a 500 may be passing) moves to the
   next one, for this request and every later one.  The form is found once per endpoint: until a request of
   a kind (a schema with an ``anyOf`` root, or an object) has been answered in the current form, one request
   of that kind asks and the others wait for it.  The schema is in the system message as well, so every form
   can be followed.  A parameter the model refuses by name (a newer OpenAI model's ``max_tokens``, which it
   wants as ``max_completion_tokens``, or its ``temperature``) is renamed or dropped the same way.
2. **Transport.**  :func:`pipelines_port.post_json`, the runtime's one retry policy: 429, 408 and 5xx retried
   with backoff, ``Retry-After`` (or ``retry-after-ms``) honoured up to a bound, timeouts and dropped
   connections retried; a per-request timeout.  How many requests go at once is the server's
   (``servers.py``): a limit that adapts to what the server sustains, up to the endpoint's ``concurrency``,
   the requests of an agent's critical path (``priority`` ``CRITICAL``) before the judge's (``DEFERRED``); a
   request gives its slot back while it waits to retry.
3. **The answer**, parsed strictly: the message content is one JSON object (a Markdown code fence around it is
   taken off), valid against the schema, and passing the role's own ``check`` (asked before the schema's
   ``anyOf`` root, so the problem named is the rule the answer broke).  Anything else (not JSON, the
   wrong shape, an answer cut at ``max_tokens``, a refusal) is asked again **once**, the problem named; a
   second bad answer raises :class:`ModelError`.
4. **The cache** (``cache.py``), when given: keyed by everything sent (the messages, the schema, the model's
   name), so an unchanged request is answered from disk and asks nothing.

The key is read from the environment and sent only as ``Authorization: Bearer``; it is in no message, log
line, report or cache file (errors are scrubbed of it, in case a server echoes it).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple
from urllib.parse import urlsplit

import pipelines_port as pp

from . import servers as _servers
from .cache import AnswerCache
from .servers import CRITICAL, DEFERRED, ModelServers

__all__ = ["DEFAULT_BASE_URL", "Endpoint", "Answer", "Usage", "ModelError", "ChatClient", "endpoint_from_options",
           "MODEL_RETRY", "add_usage", "FORMS", "object_root", "CRITICAL", "DEFERRED", "ModelServers"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# Bounded: a role waits at most ~1 + 2 + 4 s between tries, or what Retry-After asks up to 60 s; then the row is
# reported as not judged (or the tool call as an error), never left hanging.
MODEL_RETRY = pp.RetryPolicy(max_attempts=4, base_delay_s=1.0, max_delay_s=20.0, max_retry_after_s=60.0,
                             transport_retries=2)
FORMS = ("json_schema", "json_schema+object_root", "json_object+schema", "json_object", "none")
_REFUSED_FORM = re.compile(r"response_format|json_schema|json_object|schema|structured", re.I)
_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n?(.*?)\n?```$", re.S)


class ModelError(Exception):
    """A role's request could not be answered: one line naming why (never the key); ``usage``: what it cost."""

    def __init__(self, message: str, usage: Optional[Mapping[str, int]] = None) -> None:
        super().__init__(message)
        self.usage: Dict[str, int] = dict(usage or {})


class Endpoint(NamedTuple):
    """Where a role asks: ``{base_url}/chat/completions`` with ``model``, the key in ``$key_env`` (if any)."""

    base_url: str
    model: str
    key_env: Optional[str] = "OPENAI_API_KEY"
    timeout_s: float = 120.0
    concurrency: int = 16
    max_tokens: int = 2048

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def describe(self) -> str:
        """``model at https://host/v1``: no credentials, no query (they may hold keys)."""
        return f"{self.model} at {_safe(self.base_url).rstrip('/')}"


class Usage:
    """Requests and tokens spent (``cached``: answers taken from the cache instead)."""

    __slots__ = ("requests", "prompt_tokens", "completion_tokens", "cached", "retries")

    def __init__(self) -> None:
        self.requests = self.prompt_tokens = self.completion_tokens = self.cached = self.retries = 0

    def add(self, other: Mapping[str, int]) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + int(other.get(name) or 0))

    def to_json(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


def add_usage(total: Dict[str, int], spent: Mapping[str, int]) -> None:
    """``spent`` summed into ``total`` (a row's usage of a role), key by key."""
    for key, value in spent.items():
        total[key] = total.get(key, 0) + value


class _Request(NamedTuple):
    """What a role asks for, whatever the form it goes in."""

    schema: Mapping[str, Any]
    name: str
    strict: bool
    priority: int


_OVERLOADED = frozenset({408, 429, 500, 502, 503, 504, 529})  # statuses of a server that cannot take more now


class Answer(NamedTuple):
    """One role's answer: the JSON ``value``, what it cost, and whether the cache gave it."""

    value: Dict[str, Any]
    usage: Dict[str, int]
    cached: bool = False


def _is_loopback(base_url: str) -> bool:
    host = (urlsplit(base_url).hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_from_options(model: str, url: Optional[str], key_env: Optional[str], *, what: str,
                          timeout_s: float = 120.0, concurrency: int = 16) -> Endpoint:
    """An :class:`Endpoint` from a role's command-line options; ``ValueError`` names a bad one.

    ``url`` defaults to ``$OPENAI_BASE_URL``, else OpenAI's; ``key_env`` to ``OPENAI_API_KEY`` (``""``: none).
    A key variable that is not set is an error unless the server is on this machine (local servers need none).
    """
    base = (url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL).strip()
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what}-url must be an http:// or https:// base URL such as {DEFAULT_BASE_URL}, "
                         f"got {_safe(base)!r}")
    if parts.username or parts.password or parts.query:
        raise ValueError(f"{what}-url must not carry credentials or a query: put the key in an environment "
                         f"variable and name it with {what}-key-env")
    if not model.strip():
        raise ValueError(f"{what}: give a model name (or `scripted`, the kit's offline stand-in)")
    name = key_env if key_env is not None else "OPENAI_API_KEY"
    if name and not os.environ.get(name, "").strip() and not _is_loopback(base):
        raise ValueError(f"{what}: the environment variable {name} holding the API key for {_safe(base)} is not set "
                         f"(a server on this machine needs none; {what}-key-env names another variable)")
    return Endpoint(base.rstrip("/"), model.strip(), name or None, timeout_s, concurrency)


def _safe(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


def object_root(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` with one object at its root, for a server that takes no ``anyOf`` there (OpenAI's strict mode).

    The root's ``anyOf`` of objects becomes one object with every branch's properties, each property the
    branches' schemas for it: one schema when they agree, one enum when they are enums of one type, else their
    ``anyOf`` (which such servers take below the root).  Which values go together is lost; the check after the
    answer still holds the answer to the whole schema.  Any other schema is returned as it is.
    """
    branches = schema.get("anyOf")
    if "properties" in schema or not isinstance(branches, list) or not branches or not all(
            isinstance(b, Mapping) and b.get("type") == "object" and isinstance(b.get("properties"), Mapping)
            for b in branches):
        return schema
    names = list(dict.fromkeys(name for branch in branches for name in branch["properties"]))
    merged: Dict[str, Any] = {"type": "object",
                              "properties": {name: _merged([b["properties"][name] for b in branches
                                                            if name in b["properties"]]) for name in names},
                              "required": [name for name in names
                                           if all(name in (b.get("required") or ()) for b in branches)]}
    if all(b.get("additionalProperties") is False for b in branches):
        merged["additionalProperties"] = False
    return merged


def _merged(options: List[Any]) -> Any:
    distinct: List[Any] = []
    for option in options:
        if option not in distinct:
            distinct.append(option)
    if len(distinct) == 1:
        return distinct[0]
    if all(isinstance(o, Mapping) and set(o) == {"type", "enum"} and o["type"] == distinct[0]["type"]
           for o in distinct):
        values = list(dict.fromkeys(v for o in distinct for v in o["enum"]))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            values.sort()
        return {"type": distinct[0]["type"], "enum": values}
    return {"anyOf": distinct}


class _Dialect:
    """How one model at one server takes a request: its form and parameters, found once and shared.

    ``version`` counts the changes.  A kind of request (``True``: a schema with an ``anyOf`` root) is proven
    when one was answered in the current version; until then one request asks (the probe, one at a time
    whatever its kind, so the form is found once) while the others of unproven kinds wait for it.  A probe
    that ends without an answer (a timeout, an error status) lets the rest of its kind go at once rather than
    one after another.
    """

    def __init__(self) -> None:
        self.form = 0  # index into FORMS: the first this endpoint has not refused
        self.token_limit = "max_tokens"  # newer OpenAI models take only max_completion_tokens
        self.temperature = True  # ... and only their default temperature
        self.version = 0
        self._proven: Set[Tuple[bool, int]] = set()
        self._probing = False
        self._open: Set[bool] = set()
        self._condition = threading.Condition()

    def turn(self, kind: bool) -> bool:
        """Wait while another request probes and this kind is unproven; ``True`` when the caller is the probe."""
        with self._condition:
            while (kind, self.version) not in self._proven and kind not in self._open and self._probing:
                self._condition.wait()
            if (kind, self.version) in self._proven or kind in self._open:
                return False
            self._probing = True
            return True

    def done(self, kind: bool, probe: bool, answered_in: Optional[int]) -> None:
        """A request of ``kind`` ended: answered in version ``answered_in``, or not answered (``None``)."""
        with self._condition:
            if answered_in == self.version:
                self._proven.add((kind, answered_in))
            if probe:
                self._probing = False
                if answered_in is None:
                    self._open.add(kind)
            self._condition.notify_all()

    def change(self, seen: int, update: Callable[[_Dialect], bool]) -> bool:
        """Whether to ask again: another request changed the dialect since version ``seen``, or ``update`` (which
        says whether it changed anything) did, starting a new version."""
        with self._condition:
            if self.version != seen:
                return True
            if not update(self):
                return False
            self.version += 1
            self._open.clear()
            return True


class ChatClient:
    """Asks one :class:`Endpoint` for JSON answers (see the module docstring); safe to share between threads.

    ``servers``: the run's :class:`ModelServers` (how many requests at once, per server); ``role`` names this
    client's requests in its report.
    """

    def __init__(self, endpoint: Endpoint, *, cache: Optional[AnswerCache] = None,
                 retry: Optional[pp.RetryPolicy] = None, sleep: Callable[[float], None] = time.sleep,
                 servers: Optional[ModelServers] = None, role: str = "") -> None:
        self.endpoint = endpoint
        self.cache = cache
        self.retry = retry or MODEL_RETRY
        self._sleep = sleep
        self._key = os.environ.get(endpoint.key_env, "").strip() if endpoint.key_env else ""
        self.server = (servers or _servers.SHARED).server(endpoint.base_url, _safe(endpoint.base_url).rstrip("/"))
        self._lane = self.server.lane(role or endpoint.model, endpoint.concurrency, endpoint.timeout_s)
        self._dialect = self.server.shared(("dialect", endpoint.model), _Dialect)
        self.usage = Usage()  # everything this client spent, all calls together
        self._usage_lock = threading.Lock()

    def __repr__(self) -> str:  # the key is a secret
        return f"ChatClient({self.endpoint.describe()!r})"

    @property
    def form(self) -> str:
        """The structured-output form this endpoint takes, as far as it is known (``FORMS``)."""
        return FORMS[self._dialect.form]

    # -- the one public call ------------------------------------------------------------------------------------

    def ask_json(self, messages: Sequence[Mapping[str, Any]], schema: Mapping[str, Any], *, name: str,
                 strict: bool = True, check: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None,
                 priority: int = CRITICAL) -> Answer:
        """One JSON object of ``schema`` for ``messages``; ``check(value)`` names a problem or returns ``None``.

        ``priority``: ``CRITICAL`` for a request an agent waits on, ``DEFERRED`` for one that can wait (the
        judge's).  Raises :class:`ModelError` when no usable answer came (transport, an error status after the
        retries, two answers that were not usable).
        """
        conversation = [dict(m) for m in messages]
        conversation[0] = dict(conversation[0], content=str(conversation[0].get("content", "")) + _schema_note(schema))
        key = None
        if self.cache is not None:
            key = self.cache.key({"model": self.endpoint.model, "name": name, "schema": schema,
                                  "messages": conversation})
            hit = self.cache.get(key)
            value = hit.get("value") if hit is not None else None
            if isinstance(value, dict) and _problem(value, schema, check) is None:
                self._count({"cached": 1})
                return Answer(value, {"cached": 1}, cached=True)
        spent: Dict[str, int] = {}
        try:
            return self._ask(conversation, _Request(schema, name, strict, priority), check, key, spent)
        except ModelError as exc:
            self._count(spent)
            exc.usage = dict(spent)
            raise

    def _ask(self, conversation: List[Dict[str, Any]], request: _Request,
             check: Optional[Callable[[Dict[str, Any]], Optional[str]]], key: Optional[str],
             spent: Dict[str, int]) -> Answer:
        """An answer, asked once more when the first is unusable; raises :class:`ModelError`."""
        problem = ""
        for attempt in (1, 2):
            content, finish = self._complete(conversation, request, spent)
            value, problem = _parse(content, finish)
            if value is not None:
                problem = _problem(value, request.schema, check) or ""
            if not problem and value is not None:
                self._count(spent)
                if self.cache is not None and key is not None:
                    self.cache.put(key, {"value": value, "model": self.endpoint.model})
                return Answer(value, spent)
            if attempt == 1:  # one re-ask, the problem named
                conversation = [
                    *conversation, {"role": "assistant", "content": content[:4000]},
                    {"role": "user", "content": f"That answer cannot be used: {problem}. Answer again with only "
                                                "one JSON object that follows the schema."}]
        raise ModelError(f"the model's answer was not usable after one re-ask: {problem}")

    # -- the parts -----------------------------------------------------------------------------------------------

    def _count(self, spent: Mapping[str, int]) -> None:
        with self._usage_lock:
            self.usage.add(spent)

    def _complete(self, conversation: List[Dict[str, Any]], request: _Request,
                  spent: Dict[str, int]) -> Tuple[str, str]:
        """One completion's content and finish reason, in the form the endpoint takes (found once, shared)."""
        dialect = self._dialect
        kind = object_root(request.schema) is not request.schema
        probe = dialect.turn(kind)
        answered_in: Optional[int] = None
        try:
            while True:
                version, form = dialect.version, dialect.form
                try:
                    reply = self._post(self._payload(conversation, request, FORMS[form]), spent, request.priority)
                except pp.HTTPStatusError as exc:
                    if dialect.change(version, functools.partial(_learn, form=form, exc=exc, rooted=kind)):
                        continue
                    raise ModelError(self._scrub(_status_message(exc, self.endpoint))) from None
                answered_in = version
                return _content(reply, spent)
        finally:
            dialect.done(kind, probe, answered_in)

    def _payload(self, conversation: List[Dict[str, Any]], request: _Request, form: str) -> Dict[str, Any]:
        dialect = self._dialect
        payload: Dict[str, Any] = {"model": self.endpoint.model, "messages": conversation,
                                   dialect.token_limit: self.endpoint.max_tokens}
        if dialect.temperature:
            payload["temperature"] = 0
        if form.startswith("json_schema"):
            schema = object_root(request.schema) if form == "json_schema+object_root" else request.schema
            payload["response_format"] = {"type": "json_schema", "json_schema": {
                "name": request.name, "schema": schema, "strict": request.strict}}
        elif form == "json_object+schema":
            payload["response_format"] = {"type": "json_object", "schema": request.schema}
        elif form == "json_object":
            payload["response_format"] = {"type": "json_object"}
        return payload

    def _post(self, payload: Mapping[str, Any], spent: Dict[str, int], priority: int) -> Any:
        """One request through the runtime's retry policy, each try in a slot of the server's limit."""
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        held = [self.server.acquire(self._lane, priority)]

        def sleep(seconds: float) -> None:  # a try failed in a way worth retrying: the server is overloaded
            spent["retries"] = spent.get("retries", 0) + 1
            self.server.release(held.pop(), _servers.OVERLOADED)
            self._sleep(seconds)
            held.append(self.server.acquire(self._lane, priority))

        spent["requests"] = spent.get("requests", 0) + 1
        ended = _servers.OTHER
        try:
            reply = pp.post_json(self.endpoint.url, payload, headers=headers, timeout=self.endpoint.timeout_s,
                                 retry=self.retry, sleep=sleep)
            ended = _servers.ANSWERED
            return reply
        except pp.HTTPStatusError as exc:
            if exc.status_code is None or exc.status_code in _OVERLOADED:
                ended = _servers.OVERLOADED
            raise
        except (pp.PipelinesError, OSError, ValueError) as exc:  # e.g. a Retry-After longer than the policy waits
            ended = _servers.OVERLOADED
            raise ModelError(self._scrub(f"{self.endpoint.describe()}: {exc}")) from None
        finally:
            if held:
                self.server.release(held.pop(), ended)

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "[redacted]") if self._key else text


def _schema_note(schema: Mapping[str, Any]) -> str:
    return ("\n\nAnswer with exactly one JSON object, and nothing else, that follows this JSON Schema:\n"
            + json.dumps(schema, ensure_ascii=False))


def _refuses_form(exc: pp.HTTPStatusError) -> bool:
    """The server refused the request's ``response_format`` (not the request as a whole)."""
    return exc.status_code in (400, 422, 500, 501) and bool(_REFUSED_FORM.search(_body_text(exc.body)))


def _learn(dialect: _Dialect, *, form: int, exc: pp.HTTPStatusError, rooted: bool) -> bool:
    """What a refusal teaches: a parameter to rename or drop, else the next form (``True`` when either)."""
    return _adjusted(dialect, exc) or _next_form(dialect, form, exc, rooted)


def _next_form(dialect: _Dialect, form: int, exc: pp.HTTPStatusError, rooted: bool) -> bool:
    """Move past ``form`` when ``exc`` refused it: to the object-root schema when a 400 or 422 refused an
    ``anyOf`` root in ``json_schema`` (the server checked the schema), else to the next form of another kind."""
    if not _refuses_form(exc) or form >= len(FORMS) - 1:
        return False
    following = form + 1
    if FORMS[following] == "json_schema+object_root" and not (rooted and exc.status_code in (400, 422)):
        following += 1
    if following <= dialect.form:
        return False
    dialect.form = following
    return True


def _adjusted(dialect: _Dialect, exc: pp.HTTPStatusError) -> bool:
    """Drop or rename a parameter the model refused (a 400 naming it), for this request and every later one.

    OpenAI's newer models refuse ``max_tokens`` ("Use 'max_completion_tokens' instead") and any ``temperature``
    but their default; older servers (llama.cpp's) ignore ``max_completion_tokens``, so it is sent only when
    asked for.
    """
    if exc.status_code != 400:
        return False
    error = exc.body.get("error") if isinstance(exc.body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    text = _body_text(exc.body)
    if dialect.token_limit == "max_tokens" and "max_completion_tokens" in text and (
            param == "max_tokens" or "'max_tokens'" in text):
        dialect.token_limit = "max_completion_tokens"
        return True
    if dialect.temperature and (param == "temperature" or "'temperature'" in text):
        dialect.temperature = False
        return True
    return False


def _body_text(body: Any) -> str:
    return body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, default=str)


def _status_message(exc: pp.HTTPStatusError, endpoint: Endpoint) -> str:
    """One line for an error status: what the server said, and the likely fix for the common ones."""
    status = exc.status_code
    hint = {401: f"the API key was refused (is ${endpoint.key_env} the key for this server?)",
            403: "the key may not use this model or endpoint",
            404: f"no such endpoint or model (is {endpoint.describe()} right? many servers want the base URL to "
                 "end in /v1)"}.get(status or 0, "")
    text = " ".join(str(exc).split())
    return f"{text[:400]}" + (f": {hint}" if hint else "")


def _content(reply: Any, spent: Dict[str, int]) -> Tuple[str, str]:
    """The message content and finish reason of a Chat Completions reply; tokens counted into ``spent``."""
    if not isinstance(reply, dict):
        raise ModelError(f"the server's reply is not a Chat Completions object: {json.dumps(reply)[:200]}")
    usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
    for ours, theirs in (("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens")):
        value = usage.get(theirs)
        if isinstance(value, int) and not isinstance(value, bool):
            spent[ours] = spent.get(ours, 0) + value
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        error = reply.get("error")
        raise ModelError("the server's reply has no choices" + (f": {json.dumps(error)[:300]}" if error else ""))
    message = choices[0].get("message") if isinstance(choices[0].get("message"), dict) else {}
    if isinstance(message.get("refusal"), str) and message["refusal"].strip():
        return "", "refusal:" + message["refusal"].strip()[:300]
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return (content if isinstance(content, str) else ""), str(choices[0].get("finish_reason") or "")


def _parse(content: str, finish: str) -> Tuple[Optional[Dict[str, Any]], str]:
    """The answer as a JSON object, or ``None`` and the problem in a few words."""
    if finish.startswith("refusal:"):
        return None, f"the model refused ({finish[len('refusal:'):]})"
    text = content.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    if finish == "length":
        return None, "the answer was cut at the token limit: answer shorter"
    if not text:
        return None, "the answer was empty"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return None, f"the answer is not JSON ({exc.msg} at character {exc.pos}): {text[:120]!r}"
    if not isinstance(value, dict):
        return None, f"the answer is JSON but not an object: {text[:120]!r}"
    return value, ""


def _problem(value: Dict[str, Any], schema: Mapping[str, Any],
             check: Optional[Callable[[Dict[str, Any]], Optional[str]]]) -> Optional[str]:
    """What is wrong with an answer, named as precisely as can be: each member against its property (the
    object-root form), then the role's own rules, then the whole schema (its ``anyOf`` root)."""
    plain = object_root(schema)
    problems = pp.validate_args(plain, value, path="answer")
    if not problems:
        rule = check(value) if check is not None else None
        if rule:
            return rule
        if plain is not schema:
            problems = pp.validate_args(schema, value, path="answer")
    return "the answer does not follow the schema: " + "; ".join(problems[:5]) if problems else None
