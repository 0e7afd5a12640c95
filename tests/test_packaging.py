"""The kit as a distribution: pyproject.toml, the wheel's contents, and the one console command.

The wheel is built from a copy of the checkout (so no build/ or *.egg-info lands in
it) with the interpreter's own setuptools, offline: ``pip wheel --no-deps
--no-build-isolation``.  Unpacked, a pure-Python wheel is an install, so the kit
is also run from there, outside the checkout, as the console command runs it.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

import pipelines_port as pp

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
COMMANDS = ["serve", "init", "doctor", "mcp", "check", "dataset", "simulate", "merge", "compare", "demo", "model",
            "proxy", "register", "test"]


def _project_version() -> str:
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # 3.9, 3.10: the one line is enough
        project = PYPROJECT.split("[project]", 1)[1].split("\n[", 1)[0]
        match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.M)
        assert match, "no version in [project]"
        return match.group(1)
    return str(tomllib.loads(PYPROJECT)["project"]["version"])


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _why_no_wheel() -> Optional[str]:
    """Why this interpreter cannot build the wheel offline, or None when it can."""
    if importlib.util.find_spec("pip") is None:
        return "pip is not installed for this interpreter"
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed for this interpreter (pip install . still works: it fetches one)"
    have = importlib.metadata.version("setuptools")  # not imported here: it would patch distutils in this process
    wanted = re.search(r'"setuptools>=([\d.]+)"', PYPROJECT)
    assert wanted, "pyproject.toml's build-system requires no setuptools>=X"
    if _version_tuple(have) < _version_tuple(wanted.group(1)):
        return (f"setuptools {have} is older than the {wanted.group(1)} pyproject.toml requires "
                "(pip install . fetches a current one; .ci/run builds the wheel in a venv that has one)")
    if _version_tuple(have) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {have} needs the wheel package to build wheels, and it is not installed"
    return None


def run(args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_pyproject_version_is_the_module_version() -> None:
    assert _project_version() == pp.__version__


def test_pyproject_names_the_console_command_and_no_dependencies() -> None:
    assert re.search(r'^pipelines-port = "pipelines_port_kit\.cli:main"$', PYPROJECT, re.M)
    assert re.search(r'^dependencies = \[\]$', PYPROJECT, re.M)
    assert re.search(r'^requires-python = ">=3\.9"$', PYPROJECT, re.M)


# -- the wheel -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    why = _why_no_wheel()
    if why:
        pytest.skip(f"cannot build the wheel offline here: {why}")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".benchmarks", ".venv",
        "build", "dist", "*.egg-info"))
    out = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
               "-w", str(work / "dist"), str(source)], cwd=work)
    assert out.returncode == 0, out.stdout + out.stderr
    (built,) = (work / "dist").glob("pipelines_port-*.whl")
    yield built


@pytest.fixture(scope="module")
def wheel_files(wheel: Path) -> List[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_wheel_holds_the_module_the_kit_and_its_data(wheel: Path, wheel_files: List[str]) -> None:
    assert wheel.name == f"pipelines_port-{pp.__version__}-py3-none-any.whl"
    names = set(wheel_files)
    for needed in ["pipelines_port.py", "pipelines_port_kit/__init__.py", "pipelines_port_kit/__main__.py",
                   "pipelines_port_kit/cli.py", "pipelines_port_kit/project/init.py",
                   "pipelines_port_kit/project/doctor.py", "pipelines_port_kit/checker/check.py",
                   "pipelines_port_kit/checker/rules.json", "pipelines_port_kit/py.typed",
                   "pipelines_port_kit/templates/minimal.py", "pipelines_port_kit/templates/tools_schema.json",
                   "pipelines_port_kit/simulator/samples/orders.csv",
                   "pipelines_port_kit/simulator/samples/orders_fixtures.json",
                   "pipelines_port_kit/simulator/prompts/judge.md", "pipelines_port-stubs/py.typed"]:
        assert needed in names, needed
    kit_sources = {"pipelines_port_kit/" + p.relative_to(ROOT / "conformance").as_posix()
                   for p in (ROOT / "conformance").rglob("*.py") if "ports" not in p.parts}
    assert kit_sources - names == set()  # every sub-package of the kit is in the wheel
    templates = {Path(n).name for n in names if n.startswith("pipelines_port_kit/templates/")}
    assert templates == {p.name for p in (ROOT / "templates").iterdir() if p.suffix in (".py", ".json")}
    vectors = {Path(n).name for n in names if n.startswith("pipelines_port_kit/checker/vectors/") and n.endswith(".json")}
    assert vectors == {p.name for p in (ROOT / "conformance" / "checker" / "vectors").glob("*.json")} and len(vectors) >= 8
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"pipelines_port.py", "pipelines_port_kit", "pipelines_port-stubs",
                    f"pipelines_port-{pp.__version__}.dist-info"}  # no conformance/, tests/, bench/, templates/
    assert not [n for n in names if "/ports/" in n or n.endswith((".pyc", ".js", ".ts", ".go"))]


def test_wheel_metadata_entry_point_and_markers(wheel: Path, wheel_files: List[str]) -> None:
    dist_info = f"pipelines_port-{pp.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        entry_points = configparser.ConfigParser()
        entry_points.read_string(z.read(f"{dist_info}/entry_points.txt").decode())
        metadata = z.read(f"{dist_info}/METADATA").decode()
        stub_marker = z.read("pipelines_port-stubs/py.typed").decode()
        module = z.read("pipelines_port.py")
    assert dict(entry_points["console_scripts"]) == {"pipelines-port": "pipelines_port_kit.cli:main"}
    assert "Name: pipelines-port" in metadata and f"Version: {pp.__version__}" in metadata
    assert "Requires-Python: >=3.9" in metadata and "Requires-Dist" not in metadata
    assert "License-Expression: MIT" in metadata and f"{dist_info}/licenses/LICENSE" in wheel_files
    assert stub_marker == "partial\n"  # PEP 561: type checkers read the module's inline annotations
    assert module == (ROOT / "pipelines_port.py").read_bytes()


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Dict[str, str]]:
    """The wheel unpacked (a pure-Python wheel's install), and an environment that sees only it."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    return site, env


def test_the_installed_kit_runs_outside_the_checkout(installed: Tuple[Path, Dict[str, str]],
                                                      tmp_path: Path) -> None:
    site, env = installed
    kit = [sys.executable, "-m", "pipelines_port_kit"]
    out = run(kit + ["--version"], cwd=tmp_path, env=env)
    assert (out.returncode, out.stdout) == (0, f"pipelines-port {pp.__version__}\n"), out.stderr
    out = run(kit + ["init", "--list"], cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.split()[0] == "anthropic_messages", out.stderr
    out = run(kit + ["init", "proj", "--template", "minimal"], cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "proj" / "agent.py").read_text() == (ROOT / "templates" / "minimal.py").read_text()
    assert (tmp_path / "proj" / "pipelines_port.py").read_bytes() == (site / "pipelines_port.py").read_bytes()
    readme = (tmp_path / "proj" / "README.md").read_text()
    assert "pipelines-port doctor --app agent.py:agent" in readme and "python3 -m pipelines_port serve" in readme
    assert "pipelines-port doctor" in out.stdout and "conformance" not in out.stdout + readme
    out = run(kit + ["demo"], cwd=tmp_path, env=env)  # the bundled sample against the bundled template
    assert out.returncode == 0 and "7 runs: 7 ran without error, 0 errors" in out.stdout, out.stdout + out.stderr
    assert "scripted stand-in" in out.stderr and "refund_order" in out.stdout  # a whole agent loop, offline
    out = run(kit + ["check", "--help"], cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.startswith("usage: pipelines-port check"), out.stderr
    out = run([sys.executable, "-c", "import conformance"], cwd=tmp_path, env=env)
    assert out.returncode == 1 and "No module named 'conformance'" in out.stderr


# -- the command from a checkout -------------------------------------------------------------------------


def checkout(args: List[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run([sys.executable, "-m", "conformance"] + args, cwd=cwd, env=env)


def test_version_and_help_list_every_command_with_one_line() -> None:
    out = checkout(["--version"])
    assert (out.returncode, out.stdout) == (0, f"pipelines-port {pp.__version__}\n")
    out = checkout(["--help"])
    assert out.returncode == 0
    table = out.stdout.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in table] == COMMANDS
    assert all(len(line.split(None, 1)) == 2 for line in table)  # a name and its one line


def test_init_list_and_init_from_a_checkout(tmp_path: Path) -> None:
    out = checkout(["init", "--list"])
    assert out.returncode == 0 and "minimal" in out.stdout
    out = checkout(["init", str(tmp_path / "proj")], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["README.md", "agent.py", "fixtures.json",
        "pipelines_port.py", "tasks.csv", "tools_schema.json"]
    readme = (tmp_path / "proj" / "README.md").read_text()
    assert "python3 -m conformance doctor --app agent.py:agent" in readme and "pipelines_port.py init" not in readme


@pytest.mark.parametrize("args,needle", [
    ([], "give a COMMAND"),
    (["nope"], "unknown command 'nope'"),
    (["--nope"], "unknown option '--nope'"),
])
def test_usage_errors_are_one_line_exit_2(args: List[str], needle: str) -> None:
    out = checkout(args)
    assert out.returncode == 2 and needle in out.stderr and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_serve_and_mcp_are_the_modules_own_commands() -> None:
    out = checkout(["serve", "--help"])
    assert out.returncode == 0 and out.stdout.startswith("usage: python3 -m conformance serve")
    out = checkout(["serve"])  # the agent is missing: argparse's usage error, exit 2, no traceback
    assert out.returncode == 2 and "Traceback" not in out.stderr
    out = checkout(["mcp", "--help"])
    assert out.returncode == 0 and "MCP" in out.stdout
