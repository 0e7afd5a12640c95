"""The Go port (conformance/ports/go/): its own tests, the conformance check, and its server over 127.0.0.1.

The server (``cmd/conformance-server``, serving the conformance agent) is built
once into a temporary directory and run as a subprocess; the agent's tool
calls go to a MockProxy. So is the same agent mounted under a prefix in a chi
router (``internal/chitest``, a module of its own whose one dependency, chi,
the ``chi`` fixture fetches with ``go mod download``; the builds then run with
``GOPROXY=off``). Skipped when ``go`` is not on PATH.
"""

from __future__ import annotations

import http.client
import functools
import os
import pathlib
import re
import shutil
import signal
import subprocess
import threading
from typing import Dict, Iterator, Optional

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.port_process import (
    PortServer, assert_a_custom_auth_header_and_the_misconfigured_mode, post,
    assert_a_script_through_the_proxy_and_a_failing_agent, assert_auth_ping_and_the_refusals,
    assert_bad_arguments_are_one_line, assert_sigterm_lets_a_dispatch_finish, assert_the_check_passes_at_strict)
from tests.registries import go_mod_download, need

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORT_DIR = ROOT / "conformance" / "ports" / "go"
CHI_DIR = PORT_DIR / "internal" / "chitest"  # the chi-mounted handler: a module of its own, with chi
GO_MODULE = re.search(r"^module (\S+)$", (PORT_DIR / "go.mod").read_text(), re.M).group(1)  # type: ignore[union-attr]
CHI_PREFIX = "/agents/support"
GO = shutil.which("go")
AGENT_TOKEN = "go-agent-token-5d5d5d5d"
RUN_TOKEN = "go-run-token-6e6e6e6e"

pytestmark = pytest.mark.skipif(GO is None, reason="go is not on PATH: the Go port cannot be built")


def go_env(cache: pathlib.Path, mod: str = "mod") -> Dict[str, str]:
    """The environment for ``go``: no network (the port needs nothing; chi is already in the module cache), a
    build cache that exists."""
    env = {**os.environ, "GOFLAGS": f"-mod={mod}", "GOPROXY": "off", "GO111MODULE": "on"}
    if not env.get("GOCACHE") and not env.get("HOME") and not env.get("XDG_CACHE_HOME"):
        env["GOCACHE"] = str(cache)
    return env


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``go build`` of the conformance server, once per module."""
    out = tmp_path_factory.mktemp("go-port")
    exe = out / "conformance-server"
    done = subprocess.run([GO, "build", "-o", str(exe), "./cmd/conformance-server"], cwd=PORT_DIR,
                          env=go_env(out / "cache"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe


class GoServer(PortServer):
    """The built conformance server as a subprocess on a free port; ``url`` is its dispatch URL."""

    def __init__(self, exe: pathlib.Path, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__([str(exe)], *args, agent_token=AGENT_TOKEN, env=env)


@pytest.fixture(scope="module")
def server(binary: pathlib.Path) -> Iterator[GoServer]:
    go = GoServer(binary)
    yield go
    log = go.log()
    assert go.stop() == 0
    assert AGENT_TOKEN not in log and RUN_TOKEN not in log  # no token in any log line


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


# -- the port's own tests ------------------------------------------------------------------------


def test_go_vet_and_go_test_pass(tmp_path: pathlib.Path) -> None:
    env = go_env(tmp_path / "cache")
    vet = subprocess.run([GO, "vet", "./..."], cwd=PORT_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert vet.returncode == 0, vet.stdout + vet.stderr
    done = subprocess.run([GO, "test", "-count=1", "-v", "-run", "TestVectors", "./..."], cwd=PORT_DIR, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (counts,) = [line for line in done.stdout.splitlines() if "vectors:" in line]
    passed = int(counts.split("vectors:")[1].split(" passed")[0])
    assert passed > 200 and " 0 failed" in counts, counts
    done = subprocess.run([GO, "test", "-count=1", "./..."], cwd=PORT_DIR, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_gofmt_is_clean() -> None:
    gofmt = shutil.which("gofmt") or str(pathlib.Path(GO).with_name("gofmt"))  # type: ignore[arg-type]
    done = subprocess.run([gofmt, "-l", "."], cwd=PORT_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "", done.stdout + done.stderr


# -- the conformance check -----------------------------------------------------------------------


def test_the_conformance_check_passes_at_strict(server: GoServer) -> None:
    assert_the_check_passes_at_strict(server, AGENT_TOKEN)


def test_a_custom_auth_header_and_the_misconfigured_mode(binary: pathlib.Path) -> None:
    assert_a_custom_auth_header_and_the_misconfigured_mode(functools.partial(GoServer, binary), AGENT_TOKEN)


# -- direct HTTP ---------------------------------------------------------------------------------


def test_auth_ping_and_the_refusals(server: GoServer) -> None:
    assert_auth_ping_and_the_refusals(server, AGENT_TOKEN)


def test_a_script_through_the_proxy_and_a_failing_agent(server: GoServer, proxy: MockProxy) -> None:
    assert_a_script_through_the_proxy_and_a_failing_agent(server, proxy, agent_token=AGENT_TOKEN, run_token=RUN_TOKEN)


def test_bad_arguments_are_one_line(binary: pathlib.Path) -> None:
    assert_bad_arguments_are_one_line([str(binary)])


def test_sigterm_lets_an_in_flight_dispatch_finish(binary: pathlib.Path, proxy: MockProxy) -> None:
    assert_sigterm_lets_a_dispatch_finish(GoServer(binary), proxy, agent_token=AGENT_TOKEN, run_token=RUN_TOKEN)


def test_the_readme_quick_start_builds_and_serves(tmp_path: pathlib.Path) -> None:
    """The README's Go quick start, as printed, is a complete program: it builds against the port and serves."""
    readme = (PORT_DIR / "README.md").read_text()
    quick = re.search(r"## Quick start: your own agent\n.*?```go\n(.*?)```", readme, re.S)
    assert quick is not None and len(quick.group(1).splitlines()) <= 30
    module = tmp_path / "agent"
    module.mkdir()
    (module / "go.mod").write_text(f"module agent\n\ngo 1.19\n\nrequire {GO_MODULE} v0.0.0\n\n"
                                   f"replace {GO_MODULE} => {PORT_DIR}\n")
    (module / "main.go").write_text(quick.group(1).replace('"127.0.0.1:8080"', '"127.0.0.1:0"'))
    exe = tmp_path / "quick-start"
    done = subprocess.run([GO, "build", "-o", str(exe), "."], cwd=module, env=go_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([GO, "vet", "."], cwd=module, env=go_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen([str(exe)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    try:
        port = wait_listening(proc.pid, "the quick start")  # it logs nothing at start (127.0.0.1:0 picks a port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/dispatch", body=b'{"ping": true}',
                     headers={"Authorization": f"Bearer {AGENT_TOKEN}", "Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.kill()
        proc.wait(10)


# -- mounted under a prefix in a router -------------------------------------------------------------


@pytest.fixture(scope="module")
def chi() -> None:
    """chi, in the module cache: ``go mod download`` in ``internal/chitest`` (skipped when the proxy is unreachable)."""
    need(go_mod_download, CHI_DIR)


@pytest.fixture(scope="module")
def chi_binary(tmp_path_factory: pytest.TempPathFactory, chi: None) -> pathlib.Path:
    """``go build`` of ``internal/chitest``'s chi-conformance-server, offline: chi must be in the module cache."""
    out = tmp_path_factory.mktemp("go-chi")
    exe = out / "chi-conformance-server"
    done = subprocess.run([GO, "build", "-o", str(exe), "./cmd/chi-conformance-server"], cwd=CHI_DIR,
                          env=go_env(out / "cache", mod="readonly"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return exe


def test_the_port_requires_nothing_and_its_path_can_be_required() -> None:
    """The library's module has no dependency (chi lives in a module of its own), and its path is not a bare
    word (reserved for the standard library, never fetched): the README gives the path and the replace line."""
    assert "require" not in (PORT_DIR / "go.mod").read_text() and not (PORT_DIR / "go.sum").exists()
    assert "." in GO_MODULE.split("/")[0]
    readme = (PORT_DIR / "README.md").read_text()
    assert f"require {GO_MODULE} v0.0.0\nreplace {GO_MODULE} => " in readme
    chi_mod = (CHI_DIR / "go.mod").read_text()
    assert f"replace {GO_MODULE} => ../..\n" in chi_mod and "github.com/go-chi/chi/v5 v" in chi_mod


def test_the_chi_module_vets_and_tests(tmp_path: pathlib.Path, chi: None) -> None:
    """internal/chitest's own test: 120 concurrent dispatches, each with its own run token, through the handler
    mounted under a prefix in a chi router on 127.0.0.1 (mux_test.go does the same in an http.ServeMux)."""
    env = go_env(tmp_path / "cache", mod="readonly")
    vet = subprocess.run([GO, "vet", "./..."], cwd=CHI_DIR, env=env, capture_output=True, text=True, timeout=300)
    assert vet.returncode == 0, vet.stdout + vet.stderr
    done = subprocess.run([GO, "test", "-count=1", "-v", "./..."], cwd=CHI_DIR, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "--- PASS: TestAChiRouterMountsTheHandlerUnderAPrefix" in done.stdout


def test_the_check_passes_at_strict_behind_a_chi_router(chi_binary: pathlib.Path) -> None:
    """The whole check, both profiles at --strict, against the conformance agent mounted under a prefix."""
    server = PortServer([str(chi_binary)], agent_token=AGENT_TOKEN)
    try:
        assert server.url == f"http://{server.host}:{server.port}{CHI_PREFIX}/dispatch"
        assert_the_check_passes_at_strict(server, AGENT_TOKEN)
        auth = {"Authorization": f"Bearer {AGENT_TOKEN}"}
        assert post(server, {"ping": True}, auth, path=f"{CHI_PREFIX}/dispatch")[0] == 200
        status, _, body = post(server, {"ping": True}, auth, path="/dispatch")  # outside the prefix: chi's 404
        assert status == 404 and b"detail" not in body
    finally:
        log = server.log()
        assert server.stop() == 0
    assert AGENT_TOKEN not in log


def readme_go_block(readme: str, heading: str) -> str:
    """The first Go code block after a README heading."""
    found = re.search(re.escape(heading) + r"\n.*?```go\n(.*?)```", readme, re.S)
    assert found is not None, heading
    return found.group(1)


@pytest.mark.parametrize("recipe", ["### In a standard `http.ServeMux`", "### In a `chi` router"])
def test_the_readme_router_recipes_build_and_serve(recipe: str, tmp_path: pathlib.Path, chi: None) -> None:
    """Each recipe of the README's "Mount it in your router", with its main.go as printed, builds, serves a
    ping under the prefix beside the rest of the service, and stops gracefully on SIGTERM."""
    readme = (PORT_DIR / "README.md").read_text()
    main = readme_go_block(readme, "## Mount it in your router")
    routes = readme_go_block(readme, recipe)
    module = tmp_path / "service"
    module.mkdir()
    requires = f"require {GO_MODULE} v0.0.0\n"
    if "go-chi" in routes:
        (chi,) = re.findall(r"^\s*(github\.com/go-chi/chi/v5 v\S+)$", (CHI_DIR / "go.mod").read_text(), re.M)
        requires += f"require {chi}\n"
        shutil.copy(CHI_DIR / "go.sum", module / "go.sum")
    (module / "go.mod").write_text(f"module service\n\ngo 1.24\n\n{requires}\nreplace {GO_MODULE} => {PORT_DIR}\n")
    (module / "main.go").write_text(main.replace('"127.0.0.1:8080"', '"127.0.0.1:0"'))
    (module / "routes.go").write_text(routes)
    env = go_env(tmp_path / "cache", mod="readonly")
    exe = tmp_path / "service-exe"
    for cmd in ([GO, "vet", "."], [GO, "build", "-o", str(exe), "."]):
        done = subprocess.run(cmd, cwd=module, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    proc = subprocess.Popen([str(exe)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    try:
        port = wait_listening(proc.pid, "the recipe")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", f"{CHI_PREFIX}/dispatch", body=b'{"ping": true}',
                     headers={"Authorization": f"Bearer {AGENT_TOKEN}", "Content-Type": "application/json"})
        reply = conn.getresponse()
        assert (reply.status, reply.read()) == (200, b'{"ok":true}')
        conn.request("GET", "/")
        reply = conn.getresponse()
        assert (reply.status, reply.read()) == (200, b"the rest of the service")
        conn.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_listening(pid: int, what: str) -> int:
    """The port ``pid`` comes to listen on (found in /proc), within 5 s."""
    for _ in range(100):
        port = listening_port(pid)
        if port:
            return port
        threading.Event().wait(0.05)
    raise AssertionError(f"{what} did not listen")


def listening_port(pid: int) -> Optional[int]:
    """The TCP port a process listens on, from /proc (Linux), or None."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        rows = pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        fields = row.split()
        if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # 0A: LISTEN
            return int(fields[1].split(":")[1], 16)
    return None
