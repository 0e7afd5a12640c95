"""Shared helpers for the interop tier's host and MCP client tests: processes, ports, HTTP calls, dispatches.

Standard library (and the kit) only, so importing it never needs an interop package: the tests that
use it skip on their own (``pytest.importorskip``) when uvicorn, gunicorn or mcp is missing.  Every
wait is bounded, every server listens on 127.0.0.1 only, and every process started here is stopped
by :meth:`ServerProcess.stop` (SIGTERM, then SIGKILL after a bounded grace).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]

READY_S = 30.0  # how long a server may take to answer /healthz after its start
STOP_S = 15.0  # how long a server may take to exit after SIGTERM before it is killed
CALL_S = 20.0  # one HTTP call's timeout


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server that takes it binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def subprocess_env(*paths: os.PathLike[str] | str, **extra: str) -> Dict[str, str]:
    """This process's environment for a child: no ``PIPELINES_*`` nor ``AGENT_TOKEN`` leaking in from the
    caller's shell, ``PYTHONPATH`` = ``paths`` then the repository root, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINES_") and k != "AGENT_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(ROOT)])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------


class Reply(NamedTuple):
    status: int
    headers: Dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_call(base: str, method: str, path: str, headers: Optional[Mapping[str, str]] = None,
              body: Optional[bytes] = None, timeout: float = CALL_S) -> Reply:
    """One request; every status (4xx and 5xx too) comes back as a :class:`Reply`."""
    request = urllib.request.Request(base + path, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return Reply(reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read())
    except urllib.error.HTTPError as err:
        with err:
            return Reply(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read())


def dispatch_request(proxy_url: str, token: str, run_token: Optional[str], instruction: str, *,
                     run_id: int = 17, task_id: int = 42) -> Tuple[Dict[str, str], bytes]:
    """Headers and body of one §2 dispatch (``run_token=None``: the run token header is left out)."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if run_token is not None:
        headers["X-Pipelines-Run-Token"] = run_token
    body = {"run_id": run_id, "task_id": task_id, "odyssey_proxy_url": proxy_url,
            "input": {"user_instruction": instruction, "input": {"order_id": "4521"}}}
    return headers, json.dumps(body).encode()


def wait_ready(base: str, proc: Optional[subprocess.Popen[Any]] = None, seconds: float = READY_S,
               log: Optional[Path] = None) -> None:
    """Poll ``GET {base}/healthz`` until it answers 200.  Fails at once when ``proc`` exits or the server answers
    anything else (it is up but cannot run the app: its log says why), and after ``seconds`` without an answer."""
    def tail() -> str:
        return log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode} before it was ready:\n{tail()}")
        try:
            reply = http_call(base, "GET", "/healthz", timeout=2)
        except OSError:  # not listening yet (or an empty reply: the server is still starting its worker)
            time.sleep(0.1)
            continue
        if reply.status == 200:
            return
        raise AssertionError(f"{base} answered GET /healthz with {reply.status} {reply.body[:200]!r}:\n{tail()}")
    raise AssertionError(f"{base} did not answer GET /healthz within {seconds:g} s:\n{tail()}")


# ---------------------------------------------------------------------------
# Server processes
# ---------------------------------------------------------------------------


def uvicorn_command(target: str, port: int) -> List[str]:
    """uvicorn with its DEFAULT flags (no ``--interface``, no ``--lifespan``; host 127.0.0.1 by default)."""
    return [sys.executable, "-m", "uvicorn", target, "--port", str(port)]


def gunicorn_command(target: str, port: int, *, worker: str = "gthread", threads: int = 8,
                     timeout: Optional[float] = None) -> List[str]:
    """gunicorn as the README recipe runs it: ``-k gthread --threads 8 --timeout T`` (T above run_timeout_s)."""
    command = [sys.executable, "-m", "gunicorn", target, "-k", worker, "--bind", f"127.0.0.1:{port}",
               "--graceful-timeout", "5"]
    if worker == "gthread":
        command += ["--threads", str(threads)]
    if timeout is not None:
        command += ["--timeout", str(int(timeout))]
    return command + _gunicorn_control_socket_flag()


def _gunicorn_control_socket_flag() -> List[str]:
    """gunicorn 24+ opens a control socket at ``~/.gunicorn/gunicorn.ctl`` by default: concurrent test servers
    would share it, so it is turned off where the option exists."""
    try:
        from gunicorn.config import KNOWN_SETTINGS  # pyright: ignore[reportMissingImports]
    except ImportError:
        return []
    flags = {flag for setting in KNOWN_SETTINGS for flag in (getattr(setting, "cli", None) or [])}
    return ["--no-control-socket"] if "--no-control-socket" in flags else []


def hypercorn_command(target: str, port: int) -> List[str]:
    """hypercorn with its default flags (it finds out itself that the app is ASGI)."""
    return [sys.executable, "-m", "hypercorn", target, "--bind", f"127.0.0.1:{port}"]


class ServerProcess:
    """One server started as a subprocess; its output (stdout and stderr) goes to ``log_path``.

    A file, not a pipe: nobody reads a pipe while the tests run, and a full one would block the server.
    """

    def __init__(self, name: str, command: Sequence[str], port: int, *, cwd: Path, env: Mapping[str, str],
                 log_path: Path) -> None:
        self.name = name
        self.command = list(command)
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc: subprocess.Popen[Any] = subprocess.Popen(
            self.command, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.returncode: Optional[int] = None

    def wait_ready(self, seconds: float = READY_S) -> ServerProcess:
        try:
            wait_ready(self.base, self.proc, seconds, self.log_path)
        except AssertionError as exc:
            raise AssertionError(f"{self.name} ({' '.join(self.command[1:])}): {exc}") from None
        return self

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, grace_s: float = STOP_S) -> int:
        """SIGTERM (a graceful stop for all three servers), SIGKILL to its process group after ``grace_s``."""
        if self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # anything left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerProcess({self.name!r}, {self.base})"


@contextlib.contextmanager
def started(name: str, command: Callable[[int], Sequence[str]], *, cwd: Path, env: Mapping[str, str]) -> Iterator[str]:
    """``command(port)`` on a free port as a :class:`ServerProcess` (its log beside it in ``cwd``), ready; its base
    URL.  Stopped on exit."""
    port = free_port()
    slug = "".join(c if c.isalnum() else "_" for c in name)
    with ServerProcess(name, command(port), port, cwd=cwd, env=env, log_path=cwd / f"{slug}.log") as proc:
        proc.wait_ready()
        yield proc.base
