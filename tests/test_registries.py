"""tests/registries.py: a fetch skips a test when the registry is unreachable and fails it when the registry answers
no, each told apart from the client's own output (npm and go, against registries on 127.0.0.1)."""

from __future__ import annotations

import http.server
import json
import pathlib
import shutil
import socket
import threading
from typing import Iterator

import pytest

from tests import registries
from tests.registries import FetchFailed, go_mod_download, need, npm_ci

LOCK = {"name": "app", "version": "1.0.0", "lockfileVersion": 3, "requires": True, "packages": {
    "": {"name": "app", "version": "1.0.0", "dependencies": {"left-pad": "1.3.0"}},
    "node_modules/left-pad": {"version": "1.3.0",
                              "resolved": "http://127.0.0.1:1/left-pad/-/left-pad-1.3.0.tgz",
                              "integrity": "sha512-AAAA"}}}


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on: a connection there is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def not_found() -> Iterator[str]:
    """A registry on 127.0.0.1 that answers every request 404: reachable, but the package is not there."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"error": "Not found"}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def app(tmp_path: pathlib.Path, registry: str) -> pathlib.Path:
    folder = tmp_path / "app"
    folder.mkdir()
    lock = json.loads(json.dumps(LOCK).replace("http://127.0.0.1:1", registry))
    (folder / "package.json").write_text(json.dumps({**lock["packages"][""]}))
    (folder / "package-lock.json").write_text(json.dumps(lock))
    return folder


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """Empty caches and a clean memory of what this process fetched."""
    monkeypatch.setattr(registries, "_DONE", {})
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "go-mod"))
    monkeypatch.setenv("GOFLAGS", "-modcacherw")
    monkeypatch.setenv("GONOSUMDB", "*")
    monkeypatch.setenv("GONOSUMCHECK", "1")
    monkeypatch.setenv("GOSUMDB", "off")


npm_only = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not on PATH")
go_only = pytest.mark.skipif(shutil.which("go") is None, reason="go is not on PATH")


@npm_only
def test_npm_with_its_registry_unreachable_skips(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("npm_config_registry", registry)
    folder = app(tmp_path, registry)
    with pytest.raises(FetchFailed) as failed:
        npm_ci(folder)
    assert failed.value.unreachable and "the registry is unreachable" in str(failed.value)
    with pytest.raises(pytest.skip.Exception, match="unreachable"):
        need(npm_ci, folder)


@npm_only
def test_npm_with_the_package_missing_fails(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                            not_found: str) -> None:
    monkeypatch.setenv("npm_config_registry", not_found)
    folder = app(tmp_path, not_found)
    with pytest.raises(FetchFailed) as failed:
        npm_ci(folder)
    assert not failed.value.unreachable and "404" in str(failed.value)
    with pytest.raises(pytest.fail.Exception, match="npm ci in"):
        need(npm_ci, folder)


@npm_only
def test_npm_ci_runs_once_and_not_at_all_when_node_modules_matches(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = app(tmp_path, "http://127.0.0.1:1")
    calls = []
    monkeypatch.setattr(registries, "run", lambda *args, **kwargs: calls.append(args))
    npm_ci(folder)
    npm_ci(folder)  # remembered: once per process
    assert len(calls) == 1 and calls[0][0][1] == "ci"
    monkeypatch.setattr(registries, "_DONE", {})  # another process, after npm wrote its copy of the lockfile last
    (folder / "node_modules").mkdir()
    (folder / "node_modules" / ".package-lock.json").write_text("{}")
    npm_ci(folder)
    assert len(calls) == 1


def go_module(tmp_path: pathlib.Path) -> pathlib.Path:
    module = tmp_path / "mod"
    module.mkdir()
    (module / "go.mod").write_text("module example.com/m\n\ngo 1.21\n\nrequire example.com/nowhere v1.0.0\n")
    return module


@go_only
def test_go_with_its_proxy_unreachable_skips(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOPROXY", f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(pytest.skip.Exception, match="unreachable"):
        need(go_mod_download, go_module(tmp_path))


@go_only
def test_go_with_the_module_missing_fails(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                          not_found: str) -> None:
    monkeypatch.setenv("GOPROXY", not_found)
    with pytest.raises(pytest.fail.Exception, match="404|not found"):
        need(go_mod_download, go_module(tmp_path))
