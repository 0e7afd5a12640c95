"""`pipelines-port init` (`python3 -m conformance init`): scaffold a project, serve the copy, dispatch to it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import List

import pytest

import pipelines_port as pp
from conformance.harness.mock_proxy import MockProxy

ROOT = Path(__file__).resolve().parent.parent


def cli(args: List[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "conformance"] + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=30)


def test_list_names_every_template_with_its_summary() -> None:
    out = cli(["init", "--list"])
    assert out.returncode == 0
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert set(names) == {"minimal", "async_framework", "openai_responses", "openai_chat", "anthropic_messages"}
    assert all(len(line.split(None, 1)) == 2 for line in out.stdout.splitlines())


def test_scaffolded_project_serves_and_answers_a_dispatch(tmp_path: Path) -> None:
    project = tmp_path / "my-agent"
    out = cli(["init", str(project), "--template", "minimal"])
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "agent.py", "fixtures.json",
        "pipelines_port.py", "tasks.csv", "tools_schema.json"]
    assert (project / "pipelines_port.py").read_text() == (ROOT / "pipelines_port.py").read_text()
    assert (project / "agent.py").read_text() == (ROOT / "templates" / "minimal.py").read_text()
    assert "serve agent.py:agent" in (project / "README.md").read_text()

    # Serve the scaffolded copy from inside the project, with nothing of the kit on the path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen([sys.executable, "pipelines_port.py", "serve", "agent.py:agent", "--port", "0"],
                            cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "AGENT_TOKEN": "init-agent-token"})
    try:
        url = re.search(r"listening on (http://\S+)", proc.stdout.readline()).group(1)
        tools_line = [proc.stdout.readline(), proc.stdout.readline()][1]
        assert "tools declared" in tools_line  # tools_schema.json beside agent.py is served
        with MockProxy(tokens=["init-run-token"]) as proxy:
            proxy.script("search_kb", [{"response": {"hits": ["Refunds take 5 days."]}}])
            body = {"run_id": 1, "task_id": 2, "odyssey_proxy_url": proxy.url,
                    "input": {"user_instruction": "How long do refunds take?"}}
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
                "Content-Type": "application/json", "Authorization": "Bearer init-agent-token",
                "X-Pipelines-Run-Token": "init-run-token"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                reply = json.loads(resp.read())
            (call,) = proxy.calls("search_kb")
            assert call.json == {"query": "How long do refunds take?"} and call.bearer == "init-run-token"
        assert "Refunds take 5 days." in reply["final_response"]
        assert pp.validate_response(reply) == []
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_init_refuses_to_overwrite_without_force_and_writes_nothing(tmp_path: Path) -> None:
    project = tmp_path / "p"
    project.mkdir()
    (project / "agent.py").write_text("# mine\n")
    out = cli(["init", str(project), "--template", "openai_chat"])
    assert out.returncode == 2 and "agent.py" in out.stderr and "--force" in out.stderr
    assert sorted(p.name for p in project.iterdir()) == ["agent.py"]  # nothing half-written
    assert (project / "agent.py").read_text() == "# mine\n"
    out = cli(["init", str(project), "--template", "openai_chat", "--force"])
    assert out.returncode == 0
    assert (project / "agent.py").read_text() == (ROOT / "templates" / "openai_chat.py").read_text()
    assert not [p for p in project.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("args,needle", [
    (["init", "{dir}", "--template", "nope"], "unknown template 'nope'"),
    (["init"], "needs a DIR"),
    (["init", "{file}"], "not a directory"),
])
def test_init_usage_errors(tmp_path: Path, args: List[str], needle: str) -> None:
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    out = cli([a.format(dir=tmp_path / "new", file=a_file) for a in args])
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "new").exists()


def test_init_never_follows_a_planted_temporary_file(tmp_path: Path) -> None:
    """Temporary files are created exclusively (mkstemp in the target folder): a planted name or symlink is untouched."""
    from conformance.project.init import init_project

    project = tmp_path / "proj"
    project.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("agent.py", "README.md", "tools_schema.json", "pipelines_port.py"):  # the old fixed names
        (project / f"{name}.{os.getpid()}.tmp").symlink_to(victim)
    written = init_project(str(project), "minimal")
    assert victim.read_text() == "keep me"
    assert sorted(Path(p).name for p in written) == ["README.md", "agent.py", "fixtures.json", "pipelines_port.py",
                                                     "tasks.csv", "tools_schema.json"]
    assert not [p for p in project.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
