"""The dispatch app under the real servers users run it with: uvicorn (default flags) and gunicorn.

The same table of requests goes to our own http.server adapter, to ``DispatchApp`` as an ASGI3
app under ``uvicorn`` started with no ``--interface`` flag, and to ``DispatchApp.wsgi`` under
``gunicorn`` with the recipe of the README (``-k gthread --threads 8 --timeout`` above the run
timeout: gunicorn's default 30 s worker timeout would kill a run before our 504).  Each case must
get the same status and the same JSON body from every server.  Skipped when uvicorn or gunicorn is
missing.  Network: 127.0.0.1 only; every wait is bounded; every process is stopped by its fixture.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

pytest.importorskip("uvicorn", reason="the host tests need uvicorn")
pytest.importorskip("gunicorn", reason="the host tests need gunicorn")

import pipelines_port as pp  # noqa: E402
from conformance.mock_proxy import MockProxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "host-agent-token"
RUN_TOKEN = "rt-host-run"
RUN_TIMEOUT_S = 1.0
TOOLS = [{"name": "get_order", "description": "Look up an order", "input_schema": {"type": "object"}}]

APP = textwrap.dedent(f'''
    import time
    import pipelines_port as pp

    TOOLS = {TOOLS!r}

    def agent(envelope):
        if envelope.user_instruction == "raise":
            raise ValueError("bad order")
        if envelope.user_instruction == "slow":
            time.sleep(3)
            return "too late"
        order = pp.proxy_call("get_order", {{"order_id": "4521"}})
        return f"order 4521 is {{order['status']}}"

    app = pp.DispatchApp(agent, token={TOKEN!r}, run_timeout_s={RUN_TIMEOUT_S}, tools_schema=TOOLS)
    application = app.wsgi
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base: str, proc: Optional[subprocess.Popen] = None, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{base} did not answer /healthz within {seconds} s")


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=5)
    return out or ""


@pytest.fixture(scope="module")
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        p.script("get_order", [{"response": {"status": "shipped"}}])
        yield p


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, str]]:
    """name -> base URL: http.server in process, uvicorn and gunicorn as processes."""
    folder = tmp_path_factory.mktemp("hostapp")
    (folder / "hostapp.py").write_text(APP)
    env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{ROOT}"}
    env.pop("AGENT_TOKEN", None)
    app = pp.load_agent(f"{folder / 'hostapp.py'}:app")
    ours = pp.start_server(app, host="127.0.0.1", port=0)
    procs: List[Tuple[str, subprocess.Popen]] = []
    bases = {"http.server": ours.url.rsplit("/dispatch", 1)[0]}
    try:
        port = free_port()
        procs.append(("uvicorn", subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "hostapp:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        bases["uvicorn"] = f"http://127.0.0.1:{port}"
        port = free_port()
        procs.append(("gunicorn", subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "hostapp:application", "-k", "gthread", "--threads", "8",
             "--timeout", str(int(RUN_TIMEOUT_S) + 30), "--bind", f"127.0.0.1:{port}"],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        bases["gunicorn"] = f"http://127.0.0.1:{port}"
        for name, proc in procs:
            wait_ready(bases[name], proc)
        yield bases
    finally:
        ours.close(1)
        for _, proc in procs:
            stop(proc)


def call(base: str, method: str, path: str, headers: Dict[str, str], body: Optional[bytes]) -> Tuple[int, Any]:
    request = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def dispatch(proxy: MockProxy, instruction: str, run_token: Optional[str] = RUN_TOKEN) -> Tuple[Dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    if run_token:
        headers["X-Pipelines-Run-Token"] = run_token
    body = {"run_id": 17, "task_id": 42, "odyssey_proxy_url": proxy.url,
            "input": {"user_instruction": instruction, "input": {"order_id": "4521"}}}
    return headers, json.dumps(body).encode()


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
CASES = [
    ("ping", lambda p: ("POST", "/dispatch", AUTH, b'{"ping": true}'), 200),
    ("wrong token", lambda p: ("POST", "/dispatch", {**AUTH, "Authorization": "Bearer nope"}, b'{"ping": true}'), 401),
    ("bad JSON", lambda p: ("POST", "/dispatch", AUTH, b"{not json"), 400),
    ("missing run token", lambda p: ("POST", "/dispatch", *dispatch(p, "hello", run_token=None)), 400),
    ("agent error", lambda p: ("POST", "/dispatch", *dispatch(p, "raise")), 500),
    ("run timeout", lambda p: ("POST", "/dispatch", *dispatch(p, "slow")), 504),
    ("dispatch", lambda p: ("POST", "/dispatch", *dispatch(p, "hello")), 200),
    ("health", lambda p: ("GET", "/healthz", {}, None), 200),
    ("tools schema", lambda p: ("GET", "/tools_schema", {}, None), 200),
    ("wrong method", lambda p: ("GET", "/dispatch", AUTH, None), 405),
]


@pytest.mark.parametrize("name,make,status", CASES, ids=[c[0] for c in CASES])
def test_every_host_gives_the_same_answer(name: str, make: Any, status: int, servers: Dict[str, str],
                                          proxy: MockProxy) -> None:
    method, path, headers, body = make(proxy)
    answers = {host: call(base, method, path, headers, body) for host, base in servers.items()}
    statuses = {host: answer[0] for host, answer in answers.items()}
    assert set(statuses.values()) == {status}, answers
    bodies = [answer[1] for answer in answers.values()]
    assert all(b == bodies[0] for b in bodies), answers
    if name == "agent error":
        assert bodies[0]["detail"].startswith("ValueError: bad order")
    if name == "dispatch":
        assert bodies[0] == {"final_response": "order 4521 is shipped"}
    if name == "tools schema":
        assert bodies[0] == {"tools_schema": TOOLS}


def test_the_dispatches_reached_the_proxy_with_the_run_token(servers: Dict[str, str], proxy: MockProxy) -> None:
    before = len(proxy.calls("get_order"))
    for base in servers.values():
        headers, body = dispatch(proxy, "hello")
        assert call(base, "POST", "/dispatch", headers, body)[0] == 200
    made = proxy.calls("get_order")[before:]
    assert len(made) == len(servers)
    assert all(r.headers.get("authorization") == f"Bearer {RUN_TOKEN}" for r in made)
    assert len({r.headers.get("idempotency-key") for r in made}) == len(made)


def test_uvicorn_runs_the_lifespan_cleanly(tmp_path: Path) -> None:
    """Default flags: lifespan "auto" finds our startup/shutdown handling; no error on the way in or out."""
    (tmp_path / "hostapp.py").write_text(APP)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "hostapp:app", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
    finally:
        log = stop(proc)
    assert "Application startup complete" in log and "Application shutdown complete" in log, log
    assert "ASGI 'lifespan' protocol appears unsupported" not in log and "Traceback" not in log, log
