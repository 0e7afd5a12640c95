"""The TypeScript port as the npm package a user installs: packed, installed, compiled against, served by Hono.

``npm pack`` in a copy of ``conformance/ports/typescript`` (its ``prepack`` builds ``dist/`` from ``src/``), the
tarball installed into a fresh project beside Hono and its Node adapter (``tests/data/typescript_package``: exact
versions, locked), the port's conformance agent, a Hono server and the README's Hono recipe compiled against the
installed package by the port's locked ``tsc`` in strict mode, then served: the whole conformance check at
``--strict`` and 120 concurrent dispatches go through Hono to ``fetchHandler``.

The port's compiler and the locked hosts come from the npm registry, fetched by the tests themselves
(``tests/registries.py``): skipped when node or npm is missing or the registry is unreachable.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.conftest import Together
from tests.port_process import PortServer, platform_dispatch, post, run_check
from tests.registries import need, run

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORT_DIR = ROOT / "conformance" / "ports" / "typescript"
PROJECT = ROOT / "tests" / "data" / "typescript_package"
NODE = shutil.which("node")
NPM = shutil.which("npm")
AGENT_TOKEN = "hono-agent-token-5d5d5d5d"
# What the tarball holds: the library and its declarations, the README and the licence; no tests, no server.
PACKED_FILES = {"LICENSE", "README.md", "package.json", "dist/pipelines_port.js", "dist/pipelines_port.d.ts"}

pytestmark = pytest.mark.skipif(NODE is None or NPM is None, reason="node or npm is not on PATH: the package cannot be packed")


class Packed(NamedTuple):
    tarball: pathlib.Path
    files: List[str]  # the paths npm pack put in the tarball
    app: pathlib.Path  # the project the tarball is installed in, compiled


def npm(*args: str, cwd: pathlib.Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(NPM), *args, "--no-audit", "--no-fund", "--loglevel=error"], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def install(app: pathlib.Path, tarball: pathlib.Path) -> None:
    """The tarball, plus the project's locked frameworks from the registry (npm's cache first)."""
    cmd = [str(NPM), "install", "--no-save", str(tarball), "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error"]
    need(run, cmd, app, "npm install of the package beside its locked hosts")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, tsc: pathlib.Path) -> Packed:
    work = tmp_path_factory.mktemp("typescript-package")
    # A copy without dist/: what goes in the tarball is what prepack builds from src/ (the checkout is left alone).
    port = work / "port"
    shutil.copytree(PORT_DIR, port, ignore=shutil.ignore_patterns("node_modules", "dist"))
    os.symlink(PORT_DIR / "node_modules", port / "node_modules")
    done = npm("pack", "--json", "--pack-destination", str(work), cwd=port)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("["):])[0]
    tarball = work / report["filename"]
    app = work / "app"
    shutil.copytree(PROJECT, app)
    install(app, tarball)
    # The port's conformance agent, importing the installed package instead of the file beside it.
    agent = (PORT_DIR / "src" / "conformance_agent.ts").read_text()
    assert agent.count('from "./pipelines_port.js"') == 2
    (app / "src" / "conformance_agent.ts").write_text(agent.replace('from "./pipelines_port.js"', 'from "pipelines-port"'))
    # The README's Hono recipe, as printed, compiled too (not served: it listens on 8080).
    recipe = re.search(r"\*\*Hono\*\* on Node.*?```ts\n(.*?)```", (PORT_DIR / "README.md").read_text(), re.S)
    assert recipe is not None and 'from "pipelines-port"' in recipe.group(1)
    (app / "src" / "readme_hono.ts").write_text(recipe.group(1))
    (app / "src" / "agent.ts").write_text('export { conformanceAgent as agent } from "./conformance_agent.js";\n')
    done = subprocess.run([str(tsc), "-p", str(app)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # strict, against the package's own .d.ts
    return Packed(tarball, sorted(f["path"] for f in report["files"]), app)


class HonoServer(PortServer):
    """``node dist/server.js --port 0`` in the installed project: Hono on Node, serving fetchHandler."""

    def __init__(self, app: pathlib.Path, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__([str(NODE), str(app / "dist" / "server.js")], agent_token=AGENT_TOKEN, env=env)


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
    tokens = [f"hono-run-token-{i:03d}-xxxxxxxx" for i in range(120)]
    script = {"steps": [{"call": "whoami", "args": {}}, {"call": "whoami", "args": {}}]}
    with MockProxy(tokens=tokens) as proxy:
        # The first 40 calls are held until all 40 are in flight: the dispatches really overlap.
        proxy.script("whoami", Together(40)(lambda r: {"response": {"bearer_sha": hashlib.sha256(r.bearer.encode()).hexdigest()}}))

        def one(i: int) -> Tuple[int, Dict[str, Any]]:
            return platform_dispatch(hono, proxy, script, agent_token=AGENT_TOKEN, run_token=tokens[i], run_id=i)

        with ThreadPoolExecutor(120) as pool:
            replies = list(pool.map(one, range(120)))
        for i, (status, reply) in enumerate(replies):
            want = hashlib.sha256(tokens[i].encode()).hexdigest()
            results = json.loads(reply["final_response"])["results"] if status == 200 else reply
            assert results == [{"ok": True, "value": {"bearer_sha": want}}] * 2, (i, status, reply)
        calls = proxy.calls("whoami")
        assert len(calls) == 240 and sorted(c.bearer for c in calls) == sorted(tokens * 2)
        assert proxy.max_in_flight >= 40
