"""The TypeScript package where its users deploy it, beyond Node: Bun, Deno, Cloudflare Workers and Next.js.

Each runtime comes from its own npm package, at the exact version of a committed lockfile (``tests/data/
typescript_runtimes``: bun, deno and miniflare with its workerd, one project; ``tests/data/typescript_next``:
next and React), beside the port's tarball (``npm pack``, installed as a user installs it). Each serves the
port's README recipe for it, word for word, with the port's conformance agent as ``agent``, on 127.0.0.1; then
``python3 -m conformance check URL --strict`` and 100 concurrent dispatches with distinct run tokens go through it.
Node itself, with Hono and Express, is ``tests/test_typescript_package.py``.

The packages come from the npm registry, fetched by the tests themselves once per session (``tests/registries.py``):
skipped when node or npm is missing or the registry is unreachable, failed when the registry answers and an
install fails.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Iterator, List

import pytest

from tests.port_process import (PortServer, assert_concurrent_dispatches_keep_their_tokens,
                                assert_the_check_passes_at_strict, post, run_check)
from tests.ts_package import NODE, NPM, Tarball, install, recipes, write

AGENT_TOKEN = "runtime-agent-token-6e6e6e6e"
ON_LOOPBACK = {"HOST": "127.0.0.1", "PORT": "0"}
# workerd's own limits, not the port's (the README says why): its node:http client drops a failed connection's
# error (the call fails at its timeout instead), and its local HTTP listener accepts obs-fold.
WORKERD_LIMITS = ["proxy.transport_refused", "proxy.transport_dropped", "proxy.transport_retry_same_key",
                  "http.no_smuggling"]

pytestmark = pytest.mark.skipif(NODE is None or NPM is None, reason="node or npm is not on PATH: the package cannot be packed")


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory, ts_tarball: Tarball) -> pathlib.Path:
    """Bun, Deno and miniflare (workerd) installed beside the package, with the README's recipes for them."""
    return install("typescript_runtimes", tmp_path_factory.mktemp("typescript-runtimes"), ts_tarball)


def serve(cmd: List[str], app: pathlib.Path, **options: object) -> PortServer:
    return PortServer(cmd, agent_token=AGENT_TOKEN, env=ON_LOOPBACK, cwd=str(app), **options)  # type: ignore[arg-type]


def check_and_dispatch(server: PortServer, *skip: str) -> None:
    """The check at ``--strict`` (with ``skip`` left out), then 100 concurrent dispatches."""
    if skip:
        report = run_check(server, AGENT_TOKEN, "--strict", "--skip", ",".join(skip))
        assert report["passed"] >= 199 and report["level_met"] == "MUST+SHOULD"
        skipped = {c["id"] for c in report["cases"] if c["status"] == "skip"} - set(skip)
        assert all(case.startswith("vectors.inbound:auth-") for case in skipped), skipped  # the X-API-Key vectors
    else:
        assert_the_check_passes_at_strict(server, AGENT_TOKEN)
    assert post(server, {"ping": True}, {"Authorization": "Bearer guess-7070"})[0] == 401
    assert_concurrent_dispatches_keep_their_tokens(server, AGENT_TOKEN)


def stopped(server: PortServer, status: int = 0) -> None:
    """SIGTERM: the recipe's shutdown lets in-flight dispatches finish, and the process exits with ``status``."""
    log = server.log()
    assert server.stop() == status, log[-3000:]


def test_bun_serve(runtimes: pathlib.Path) -> None:
    write(runtimes, "bun/server.ts", agent_import="./conformance_agent.ts")
    server = serve([str(runtimes / "node_modules" / ".bin" / "bun"), "bun/server.ts"], runtimes)
    try:
        check_and_dispatch(server)
    finally:
        stopped(server)


def test_deno_serve(runtimes: pathlib.Path) -> None:
    write(runtimes, "deno/server.ts", agent_import="./conformance_agent.ts")
    deno = str(runtimes / "node_modules" / ".bin" / "deno")
    server = serve([deno, "run", "--allow-net", "--allow-env", "--allow-read", "deno/server.ts"], runtimes)
    try:
        check_and_dispatch(server)
    finally:
        stopped(server)


def test_cloudflare_workers_under_workerd_through_miniflare(runtimes: pathlib.Path, tsc: pathlib.Path) -> None:
    write(runtimes, "worker/src/worker.ts", agent_import="./conformance_agent.ts")
    (runtimes / "worker" / "wrangler.jsonc").write_text(recipes()["worker/wrangler.jsonc"])
    done = subprocess.run([str(tsc), "-p", str(runtimes)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # strict, against the package's own .d.ts
    server = serve([str(NODE), "workers.mjs", "worker"], runtimes, start_s=60)
    try:
        check_and_dispatch(server, *WORKERD_LIMITS)
    finally:
        stopped(server, 128 + 15)  # miniflare's own exit hook disposes of workerd, then exits as SIGTERM asks


@pytest.fixture(scope="module")
def nextjs(tmp_path_factory: pytest.TempPathFactory, ts_tarball: Tarball) -> Iterator[pathlib.Path]:
    """The README's route handler in an App Router project, ``next build`` done."""
    app = install("typescript_next", tmp_path_factory.mktemp("typescript-next"), ts_tarball)
    write(app, "app/api/dispatch/route.ts", agent_import="./conformance_agent", agent_in=".")
    done = subprocess.run([str(app / "node_modules" / ".bin" / "next"), "build"], cwd=app, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "NEXT_TELEMETRY_DISABLED": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]  # the route type-checked and built
    assert "/api/dispatch" in done.stdout
    yield app


def test_nextjs_route_handler_under_next_start(nextjs: pathlib.Path) -> None:
    next_bin = str(nextjs / "node_modules" / ".bin" / "next")
    server = PortServer([next_bin, "start", "-H", "127.0.0.1"], agent_token=AGENT_TOKEN, cwd=str(nextjs),
                        env={"NEXT_TELEMETRY_DISABLED": "1"}, banner=r"Local:\s+(http://\S+)", path="/api/dispatch",
                        start_s=60)
    try:
        check_and_dispatch(server)
    finally:
        stopped(server, 128 + 15)  # next start closes its server on SIGTERM, then exits as the signal asks
