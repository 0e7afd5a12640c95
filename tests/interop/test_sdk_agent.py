"""The conformance check against an independent implementation on the platform's own SDK.

``tests/interop/sdk_agent.py`` is the conformance agent written on ``pipelines-sdk`` (FastAPI +
``register_dispatch_route``, the SDK's proxy and trace clients), served by uvicorn.  The check must find it
conforming on every MUST rule except the SDK's own violations, listed in conformance/README.md ("The
platform's SDK, checked"): exactly those cases, no more (a checker enforcing our choices as rules) and no
fewer (a violation the checker stopped seeing).  Skips when the SDK, FastAPI or uvicorn is missing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest

from tests.interop.hosts import ROOT, ServerProcess, free_port, subprocess_env

pytest.importorskip("fastapi", reason="the SDK-based agent needs fastapi")
pytest.importorskip("uvicorn", reason="the SDK-based agent is served by uvicorn")
pytest.importorskip("pipelines.odyssey", reason="the SDK-based agent needs pipelines-sdk")

TOKEN = "sdk-agent-token-4c4c4c"


def documented_violations() -> Dict[str, str]:
    """The README's table: case id -> rule."""
    text = (ROOT / "conformance" / "README.md").read_text(encoding="utf-8")
    section = text.split("## The platform's SDK, checked", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| MUST `([a-z0-9-]+)` \|", section, re.M)}


def check(url: str, *args: str) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "conformance", "check", url, "--json", "-", "--timeout", "20", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report: Dict[str, Any] = json.loads(done.stdout)
    return report


def serve(tmp_path: Path, name: str, **env: str) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.interop.sdk_agent:app", "--port", str(port),
               "--log-level", "warning"]
    return ServerProcess(name, command, port, cwd=ROOT, env=subprocess_env(**env), log_path=tmp_path / f"{name}.log")


def must_failures(report: Dict[str, Any]) -> Set[str]:
    return {c["id"] for c in report["cases"] if c["status"] == "fail"}


def test_the_sdk_based_agent_fails_only_the_documented_must_cases(tmp_path: Path) -> None:
    documented = documented_violations()
    assert len(documented) == 7
    with serve(tmp_path, "sdk-agent", AGENT_TOKEN=TOKEN).wait_ready() as server:
        report = check(server.base + "/dispatch", "--token", TOKEN)
    assert must_failures(report) == set(documented), [
        (c["id"], c["findings"]) for c in report["cases"] if c["status"] == "fail"]
    for case in report["cases"]:
        if case["status"] == "fail":  # each for the documented rule
            assert {f["rule"] for f in case["findings"] if f["level"] == "MUST"} == {documented[case["id"]]}
    assert report["level_met"] == "none" and report["passed"] > 150
    warned_rules: List[str] = sorted({f["rule"] for c in report["cases"] for f in c["findings"]
                                      if f["level"] == "SHOULD"})
    assert "idempotency-key-per-call" in warned_rules and "honour-retry-after" in warned_rules
    assert TOKEN not in json.dumps(report)


def test_the_sdk_based_agent_answers_503_when_its_token_variable_is_unset(tmp_path: Path) -> None:
    with serve(tmp_path, "sdk-agent-misconfigured").wait_ready() as server:
        report = check(server.base + "/dispatch", "--misconfigured", "--strict")
    assert [(c["id"], c["status"]) for c in report["cases"]] == [("misconfigured.refuses_everything", "pass")]
