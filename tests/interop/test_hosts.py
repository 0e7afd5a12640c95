"""The dispatch app under the real servers users run it with: uvicorn (default flags), gunicorn, hypercorn.

One table of requests goes, over real sockets on 127.0.0.1, to every host below, and each case must
get the same status, the same JSON body and the same meaningful headers from all of them:

- ``http.server``: our own adapter, ``pp.start_server(app)`` in this process;
- ``uvicorn DispatchApp``: ``app = pp.DispatchApp(agent, token=...)`` as an ASGI3 app, started as
  ``python -m uvicorn hostapp:app --port P``: DEFAULT flags, no ``--interface`` (uvicorn's interface
  detection must see ASGI3) and no ``--lifespan`` ("auto": our lifespan handling must satisfy it);
- ``uvicorn .asgi`` and ``uvicorn asgi_app``: ``app.asgi`` and ``pp.asgi_app(agent)``, plain
  ``async def`` functions, under the same default flags (the latter with the token from ``$AGENT_TOKEN``);
- ``gunicorn .wsgi`` and ``gunicorn wsgi_app``: ``app.wsgi`` and ``pp.wsgi_app(agent)`` under the README
  recipe, ``-k gthread --threads 8 --timeout <run_timeout_s + 30>``;
- ``hypercorn DispatchApp``: the same ASGI3 instance under hypercorn's defaults, when hypercorn is installed.

Skipped when uvicorn or gunicorn is missing (pins: tests/interop/requirements-hosts.txt).  Every wait
is bounded and every process is stopped by the fixture that started it.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pytest

pytest.importorskip("uvicorn", reason="the host tests need uvicorn (tests/interop/requirements-hosts.txt)")
pytest.importorskip("gunicorn", reason="the host tests need gunicorn (tests/interop/requirements-hosts.txt)")

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy
from tests.interop.hosts import (
    Reply,
    ServerProcess,
    dispatch_request,
    free_port,
    gunicorn_command,
    http_call,
    hypercorn_command,
    subprocess_env,
    uvicorn_command,
)

HAVE_HYPERCORN = importlib.util.find_spec("hypercorn") is not None

TOKEN = "agent-token-hosts-7f3a9c51"
RUN_TOKEN = "run-token-hosts-2b8e41d0"
RUN_TIMEOUT_S = 1.0
SLOW_S = 3.0  # the overrunning agent's sleep: well past RUN_TIMEOUT_S
GUNICORN_TIMEOUT_S = int(RUN_TIMEOUT_S) + 30  # the README recipe: gunicorn's --timeout above run_timeout_s
TOOLS = [
    {"name": "get_order", "description": "Look up an order",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}},
    {"name": "issue_refund", "description": "Refund an order",
     "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}}},
]

# The app module every server loads (written to a temporary folder as hostapp.py).
APP = textwrap.dedent(f'''
    import time

    import pipelines_port as pp

    TOOLS = {TOOLS!r}


    def agent(envelope):
        instruction = envelope.user_instruction
        if instruction == "raise":
            raise ValueError("bad order 4521")
        if instruction.startswith("sleep "):
            time.sleep(float(instruction.split()[1]))
            return "too late"
        order = pp.proxy_call("get_order", {{"order_id": "4521"}})
        if envelope.is_multi_turn:  # a turn of a multi-turn run: the turn reply, sent as built (CONTRACT §4.2)
            return pp.build_turn_reply("order 4521 is " + order["status"], metadata={{"model": "m-1"}},
                                       session_done=True)
        return "order 4521 is " + order["status"]


    OPTIONS = dict(run_timeout_s={RUN_TIMEOUT_S!r}, tools_schema=TOOLS, proxy_hosts="127.0.0.1", strict=False)

    app = pp.DispatchApp(agent, token={TOKEN!r}, **OPTIONS)   # the token= option
    asgi = app.asgi
    application = app.wsgi
    env_asgi = pp.asgi_app(agent, **OPTIONS)                   # the token from $AGENT_TOKEN
    env_wsgi = pp.wsgi_app(agent, **OPTIONS)

    # For the gunicorn sync-worker test: a run allowed 10 s, so only gunicorn's --timeout can cut it short.
    long_wsgi = pp.DispatchApp(agent, token={TOKEN!r}, run_timeout_s=10, proxy_hosts="127.0.0.1").wsgi
''')

# name -> (command builder, target in hostapp); the http.server host runs in this process.
SUBPROCESS_HOSTS: Dict[str, Tuple[Callable[[str, int], List[str]], str]] = {
    "uvicorn DispatchApp": (uvicorn_command, "hostapp:app"),
    "uvicorn .asgi": (uvicorn_command, "hostapp:asgi"),
    "uvicorn asgi_app": (uvicorn_command, "hostapp:env_asgi"),
    "gunicorn .wsgi": (lambda t, p: gunicorn_command(t, p, timeout=GUNICORN_TIMEOUT_S), "hostapp:application"),
    "gunicorn wsgi_app": (lambda t, p: gunicorn_command(t, p, timeout=GUNICORN_TIMEOUT_S), "hostapp:env_wsgi"),
}
if HAVE_HYPERCORN:
    SUBPROCESS_HOSTS["hypercorn DispatchApp"] = (hypercorn_command, "hostapp:app")


@pytest.fixture(scope="module")
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        p.script("get_order", lambda r: {"response": {"order_id": (r.json or {}).get("order_id"), "status": "shipped"}})
        yield p


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hostapp")
    (folder / "hostapp.py").write_text(APP)
    return folder


def app_env(app_dir: Path) -> Dict[str, str]:
    return subprocess_env(app_dir, AGENT_TOKEN=TOKEN)


class Hosts(NamedTuple):
    bases: Dict[str, str]  # host name -> base URL
    procs: Dict[str, ServerProcess]


@pytest.fixture(scope="module")
def hosts(app_dir: Path) -> Iterator[Hosts]:
    """Every host of the table, started together (in parallel) and stopped at the end of the module."""
    app = pp.load_agent(f"{app_dir / 'hostapp.py'}:app")
    ours = pp.start_server(app, host="127.0.0.1", port=0)
    procs: Dict[str, ServerProcess] = {}
    try:
        for name, (command, target) in SUBPROCESS_HOSTS.items():
            port = free_port()
            slug = name.replace(" ", "_").replace(".", "")
            procs[name] = ServerProcess(name, command(target, port), port, cwd=app_dir, env=app_env(app_dir),
                                        log_path=app_dir / f"{slug}.log")
        for proc in procs.values():
            proc.wait_ready()
        bases = {"http.server": f"http://127.0.0.1:{ours.server_address[1]}"}
        bases.update({name: proc.base for name, proc in procs.items()})
        yield Hosts(bases, procs)
    finally:
        ours.close(1)
        for proc in procs.values():
            proc.stop()


def ask_all(hosts: Hosts, method: str, path: str, headers: Dict[str, str], body: Optional[bytes]) -> Dict[str, Reply]:
    """The same request to every host at once (so the slow cases cost one wait, not one per host)."""
    with ThreadPoolExecutor(max_workers=len(hosts.bases)) as pool:
        futures = {name: pool.submit(http_call, base, method, path, headers, body)
                   for name, base in hosts.bases.items()}
        return {name: future.result() for name, future in futures.items()}


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
PING = b'{"ping": true}'


class Case(NamedTuple):
    id: str
    request: Callable[[MockProxy], Tuple[str, str, Dict[str, str], Optional[bytes]]]
    status: int
    check: Callable[[Any], bool]  # on the JSON body all hosts agreed on


def _dispatch(instruction: str, run_token: Optional[str] = RUN_TOKEN) -> Callable[[MockProxy], Tuple[Any, ...]]:
    return lambda p: ("POST", "/dispatch", *dispatch_request(p.url, TOKEN, run_token, instruction))


def _turn(p: MockProxy) -> Tuple[Any, ...]:
    """A turn of a multi-turn run: the dispatch's input carries session_id and turn_id (§2.2 multi-turn-fields)."""
    headers, body = dispatch_request(p.url, TOKEN, RUN_TOKEN, "hello")
    payload = json.loads(body)
    payload["input"].update({"latest_user_prompt": "hello", "session_id": "sess-1", "turn_id": "sess-1-t0",
                             "messages": []})
    return "POST", "/dispatch", headers, json.dumps(payload).encode()


CASES = [
    Case("ping", lambda p: ("POST", "/dispatch", AUTH, PING), 200, lambda b: b == {"ok": True}),
    Case("wrong token", lambda p: ("POST", "/dispatch", {**AUTH, "Authorization": "Bearer not-the-token"}, PING),
         401, lambda b: "credential" in b["detail"] and "not-the-token" not in b["detail"]),
    Case("no credential", lambda p: ("POST", "/dispatch", {"Content-Type": "application/json"}, PING), 401,
         lambda b: "credential" in b["detail"]),
    Case("bad JSON", lambda p: ("POST", "/dispatch", AUTH, b"{not json"), 400,
         lambda b: b["detail"].startswith("body is not valid JSON")),
    Case("missing run token", _dispatch("hello", run_token=None), 400,
         lambda b: "run token" in b["detail"]),
    Case("agent raises", _dispatch("raise"), 500, lambda b: b["detail"].startswith("ValueError")
         and "bad order 4521" in b["detail"]),
    Case("run timeout", _dispatch(f"sleep {SLOW_S}"), 504, lambda b: f"run_timeout_s={RUN_TIMEOUT_S:g}" in b["detail"]),
    Case("dispatch", _dispatch("hello"), 200, lambda b: b == {"final_response": "order 4521 is shipped"}),
    Case("turn reply", _turn, 200, lambda b: b == {"message": "order 4521 is shipped", "session_done": True,
                                                   "metadata": {"model": "m-1"}}),
    Case("healthz", lambda p: ("GET", "/healthz", {}, None), 200,
         lambda b: b == {"ok": True, "version": pp.__version__}),
    Case("tools_schema", lambda p: ("GET", "/tools_schema", AUTH, None), 200, lambda b: b == {"tools_schema": TOOLS}),
    Case("wrong method", lambda p: ("GET", "/dispatch", AUTH, None), 405, lambda b: "POST" in b["detail"]),
    Case("no route", lambda p: ("POST", "/nowhere", AUTH, PING), 404, lambda b: "/dispatch" in b["detail"]),
]

# Headers whose values must agree too (the servers add Date, Server and framing headers of their own).
COMPARED_HEADERS = ("content-type", "www-authenticate", "allow")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_host_gives_the_same_answer(case: Case, hosts: Hosts, proxy: MockProxy) -> None:
    before = len(proxy.calls("get_order"))
    method, path, headers, body = case.request(proxy)
    started = time.monotonic()
    replies = ask_all(hosts, method, path, headers, body)
    elapsed = time.monotonic() - started
    shown = {name: (r.status, r.body[:300]) for name, r in replies.items()}
    assert {name: r.status for name, r in replies.items()} == dict.fromkeys(replies, case.status), shown
    bodies = {name: json.loads(r.body) for name, r in replies.items()}
    first = next(iter(bodies.values()))
    assert all(b == first for b in bodies.values()), bodies
    assert case.check(first), first
    for header in COMPARED_HEADERS:
        values = {name: r.headers.get(header) for name, r in replies.items()}
        assert len(set(values.values())) == 1, (header, values)
    assert all(r.headers.get("content-type") == "application/json" for r in replies.values())

    made = proxy.calls("get_order")[before:]
    if case.id in ("dispatch", "turn reply"):  # each host ran the agent, whose one proxy call carried the run token
        assert len(made) == len(replies), made
        assert all(r.run_token == RUN_TOKEN and r.bearer == RUN_TOKEN for r in made)
        assert all(r.json == {"order_id": "4521"} for r in made)
        keys = [r.idempotency_key for r in made]
        assert all(keys) and len(set(keys)) == len(keys), keys
    elif case.id == "run timeout":
        assert elapsed < SLOW_S, f"the 504 came after {elapsed:.1f} s, not at run_timeout_s={RUN_TIMEOUT_S:g}"
    else:
        assert made == [], "only a dispatch may reach the proxy"


def test_the_table_covers_every_host(hosts: Hosts) -> None:
    expected = {"http.server", *SUBPROCESS_HOSTS}
    assert set(hosts.bases) == expected


def test_gunicorn_recipe_answers_the_504_itself(hosts: Hosts, proxy: MockProxy) -> None:
    """The README recipe: ``gunicorn app:application -k gthread --threads 8 --timeout <run_timeout_s + 30>``.

    What ``--timeout`` does (gunicorn 27.0.1, checked by hand and by the sync-worker test below):

    - with the default ``sync`` worker, one request per process: the arbiter SIGABRTs a worker that has not
      checked in for ``--timeout`` seconds (default 30), which is every worker running a longer dispatch.
      gunicorn's abort handler raises ``SystemExit(1)`` in the thread that waits for the agent, the worker
      dies and is replaced, and the caller never gets the kit's 504 at ``run_timeout_s``: with a 300 s
      run timeout under the default 30 s, every run longer than 30 s is lost;
    - with ``gthread``, the worker's main loop checks in every second while its threads run dispatches, so
      ``--timeout`` does not cut a long run short (it still catches a hung worker), but the graceful stop
      (``--graceful-timeout``, default 30 s) still bounds in-flight runs on a restart or a deploy.

    Keeping ``--timeout`` above ``run_timeout_s`` makes the recipe right whichever worker class ends up in
    use, and threads let one worker hold many dispatches that wait on the proxy.  This test does not wait
    30 s: it checks, on the table's gunicorn host (the recipe with run_timeout_s=1 s), that an overrunning
    agent gets the kit's own 504 at about run_timeout_s, from the same worker, which then goes on serving.
    """
    server = hosts.procs["gunicorn .wsgi"]
    assert "--timeout" in server.command and server.command[server.command.index("--timeout") + 1] == str(
        GUNICORN_TIMEOUT_S)
    headers, body = dispatch_request(proxy.url, TOKEN, RUN_TOKEN, f"sleep {SLOW_S}")
    started = time.monotonic()
    reply = http_call(server.base, "POST", "/dispatch", headers, body)
    elapsed = time.monotonic() - started
    assert reply.status == 504, reply
    assert reply.json() == {"detail": f"agent did not finish within run_timeout_s={RUN_TIMEOUT_S:g} s"}
    assert RUN_TIMEOUT_S * 0.9 <= elapsed < SLOW_S, elapsed
    assert http_call(server.base, "POST", "/dispatch", AUTH, PING).status == 200
    log = server.log()
    assert "WORKER TIMEOUT" not in log, log
    assert log.count("Booting worker") == 1, log


def test_gunicorn_sync_worker_timeout_below_the_run_loses_it(app_dir: Path, proxy: MockProxy) -> None:
    """What the recipe avoids, in seconds instead of 30: ``-k sync --timeout 1`` and a run of 6 s (allowed 10 s).

    The arbiter kills the worker after about 1-2 s: the caller gets neither the agent's answer nor the kit's
    504, and gunicorn logs WORKER TIMEOUT.  (With gunicorn 27.0.1 and today's kit the caller sees a 500
    ``SystemExit: 1``: the kit reports gunicorn's abort, raised in the waiting thread, as an agent error.)
    """
    port = free_port()
    with ServerProcess("gunicorn sync", gunicorn_command("hostapp:long_wsgi", port, worker="sync", timeout=1), port,
                       cwd=app_dir, env=app_env(app_dir), log_path=app_dir / "gunicorn_sync.log") as server:
        server.wait_ready()
        headers, body = dispatch_request(proxy.url, TOKEN, RUN_TOKEN, "sleep 6")
        started = time.monotonic()
        try:
            outcome: Any = http_call(server.base, "POST", "/dispatch", headers, body)
        except (OSError, http.client.HTTPException) as exc:  # the worker died before it answered
            outcome = exc
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 5
        while "WORKER TIMEOUT" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = server.log()
    assert elapsed < 5, (elapsed, outcome)
    assert not (isinstance(outcome, Reply) and outcome.status in (200, 504)), outcome
    assert "WORKER TIMEOUT" in log, log


@pytest.mark.parametrize("target", ["app", "asgi", "env_asgi"])
def test_uvicorn_default_flags_run_the_lifespan_cleanly(app_dir: Path, target: str) -> None:
    """``uvicorn hostapp:<target> --port P``: lifespan "auto" starts and stops the app with no error."""
    port = free_port()
    server = ServerProcess(f"uvicorn {target}", uvicorn_command(f"hostapp:{target}", port), port, cwd=app_dir,
                           env=app_env(app_dir), log_path=app_dir / f"lifespan_{target}.log")
    try:
        server.wait_ready()
        assert http_call(server.base, "POST", "/dispatch", AUTH, PING).status == 200
    finally:
        code = server.stop()
    log = server.log_path.read_text(errors="replace")
    assert code in (0, -signal.SIGTERM), log  # uvicorn 0.29+ re-raises the signal once it has shut down
    for line in ("Waiting for application startup.", "Application startup complete.",
                 "Waiting for application shutdown.", "Application shutdown complete."):
        assert line in log, log
    for bad in ("Traceback", "ERROR", "lifespan' protocol appears unsupported", "ASGI callable returned without"):
        assert bad not in log, log
