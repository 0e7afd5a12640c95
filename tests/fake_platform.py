"""A stand-in for the platform's REST API on 127.0.0.1, standard library only: agents and test runs in memory.

It answers in the shapes the SDK (``pipelines-sdk`` 0.1.15) reads: ``{"items": [...]}`` agent listings, the
agent row, ``{"test_run_id", "warnings"}`` for a created run, and the run's rollup (``totals`` with
``task_count``, ``pending``, ``running``, ``judging``, ``not_dispatched``, ``completed``, ``failed``,
``timed_out``, ``cancelled``, ``pass_count``, ``fail_count``; one page of ``tasks`` with ``task_id``,
``status``, ``judge_passed``, ``instruction_excerpt``, ``web_url``, ``runs[].latency_ms``; ``warnings``,
``web_url``), and errors as FastAPI words them (``detail``: a string, or a list of ``loc`` / ``msg``).

Every request is recorded (``requests``).  A run finishes after ``finish_after`` polls, its rows ending
as ``outcomes`` says (``{"judge_passed": True}``, ``{"status": "failed"}``, ...); ``never_finish`` keeps it
running.  Faults: ``fault(METHOD, PATH, status, times=n)`` answers an error n times, ``drop(METHOD, PATH)``
closes the connection without a reply.  ``tests/interop/test_platform_oracle.py`` runs the SDK against
it too: the SDK reading every reply shape here is what keeps the stand-in honest.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

API_KEY = "pk_test_fake-platform-key-0123456789"
IN_FLIGHT = ("pending", "running", "judging", "not_dispatched")
COUNTED = ("pending", "running", "judging", "not_dispatched", "completed", "failed", "timed_out", "cancelled")


class Recorded(NamedTuple):
    method: str
    path: str
    query: Dict[str, str]
    headers: Dict[str, str]  # lower-case names
    body: Any


class Fault(NamedTuple):
    method: str
    path: str  # a prefix of the request path
    status: Optional[int]  # 0: drop the connection; None: answer as usual (an ``after`` placeholder)
    body: Any
    headers: Dict[str, str]


class Run:
    """One test run: its rows, how each ends, and how many polls it has had."""

    def __init__(self, run_id: int, agent_id: int, rows: List[Dict[str, Any]], outcomes: List[Dict[str, Any]],
                 finish_after: int, never_finish: bool, warnings: List[str]) -> None:
        self.id, self.agent_id, self.rows = run_id, agent_id, rows
        self.outcomes = outcomes
        self.finish_after = max(1, finish_after)
        self.never_finish = never_finish
        self.warnings = warnings
        self.polls = 0

    def tasks(self, base: str) -> List[Dict[str, Any]]:
        n = len(self.rows)
        done = 0 if self.never_finish else min(n, -(-n * self.polls // self.finish_after))
        tasks = []
        for i, row in enumerate(self.rows):
            text = str(row.get("user", ""))
            task: Dict[str, Any] = {"task_id": 1000 * self.id + i, "name": None, "instruction_excerpt": text[:80],
                                    "web_url": f"{base}/test-runs/{self.id}/tasks/{1000 * self.id + i}",
                                    "status": "running" if self.polls else "pending", "judge_passed": None,
                                    "runs": []}
            outcome = self.outcomes[i % len(self.outcomes)] if self.outcomes else {"judge_passed": True}
            if self.warnings:
                task["status"] = "not_dispatched"
            elif outcome.get("status") == "not_dispatched":  # never queued: in flight for ever
                task.update(outcome)
            elif i < done:
                task.update({"status": "completed", "runs": [{"latency_ms": 1200 + 10 * i}]}, **outcome)
            tasks.append(task)
        return tasks

    def rollup(self, base: str, page: int, page_size: int) -> Dict[str, Any]:
        tasks = self.tasks(base)
        totals = {key: sum(1 for t in tasks if t["status"] == key) for key in COUNTED}
        totals.update(task_count=len(tasks), pass_count=sum(1 for t in tasks if t.get("judge_passed") is True),
                      fail_count=sum(1 for t in tasks if t.get("judge_passed") is False))
        finished = not any(totals[k] for k in IN_FLIGHT)
        return {"test_run_id": self.id, "agent_id": self.agent_id, "status": "completed" if finished else "running",
                "totals": totals, "tasks": tasks[(page - 1) * page_size: page * page_size], "page": page,
                "page_size": page_size, "warnings": list(self.warnings), "web_url": f"{base}/test-runs/{self.id}",
                "total_cost_usd": 0.0123}


class FakePlatform:
    """The stand-in; ``with FakePlatform() as platform:`` serves it at ``platform.url``."""

    def __init__(self, *, api_key: str = API_KEY, page_size: int = 50, finish_after: int = 2) -> None:
        self.api_key = api_key
        self.page_size = page_size
        self.finish_after = finish_after
        self.never_finish = False
        self.outcomes: List[Dict[str, Any]] = []
        self.create_warnings: List[str] = []
        self.echo_key_in_errors = False  # a careless platform that repeats the key it was sent
        self.hidden_names: set = set()  # names taken by agents this key cannot list (another organisation's)
        self.requests: List[Recorded] = []
        self.agents: Dict[int, Dict[str, Any]] = {}
        self.runs: Dict[int, Run] = {}
        self._faults: List[Fault] = []
        self._lock = threading.Lock()
        self._next_id = 41
        self._server: Optional[ThreadingHTTPServer] = None
        self.url = ""

    # -- scripting ---------------------------------------------------------------------------------

    def fault(self, method: str, path: str, status: int, body: Any = None, headers: Optional[Dict[str, str]] = None,
              times: int = 1, after: int = 0) -> None:
        """Answer ``times`` requests ``METHOD PATH...`` with ``status`` (0 drops the connection), once ``after``
        more of them (counted from the faults already queued) have been answered as usual."""
        with self._lock:
            self._faults += [Fault(method, path, None, None, {})] * after
            self._faults += [Fault(method, path, status, body, dict(headers or {}))] * times

    def drop(self, method: str, path: str, times: int = 1, after: int = 0) -> None:
        self.fault(method, path, 0, times=times, after=after)

    def add_agent(self, name: str, mode: str = "external_http", **fields: Any) -> Dict[str, Any]:
        with self._lock:
            agent = self._new_agent({"name": name, "mode": mode, "config": {}, "tools_schema": [], **fields})
        return agent

    def calls(self, method: str, prefix: str = "/api/") -> List[Recorded]:
        return [r for r in self.requests if r.method == method and r.path.startswith(prefix)]

    # -- serving -----------------------------------------------------------------------------------

    def __enter__(self) -> FakePlatform:
        platform = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, reply, extra = platform.handle(self.command, parts.path, query, headers, body)
                if status == 0:
                    self.close_connection = True
                    return
                data = b"" if reply is None else json.dumps(reply).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- the API -----------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: Dict[str, str], headers: Dict[str, str],
               body: Any) -> Tuple[int, Any, Dict[str, str]]:
        with self._lock:
            self.requests.append(Recorded(method, path, query, headers, body))
            for i, fault in enumerate(self._faults):
                if fault.method == method and path.startswith(fault.path):
                    del self._faults[i]
                    if fault.status is not None:
                        return fault.status, fault.body, fault.headers
                    break
            sent = headers.get("authorization", "")
            if sent != f"Bearer {self.api_key}":
                said = f"Invalid API key: {sent}" if self.echo_key_in_errors else "Invalid or missing API key"
                return 401, {"detail": said}, {}
            return self._route(method, path.rstrip("/"), query, body)

    def _route(self, method: str, path: str, query: Dict[str, str], body: Any) -> Tuple[int, Any, Dict[str, str]]:
        parts = path.split("/")[1:]  # ["api", "agents", ...]
        routes: List[Tuple[str, List[str], Callable[..., Tuple[int, Any]]]] = [
            ("GET", ["api", "agents"], lambda: self._list_agents(query.get("search", ""))),
            ("POST", ["api", "agents"], lambda: self._create_agent(body)),
            ("GET", ["api", "agents", "*"], lambda a: self._get_agent(a)),
            ("PUT", ["api", "agents", "*"], lambda a: self._update_agent(a, body)),
            ("POST", ["api", "agents", "*", "test-runs"], lambda a: self._create_run(a, body)),
            ("GET", ["api", "test-runs", "*"], lambda r: self._get_run(r, query.get("page"))),
        ]
        for verb, pattern, answer in routes:
            if verb == method and len(pattern) == len(parts) and all(p in ("*", q) for p, q in zip(pattern, parts)):
                status, reply = answer(*[q for p, q in zip(pattern, parts) if p == "*"])
                return status, reply, {}
        return 404, {"detail": "Not Found"}, {}

    def _new_agent(self, body: Mapping[str, Any]) -> Dict[str, Any]:
        self._next_id += 1
        config = dict(body.get("config") or {})
        has_credential = bool(config.pop("auth_credential_value", None))  # write-only: never read back
        agent = {"id": self._next_id, "name": body["name"], "mode": body["mode"], "status": "draft",
                 "config": dict(config, has_auth_credential=has_credential),
                 "tools_schema": body.get("tools_schema") or [], "concurrency_cap": body.get("concurrency_cap", 5),
                 "run_timeout_s": body.get("run_timeout_s", 300), "ledger_schema": body.get("ledger_schema")}
        self.agents[agent["id"]] = agent
        return agent

    def _list_agents(self, search: str) -> Tuple[int, Any]:
        items = [a for a in self.agents.values() if search.lower() in a["name"].lower()]
        return 200, {"items": items, "total": len(items), "page": 1, "page_size": 50, "has_more": False}

    def _invalid(self, body: Any, create: bool) -> List[Dict[str, Any]]:
        problems = []
        if not isinstance(body, dict):
            return [{"loc": ["body"], "msg": "Input should be a valid dictionary", "type": "dict_type"}]
        if create and not (isinstance(body.get("name"), str) and body["name"].strip()):
            problems.append({"loc": ["body", "name"], "msg": "Field required", "type": "missing"})
        if create and body.get("mode") not in ("external_http", "sandbox"):
            problems.append({"loc": ["body", "mode"], "msg": "Input should be 'external_http' or 'sandbox'",
                             "type": "enum"})
        config = body.get("config")
        if isinstance(config, dict) and body.get("mode", "external_http") == "external_http" and create:
            url = config.get("endpoint_url")
            if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                problems.append({"loc": ["body", "config", "endpoint_url"],
                                 "msg": "Value error, endpoint_url must be an http(s) URL", "type": "value_error"})
        if isinstance(config, dict) and "source_files" in config and config.get("entrypoint_file") not in (
                config.get("source_files") or {}):
            problems.append({"loc": ["body", "config", "entrypoint_file"],
                             "msg": "Value error, entrypoint_file is not among source_files", "type": "value_error"})
        return problems

    def _create_agent(self, body: Any) -> Tuple[int, Any]:
        problems = self._invalid(body, create=True)
        if problems:
            return 422, {"detail": problems}
        name = body["name"]
        if name in self.hidden_names or any(a["name"] == name for a in self.agents.values()):
            return 409, {"detail": f"An agent named '{name}' already exists"}
        return 201, self._new_agent(body)

    def _get_agent(self, agent_id: str) -> Tuple[int, Any]:
        agent = self.agents.get(int(agent_id)) if agent_id.isdigit() else None
        return (200, agent) if agent else (404, {"detail": "Agent not found"})

    def _update_agent(self, agent_id: str, body: Any) -> Tuple[int, Any]:
        agent = self.agents.get(int(agent_id)) if agent_id.isdigit() else None
        if agent is None:
            return 404, {"detail": "Agent not found"}
        problems = self._invalid(body, create=False)
        if problems:
            return 422, {"detail": problems}
        for key, value in body.items():
            if key == "config":  # deep-merged; a credential not sent is kept
                config = dict(value)
                sent = bool(config.pop("auth_credential_value", None))
                agent["config"] = dict(agent["config"], **config)
                agent["config"]["has_auth_credential"] = sent or agent["config"].get("has_auth_credential", False)
            elif key in ("tools_schema", "ledger_schema", "concurrency_cap", "run_timeout_s", "description"):
                agent[key] = value
        return 200, agent

    def _create_run(self, agent_id: str, body: Any) -> Tuple[int, Any]:
        agent = self.agents.get(int(agent_id)) if agent_id.isdigit() else None
        if agent is None:
            return 404, {"detail": "Agent not found"}
        rows = body.get("rows") if isinstance(body, dict) else None
        if not isinstance(rows, list) or not rows:
            return 422, {"detail": [{"loc": ["body", "rows"], "msg": "at least one row is required",
                                     "type": "value_error"}]}
        for i, row in enumerate(rows):
            if not (isinstance(row, dict) and str(row.get("user", "")).strip()):
                return 422, {"detail": [{"loc": ["body", "rows", i, "user"], "msg": "the user instruction is empty",
                                         "type": "value_error"}]}
        self._next_id += 1
        run = Run(self._next_id, agent["id"], rows, list(self.outcomes), self.finish_after, self.never_finish,
                  list(self.create_warnings))
        self.runs[run.id] = run
        return 201, {"test_run_id": run.id, "task_count": len(rows), "warnings": list(self.create_warnings)}

    def _get_run(self, run_id: str, page: Optional[str]) -> Tuple[int, Any]:
        run = self.runs.get(int(run_id)) if run_id.isdigit() else None
        if run is None:
            return 404, {"detail": "Test run not found"}
        number = int(page) if page and page.isdigit() else 1
        if number == 1:
            run.polls += 1
        return 200, run.rollup(self.url, number, self.page_size)
