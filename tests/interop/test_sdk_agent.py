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
from typing import Any, Dict, Set

import pytest

from tests.interop.hosts import ROOT, ServerProcess, free_port, subprocess_env

pytest.importorskip("fastapi", reason="the SDK-based agent needs fastapi")
pytest.importorskip("uvicorn", reason="the SDK-based agent is served by uvicorn")
pytest.importorskip("pipelines.odyssey", reason="the SDK-based agent needs pipelines-sdk")

TOKEN = "sdk-agent-token-4c4c4c"


# The SHOULD rules the SDK breaks, each from hardening or HTTP practice rather than the platform's documents
# (conformance/README.md, "The platform's SDK, checked"): the default check passes it, --strict fails exactly these.
SDK_SHOULD_BREAKS = {
    "agent-text-scrubbed", "tool-name-path-safe", "idempotency-key-per-call", "idempotency-key-reuse",
    "transport-retry-with-key", "honour-retry-after", "envelope-missing-named", "no-request-smuggling",
    "turn-reply-as-built",
}


def documented_breaks() -> Set[str]:
    """The README's list of the SDK's SHOULD breaks."""
    text = (ROOT / "conformance" / "README.md").read_text(encoding="utf-8")
    section = text.split("## The platform's SDK, checked", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z0-9-]+)` \| SHOULD \|", section, re.M))


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


def broken_rules(report: Dict[str, Any], level: str) -> Set[str]:
    return {f["rule"] for c in report["cases"] if c["status"] in ("fail", "warn") for f in c["findings"]
            if f["level"] == level}


def test_the_sdk_based_agent_passes_the_default_check_and_fails_only_listed_shoulds_at_strict(tmp_path: Path) -> None:
    assert documented_breaks() == SDK_SHOULD_BREAKS  # the README and this list agree
    with serve(tmp_path, "sdk-agent", AGENT_TOKEN=TOKEN).wait_ready() as server:
        report = check(server.base + "/dispatch", "--token", TOKEN)
        strict = check(server.base + "/dispatch", "--token", TOKEN, "--strict")
    # No false failure: the one MUST failure is real. The SDK's error text carries a proxy error body as it came,
    # so a proxy that echoes the run token puts the token the SDK holds into the 500 it answers.
    failed_ids = {c["id"] for c in report["cases"] if c["status"] == "fail"}
    assert failed_ids == {"secrets.proxy_error_echo", "secrets.no_token_in_any_body"}, failed_ids
    assert report["level_met"] == "none" and report["passed"] > 150
    assert broken_rules(report, "MUST") == {"run-token-secret"}
    assert broken_rules(report, "SHOULD") == SDK_SHOULD_BREAKS
    failed = [c for c in strict["cases"] if c["status"] == "fail"]
    assert failed and {f["rule"] for c in failed for f in c["findings"]
                       if f["level"] == "SHOULD"} == SDK_SHOULD_BREAKS
    sources = {f["rule"]: f["source"] for c in failed for f in c["findings"] if f["level"] == "SHOULD"}
    assert all(not source.startswith("the platform's documents") for source in sources.values()), sources
    assert TOKEN not in json.dumps(report) + json.dumps(strict)


def test_the_sdk_based_agent_answers_503_when_its_token_variable_is_unset(tmp_path: Path) -> None:
    with serve(tmp_path, "sdk-agent-misconfigured").wait_ready() as server:
        report = check(server.base + "/dispatch", "--misconfigured", "--strict")
    assert [(c["id"], c["status"]) for c in report["cases"]] == [("misconfigured.refuses_everything", "pass")]
