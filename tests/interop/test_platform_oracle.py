"""``register`` and ``test`` against the platform's own SDK (``pipelines-sdk`` 0.1.15) as the oracle.

Both talk to one recording stand-in of the platform's REST API (``tests/fake_platform.py``), and the SDK is
called as a black box (nothing of it is copied):

1. request bodies: for a corpus of registrations (HTTP and code agents, created and updated, tools with
   passthrough, a ledger schema and adapter, a custom auth header) the body ``register`` sends equals the
   one the SDK's ``registration`` helpers send for the same agent, and for datasets with every seed axis
   the body ``test`` sends equals the one the SDK's ``pipelines test`` sends for the same CSV;
2. reply shapes: every reply the SDK reads (a finished rollup, one in flight, ``not_dispatched`` rows,
   dispatch warnings, a paged task list, errors of each status) the kit reads to the same conclusions:
   complete or not, the counts, the warnings, which rows failed, their durations, the error's text;
3. the two commands end to end on the same scripted runs: the same exit status, except where
   ``DELIBERATE`` says why not.

The stand-in is kept honest by the SDK reading every reply it gives.  Run:
``/tmp/sdkvenv/bin/python -m pytest -q tests/interop/test_platform_oracle.py``.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

try:  # the SDK with its odyssey extra (pydantic): without it, nothing here runs
    import httpx  # noqa: F401
    from pipelines.odyssey import registration as sdk_registration
except ImportError as exc:
    pytest.skip(f"the platform oracle needs pipelines-sdk[odyssey] and httpx: {exc}", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pipelines_port as pp  # noqa: E402
from conformance import cli  # noqa: E402
from conformance.platform_api import client as api  # noqa: E402
from conformance.platform_api import register as reg  # noqa: E402
from conformance.platform_api import testrun  # noqa: E402
from pipelines import PipelinesClient  # noqa: E402
from pipelines.cli import _junit as sdk_junit  # noqa: E402
from pipelines.cli import _progress as sdk_progress  # noqa: E402
from pipelines.cli import _runs_export as sdk_export  # noqa: E402
from pipelines.cli import _test_cmd as sdk_test  # noqa: E402
from pipelines.cli.main import main as sdk_main  # noqa: E402
from pipelines.client import test_run_is_complete  # noqa: E402
from pipelines.odyssey import Tool, adapter, passthrough, simulated  # noqa: E402
from pipelines.odyssey._apierrors import humanize_detail  # noqa: E402
from tests.fake_platform import FakePlatform  # noqa: E402

TOKEN = "agent-token-for-the-oracle-0123"
ENDPOINT = "https://agent.example.com/dispatch"
TEMPLATE_TOOLS: List[Dict[str, Any]] = json.loads((ROOT / "templates" / "tools_schema.json").read_text())
SAMPLE = ROOT / "conformance" / "simulator" / "samples" / "orders.csv"
FAST = pp.RetryPolicy(max_attempts=6, base_delay_s=0.01, max_delay_s=0.05, transport_retries=3)

# Where the kit and the SDK's CLI part on purpose (each entry is needed by a case below, or it fails).
DELIBERATE = {
    "not-judged-rows-count": "--min-pass-rate: the SDK rates PASS / judged rows (none judged passes the gate); the "
                             "kit rates PASS / rows, a row not judged is not a pass, as the local judge does",
}


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> Iterator[FakePlatform]:
    with FakePlatform() as fake:
        monkeypatch.setenv("PIPELINES_API_KEY", fake.api_key)
        monkeypatch.setenv("PIPELINES_API_URL", fake.url)  # the kit's
        monkeypatch.setenv("PIPELINES_BASE_URL", fake.url)  # the SDK's
        monkeypatch.setenv("PIPELINES_CONFIG_FILE", str(tmp_path / "sdk-config.json"))
        monkeypatch.setenv("AGENT_TOKEN", TOKEN)
        monkeypatch.setattr(api, "RETRY", FAST)
        monkeypatch.chdir(tmp_path)
        yield fake


def kit(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sdk(capsys: pytest.CaptureFixture, *argv: str) -> Tuple[int, str, str]:
    """The SDK's own ``pipelines`` command line, in this process, its client's retries without waiting."""
    def factory(**kwargs: Any) -> PipelinesClient:
        return PipelinesClient(retry_sleep=lambda _s: None, **kwargs)
    code = sdk_main(list(argv), client_factory=factory)
    out, err = capsys.readouterr()
    return code, out, err


def last_body(platform: FakePlatform, method: str, prefix: str) -> Any:
    calls = platform.calls(method, prefix)
    assert calls, f"no {method} {prefix}"
    return calls[-1].body


# ---------------------------------------------------------------------------
# 1. Request bodies: registrations
# ---------------------------------------------------------------------------


def tools_file(tmp_path: pathlib.Path) -> Tuple[str, List[Any]]:
    """A tools file (a passthrough binding, a ledger adapter) and the same tools as the SDK's ``Tool`` objects."""
    entries = json.loads(json.dumps(TEMPLATE_TOOLS))
    entries[1]["ledger_write_policy"] = "adapter"
    entries[1]["ledger_adapter"] = {"op": "update", "entity_type": "order", "id_from": "$.order_id",
                                    "field_map": {"status": "$.status"}}
    entries[2]["passthrough_binding"] = {"tool_name": "search", "endpoint_name": "kb-live"}
    for entry in entries:
        entry.pop("default_execution_mode")
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(entries))
    t = TEMPLATE_TOOLS
    tools = [
        Tool(name=t[0]["name"], input_schema=t[0]["input_schema"], description=t[0]["description"], mode=simulated()),
        Tool(name=t[1]["name"], input_schema=t[1]["input_schema"], description=t[1]["description"], mode=simulated(),
             ledger=adapter(op="update", entity_type="order", id_from="$.order_id",
                            field_map={"status": "$.status"})),
        Tool(name=t[2]["name"], input_schema=t[2]["input_schema"], description=t[2]["description"],
             mode=passthrough(tool_name="search", endpoint_name="kb-live")),
    ]
    tools += [Tool(name=e["name"], input_schema=e["input_schema"], description=e["description"], mode=simulated())
              for e in t[3:]]  # the template's other tools, as they are
    return str(path), tools


LEDGER = {"entities": [{"entity_type": "order", "id_field": "id", "fields": {"status": {"type": "string"}}}]}


def test_http_agent_bodies_equal_the_sdks(platform: FakePlatform, tmp_path: pathlib.Path,
                                          capsys: pytest.CaptureFixture) -> None:
    path, tools = tools_file(tmp_path)
    (tmp_path / "ledger.json").write_text(json.dumps(LEDGER))
    shutil.copy(ROOT / "templates" / "tools_schema.json", tmp_path / "tools_schema.json")
    cases = [
        # (kit flags, the SDK's create_http_agent arguments for the same agent)
        (["--name", "plain", "--endpoint", ENDPOINT],
         {"name": "plain", "endpoint_url": ENDPOINT, "auth_header_name": "Authorization",
          "auth_credential_value": f"Bearer {TOKEN}", "tools_schema": TEMPLATE_TOOLS}),
        (["--name", "custom", "--endpoint", ENDPOINT, "--auth-header", "X-API-Key", "--timeout", "90",
          "--concurrency", "9", "--run-timeout", "600", "--tools", path, "--passthrough", "search_kb",
          "--ledger-schema", "ledger.json"],
         {"name": "custom", "endpoint_url": ENDPOINT, "auth_header_name": "X-API-Key", "auth_credential_value": TOKEN,
          "timeout_s": 90, "concurrency_cap": 9, "run_timeout_s": 600, "tools_schema": tools,
          "ledger_schema": LEDGER}),
    ]
    for flags, arguments in cases:
        code, _, err = kit(capsys, "register", *flags)
        assert code == 0, err
        ours = last_body(platform, "POST", "/api/agents")
        platform.agents.clear()
        sdk_registration.create_http_agent(api_key=platform.api_key, base_url=platform.url, **arguments)
        theirs = last_body(platform, "POST", "/api/agents")
        platform.agents.clear()
        assert ours == theirs, flags
    # an update: PUT /api/agents/{id} with what changes, as update_http_agent sends it
    agent = platform.add_agent("plain")
    assert kit(capsys, "register", "--name", "plain", "--endpoint", ENDPOINT, "--concurrency", "9",
               "--tools", path, "--passthrough", "search_kb")[0] == 0
    ours = last_body(platform, "PUT", "/api/agents/")
    sdk_registration.update_http_agent(agent_id=agent["id"], api_key=platform.api_key, base_url=platform.url,
                                       endpoint_url=ENDPOINT, auth_header_name="Authorization",
                                       auth_credential_value=f"Bearer {TOKEN}", tools_schema=tools, concurrency_cap=9)
    assert ours == last_body(platform, "PUT", "/api/agents/")
    assert {r.headers["authorization"] for r in platform.requests} == {f"Bearer {platform.api_key}"}


def code_project(tmp_path: pathlib.Path, with_module: bool = True) -> pathlib.Path:
    folder = tmp_path / "project"
    (folder / "helpers").mkdir(parents=True)
    (folder / "agent.py").write_text((ROOT / "templates" / "minimal.py").read_text())
    (folder / "helpers" / "__init__.py").write_text("")
    (folder / "helpers" / "text.py").write_text("def shout(s):\n    return s.upper()\n")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "agent.cpython-311.pyc").write_bytes(b"\0")
    (folder / ".git").mkdir()
    (folder / ".git" / "hook.py").write_text("x = 1\n")
    (folder / "venv").mkdir()
    (folder / "venv" / "site.py").write_text("x = 1\n")
    (folder / "scratch_a.py").write_text("x = 1\n")
    (folder / ".pipelinesignore").write_text("scratch_*.py\n")
    (folder / "tasks.csv").write_text("user\nhi\n")
    if with_module:
        shutil.copy(ROOT / "pipelines_port.py", folder / "pipelines_port.py")
    return folder


def test_code_agent_bodies_equal_the_sdks_and_the_upload_is_what_its_walk_takes(
        platform: FakePlatform, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    folder = code_project(tmp_path)
    # The SDK's own upload validator takes the module as it is, beside a template agent: within the platform's
    # per-file limit, and nothing else in the folder it would refuse.
    walked_with_module = sdk_registration.walk_agent_source_dir(folder)
    assert walked_with_module["pipelines_port.py"] == (ROOT / "pipelines_port.py").read_text(encoding="utf-8")
    code, _, err = kit(capsys, "register", "--name", "coded", "--code", str(folder), "--entrypoint", "agent.py:run")
    assert code == 0, err
    ours = last_body(platform, "POST", "/api/agents")
    files = ours["config"]["source_files"]
    platform.agents.clear()
    sdk_registration.create_code_agent(name="coded", entrypoint="run", entrypoint_file="agent.py", files=files,
                                       tools_schema=[], api_key=platform.api_key, base_url=platform.url)
    assert ours == last_body(platform, "POST", "/api/agents")  # the SDK sends the very same body
    # The user's own files: what the SDK's walk takes from the folder (without the module) is what the kit took.
    (folder / "pipelines_port.py").unlink()
    walked = sdk_registration.walk_agent_source_dir(folder)
    assert files == walked_with_module and {k: v for k, v in files.items() if k != "pipelines_port.py"} == walked
    # an update: the whole tree again (the platform replaces a code agent's config), as update_code_agent sends it
    agent = next(iter(platform.agents.values()))
    shutil.copy(ROOT / "pipelines_port.py", folder / "pipelines_port.py")
    assert kit(capsys, "register", "--name", "coded", "--code", str(folder), "--entrypoint", "agent.py:run",
               "--run-timeout", "600", "--tools", str(ROOT / "templates" / "tools_schema.json"))[0] == 0
    ours = last_body(platform, "PUT", "/api/agents/")
    sdk_registration.update_code_agent(agent_id=agent["id"], api_key=platform.api_key, base_url=platform.url,
                                       entrypoint="run", entrypoint_file="agent.py", files=files,
                                       tools_schema=TEMPLATE_TOOLS, run_timeout_s=600)
    assert ours == last_body(platform, "PUT", "/api/agents/")


# ---------------------------------------------------------------------------
# 1. Request bodies: datasets with every seed axis
# ---------------------------------------------------------------------------

DATASETS = {
    "the sample (user, behavior, state, failure_rules, expected_outcome)": SAMPLE.read_bytes(),
    "workspace columns, a BOM, CRLF, padded names, quoted line breaks, short rows, unicode": (
        "\ufeff user ,behavior, state ,failure_rules,expected_outcome,scenario_ref,workspace_seed,setup_command\r\n"
        '"Fix the bug in\r\nparse.py",be terse,"{""repo"":{""r1"":{""branch"":""main""}}}",'
        '"[{""trigger"":""random"",""tool"":""*"",""probability"":0.2,""error"":{""code"":503,""message"":""x""}}]",'
        "REFUSAL,sc-1,seed-7,make setup\r\n"
        "Résumé en français ✓,,,,,,,\r\n"
        "Only the user\r\n").encode("utf-8"),
    "only the user column, extra empty cells": "user\nfirst,\nsecond,,\n".encode(),
}


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_test_run_bodies_equal_the_sdks_for_every_seed_axis(platform: FakePlatform, tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture, name: str) -> None:
    (tmp_path / "tasks.csv").write_bytes(DATASETS[name])
    agent = platform.add_agent("bot")
    code, _, err = kit(capsys, "test", "tasks.csv", "--agent", "bot", "--poll-interval", "0.01")
    assert code == 0, err
    ours = last_body(platform, "POST", "/api/agents/")
    code, _, err = sdk(capsys, "test", "tasks.csv", "--agent", "bot", "--display", "plain", "--poll-interval", "0")
    assert code == 0, err
    theirs = last_body(platform, "POST", "/api/agents/")
    assert ours == theirs
    lookups = [r.query for r in platform.calls("GET", "/api/agents")]
    assert lookups == [{"search": "bot"}, {"search": "bot"}]  # the name is looked up alike
    assert {r.path for r in platform.calls("POST")} == {f"/api/agents/{agent['id']}/test-runs"}


# ---------------------------------------------------------------------------
# 2. Reply shapes: the kit reads what the SDK reads, to the same conclusions
# ---------------------------------------------------------------------------


def rollups(platform: FakePlatform) -> Dict[str, Dict[str, Any]]:
    """Rollups the stand-in gives, in every state the SDK tells apart, plus hand-made edge shapes."""
    made: Dict[str, Dict[str, Any]] = {}
    rows = [{"user": f"task {i}"} for i in range(5)]
    scenarios = {
        "finished": ([{"judge_passed": True}, {"judge_passed": False, "failure_mode": "incorrect_completion"}], 1),
        "in flight": ([{"judge_passed": True}], 0),
        "failed rows": ([{"judge_passed": True}, {"status": "failed"}, {"status": "timed_out"},
                         {"status": "cancelled"}], 1),
        "not dispatched rows": ([{"judge_passed": True}, {"status": "not_dispatched"}], 1),
        "completed, no verdicts": ([{"judge_passed": None}], 1),
    }
    for label, (outcomes, polls) in scenarios.items():
        run = make_run(platform, rows, outcomes)
        run.polls = polls * run.finish_after
        made[label] = run.rollup(platform.url, 1, 50)
    warned = make_run(platform, rows, [{"judge_passed": True}], warnings=["broker down: runs not queued"])
    made["dispatch warnings"] = warned.rollup(platform.url, 1, 50)
    made["empty"] = {"test_run_id": 9, "totals": {}, "tasks": []}
    made["verdict strings, latencies"] = {"test_run_id": 10, "totals": {"task_count": 1, "completed": 1},
                                          "tasks": [{"task_id": 1, "status": "completed", "judge_passed": False,
                                                     "runs": [{"latency_ms": 5}, {"latency_ms": 70.5}, {}]}]}
    return made


def make_run(platform: FakePlatform, rows: List[Dict[str, Any]], outcomes: List[Dict[str, Any]],
               warnings: Optional[List[str]] = None) -> Any:
    from tests.fake_platform import Run

    run = Run(len(platform.runs) + 1, 1, rows, outcomes, 1, False, warnings or [])
    platform.runs[run.id] = run
    return run


def test_every_rollup_shape_reads_alike(platform: FakePlatform) -> None:
    for label, rollup in rollups(platform).items():
        assert testrun.is_complete(rollup) == test_run_is_complete(rollup), label
        assert testrun.dispatch_warnings(rollup) == sdk_test._dispatch_warnings(rollup), label
        theirs = sdk_progress.summarize(rollup)
        assert testrun.progress(rollup) == {k: theirs[k] for k in ("total", "done", "in_flight", "passed", "failed")}
        report = testrun.build_report(rollup, [], dataset={"file": "t.csv"}, agent=1, api_url="x", started_at="",
                                      duration_ms=0, outcome="complete")
        tasks = rollup["tasks"]
        for task, run in zip(tasks, report["runs"]):
            assert run["duration_ms"] == pytest.approx(sdk_junit._task_time_seconds(task) * 1000), label
            # the SDK's JUnit <failure> (a FAIL, or a run that failed or timed out) is the kit's FAIL or the
            # kit's not-judged row of a run that failed or timed out (the local judge's JUnit: an <error>)
            failed = run["judge"]["verdict"] == "FAIL" or run["platform_status"] in testrun.RUN_FAILURES
            assert failed == sdk_junit._is_task_failure(task), label
        assert ({t["task_id"] for t in sdk_progress.failed_tasks(rollup)}
                == {r["task_id"] for r in report["runs"]
                    if r["judge"]["verdict"] == "FAIL" or r["platform_status"] in testrun.RUN_FAILURES}), label
        has_failures = any(testrun._count(testrun._totals(rollup), k) for k in testrun.RUN_FAILURES)
        assert has_failures == sdk_progress.has_terminal_failures(rollup), label


def test_a_paged_task_list_is_read_whole_alike(platform: FakePlatform) -> None:
    platform.page_size = 2
    run = make_run(platform, [{"user": f"task {i}"} for i in range(7)], [{"judge_passed": True}])
    run.polls = 1
    with PipelinesClient(api_key=platform.api_key, base_url=platform.url) as theirs:
        expected = sdk_export.fetch_full_rollup(theirs, run.id)
    with api.Client(platform.url, platform.api_key) as ours:
        got = testrun.all_tasks(ours, run.id, ours.get_test_run(run.id))
    assert [t["task_id"] for t in got["tasks"]] == [t["task_id"] for t in expected["tasks"]]
    assert len(got["tasks"]) == 7


ERRORS = [
    (401, {"detail": "Invalid API key"}),
    (403, {"detail": "API key lacks scope agents:write"}),
    (404, {"detail": "Agent not found"}),
    (409, {"detail": "An agent named 'bot' already exists"}),
    (422, {"detail": [{"loc": ["body", "config", "endpoint_url"], "msg": "must be externally reachable",
                       "type": "value_error"}, {"loc": ["body", "rows", 2, "state"], "msg": "not an object"}]}),
    (422, {"detail": "tools_schema: duplicate tool name"}),
    (409, {"detail": {"error_class": "name_taken", "message": "An agent named 'bot' already exists"}}),
    (400, {"detail": {"error_class": "bad_request"}}),
]


@pytest.mark.parametrize("status, body", ERRORS, ids=[f"{s}-{i}" for i, (s, _) in enumerate(ERRORS)])
def test_every_error_reply_reads_alike(platform: FakePlatform, status: int, body: Dict[str, Any]) -> None:
    from pipelines.errors import PipelinesAPIError, error_for_status

    platform.fault("GET", "/api/test-runs/", status, body)
    with PipelinesClient(api_key=platform.api_key, base_url=platform.url) as theirs, \
            pytest.raises(PipelinesAPIError) as sdk_error:
        theirs.get_test_run(5)
    assert type(sdk_error.value) is error_for_status(status) and sdk_error.value.status_code == status
    platform.fault("GET", "/api/test-runs/", status, body)
    with api.Client(platform.url, platform.api_key) as ours, pytest.raises(api.PlatformError) as kit_error:
        ours.get_test_run(5)
    error = kit_error.value
    assert error.status == status and error.usage  # a 4xx but 429: the caller's setup (exit status 2)
    detail = body["detail"]
    if isinstance(detail, list):  # which field and why: the SDK's location without its "body." prefix
        assert [(f, why) for f, why in error.fields] == [(".".join(map(str, d["loc"][1:])).replace(".2", "[2]"),
                                                          d["msg"]) for d in detail]
        for field, why in error.fields:
            assert f"{field}: {why}" in str(error)
    else:
        assert error.detail == humanize_detail(detail)
    assert "\n" not in str(error) and platform.api_key not in str(error)


# ---------------------------------------------------------------------------
# 3. The two commands end to end on the same runs
# ---------------------------------------------------------------------------

RUNS = [
    # (label, outcomes, stand-in settings, extra flags, the deliberate difference that explains a split, if any)
    ("all pass", [{"judge_passed": True}], {}, [], None),
    ("one FAIL, gate met", [{"judge_passed": True}] * 4 + [{"judge_passed": False}], {}, ["--min-pass-rate", "0.7"],
     None),
    ("one FAIL, gate missed", [{"judge_passed": True}] * 4 + [{"judge_passed": False}], {},
     ["--min-pass-rate", "0.9"], None),
    ("a row failed", [{"judge_passed": True}, {"status": "failed"}], {}, [], None),
    ("a row timed out", [{"judge_passed": True}, {"status": "timed_out"}], {}, [], None),
    ("not dispatched", [{"judge_passed": True}], {"create_warnings": ["broker down"]}, [], None),
    ("never finishes", [{"judge_passed": True}], {"never_finish": True}, ["--timeout", "0.3"], None),
    ("no verdicts, gate set", [{"judge_passed": None}], {}, ["--min-pass-rate", "0.8"], "not-judged-rows-count"),
]


@pytest.mark.parametrize("label, outcomes, settings, flags, deliberate", RUNS, ids=[r[0] for r in RUNS])
def test_the_commands_exit_alike_on_the_same_runs(platform: FakePlatform, tmp_path: pathlib.Path,
                                                  capsys: pytest.CaptureFixture, label: str,
                                                  outcomes: List[Dict[str, Any]], settings: Dict[str, Any],
                                                  flags: List[str], deliberate: Optional[str]) -> None:
    shutil.copy(SAMPLE, tmp_path / "tasks.csv")
    agent = platform.add_agent("bot")
    platform.outcomes = outcomes
    for key, value in settings.items():
        setattr(platform, key, value)
    ours = kit(capsys, "test", "tasks.csv", "--agent", str(agent["id"]), "--poll-interval", "0.05", *flags)
    theirs = sdk(capsys, "test", "tasks.csv", "--agent", str(agent["id"]), "--display", "plain",
                 "--poll-interval", "0.05", *flags)
    if deliberate is None:
        assert ours[0] == theirs[0], (label, ours[2], theirs[2])
    else:
        assert deliberate in DELIBERATE and ours[0] != theirs[0], label
    assert ours[0] in (0, 1)
