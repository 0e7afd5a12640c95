"""The TypeScript port as its users get it: the npm package packed from a copy of the port, installed from the
tarball into a locked project of ``tests/data``, the port's conformance agent beside it, and the README's recipes
written into the project word for word (``<!-- recipe: FILE -->`` before each code block names the file)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
from typing import Dict, List, NamedTuple

from tests.registries import need, run

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORT_DIR = ROOT / "conformance" / "ports" / "typescript"
DATA = ROOT / "tests" / "data"
NODE = shutil.which("node")
NPM = shutil.which("npm")


class Tarball(NamedTuple):
    path: pathlib.Path
    files: List[str]  # the paths npm pack put in it


def pack(work: pathlib.Path) -> Tarball:
    """``npm pack`` in a copy of the port without dist/: the tarball holds what prepack builds from src/."""
    port = work / "port"
    shutil.copytree(PORT_DIR, port, ignore=shutil.ignore_patterns("node_modules", "dist"))
    os.symlink(PORT_DIR / "node_modules", port / "node_modules")
    done = subprocess.run([str(NPM), "pack", "--json", "--pack-destination", str(work), "--loglevel=error"], cwd=port,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("["):])[0]
    return Tarball(work / report["filename"], sorted(f["path"] for f in report["files"]))


def install(project: str, work: pathlib.Path, tarball: Tarball) -> pathlib.Path:
    """A copy of ``tests/data/PROJECT`` with its locked packages from the registry and the tarball beside them."""
    app = work / project
    shutil.copytree(DATA / project, app)
    cmd = [str(NPM), "install", "--no-save", str(tarball.path), "--prefer-offline", "--no-audit", "--no-fund",
           "--loglevel=error"]
    need(run, cmd, app, f"npm install of the package beside the locked {project}")
    return app


def recipes() -> Dict[str, str]:
    """The README's recipes: file name -> code, as printed."""
    text = (PORT_DIR / "README.md").read_text()
    found = dict(re.findall(r"<!-- recipe: (\S+) -->\n```\w+\n(.*?)```", text, re.S))
    assert found, "no recipes in the port's README"
    return found


def write(app: pathlib.Path, *files: str, agent_import: str = "./conformance_agent.js", agent_in: str = "") -> None:
    """The named recipes into ``app``, and the port's conformance agent as ``agent``: ``agent.ts`` beside each
    recipe (in ``agent_in`` instead when given), importing the installed package."""
    source = (PORT_DIR / "src" / "conformance_agent.ts").read_text()
    assert source.count('from "./pipelines_port.js"') == 2
    book = recipes()
    for name in files:
        path = app / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(book[name])
        beside = app / agent_in if agent_in else path.parent
        (beside / "conformance_agent.ts").write_text(source.replace('from "./pipelines_port.js"', 'from "pipelines-port"'))
        (beside / "agent.ts").write_text(f'export {{ conformanceAgent as agent }} from "{agent_import}";\n')
