"""`pipelines-port doctor` (`python3 -m conformance doctor`): one line per check, green or red, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from conformance.harness.mock_proxy import MockProxy

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"name": "get_order", "description": "d", "input_schema": {"type": "object"}}]
GOOD_CSV = 'user,expected_outcome\n"Where is order 4521?",completion\n'
BAD_CSV = 'user_instruction,state\n"hi","{not json"\n'


def doctor(args: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("AGENT_TOKEN", "NO_COLOR")}
    return subprocess.run([sys.executable, "-m", "conformance", "doctor"] + args, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**base, **(env or {})})


def lines(out: subprocess.CompletedProcess) -> Dict[str, str]:
    """{check label: "ok"|"fail"|"skip"} from the report."""
    states = {"✓": "ok", "✗": "fail", "-": "skip", "!": "warn"}
    found = {}
    for line in out.stdout.splitlines():
        if line[:1] in states and ": " in line:
            found[line[2:].split(": ", 1)[0]] = states[line[:1]]
    return found


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "agent.py").write_text("def agent(env):\n    return 'ok'\n")
    (tmp_path / "tools_schema.json").write_text(json.dumps(TOOLS))
    (tmp_path / "good.csv").write_text(GOOD_CSV)
    (tmp_path / "bad.csv").write_text(BAD_CSV)
    return tmp_path


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy() as p:
        yield p


def test_all_green(project: Path, proxy: MockProxy) -> None:
    out = doctor(["--app", f"{project / 'agent.py'}:agent", "--tools-schema", str(project / "tools_schema.json"),
                  "--csv", str(project / "good.csv"), "--proxy-url", proxy.url],
                 env={"AGENT_TOKEN": "doc-token", "PIPELINES_PROXY_ALLOWED_HOSTS": ".pipelines.tech"})
    assert lines(out) == {"agent imports": "ok", "server answers ping": "ok", "auth runs before ping": "ok",
                          "proxy host allow-list": "ok", "tools_schema is valid": "ok",
                          "tools_schema matches the app": "ok", "outbound proxy reachable": "ok",
                          "dataset is valid": "ok"}, out.stdout + out.stderr
    assert out.returncode == 0 and "doc-token" not in out.stdout + out.stderr


def test_an_unset_allow_list_is_a_warning_not_a_failure(project: Path, proxy: MockProxy) -> None:
    out = doctor(["--app", f"{project / 'agent.py'}:agent", "--proxy-url", proxy.url], env={"AGENT_TOKEN": "t"})
    assert lines(out)["proxy host allow-list"] == "warn" and "PIPELINES_PROXY_ALLOWED_HOSTS" in out.stdout
    assert out.returncode == 0
    assert proxy.requests[-1].name == "__reachability_probe__"


def test_reds_name_their_reason(project: Path, proxy: MockProxy) -> None:
    (project / "other.json").write_text(json.dumps([{"name": "refund", "input_schema": {"type": "object"}}]))
    out = doctor(["--app", f"{project / 'agent.py'}:agent", "--tools-schema", str(project / "other.json"),
                  "--csv", str(project / "bad.csv"), "--proxy-url", "http://127.0.0.1:9/nothing-listens"])
    states = lines(out)
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert states["server answers ping"] == "fail" and "AGENT_TOKEN is not set" in out.stdout
    assert states["tools_schema matches the app"] == "fail" and "only in the file: ['refund']" in out.stdout
    assert states["outbound proxy reachable"] == "fail" and "Connection refused" in out.stdout
    assert states["dataset is valid"] == "fail" and "did you mean" in out.stdout


def test_an_agent_that_does_not_import(project: Path, proxy: MockProxy) -> None:
    (project / "broken.py").write_text("import no_such_package_xyz\n")
    out = doctor(["--app", f"{project / 'broken.py'}:agent", "--proxy-url", proxy.url], env={"AGENT_TOKEN": "t"})
    states = lines(out)
    assert states["agent imports"] == "fail" and "no_such_package_xyz" in out.stdout
    assert states["server answers ping"] == "skip" and states["outbound proxy reachable"] == "ok"
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr


class PingBeforeAuth:
    """A hand-written endpoint with the classic bug: the ping short-circuit runs before auth."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body == {"ping": True}:
                    status, reply = 200, {"ok": True}
                elif self.headers.get("Authorization") != "Bearer right":
                    status, reply = 401, {"detail": "no"}
                else:
                    status, reply = 400, {"detail": "missing proxy URL"}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/dispatch"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_url_mode_catches_ping_before_auth(proxy: MockProxy) -> None:
    endpoint = PingBeforeAuth()
    try:
        out = doctor(["--url", endpoint.url, "--proxy-url", proxy.url], env={"AGENT_TOKEN": "right"})
    finally:
        endpoint.server.shutdown()
        endpoint.server.server_close()
    states = lines(out)
    assert states["server answers ping"] == "ok"
    assert states["auth runs before ping"] == "fail" and "got HTTP 200, expected 401" in out.stdout
    assert out.returncode == 1


def test_usage_errors_exit_2() -> None:
    out = doctor([])
    assert out.returncode == 2 and "--app" in out.stderr and "Traceback" not in out.stderr
    out = doctor(["--app", "x.py:a", "--url", "http://127.0.0.1:1/"])
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_offline_the_egress_probe_is_skipped_with_the_flag_that_enables_it(project: Path) -> None:
    """Without --proxy-url nothing is probed: a user without network did nothing wrong."""
    out = doctor(["--app", f"{project / 'agent.py'}:agent"], env={"AGENT_TOKEN": "t"})
    assert lines(out)["outbound proxy reachable"] == "skip" and "--proxy-url" in out.stdout
    assert out.returncode == 0, out.stdout


def test_the_api_keys_a_template_needs_are_checked_never_shown(tmp_path: Path) -> None:
    template = (ROOT / "templates" / "openai_chat.py").read_text()
    (tmp_path / "agent.py").write_text(template)
    (tmp_path / "pipelines_port.py").write_text((ROOT / "pipelines_port.py").read_text())
    unset = doctor(["--app", f"{tmp_path / 'agent.py'}:agent"], env={"AGENT_TOKEN": "t", "OPENAI_API_KEY": ""})
    assert lines(unset)["OPENAI_API_KEY is set"] == "fail" and "export OPENAI_API_KEY" in unset.stdout
    assert unset.returncode == 1
    given = doctor(["--app", f"{tmp_path / 'agent.py'}:agent"], env={"AGENT_TOKEN": "t", "OPENAI_API_KEY": "sk-secret-9"})
    assert lines(given)["OPENAI_API_KEY is set"] == "ok" and "sk-secret-9" not in given.stdout + given.stderr
    assert given.returncode == 0
