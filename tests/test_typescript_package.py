"""The TypeScript port as the npm package a user installs, on Node: packed, installed, compiled against, served by
Hono and by Express.

``npm pack`` in a copy of ``conformance/ports/typescript`` (its ``prepack`` builds ``dist/`` from ``src/``), the
tarball installed into a fresh project beside Hono, its Node adapter and Express (``tests/data/typescript_package``:
exact versions, locked), the port's conformance agent and the README's Hono and Express recipes, word for word,
compiled against the installed package by the port's locked ``tsc`` in strict mode, then served on 127.0.0.1: the
whole conformance check at ``--strict`` and 100+ concurrent dispatches go through Hono to ``fetchHandler`` and
through Express to ``nodeHandler``; the README's ``app.request()`` test runs under ``node --test``.

The port's compiler and the locked hosts come from the npm registry, fetched by the tests themselves
(``tests/registries.py``): skipped when node or npm is missing or the registry is unreachable.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
from typing import Dict, Iterator, List, NamedTuple, Optional

import pytest

from tests.port_process import (PortServer, assert_concurrent_dispatches_keep_their_tokens,
                                assert_the_check_passes_at_strict, post, run_check)
from tests.ts_package import NODE, NPM, PORT_DIR, ROOT, Tarball, install, write

AGENT_TOKEN = "hono-agent-token-5d5d5d5d"
# What the tarball holds: the library and its declarations, the README and the licence; no tests, no server.
PACKED_FILES = {"LICENSE", "README.md", "package.json", "dist/pipelines_port.js", "dist/pipelines_port.d.ts"}
ON_LOOPBACK = {"HOST": "127.0.0.1", "PORT": "0"}

pytestmark = pytest.mark.skipif(NODE is None or NPM is None, reason="node or npm is not on PATH: the package cannot be packed")


class Packed(NamedTuple):
    tarball: pathlib.Path
    files: List[str]  # the paths npm pack put in the tarball
    app: pathlib.Path  # the project the tarball is installed in, compiled


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, ts_tarball: Tarball, tsc: pathlib.Path) -> Packed:
    app = install("typescript_package", tmp_path_factory.mktemp("typescript-package"), ts_tarball)
    # The README's Hono and Express recipes, as printed, with the port's conformance agent as `agent`.
    write(app / "src", "app.ts", "server.ts", "app.test.ts", "express.ts")
    assert 'from "pipelines-port"' in (app / "src" / "app.ts").read_text()
    done = subprocess.run([str(tsc), "-p", str(app)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # strict, against the package's own .d.ts
    return Packed(ts_tarball.path, ts_tarball.files, app)


class HonoServer(PortServer):
    """The README's Hono server, ``node dist/server.js``, on 127.0.0.1: Hono on Node, serving fetchHandler."""

    def __init__(self, app: pathlib.Path, env: Optional[Dict[str, str]] = None, script: str = "server.js") -> None:
        super().__init__([str(NODE), str(app / "dist" / script)], agent_token=AGENT_TOKEN, env={**ON_LOOPBACK, **(env or {})})


@pytest.fixture
def hono(packed: Packed) -> Iterator[HonoServer]:
    server = HonoServer(packed.app)
    yield server
    assert server.stop() == 0, server.log()[-2000:]


# -- the package -------------------------------------------------------------------------------------------


def test_the_tarball_holds_the_library_and_its_types_and_its_metadata_is_an_installable_package(packed: Packed) -> None:
    assert set(packed.files) == PACKED_FILES and packed.tarball.name == "pipelines-port-0.1.0.tgz"
    installed = packed.app / "node_modules" / "pipelines-port"
    manifest = json.loads((installed / "package.json").read_text())
    assert manifest["name"] == "pipelines-port" and "private" not in manifest and manifest["type"] == "module"
    assert manifest["exports"]["."] == {"types": "./dist/pipelines_port.d.ts", "default": "./dist/pipelines_port.js"}
    assert manifest["license"] == "MIT" and manifest["engines"]["node"] and manifest["sideEffects"] is False
    assert "repository" not in manifest  # the project has no public address yet: none is made up (the README says)
    assert "dependencies" not in manifest and manifest["peerDependenciesMeta"]["@types/node"]["optional"] is True
    version = re.search(r'export const VERSION = "([^"]+)";', (installed / "dist" / "pipelines_port.js").read_text())
    assert version is not None and version.group(1) == manifest["version"]
    assert (installed / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    # The tarball's JavaScript is what prepack compiled from src/: the committed dist/ is the same bytes.
    for name in ("pipelines_port.js", "pipelines_port.d.ts"):
        assert (installed / "dist" / name).read_bytes() == (PORT_DIR / "dist" / name).read_bytes(), name
    declarations = (installed / "dist" / "pipelines_port.d.ts").read_text()
    assert "export type FetchHandler = (request: Request) => Promise<Response>;" in declarations
    assert re.search(r"export declare function fetchHandler\(agentOrApp: Agent \| DispatchApp, options\?: DispatchOptions\)"
                     r": FetchHandler;", declarations)


def test_strict_tsc_holds_a_consumer_to_the_package_types(packed: Packed, tsc: pathlib.Path) -> None:
    """The installed declarations type a consumer's mistakes: a wrong option and an agent of the wrong shape."""
    bad = packed.app / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "tsconfig.json").write_text(json.dumps({"extends": "../tsconfig.json", "compilerOptions": {
        "rootDir": ".", "noEmit": True}, "include": ["."]}))
    (bad / "bad.ts").write_text(
        'import { fetchHandler } from "pipelines-port";\n'
        'export const a = fetchHandler(() => "ok", { runTimeoutS: "30" });\n'
        "export const b = fetchHandler((envelope: { proxy_url: number }) => String(envelope.proxy_url));\n"
        'export const c: (request: Request) => Promise<Response> = fetchHandler(() => "ok");\n')
    done = subprocess.run([str(tsc), "-p", str(bad)], capture_output=True, text=True, timeout=300)
    errors = re.findall(r"bad\.ts\((\d+),\d+\): error (TS\d+)", done.stdout)
    assert done.returncode != 0 and sorted({line for line, _ in errors}) == ["2", "3"], done.stdout


@pytest.mark.skipif(NODE is not None and subprocess.run([NODE, "-p", "process.features.require_module === true"],
                                                         capture_output=True, text=True).stdout.strip() != "true",
                    reason="this node has no require(esm) (Node >= 20.19 / 22.12)")
def test_commonjs_can_require_the_esm_package(packed: Packed) -> None:
    done = subprocess.run([str(NODE), "-e", 'const p = require("pipelines-port"); '
                           "console.log(typeof p.fetchHandler, typeof p.nodeHandler, p.VERSION)"],
                          cwd=packed.app, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["function", "function", "0.1.0"], done.stderr


# -- served by Hono ----------------------------------------------------------------------------------------


def test_the_check_passes_at_strict_through_hono_and_the_fetch_handler(hono: HonoServer) -> None:
    report = run_check(hono, AGENT_TOKEN, "--strict")
    assert report["passed"] > 200 and report["level_met"] == "MUST+SHOULD"
    skipped = [c["id"] for c in report["cases"] if c["status"] == "skip"]
    assert all(case.startswith("vectors.inbound:auth-") for case in skipped), skipped  # the X-API-Key vectors
    assert run_check(hono, AGENT_TOKEN, "--strict", "--profile", "api")["passed"] > report["passed"]
    status, headers, body = post(hono, b"", method="GET", path="/dispatch")
    assert status == 405 and headers["allow"] == "POST"  # the port's answer, not the framework's
    assert post(hono, b"", method="GET", path="/healthz")[0] == 200


def test_the_misconfigured_mode_through_hono(packed: Packed) -> None:
    server = HonoServer(packed.app, env={"AGENT_TOKEN": ""})
    try:
        assert run_check(server, AGENT_TOKEN, "--misconfigured", "--strict")["passed"] == 1
        status, _, body = post(server, {"ping": True}, {"Authorization": f"Bearer {AGENT_TOKEN}"})
        assert status == 503 and "AGENT_TOKEN" in json.loads(body)["detail"]
    finally:
        assert server.stop() == 0


def test_120_concurrent_dispatches_through_hono_never_cross_run_tokens(hono: HonoServer) -> None:
    assert_concurrent_dispatches_keep_their_tokens(hono, AGENT_TOKEN, n=120)


def test_the_readme_app_request_test_passes_in_process(packed: Packed) -> None:
    """Hono's own test idiom, ``app.request()`` with a body and no Content-Length, under ``node --test``."""
    done = subprocess.run([str(NODE), "--test", str(packed.app / "dist" / "app.test.js")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "AGENT_TOKEN": AGENT_TOKEN})
    assert done.returncode == 0 and re.search(r"^# pass 1$", done.stdout, re.M), done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"POST /dispatch status=200 .*\(ping\)", done.stdout + done.stderr)  # the port's log line


# -- served by Express -------------------------------------------------------------------------------------


def test_the_check_passes_at_strict_through_express_and_the_node_handler(packed: Packed) -> None:
    server = HonoServer(packed.app, script="express.js")
    try:
        assert_the_check_passes_at_strict(server, AGENT_TOKEN)
        status, headers, _ = post(server, b"", method="GET", path="/dispatch")
        assert status == 405 and headers["allow"] == "POST"  # the port's answer, not Express's
        assert_concurrent_dispatches_keep_their_tokens(server, AGENT_TOKEN)
    finally:
        assert server.stop() == 0, server.log()[-2000:]
