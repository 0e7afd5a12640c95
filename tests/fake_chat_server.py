"""A misbehaving OpenAI-compatible Chat Completions server on 127.0.0.1, for the kit's model-backed roles.

Each request takes the next step of a script (the last one repeats); a step is a :class:`Reply` (a
completion, or any status with any body and headers, after an optional delay) or :data:`DROP` (the
connection is closed with no reply).  With no script, every request gets the kit's scripted role answer
(``conformance.models.scripted_roles``), so the server behaves like a sensible model.  Options: a key it
requires (401 otherwise, with the key echoed in the body as some servers do); refusing
``response_format: json_schema`` with a 500 as llama.cpp's server does; refusing a ``json_schema`` whose root
is not an object with a 400 as OpenAI's strict mode does; answering one request at a time (``serial``), the
others waiting their turn at the server, as llama.cpp's server and Ollama do; answering 503 to a request
that finds ``capacity`` others already there, as an overloaded server does.  A step may ``hold`` its answer
until an event is set.  It records every request, the order it served them in, and the most requests it held
at once::

    with FakeChatServer(script=[Reply(status=429, headers={"Retry-After": "2"}), Reply(content='{"a": 1}')]) as s:
        ChatClient(Endpoint(s.base_url, "m", None)).ask_json(...)
        s.requests[1].json
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

from conformance.models import roles
from conformance.models.scripted_roles import answer_role

__all__ = ["Reply", "DROP", "FakeChatServer", "Recorded"]


class Reply(NamedTuple):
    """One step: ``status`` with ``content`` as a completion (200) or ``body`` as it is, after ``delay`` s."""

    content: Optional[str] = None  # None: the scripted role's answer
    status: int = 200
    body: Any = None  # a status other than 200: this body (JSON unless a str)
    headers: Mapping[str, str] = {}
    delay: float = 0.0
    hold: Optional[threading.Event] = None  # answer only once this is set
    finish_reason: str = "stop"
    prompt_tokens: int = 120
    completion_tokens: int = 30


DROP = "drop"
Step = Union[Reply, str]


class Recorded(NamedTuple):
    path: str
    headers: Dict[str, str]
    json: Any


def _role_of(body: Any) -> str:
    """The kit role a request is for: the name its ``json_schema`` form sends, else what its schema says."""
    response_format = (body.get("response_format") or {}) if isinstance(body, dict) else {}
    if isinstance(response_format.get("json_schema"), dict):
        return str(response_format["json_schema"].get("name") or "")
    schema = response_format.get("schema") if isinstance(response_format.get("schema"), dict) else {}
    properties = schema.get("properties") or {}
    return (roles.JUDGE if "anyOf" in schema else roles.TOOL if "response" in properties
            else roles.USER if "message" in properties else "")


class FakeChatServer:
    def __init__(self, script: Sequence[Step] = (), *, require_key: Optional[str] = None,
                 refuse_json_schema: bool = False, refuse_anyof_root: bool = False, serial: bool = False,
                 capacity: Optional[int] = None) -> None:
        self.script: List[Step] = list(script)
        self.require_key = require_key
        self.refuse_json_schema = refuse_json_schema
        self.refuse_anyof_root = refuse_anyof_root
        self.requests: List[Recorded] = []
        self.served: List[int] = []  # indexes into requests, in the order their answers began
        self.active = self.max_active = 0
        self._lock = threading.Lock()
        self._turn = threading.Lock() if serial else None
        self.capacity = capacity
        self.shed = 0  # requests answered 503 for want of capacity
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                with fake._lock:
                    fake.requests.append(Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    number = len(fake.requests) - 1
                    step = fake.script.pop(0) if len(fake.script) > 1 else (fake.script[0] if fake.script else Reply())
                    if fake.capacity is not None and fake.active >= fake.capacity:
                        fake.shed += 1
                        step = Reply(status=503)
                    fake.active += 1
                    fake.max_active = max(fake.max_active, fake.active)
                try:
                    with fake._turn or contextlib.nullcontext():
                        with fake._lock:
                            fake.served.append(number)
                        fake._answer(self, step, body)
                finally:
                    with fake._lock:
                        fake.active -= 1

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def _answer(self, handler: BaseHTTPRequestHandler, step: Step, body: Any) -> None:
        if step == DROP:
            handler.close_connection = True
            handler.connection.close()
            return
        assert isinstance(step, Reply)
        if step.hold is not None:
            step.hold.wait(30)
        if step.delay:
            time.sleep(step.delay)
        if self.require_key is not None and handler.headers.get("Authorization") != f"Bearer {self.require_key}":
            given = handler.headers.get("Authorization") or ""
            return self._send(handler, 401, {"error": {"message": f"Incorrect API key provided: {given[7:]}",
                                                       "type": "invalid_request_error"}})
        if self.refuse_json_schema and isinstance(body, dict) and \
                (body.get("response_format") or {}).get("type") == "json_schema":
            return self._send(handler, 500, {"detail": [{"type": "literal_error", "loc": ["body", "response_format",
                                                                                           "type"],
                                                         "msg": "Input should be 'text' or 'json_object'"}]})
        json_schema = (body.get("response_format") or {}).get("json_schema") if isinstance(body, dict) else None
        if self.refuse_anyof_root and isinstance(json_schema, dict) and (json_schema.get("schema") or {}).get(
                "type") != "object":
            return self._send(handler, 400, {"error": {
                "message": f"Invalid schema for response_format '{json_schema.get('name')}': schema must be a JSON "
                           f"Schema of 'type: \"object\"', got 'type: \"None\"'.",
                "type": "invalid_request_error", "param": "response_format", "code": None}})
        if step.status != 200:
            return self._send(handler, step.status, step.body if step.body is not None else
                              {"error": {"message": f"HTTP {step.status}", "type": "server_error"}}, step.headers)
        content = step.content
        if content is None:
            content = json.dumps(answer_role(_role_of(body), body.get("messages") if isinstance(body, dict) else []))
        self._send(handler, 200, {
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": 1, "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": step.finish_reason}],
            "usage": {"prompt_tokens": step.prompt_tokens, "completion_tokens": step.completion_tokens,
                      "total_tokens": step.prompt_tokens + step.completion_tokens}}, step.headers)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, body: Any, headers: Mapping[str, str] = {}) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        handler.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    def __enter__(self) -> FakeChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
