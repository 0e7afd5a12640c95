"""``register`` and ``test``: the kit against a stand-in of the platform's REST API (tests/fake_platform.py).

Offline: the stand-in runs on 127.0.0.1.  Every test that runs a command checks that the API key (and the
agent's token) appear in no output and no written file.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any, Iterator, List, Tuple

import pytest

import pipelines_port as pp
from conformance import cli
from conformance.harness.mock_proxy import MockProxy
from conformance.platform_api import client as api
from conformance.platform_api import register as reg
from conformance.platform_api import testrun
from tests.conftest import FakeSleep
from tests.fake_platform import FakePlatform

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "conformance" / "simulator" / "samples" / "orders.csv"
# The sample's first five rows and the template's first three tools: what these tests' figures count.
TOOLS = json.loads((ROOT / "templates" / "tools_schema.json").read_text())[:3]


def write_sample(path: pathlib.Path) -> None:
    path.write_text("".join(SAMPLE.read_text(encoding="utf-8").splitlines(keepends=True)[:6]), encoding="utf-8")


def write_tools(path: pathlib.Path) -> None:
    path.write_text(json.dumps(TOOLS, indent=2), encoding="utf-8")
AGENT_TOKEN = "agent-token-0123456789abcdef"
FAST = pp.RetryPolicy(max_attempts=6, base_delay_s=0.01, max_delay_s=0.05, max_retry_after_s=120.0,
                      transport_retries=3)
PASS = {"judge_passed": True, "task_completion": 5, "explanation": "answered from the order"}
FAIL = {"judge_passed": False, "task_completion": 2, "failure_mode": "incorrect_completion",
        "instruction_adherence": 2, "explanation": "refunded an order that was not eligible"}


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> Iterator[FakePlatform]:
    with FakePlatform() as fake:
        monkeypatch.setenv("PIPELINES_API_KEY", fake.api_key)
        monkeypatch.setenv("PIPELINES_API_URL", fake.url)
        monkeypatch.delenv("PIPELINES_BASE_URL", raising=False)
        monkeypatch.setenv("AGENT_TOKEN", AGENT_TOKEN)
        monkeypatch.setattr(api, "RETRY", FAST)
        monkeypatch.chdir(tmp_path)
        yield fake
    secrets = [FakePlatform().api_key, AGENT_TOKEN]
    for path in tmp_path.rglob("*"):  # no secret in any file a command wrote
        if path.is_file() and path.suffix in (".json", ".xml", ".txt", ".html"):
            text = path.read_text(encoding="utf-8", errors="replace")
            assert not any(s in text for s in secrets), path


def run(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, str, str]:
    """One kit command in this process: ``(exit status, stdout, stderr)``, with no secret in either."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    for secret in (FakePlatform().api_key, AGENT_TOKEN):
        assert secret not in out and secret not in err
    return code, out, err


def project(tmp_path: pathlib.Path) -> pathlib.Path:
    """A project folder as ``init`` makes it, plus what must never be uploaded."""
    (tmp_path / "agent.py").write_text((ROOT / "templates" / "minimal.py").read_text(encoding="utf-8"))
    shutil.copy(ROOT / "pipelines_port.py", tmp_path / "pipelines_port.py")
    write_tools(tmp_path / "tools_schema.json")
    write_sample(tmp_path / "tasks.csv")
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    (tmp_path / "helpers" / "text.py").write_text("def shout(s):\n    return s.upper()\n")
    (tmp_path / ".env").write_text(f"AGENT_TOKEN={AGENT_TOKEN}\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "hook.py").write_text("x = 1\n")
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "venv" / "lib" / "site.py").write_text("x = 1\n")
    (tmp_path / "myenv").mkdir()
    (tmp_path / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "agent.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "scratch_notes.py").write_text("x = 1\n")
    (tmp_path / ".pipelinesignore").write_text("# local only\nscratch_*.py\n")
    return tmp_path


def body_of(platform: FakePlatform, method: str, prefix: str = "/api/agents") -> Any:
    calls = platform.calls(method, prefix)
    assert calls, f"no {method} {prefix}"
    return calls[-1].body


# ---------------------------------------------------------------------------
# register: HTTP agents
# ---------------------------------------------------------------------------


def test_register_an_http_agent_creates_it_with_the_sdk_shaped_body(platform: FakePlatform, tmp_path: pathlib.Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    write_tools(tmp_path / "tools_schema.json")
    code, out, err = run(capsys, "register", "--name", "support-bot", "--endpoint", "https://agent.example.com/dispatch",
                         "--timeout", "90", "--run-timeout", "600")
    assert code == 0, err
    body = body_of(platform, "POST")
    tools = json.loads(json.dumps(TOOLS))
    assert body == {"name": "support-bot", "mode": "external_http",
                    "config": {"endpoint_url": "https://agent.example.com/dispatch",
                               "auth_header_name": "Authorization", "auth_credential_value": f"Bearer {AGENT_TOKEN}",
                               "timeout_s": 90},
                    "tools_schema": tools, "concurrency_cap": 5, "run_timeout_s": 600}
    agent_id = next(iter(platform.agents))
    assert out == f"{agent_id}\n" and f"created agent #{agent_id} 'support-bot'" in err
    assert platform.calls("POST")[-1].headers["authorization"] == f"Bearer {platform.api_key}"
    assert platform.calls("POST")[-1].headers["idempotency-key"]


def test_register_again_updates_the_agent_of_that_name_with_what_changed(platform: FakePlatform,
                                                                          capsys: pytest.CaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    agent = platform.add_agent("support-bot", config={"endpoint_url": "https://old.example.com/dispatch"})
    platform.add_agent("support-bot-2")  # the listing's search matches substrings: only the exact name counts
    monkeypatch.delenv("AGENT_TOKEN")
    code, out, err = run(capsys, "register", "--name", "support-bot", "--endpoint", "https://new.example.com/dispatch",
                         "--concurrency", "9")
    assert code == 0, err
    assert not platform.calls("POST")
    assert platform.calls("PUT")[-1].path == f"/api/agents/{agent['id']}"
    # No name, mode, tools (no tools file) or run timeout: the platform leaves what is not sent unchanged;
    # with $AGENT_TOKEN unset no credential is sent, and the stored one stays.
    assert body_of(platform, "PUT") == {"config": {"endpoint_url": "https://new.example.com/dispatch",
                                                   "auth_header_name": "Authorization"}, "concurrency_cap": 9}
    assert "$AGENT_TOKEN is not set" in err and out == f"{agent['id']}\n"


def test_register_custom_header_sends_the_bare_token_and_passthrough_flips_modes(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tools = json.loads(json.dumps(TOOLS))
    tools[2]["passthrough_binding"] = {"endpoint_name": "kb-prod", "tool_name": "search"}
    tools[0]["default_execution_mode"] = "passthrough"  # the file says so; the flags, given, are the whole choice
    (tmp_path / "tools.json").write_text(json.dumps({"tools": tools}))
    (tmp_path / "ledger.json").write_text(json.dumps({"entities": [{"type": "order", "fields": {"status": "str"}}]}))
    monkeypatch.setenv("MY_KEY", "raw-key-value-123456")
    code, _, err = run(capsys, "register", "--name", "kb", "--endpoint", "https://agent.example.com/d",
                       "--auth-header", "X-API-Key", "--credential-env", "MY_KEY", "--tools", "tools.json",
                       "--passthrough", "search_kb", "--ledger-schema", "ledger.json")
    assert code == 0, err
    body = body_of(platform, "POST")
    assert body["config"]["auth_header_name"] == "X-API-Key"
    assert body["config"]["auth_credential_value"] == "raw-key-value-123456"
    assert [t["default_execution_mode"] for t in body["tools_schema"]] == ["sandbox", "sandbox", "passthrough"]
    assert body["tools_schema"][2]["passthrough_binding"] == {"endpoint_name": "kb-prod", "tool_name": "search"}
    assert body["ledger_schema"] == {"entities": [{"type": "order", "fields": {"status": "str"}}]}
    assert "search_kb (passthrough)" in err and "warning" not in err


def test_register_dry_run_prints_the_body_with_the_credential_masked_and_sends_nothing(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPELINES_API_KEY")  # a dry run needs no key
    write_tools(tmp_path / "tools_schema.json")
    code, out, err = run(capsys, "register", "--name", "bot", "--endpoint", "http://127.0.0.1:8080/dispatch",
                         "--passthrough", "search_kb", "--dry-run")
    assert code == 0, err
    body = json.loads(out)
    assert body["config"]["auth_credential_value"] == "Bearer ********"
    assert body["mode"] == "external_http" and body["concurrency_cap"] == 5 and len(body["tools_schema"]) == 3
    assert platform.requests == []
    assert "127.0.0.1 is a loopback or private address" in err  # the platform cannot call it
    assert "search_kb is passthrough, but its entry" in err  # no binding: said, and sent as asked


@pytest.mark.parametrize("argv, message", [
    (["--code", "."], "--code needs --entrypoint"),
    (["--endpoint", "https://a.example/d", "--entrypoint", "agent.py:run"], "--entrypoint is for code agents"),
    (["--code", ".", "--entrypoint", "agent.py:run", "--timeout", "5"], "--timeout is for HTTP agents"),
    (["--endpoint", "ftp://a.example/d"], "expected the agent's http(s):// dispatch URL"),
    (["--endpoint", "https://a.example/d", "--auth-header", "X Key"], "letters, digits and hyphens"),
    (["--endpoint", "https://a.example/d", "--passthrough", "nope"], "--passthrough nope: no such tool"),
    (["--endpoint", "https://a.example/d", "--ledger-schema", "missing.json"], "cannot read the ledger schema"),
    (["--code", ".", "--entrypoint", "agent:run"], "expected FILE.py:NAME"),
    (["--code", ".", "--entrypoint", "main.py:run"], "main.py is not among the files uploaded"),
])
def test_register_refuses_bad_flags_with_one_line_and_status_2(platform: FakePlatform, tmp_path: pathlib.Path,
                                                               capsys: pytest.CaptureFixture, argv: List[str],
                                                               message: str) -> None:
    project(tmp_path)
    code, out, err = run(capsys, "register", "--name", "x", *argv)
    assert (code, out) == (2, "")
    assert message in err and len(err.strip().splitlines()[-1]) < 400
    assert platform.calls("POST") == [] and platform.calls("PUT") == []


def test_register_a_name_taken_elsewhere_is_refused_with_the_fix(platform: FakePlatform,
                                                                 capsys: pytest.CaptureFixture) -> None:
    platform.hidden_names.add("taken")
    code, out, err = run(capsys, "register", "--name", "taken", "--endpoint", "https://a.example/d")
    assert (code, out) == (2, "")
    assert "409 Conflict: the name 'taken' is taken on the platform" in err and "choose another --name" in err


def test_register_a_409_from_a_create_race_updates_the_agent_made_meanwhile(platform: FakePlatform,
                                                                            capsys: pytest.CaptureFixture) -> None:
    agent = platform.add_agent("raced")
    platform.fault("GET", "/api/agents", 200, {"items": []})  # the first lookup misses it
    code, out, err = run(capsys, "register", "--name", "raced", "--endpoint", "https://a.example/d")
    assert code == 0, err
    assert [r.method for r in platform.requests] == ["GET", "POST", "GET", "PUT"]
    assert out == f"{agent['id']}\n" and "updated agent" in err


def test_register_several_agents_of_one_name_or_another_mode_is_refused(platform: FakePlatform,
                                                                         capsys: pytest.CaptureFixture,
                                                                         tmp_path: pathlib.Path) -> None:
    code_agent = platform.add_agent("coded", mode="sandbox")
    code, _, err = run(capsys, "register", "--name", "coded", "--endpoint", "https://a.example/d")
    assert code == 2 and f"'coded' (#{code_agent['id']}) is a sandbox agent" in err
    platform.add_agent("twin")
    platform.add_agent("twin")
    code, _, err = run(capsys, "register", "--name", "twin", "--endpoint", "https://a.example/d")
    assert code == 2 and "2 agents are named 'twin'" in err
    assert platform.calls("PUT") == [] and platform.calls("POST") == []


def test_register_422_names_each_field_and_why(platform: FakePlatform, capsys: pytest.CaptureFixture) -> None:
    platform.fault("POST", "/api/agents", 422, {"detail": [
        {"loc": ["body", "config", "endpoint_url"], "msg": "must be externally reachable", "type": "value_error"},
        {"loc": ["body", "tools_schema", 1, "ledger_adapter"], "msg": "entity_type 'order' is not in the ledger",
         "type": "value_error"}]})
    code, _, err = run(capsys, "register", "--name", "bot", "--endpoint", "https://a.example/d")
    assert code == 2
    assert ("422 Unprocessable Entity: the platform rejected agent 'bot': config.endpoint_url: must be externally "
            "reachable; tools_schema[1].ledger_adapter: entity_type 'order' is not in the ledger") in err


@pytest.mark.parametrize("status, expected, exit_status", [
    (403, ("403 Forbidden: the API key in PIPELINES_API_KEY may not do this (POST /api/agents): agents are "
           "admin-only"), 2),
    (500, "HTTP 500 from the platform after 6 attempts (POST /api/agents): agents are admin-only", 1),
])
def test_register_error_statuses_are_one_line(platform: FakePlatform, capsys: pytest.CaptureFixture, status: int,
                                              expected: str, exit_status: int) -> None:
    platform.fault("POST", "/api/agents", status, {"detail": "agents are admin-only"}, {"Retry-After": "0"}, times=6)
    code, _, err = run(capsys, "register", "--name", "bot", "--endpoint", "https://a.example/d")
    assert code == exit_status
    assert err.strip().splitlines()[-1] == f"register: {expected}"


# ---------------------------------------------------------------------------
# register: code agents, the upload
# ---------------------------------------------------------------------------


def test_register_a_code_agent_uploads_its_python_and_skips_secrets_tooling_and_venvs(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    project(tmp_path)
    code, _, err = run(capsys, "register", "--name", "coded", "--code", ".", "--entrypoint", "agent.py:run")
    assert code == 0, err
    body = body_of(platform, "POST")
    config = body["config"]
    assert body["mode"] == "sandbox" and set(body) == {"name", "mode", "config", "tools_schema", "concurrency_cap",
                                                      "run_timeout_s"}
    assert (config["entrypoint_file"], config["entrypoint"]) == ("agent.py", "run")
    assert sorted(config["source_files"]) == ["agent.py", "helpers/__init__.py", "helpers/text.py",
                                              "pipelines_port.py"]
    assert all(len(t.encode()) <= reg.MAX_FILE_BYTES for t in config["source_files"].values())
    # The module goes up as it is: the very file a user copies, within the platform's per-file limit.
    assert config["source_files"]["pipelines_port.py"] == (ROOT / "pipelines_port.py").read_text(encoding="utf-8")
    for shown in ("skipped (a secret: it stays local): .env", "skipped (hidden): .git/", "venv/", "myenv/",
                  "__pycache__/", "skipped (.pipelinesignore): scratch_notes.py",
                  "(not Python: code agents upload .py files only): tasks.csv, tools_schema.json"):
        assert shown in err, shown
    assert "packed" not in err
    assert len(body["tools_schema"]) == 3


def test_the_uploaded_module_is_the_module_and_the_agent_runs_from_the_upload(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    """The upload, written out as the sandbox writes it: ``run()`` imports the uploaded module and answers."""
    project(tmp_path)
    assert run(capsys, "register", "--name", "coded", "--code", ".", "--entrypoint", "agent.py:run")[0] == 0
    sandbox = tmp_path / "sandbox"
    for path, text in body_of(platform, "POST")["config"]["source_files"].items():
        (sandbox / path).parent.mkdir(parents=True, exist_ok=True)
        (sandbox / path).write_text(text, encoding="utf-8")
    script = """
import inspect, json, sys, traceback
import pipelines_port as pp
sys.path.insert(0, sys.argv[1])
import pipelines_port as kit_side  # the same module: the uploaded one was imported first
original = open(sys.argv[2], encoding="utf-8").read()
assert pp is kit_side and pp.__file__.startswith(sys.argv[3])
assert inspect.getsource(pp).rstrip("\\n") != ""  # tracebacks and inspect read the module's own lines
assert inspect.getsource(pp.check_credential) in original
try:
    pp.validate_proxy_url(5, "here")
except pp.EnvelopeError:
    shown = traceback.format_exc()
import agent
reply = agent.run({"user_instruction": "returns policy?"}, proxy_url=sys.argv[4], run_token=sys.argv[5])
print(json.dumps({"version": pp.__version__, "doc": pp.__doc__ == __import__("ast").get_docstring(
    __import__("ast").parse(original), clean=False), "shown": "raise EnvelopeError" in shown, "reply": reply}))
"""
    with MockProxy(tokens=["run-token-for-the-uploaded-agent"]) as proxy:
        proxy.script("search_kb", [{"response": {"articles": ["Opened electronics: 14 days"]}}])
        done = subprocess.run([sys.executable, "-c", script, str(ROOT), str(ROOT / "pipelines_port.py"), str(sandbox),
                               proxy.url, "run-token-for-the-uploaded-agent"], cwd=sandbox, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert len(proxy.calls("search_kb")) == 1
    assert seen["version"] == pp.__version__ and seen["doc"] and seen["shown"]
    assert "Opened electronics: 14 days" in seen["reply"]["final_response"]


def test_a_module_over_the_platforms_file_limit_is_refused_before_anything_is_sent(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    project(tmp_path)
    module = tmp_path / "pipelines_port.py"
    text = module.read_text(encoding="utf-8")
    module.write_text(text + "#" * (reg.MAX_FILE_BYTES + 1 - len(text.encode("utf-8")) - 1) + "\n", encoding="utf-8")
    code, _, err = run(capsys, "register", "--name", "coded", "--code", ".", "--entrypoint", "agent.py:run")
    assert code == 2 and platform.requests == []
    assert "pipelines_port.py is 200,001 bytes: the platform takes at most 200,000 per file" in err


def test_register_refuses_to_upload_a_file_holding_a_secret(platform: FakePlatform, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    project(tmp_path)
    (tmp_path / "settings.py").write_text(f'TOKEN = "{AGENT_TOKEN}"\n')
    code, _, err = run(capsys, "register", "--name", "coded", "--code", ".", "--entrypoint", "agent.py:run")
    assert code == 2 and "settings.py contains the value of $AGENT_TOKEN" in err
    assert platform.requests == []


def test_the_upload_adds_the_kits_module_when_the_folder_has_none(tmp_path: pathlib.Path) -> None:
    (tmp_path / "main.py").write_text("def run(task_input, **kw):\n    return {'final_response': 'ok'}\n")
    upload = reg.walk_upload(str(tmp_path), module_source="X = 1\n")
    assert upload.files == {"main.py": (tmp_path / "main.py").read_text(), "pipelines_port.py": "X = 1\n"}
    assert any("the kit's copy" in note for note in upload.notes)
    (tmp_path / "empty.py").write_text("")
    with pytest.raises(reg.SetupError, match=r"empty\.py is empty"):
        reg.walk_upload(str(tmp_path), module_source="X = 1\n")


# ---------------------------------------------------------------------------
# The API client: keys, retries, errors
# ---------------------------------------------------------------------------


def test_a_wrong_key_is_one_line_naming_the_variable_never_the_key(platform: FakePlatform,
                                                                   capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: pathlib.Path) -> None:
    wrong = "pk_live_WRONG-key-0123456789"
    monkeypatch.setenv("PIPELINES_API_KEY", wrong)
    platform.echo_key_in_errors = True  # a platform that repeats the key in its error body
    write_sample(tmp_path / "tasks.csv")
    for argv in (["register", "--name", "b", "--endpoint", "https://a.example/d"],
                 ["test", "tasks.csv", "--agent", "7", "--json", "r.json"]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and wrong not in out + err
        assert "401 Unauthorized: the platform refused the API key in PIPELINES_API_KEY" in err
    assert wrong in json.dumps([r.headers for r in platform.requests])  # it was sent, and only there


def test_no_key_or_an_unsafe_url_stops_before_any_request(platform: FakePlatform, capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPELINES_API_KEY")
    code, _, err = run(capsys, "register", "--name", "b", "--endpoint", "https://a.example/d")
    assert code == 2 and "set PIPELINES_API_KEY" in err
    monkeypatch.setenv("PIPELINES_API_KEY", platform.api_key)
    code, _, err = run(capsys, "register", "--name", "b", "--endpoint", "https://a.example/d",
                       "--api-url", "http://api.example.com")
    assert code == 2 and "refusing to send the API key over plain http to api.example.com" in err
    assert api.resolve_api_key({"PIPELINES_API_KEY": " pk_1 \n"}) == "pk_1"
    with pytest.raises(api.SetupError, match="control character"):
        api.resolve_api_key({"PIPELINES_API_KEY": "pk_1\nX-Other: 1"})
    assert platform.requests == []


def test_api_url_comes_from_the_flag_then_the_environment_then_the_default() -> None:
    assert api.resolve_api_url("https://a.example/", {}) == "https://a.example"
    assert api.resolve_api_url(None, {"PIPELINES_API_URL": "https://b.example",
                                      "PIPELINES_BASE_URL": "https://c.example"}) == "https://b.example"
    assert api.resolve_api_url(None, {"PIPELINES_BASE_URL": "https://c.example/v1"}) == "https://c.example/v1"
    assert api.resolve_api_url(None, {}) == "https://api.pipelines.tech"
    assert api.resolve_api_url("http://[::1]:8000", {}) == "http://[::1]:8000"
    for bad in ("ftp://x", "https://user:pw@x.example", "https://x.example/?key=1", "https://x:port"):
        with pytest.raises(api.SetupError):
            api.resolve_api_url(bad, {})


def test_429_and_5xx_are_retried_with_retry_after_honoured_seconds_or_http_date(platform: FakePlatform) -> None:
    sleep = FakeSleep()
    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    platform.fault("GET", "/api/agents", 429, {"detail": "slow down"}, {"Retry-After": "7"})
    platform.fault("GET", "/api/agents", 503, {"detail": "deploying"}, {"Retry-After": when})
    platform.fault("GET", "/api/agents", 502, None)  # no Retry-After: backoff
    platform.add_agent("bot")
    with api.Client(platform.url, platform.api_key, sleep=sleep, policy=FAST) as client:
        assert [a["name"] for a in client.agents_named("bot")] == ["bot"]
    assert sleep.waits[0] == 7 and 25 <= sleep.waits[1] <= 30 and sleep.waits[2] <= 0.05
    assert len(platform.calls("GET")) == 4


def test_a_retried_post_keeps_its_idempotency_key_and_a_long_retry_after_is_not_waited(
        platform: FakePlatform) -> None:
    agent = platform.add_agent("bot")
    platform.fault("POST", "/api/agents/", 503, {"detail": "busy"}, {"Retry-After": "0"})
    with api.Client(platform.url, platform.api_key, sleep=FakeSleep(), policy=FAST) as client:
        client.create_test_run(agent["id"], {"rows": [{"user": "hi"}], "options": {}})
        keys = {r.headers["idempotency-key"] for r in platform.calls("POST")}
        assert len(platform.calls("POST")) == 2 and len(keys) == 1
        platform.fault("GET", "/api/test-runs/", 429, {"detail": "quota"}, {"Retry-After": "3600"})
        with pytest.raises(api.PlatformError, match="asked to wait 3600 s"):
            client.get_test_run(1)


def test_a_platform_that_is_not_there_is_one_line_naming_the_url(capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: pathlib.Path) -> None:
    with FakePlatform() as gone:
        url = gone.url
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINES_API_KEY", "pk_test_0123456789")
    monkeypatch.setattr(api, "RETRY", FAST)
    code, _, err = run(capsys, "register", "--name", "b", "--endpoint", "https://a.example/d", "--api-url", url)
    assert code == 1
    assert f"could not reach the platform at {url} (GET /api/agents)" in err and "--api-url" in err


# ---------------------------------------------------------------------------
# test: a run on the platform
# ---------------------------------------------------------------------------


def sample(tmp_path: pathlib.Path) -> str:
    write_sample(tmp_path / "tasks.csv")
    return "tasks.csv"


def test_test_runs_the_dataset_follows_it_and_writes_the_local_judges_report(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    agent = platform.add_agent("support-bot")
    platform.outcomes = [PASS, FAIL, PASS, PASS, PASS]
    platform.page_size = 2  # the rollup pages its tasks: all of them are fetched
    code, out, err = run(capsys, "test", sample(tmp_path), "--agent", "support-bot", "--poll-interval", "0.01",
                         "--json", "out/report.json", "--junit", "out/junit.xml", "--min-pass-rate", "0.8")
    assert code == 0, err
    sent = body_of(platform, "POST", "/api/agents/")
    assert platform.calls("POST")[-1].path == f"/api/agents/{agent['id']}/test-runs"
    assert sent["options"] == {} and [r["user"] for r in sent["rows"]][:2] == [
        "What is the status of order 4521?", "Refund order 4521, it arrived damaged."]
    assert set(sent["rows"][0]) == {"user", "behavior", "state", "failure_rules", "expected_outcome", "turn_mode"}
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["kind"] == testrun.KIND and report["dataset"]["file"] == "tasks.csv"
    assert report["summary"]["judge"]["pass"] == 4 and report["summary"]["judge"]["pass_rate"] == 0.8
    assert report["summary"]["judge"]["failure_modes"] == {"incorrect_completion": 1}
    second = report["runs"][1]
    assert (second["row"], second["status"], second["duration_ms"]) == (2, "ok", 1210.0)
    assert second["judge"] == {"verdict": "FAIL", "task_completion": 2, "failure_mode": "incorrect_completion",
                               "instruction_adherence": 2, "explanation": "refunded an order that was not eligible",
                               "model": "platform"}
    assert report["runs"][0]["judge"]["instruction_adherence"] is None  # the platform gave none
    assert report["summary"]["judge"]["instruction_adherence"] == {"mean": 2.0, "runs": 1}
    assert second["user_instruction"] == "Refund order 4521, it arrived damaged."
    assert len(report["runs"]) == 5 and {r.query.get("page") for r in platform.calls("GET", "/api/test-runs")} \
        == {None, "2", "3"}
    suite = ET.parse(tmp_path / "out" / "junit.xml").getroot()[0]
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("5", "1", "0")
    assert "row 2: FAIL incorrect_completion: Refund order 4521" in out
    assert "test run #" in err and "5/5 done (4 PASS, 1 FAIL)" in err


def test_min_pass_rate_fails_the_command_as_the_local_judge_does(platform: FakePlatform, tmp_path: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    agent = platform.add_agent("bot")
    platform.outcomes = [PASS, FAIL]
    code, _, err = run(capsys, "test", sample(tmp_path), "--agent", str(agent["id"]), "--poll-interval", "0.01",
                       "--min-pass-rate", "70%")
    assert code == 1
    assert "pass rate 60.0% (3 of 5 rows) is below --min-pass-rate 70.0%" in err
    code, _, err = run(capsys, "test", "tasks.csv", "--agent", "bot", "--min-pass-rate", "1.5")
    assert code == 2 and "is not between 0 and 1" in err


def test_a_row_that_failed_on_the_platform_fails_the_command_and_is_not_judged(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    platform.add_agent("bot")
    platform.outcomes = [PASS, {"status": "failed", "judge_passed": None}]
    code, out, err = run(capsys, "test", sample(tmp_path), "--agent", "bot", "--poll-interval", "0.01",
                         "--json", "r.json")
    assert code == 1 and "rows the platform could not run: 2 failed" in err
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert runs[1]["status"] == "error" and runs[1]["judge"] == {
        "verdict": None, "error": "the agent run failed on the platform"}
    assert "row 2: not judged: the agent run failed on the platform" in out


def test_a_run_that_never_finishes_times_out_with_status_1_and_a_partial_report(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    platform.add_agent("bot")
    platform.never_finish = True
    code, out, err = run(capsys, "test", sample(tmp_path), "--agent", "bot", "--poll-interval", "0.05",
                         "--timeout", "0.3", "--junit", "j.xml", "--json", "r.json")
    assert code == 1
    run_id = next(iter(platform.runs))
    assert ("timed out after 0.3 s with rows in flight; the run goes on on the platform: python3 -m conformance "
            f"test --attach {run_id}") in err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outcome"] == "timeout"
    assert {r["judge"]["error"] for r in report["runs"]} == {
        "not finished (running) when the command stopped following the run"}
    assert ET.parse(tmp_path / "j.xml").getroot()[0].get("errors") == "5"
    assert 2 <= len(platform.calls("GET", "/api/test-runs")) <= 20
    # and --attach re-joins it: finished now, no new run
    platform.never_finish = False
    platform.runs[run_id].never_finish = False
    code, out, err = run(capsys, "test", "--attach", str(run_id), "--poll-interval", "0.01")
    assert code == 0, err
    assert len(platform.runs) == 1 and len(platform.calls("POST", "/api/agents/")) == 1
    assert "5 rows: 5 PASS" in out


def test_a_dropped_connection_and_a_429_storm_mid_poll_are_ridden_out(platform: FakePlatform,
                                                                       tmp_path: pathlib.Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    platform.add_agent("bot")
    platform.finish_after = 3
    platform.drop("GET", "/api/test-runs/", times=2, after=1)  # the second poll: twice no reply, then one
    platform.fault("GET", "/api/test-runs/", 429, {"detail": "rate limited"}, {"Retry-After": "0"}, times=5,
                   after=1)  # the third: five 429s, then a reply
    code, out, err = run(capsys, "test", sample(tmp_path), "--agent", "bot", "--poll-interval", "0.01")
    assert code == 0, err
    assert "5 rows: 5 PASS" in out
    assert len(platform.calls("GET", "/api/test-runs")) == 1 + (2 + 1) + (5 + 1)


def test_a_429_storm_that_outlasts_the_retries_is_status_1_with_one_line(platform: FakePlatform,
                                                                         tmp_path: pathlib.Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    platform.add_agent("bot")
    platform.fault("GET", "/api/test-runs/", 429, {"detail": "rate limited"}, {"Retry-After": "0"}, times=50)
    code, _, err = run(capsys, "test", sample(tmp_path), "--agent", "bot", "--poll-interval", "0.01")
    assert code == 1
    assert err.strip().splitlines()[-1].startswith(
        "test: 429 Too Many Requests: still rate limited after 6 attempts (GET /api/test-runs/")


def test_rows_not_dispatched_stop_the_command_at_once_with_the_warnings(platform: FakePlatform,
                                                                        tmp_path: pathlib.Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    platform.add_agent("bot")
    platform.create_warnings = ["agent runs were not enqueued: broker unavailable"]
    code, _, err = run(capsys, "test", sample(tmp_path), "--agent", "bot", "--json", "r.json")
    assert code == 1
    assert "agent runs were not enqueued: broker unavailable" in err and "not queued" in err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outcome"] == "dispatch_failed" and report["summary"]["judge"]["not_judged"] == 5
    assert report["runs"][0]["judge"]["error"].startswith("not dispatched")
    assert len(platform.calls("GET", "/api/test-runs")) == 1


def test_a_bad_dataset_or_agent_stops_before_a_run_is_created(platform: FakePlatform, tmp_path: pathlib.Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bad.csv").write_text('user,state\nhello,"{not json"\n')
    code, _, err = run(capsys, "test", "bad.csv", "--agent", "1")
    assert code == 2 and "bad.csv:2: error: row 1, column `state`: not valid JSON" in err
    assert platform.requests == []
    code, _, err = run(capsys, "test", sample(tmp_path), "--agent", "nobody")
    assert code == 2 and "no agent named 'nobody'" in err and "register --name nobody" in err
    code, _, err = run(capsys, "test", "tasks.csv", "--agent", "999")
    assert code == 2 and "404 Not Found: agent 999 does not exist" in err
    code, _, err = run(capsys, "test", "tasks.csv")
    assert code == 2 and "--attach RUN_ID" in err
    assert [r.path for r in platform.calls("POST")] == ["/api/agents/999/test-runs"]


def test_rows_go_out_as_the_csv_has_them(tmp_path: pathlib.Path) -> None:
    data = ("\ufeffuser , behavior,notes\n"  # a BOM, a padded header, an unknown column (sent: the SDK sends it)
            '" spaced ",be calm,x\n'
            ",,\n"  # every cell empty: skipped, as the check says
            "\n"
            'short\n'
            '"multi\nline",,"y"\n').encode("utf-8")
    checked, rows, described = testrun.seed_rows(data, "t.csv")
    assert checked.ok
    assert rows == [{"user": " spaced ", "behavior": "be calm", "notes": "x"},
                    {"user": "short", "behavior": "", "notes": ""},
                    {"user": "multi\nline", "behavior": "", "notes": "y"}]
    assert [(r.row, r.line) for r in described] == [(1, 2), (3, 5), (4, 6)]


def test_the_real_command_line_in_a_subprocess(platform: FakePlatform, tmp_path: pathlib.Path) -> None:
    platform.add_agent("bot")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINES_API_KEY": platform.api_key,
           "PIPELINES_API_URL": platform.url}
    done = subprocess.run([sys.executable, "-m", "conformance", "test", sample(tmp_path), "--agent", "bot",
                           "--poll-interval", "0.05", "--min-pass-rate", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert platform.api_key not in done.stdout + done.stderr
    assert "pass rate 100.0%" in done.stdout
