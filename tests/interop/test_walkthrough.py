"""The README's walk-through, run as a new user would: its commands, as written, in a fresh venv and shell.

The block between ``<!-- walkthrough -->`` and ``<!-- /walkthrough -->`` in README.md runs as one bash script
(``set -e``) in an empty folder, with a venv of its own first on ``PATH``; the one substitution is
``pip install .``, which names this checkout by its path.  It must end with an HTML report of the agent
against the dataset.  Then the "dispatch by hand" part: ``serve`` in the project, ``pipelines-port proxy``,
and the ``curl`` command it prints, pasted into bash.  Needs pip to reach an index (for setuptools): skipped
when the install cannot run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List

import pytest

from tests.interop.hosts import ROOT, free_port

if shutil.which("bash") is None or shutil.which("curl") is None:
    pytest.skip("the walk-through needs bash and curl", allow_module_level=True)


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- walkthrough -->", 1)[1].split("<!-- /walkthrough -->", 1)[0]
    lines = [line for line in block.strip().splitlines() if not line.startswith("```")]
    assert lines and lines[0].startswith("pip install .")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, str]:
    """An empty folder and a shell environment whose python/pip/pipelines-port are a fresh venv's."""
    home = tmp_path_factory.mktemp("newcomer")
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "AGENT_TOKEN", "VIRTUAL_ENV") and not k.startswith(("PIPELINES_", "OPENAI_",
                                                                                          "ANTHROPIC_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["NO_COLOR"] = "1"
    return {"home": str(home), **{f"env:{k}": v for k, v in env.items()}}


def environment(fresh: Dict[str, str]) -> Dict[str, str]:
    return {k[4:]: v for k, v in fresh.items() if k.startswith("env:")}


def test_the_readme_walkthrough_ends_with_a_report(fresh: Dict[str, str]) -> None:
    script = "set -euo pipefail\n" + walkthrough().replace("pip install .", f"pip install -q {ROOT}", 1)
    done = subprocess.run(["bash", "-c", script], cwd=fresh["home"], env=environment(fresh), capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0 and "pip" in done.stderr and ("Could not" in done.stderr or "No matching" in done.stderr):
        pytest.skip(f"pip cannot install here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    project = Path(fresh["home"]) / "my-agent"
    report = (project / "report.html").read_text(encoding="utf-8")
    rows = re.findall(r'id="row-(\d+)"', report)
    assert len(rows) == 7 and "Traceback" not in done.stderr
    assert "✓ agent imports" in done.stdout and "✗" not in done.stdout  # doctor all green (or skipped), offline
    assert "7 runs: 7 ran without error" in done.stdout
    assert "rows/s" in done.stderr  # the progress line
    # the judge, installed: its rubric ships as package data; every row judged, in the page and the JUnit file
    assert "judge (scripted): pass rate" in done.stdout and report.count('<aside class="verdict">') == 7
    assert len(ET.parse(project / "results.xml").getroot().findall("testsuite/testcase")) == 7
    # the simulated user carries the multi-turn row past its first turn
    assert "sessions: 1 model_as_user row(s), 2 turns" in done.stdout


def test_a_dispatch_by_hand_with_the_printed_curl(fresh: Dict[str, str]) -> None:
    project = Path(fresh["home"]) / "my-agent"
    if not (project / "agent.py").exists():
        pytest.skip("the walk-through did not run")
    env = dict(environment(fresh), AGENT_TOKEN="by-hand-token-0123456789")
    agent_port, proxy_port = free_port(), free_port()
    procs: List[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(["python3", "-m", "pipelines_port", "serve", "agent.py:agent", "--port",
                                       str(agent_port)], cwd=project, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        proxy = subprocess.Popen(["pipelines-port", "proxy", "--csv", "tasks.csv", "--row", "2", "--responses",
                                  "fixtures.json", "--port", str(proxy_port), "--agent-url",
                                  f"http://127.0.0.1:{agent_port}/dispatch"], cwd=project, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(proxy)
        assert proxy.stdout is not None
        printed: List[str] = []
        while not any(line.startswith("tool calls and trace events") for line in printed):
            line = proxy.stdout.readline()
            assert line, "".join(printed)
            printed.append(line)
        curl = "".join(printed[next(i for i, text in enumerate(printed) if text.startswith("curl")):-1])
        deadline = time.monotonic() + 20
        while True:  # the agent server may still be starting
            done = subprocess.run(["bash", "-c", curl], cwd=project, env=env, capture_output=True, text=True,
                                  timeout=60)
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert "Knowledge base search timed out" in body["final_response"]  # row 2's failure rule fired
        logged = proxy.stdout.readline()
        assert logged.startswith("tool search_kb")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def platform_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- platform -->", 1)[1].split("<!-- /platform -->", 1)[0]
    return "\n".join(line for line in block.strip().splitlines() if not line.startswith("```"))


def test_the_readme_platform_section_against_a_stand_in_of_the_api(fresh: Dict[str, str]) -> None:
    """The README's "Put it on the platform", as written, in the walk-through's project, with the installed command."""
    from tests.fake_platform import FakePlatform

    project = Path(fresh["home"]) / "my-agent"
    if not (project / "agent.py").exists():
        pytest.skip("the walk-through did not run")
    token = "walkthrough-agent-token-0123456789"
    with FakePlatform() as platform:
        env = dict(environment(fresh), PIPELINES_API_KEY=platform.api_key, PIPELINES_API_URL=platform.url,
                   AGENT_TOKEN=token)
        done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + platform_block()], cwd=project, env=env,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    agents = {agent["name"]: agent for agent in platform.agents.values()}
    assert agents["my-agent"]["mode"] == "external_http" and agents["my-agent"]["config"]["has_auth_credential"]
    assert agents["my-agent-code"]["mode"] == "sandbox"
    uploaded = agents["my-agent-code"]["config"]["source_files"]
    assert "agent.py" in uploaded and uploaded["pipelines_port.py"] == (project / "pipelines_port.py").read_text()
    assert [run.agent_id for run in platform.runs.values()] == [agents["my-agent"]["id"]]
    results = json.loads((project / "results.json").read_text(encoding="utf-8"))
    assert results["summary"]["judge"]["pass"] == len(results["runs"]) == 7 and (project / "junit.xml").is_file()
    for text in (done.stdout, done.stderr, (project / "results.json").read_text(), (project / "junit.xml").read_text()):
        assert platform.api_key not in text and token not in text
