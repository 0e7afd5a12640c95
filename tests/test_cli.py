"""`python3 pipelines_port.py serve ...` as a user runs it: a real process, real sockets, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from conformance.harness.mock_proxy import MockProxy

ROOT = Path(__file__).resolve().parent.parent
AGENT_TOKEN = "cli-agent-token-9"
RUN_TOKEN = "cli-run-token-77777"

AGENT_SOURCE = textwrap.dedent("""
    import time
    import pipelines_port as pp

    def agent(env):
        order = pp.proxy_call("get_order", {"order_id": "1"})
        if env.user_instruction == "slow":
            time.sleep(1.0)
        return f"{env.user_instruction}: {order}"

    def broken(env):
        raise RuntimeError("kaput")

    NOT_CALLABLE = 3
""")


@pytest.fixture
def agent_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT_SOURCE)
    return path


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, banner: List[str]) -> None:
        self.proc, self.url, self.banner = proc, url, banner

    def stop(self) -> Tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def start(args: List[str], env: Optional[Dict[str, str]] = None, module: bool = False) -> Served:
    cmd = [sys.executable, "-m", "pipelines_port"] if module else [sys.executable, str(ROOT / "pipelines_port.py")]
    proc = subprocess.Popen(cmd + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    banner: List[str] = []
    url = None
    assert proc.stdout is not None
    while url is None:
        line = proc.stdout.readline()
        if not line:
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"server did not start: {err}")
        banner.append(line.strip())
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
    banner.append(proc.stdout.readline().strip())  # the auth line
    return Served(proc, url, banner)


def post(url: str, body: object, headers: Dict[str, str]) -> Tuple[int, Dict[str, object]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def run_cli(args: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipelines_port.py")] + args, cwd=ROOT, capture_output=True,
                          text=True, timeout=30, env={**os.environ, **(env or {})})


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        p.script("get_order", [{"response": {"status": "shipped"}}])
        yield p


def dispatch(proxy: MockProxy, instruction: str = "hello") -> Dict[str, object]:
    return {"run_id": 17, "task_id": 42, "run_token_jti": "jti-cli", "odyssey_proxy_url": proxy.url,
            "input": {"user_instruction": instruction}}


def test_serve_prints_where_and_how_and_logs_each_dispatch(agent_file: Path, proxy: MockProxy) -> None:
    served = start(["serve", f"{agent_file}:agent", "--port", "0"], env={"AGENT_TOKEN": AGENT_TOKEN})
    try:
        assert served.url.endswith("/dispatch")
        assert "Authorization: Bearer <token>" in served.banner[-1] and "AGENT_TOKEN" in served.banner[-1]
        assert AGENT_TOKEN not in " ".join(served.banner)
        auth = {"Authorization": f"Bearer {AGENT_TOKEN}"}
        assert post(served.url, {"ping": True}, auth) == (200, {"ok": True})
        status, body = post(served.url, dispatch(proxy), {**auth, "X-Pipelines-Run-Token": RUN_TOKEN})
        assert status == 200 and body == {"final_response": "hello: {'status': 'shipped'}"}
        assert post(served.url, {"ping": True}, {"Authorization": "Bearer nope"})[0] == 401
    finally:
        code, err = served.stop()
    assert code == 0
    line = next(l for l in err.splitlines() if "run_id=17" in l)
    assert "task_id=42" in line and "jti=jti-cli" in line and "status=200" in line and "proxy_calls=1" in line
    assert re.search(r"duration_ms=\d+\.\d", line)
    assert RUN_TOKEN not in err and AGENT_TOKEN not in err and "nope" not in err


def test_python_dash_m_with_debug_logs_proxy_traffic_redacted(agent_file: Path, proxy: MockProxy) -> None:
    served = start(["serve", f"{agent_file}:agent", "--port", "0", "--no-auth", "--path", "/run"], module=True,
                   env={"PIPELINES_AGENT_SDK_DEBUG": "1"})
    try:
        assert served.url.endswith("/run") and "DISABLED" in served.banner[-1]
        status, _ = post(served.url, dispatch(proxy), {"X-Pipelines-Run-Token": RUN_TOKEN})
        assert status == 200
    finally:
        code, err = served.stop()
    assert "-> POST" in err and "/tools/get_order" in err and "authorization: [redacted]" in err.lower()
    assert "auth is DISABLED" in err and RUN_TOKEN not in err


def test_agent_exception_is_500_and_traceback_goes_to_the_log(agent_file: Path, proxy: MockProxy) -> None:
    served = start(["serve", f"{agent_file}:broken", "--port", "0", "--token-env", "MY_TOKEN",
                    "--auth-header", "X-API-Key"], env={"MY_TOKEN": AGENT_TOKEN})
    try:
        assert "X-API-Key: <token>" in served.banner[-1]
        status, body = post(served.url, dispatch(proxy), {"X-API-Key": AGENT_TOKEN, "X-Pipelines-Run-Token": RUN_TOKEN})
        assert (status, body) == (500, {"detail": "RuntimeError: kaput"})
    finally:
        _, err = served.stop()
    assert "Traceback" in err and 'raise RuntimeError("kaput")' in err


def test_no_access_log_drops_the_line_per_request_but_not_the_agents_errors(agent_file: Path,
                                                                           proxy: MockProxy) -> None:
    served = start(["serve", f"{agent_file}:broken", "--port", "0", "--no-access-log"], env={"AGENT_TOKEN": AGENT_TOKEN})
    try:
        auth = {"Authorization": f"Bearer {AGENT_TOKEN}", "X-Pipelines-Run-Token": RUN_TOKEN}
        assert post(served.url, dispatch(proxy), auth) == (500, {"detail": "RuntimeError: kaput"})
        assert post(served.url, {"ping": True}, {"Authorization": "Bearer nope"})[0] == 401
    finally:
        code, err = served.stop()
    assert code == 0 and "Traceback" in err and 'raise RuntimeError("kaput")' in err  # the agent's error still shows
    assert "status=" not in err and "pipelines_port.access" not in err  # no line per request, refused ones included


GC_AGENT = textwrap.dedent("""
    import gc

    async def agent(env):
        return {"final_response": f"run {env.run_id} of {env.run_token_jti}",
                "metadata": {"threshold": gc.get_threshold()[0], "frozen": gc.get_freeze_count()}}
""")


@pytest.mark.parametrize("args", [[], ["--gc-threshold", "20000"], ["--gc-threshold", "0"]])
def test_serve_tunes_the_garbage_collector_unless_told_not_to(tmp_path: Path, args: List[str]) -> None:
    """A fan-out keeps thousands of dispatches alive for seconds: serve freezes what is loaded and collects the
    first generation every 50,000 allocations (README "Speed"); ``--gc-threshold 0`` leaves Python's settings."""
    (tmp_path / "gc_agent.py").write_text(GC_AGENT)
    python_default = int(subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold()[0])"],
                                        capture_output=True, text=True, check=True).stdout)
    served = start(["serve", f"{tmp_path / 'gc_agent.py'}:agent", "--port", "0", "--no-auth", *args])

    def one(n: int) -> Tuple[int, Dict[str, object]]:
        return post(served.url, {"run_id": n, "task_id": 2, "run_token_jti": f"jti-{n}", "odyssey_proxy_url":
                                 "http://127.0.0.1:9/", "input": {"user_instruction": "x"}},
                    {"X-Pipelines-Run-Token": f"{RUN_TOKEN}-{n}"})

    try:
        with ThreadPoolExecutor(120) as pool:  # dispatches at once, each with a run of its own
            replies = list(pool.map(one, range(120)))
    finally:
        code, _ = served.stop()
    assert code == 0
    assert [status for status, _ in replies] == [200] * 120
    assert [body["final_response"] for _, body in replies] == [f"run {n} of jti-{n}" for n in range(120)]
    metadata = replies[0][1]["metadata"]
    assert isinstance(metadata, dict)
    if args[-1:] == ["0"]:
        assert metadata == {"threshold": python_default, "frozen": 0}
    else:
        assert metadata["threshold"] == (int(args[-1]) if args else 50_000) and metadata["frozen"] > 1000


def test_sigterm_lets_the_in_flight_dispatch_finish(agent_file: Path, proxy: MockProxy) -> None:
    served = start(["serve", f"{agent_file}:agent", "--port", "0", "--no-auth", "--grace", "10"])
    result: List[Tuple[int, Dict[str, object]]] = []
    t = threading.Thread(target=lambda: result.append(
        post(served.url, dispatch(proxy, "slow"), {"X-Pipelines-Run-Token": RUN_TOKEN})))
    t.start()
    try:
        for _ in range(200):  # wait until the dispatch is inside the agent (it called the proxy)
            if proxy.calls("get_order"):
                break
            threading.Event().wait(0.02)
        served.proc.send_signal(signal.SIGTERM)
        t.join(20)
        _, err = served.proc.communicate(timeout=20)
        code = served.proc.returncode
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    assert result and result[0][0] == 200 and result[0][1]["final_response"].startswith("slow:")
    assert code == 0 and "shutting down" in err


def test_unset_token_env_warns_at_start_and_answers_503(agent_file: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AGENT_TOKEN"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "pipelines_port.py"), "serve", f"{agent_file}:agent",
                             "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONPATH": str(ROOT)})
    served = Served(proc, "", [])
    try:
        first = proc.stdout.readline()
        served.url = re.search(r"listening on (http://\S+)", first).group(1)
        assert "NOT set" in proc.stdout.readline()
        status, body = post(served.url, {"ping": True}, {"Authorization": "Bearer x"})
        assert status == 503 and "AGENT_TOKEN" in body["detail"]
    finally:
        served.stop()


@pytest.mark.parametrize("args,needle", [
    (["serve"], "required"),
    (["serve", "no_colon_here"], "PATH_OR_MODULE:FUNCTION"),
    (["serve", "/nowhere/agent.py:agent"], "no such file"),
    (["serve", "{agent}:missing"], "has no function 'missing'"),
    (["serve", "{agent}:NOT_CALLABLE"], "not a function"),
    (["serve", "{bad}:agent"], "cannot import"),
    (["serve", "no_such_module_xyz:agent"], "No module named"),
    (["serve", "{agent}:agent", "--timeout", "0"], "positive"),
    (["serve", "{agent}:agent", "--timeout", "5000"], "1800"),
    (["serve", "{agent}:agent", "--max-body", "lots"], "whole number"),
    (["serve", "{agent}:agent", "--path", "dispatch"], "must start with '/'"),
    (["serve", "{agent}:agent", "--gc-threshold", "-5"], "0 or more, got '-5'"),
    (["serve", "{agent}:agent", "--gc-threshold", "many"], "0 or more, got 'many'"),
    (["frobnicate"], "invalid choice"),
])
def test_wrong_usage_is_one_clear_line_and_a_nonzero_exit(agent_file: Path, tmp_path: Path, args: List[str],
                                                         needle: str) -> None:
    bad = tmp_path / "bad_agent.py"
    bad.write_text("import json\nx = undefined_name\n")
    args = [a.format(agent=agent_file, bad=bad) for a in args]
    out = run_cli(args, env={"AGENT_TOKEN": "t"})
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    if needle == "cannot import":
        assert "NameError" in out.stderr and "line 2" in out.stderr


@pytest.mark.parametrize("args", [["--token", "s3cret-agent-token-9f9f"], ["--token=s3cret-agent-token-9f9f"],
                                  ["--token-e", "s3cret-agent-token-9f9f"]])
def test_a_token_on_the_command_line_is_refused_without_echoing_it(agent_file: Path, args: List[str]) -> None:
    """``--token X`` is not an abbreviation of ``--token-env``: it is refused, and X shows nowhere."""
    out = run_cli(["serve", f"{agent_file}:agent", "--port", "0", *args], env={"AGENT_TOKEN": "t"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and "listening" not in out.stdout
    if args[0] == "--token-e":  # no prefix stands for an option
        assert "unrecognized arguments: --token-e" in out.stderr
    else:
        assert "--token is not accepted" in out.stderr and "--token-env NAME" in out.stderr
        assert "s3cret-agent-token-9f9f" not in out.stderr + out.stdout


def test_port_in_use_is_one_clear_line(agent_file: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = run_cli(["serve", f"{agent_file}:agent", "--port", str(port), "--no-auth"])
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr and "Traceback" not in out.stderr


def test_module_path_form_and_tools_schema_beside_the_file(tmp_path: Path) -> None:
    pkg = tmp_path / "shop"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bot.py").write_text("def agent(env):\n    return 'hi'\n")
    (pkg / "tools_schema.json").write_text(json.dumps([{"name": "get_order", "input_schema": {"type": "object"}}]))
    served = start(["serve", "shop.bot:agent", "--port", "0", "--no-auth"], env={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    served.stop()
    served = start(["serve", f"{pkg / 'bot.py'}:agent", "--port", "0", "--no-auth"])
    try:
        with urllib.request.urlopen(served.url.replace("/dispatch", "/tools_schema"), timeout=10) as resp:
            assert json.loads(resp.read())["tools_schema"][0]["name"] == "get_order"
    finally:
        served.stop()


def test_help_and_version() -> None:
    out = run_cli(["serve", "--help"])
    assert out.returncode == 0 and "--token-env" in out.stdout and "--auth-header" in out.stdout
    out = run_cli(["--version"])
    assert out.returncode == 0 and "pipelines_port" in out.stdout


def test_the_command_line_names_itself_as_it_was_run() -> None:
    as_module = subprocess.run([sys.executable, "-m", "pipelines_port", "--help"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30)
    assert as_module.stdout.startswith("usage: python3 -m pipelines_port ")
    as_script = run_cli(["--help"])
    assert as_script.stdout.startswith("usage: pipelines_port.py ")
    moved = run_cli(["init", "--list"])
    assert moved.returncode == 2 and "pipelines-port init" in moved.stderr and "Traceback" not in moved.stderr
