"""Standing rules of the repository: stdlib-only runtime, a quiet import, a documented public API."""

from __future__ import annotations

import ast
import inspect
import json
import pathlib
import re
import subprocess
import sys
from typing import List, Tuple

import pytest

import pipelines_port as pp

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNTIME = [ROOT / "pipelines_port.py", *sorted((ROOT / "conformance").rglob("*.py")),
           *sorted((ROOT / "templates").glob("*.py"))]


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is new in Python 3.10")
def test_runtime_code_imports_the_standard_library_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"__future__", "pipelines_port", "conformance"}
    bad = []
    for path in RUNTIME:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] not in allowed]
    assert bad == []


def test_import_does_no_io_and_starts_nothing() -> None:
    """Nor loads what only some paths need: asyncio, ssl, http, logging (4 ms of a sandbox's start)."""
    code = r"""
import sys, threading, json
events = []
def hook(event, args):
    if event in ("open", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen", "os.system"):
        target = str(args[0]) if args else ""
        if not (event == "open" and target.endswith((".py", ".pyc"))):
            events.append([event, target])
sys.addaudithook(hook)
before, loaded = threading.active_count(), set(sys.modules)
import pipelines_port
heavy = [m for m in ("asyncio", "ssl", "http.client", "http.server", "email.utils", "logging", "base64")
         if m in sys.modules and m not in loaded]
print(json.dumps({"events": events, "threads": threading.active_count() - before, "heavy": heavy}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report == {"events": [], "threads": 0, "heavy": []}


def test_public_api_is_exported_documented_and_typed() -> None:
    for name in pp.__all__:
        obj = getattr(pp, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__, f"{name} has no docstring"
        if inspect.isfunction(obj):
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, f"{name} has no return type"
            for p in sig.parameters.values():
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name}) has no type"


def test_vectors_are_valid_json_with_names_and_expectations() -> None:
    files = sorted((ROOT / "conformance" / "checker" / "vectors").glob("*.json"))
    assert len(files) >= 8
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert doc["contract"] and doc["description"] and doc["cases"], path.name
        names = [c["name"] for c in doc["cases"]]
        assert len(names) == len(set(names)), f"{path.name}: duplicate case names"
        assert all("expect" in c or "valid" in c for c in doc["cases"]), path.name


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = "python3 -m pip install -q pytest && python3 -m pytest -q"
    quickstart = readme.split("## Quickstart", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    first, second = [line.split("#")[0].strip() for line in quickstart.strip().splitlines()[:2]]
    assert first == "python3 -m conformance demo"
    assert second == command
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_the_module_imports_nothing_of_the_kit() -> None:
    """The one file a user copies into a sandbox stands alone: no import of the kit, even lazily."""
    tree = ast.parse((ROOT / "pipelines_port.py").read_text(encoding="utf-8"))
    kit = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        kit += [n for n in names if n.split(".")[0] in ("conformance", "pipelines_port_kit", "tests", "bench")]
    assert kit == []


def test_the_contract_part_keeps_its_rules() -> None:
    """Part 1 (the contract) comes first and does no I/O: no sockets, threads, logging, files or sleeping."""
    lines = (ROOT / "pipelines_port.py").read_text(encoding="utf-8").splitlines()
    starts = [next(i for i, line in enumerate(lines) if line.startswith(f"#   PART {n} - ")) for n in (1, 2, 3)]
    assert starts == sorted(starts)
    contract = ast.parse("\n".join(lines[starts[0]:starts[1]]))
    used = set()
    for node in ast.walk(contract):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(ast.unparse(node))
    forbidden = {"socket", "threading", "_log", "logging", "time.sleep", "open", "subprocess", "http", "select",
                 "urlopen", "print"}
    assert not used & forbidden, f"part 1 uses {sorted(used & forbidden)}"
    # The one environment read: a caller that omits an environ mapping gets os.environ (the §5 constructors).
    assert sum(1 for name in used if name == "os.environ") <= 1
    defined = {n.name for n in contract.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name in ("decide", "request_body_length", "interpret_reply", "retry_decision", "response_envelope",
                 "validate_response", "error_reply", "Envelope", "check_credential", "is_ping", "RetryPolicy"):
        assert name in defined, name


def test_the_module_fits_where_it_is_copied() -> None:
    """The module goes up to the platform as it is, and the platform takes at most 200,000 bytes per file (the
    limit ``register`` checks, as the platform SDK's validator does): it fits, and part 1, the contract a porter
    reads alone, stays a short read."""
    from conformance.platform_api.register import MAX_FILE_BYTES

    data = (ROOT / "pipelines_port.py").read_bytes()
    assert MAX_FILE_BYTES == 200_000
    assert len(data) <= MAX_FILE_BYTES, f"pipelines_port.py is {len(data):,} bytes: over {MAX_FILE_BYTES:,} per file"
    lines = data.decode("utf-8").splitlines()
    part1, part2 = (next(i for i, line in enumerate(lines) if line.startswith(f"#   PART {n} - ")) for n in (1, 2))
    assert part2 - part1 <= 1500, f"part 1 is {part2 - part1} lines"


def _module_sections(lines: List[str]) -> List[Tuple[int, int, str]]:
    """``(line, level, title)`` of each part banner (``#   PART n - ...``, level 0) and each section's opening
    (a ``# ----`` rule, then its title line: level 1) in the module's lines."""
    rule = re.compile(r"# -{20,}")
    found = []
    for i, line in enumerate(lines):
        part = re.match(r"#   (PART \d - .+)$", line)
        if part:
            found.append((i + 1, 0, part.group(1).strip()))
        elif rule.fullmatch(line) and i + 1 < len(lines) and lines[i + 1].startswith("# ") \
                and not rule.fullmatch(lines[i + 1]):
            found.append((i + 2, 1, lines[i + 1][2:].strip()))
    return found


def _section_sizes(lines: List[str], sections: List[Tuple[int, int, str]]) -> List[float]:
    """Each section's size in kB (1,000 bytes, UTF-8): from its opening to the next part's or section's (a part's
    own size is its banner and what comes before its first section)."""
    starts = [n - (1 if level == 0 else 2) for n, level, _ in sections] + [len(lines)]
    return [sum(len(line.encode("utf-8")) + 1 for line in lines[a:b]) / 1000 for a, b in zip(starts, starts[1:])]


def test_the_opening_map_points_at_the_parts_and_sections_it_names() -> None:
    """The module docstring's map lists every part and section of the file, in order, at the line it starts on
    and with its size (to 0.1 kB: what the module spends its bytes on is a design decision, kept in view); each
    entry's title is its section's title (or the start of it)."""
    lines = (ROOT / "pipelines_port.py").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Map: "))
    while not lines[start].endswith("::"):
        start += 1
    entries = []
    for line in lines[start + 2:]:
        entry = re.fullmatch(r"    +(\d+) +(\d+\.\d)  ( *)(\S.*)", line)
        if entry is None:
            break
        entries.append((int(entry.group(1)), float(entry.group(2)), len(entry.group(3)) // 2, entry.group(4)))
    sections = _module_sections(lines)
    sizes = _section_sizes(lines, sections)
    expected = "\n".join(f"    {n:>5} {kb:5.1f}  {'  ' * level}{title}"
                         for (n, level, title), kb in zip(sections, sizes))
    assert len(sections) > 20
    assert [(n, level) for n, _, level, _ in entries] == [(n, level) for n, level, _ in sections], \
        f"the map's line numbers are out of date; the file's parts and sections are:\n{expected}"
    assert all(abs(kb - size) <= 0.15 for (_, kb, _, _), size in zip(entries, sizes)), \
        f"the map's sizes are out of date; the file's parts and sections are:\n{expected}"
    for (n, _, _, title), (_, _, full) in zip(entries, sections):
        assert full.startswith(title), f"line {n} opens {full!r}, not {title!r}"
    assert [title for _, _, level, title in entries if level == 0] == [
        "PART 1 - THE CONTRACT", "PART 2 - THE PYTHON RUNTIME", "PART 3 - CONVENIENCES"]


# The kit's sub-packages and the ones each may import (conformance/__init__.py draws the same graph).
KIT_ARROWS = {
    "cli": {"kit", "checker", "simulator", "models", "harness", "project", "platform_api"},
    "project": {"kit", "simulator"},
    "platform_api": {"kit", "simulator"},
    "checker": {"kit", "harness"},
    "simulator": {"kit", "harness", "models"},
    "harness": {"kit"},
    "models": {"kit"},
    "kit": set(),
}


def test_the_kit_imports_only_downward() -> None:
    """Each sub-package of the kit imports only those below it: no arrow runs back up, none sideways."""
    kit = ROOT / "conformance"
    wrong = []
    for path in sorted(kit.rglob("*.py")):
        parts = path.relative_to(kit).with_suffix("").parts
        if parts[0] == "ports" or parts[0] in ("__init__", "__main__"):
            continue
        own = parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative: resolve against the module's own package
                base = list(parts[: len(parts) - node.level])
            elif (node.module or "").split(".")[0] == "conformance":
                base = []
                node.module = (node.module or "").partition(".")[2] or None
            else:
                continue
            stem = [*base, *node.module.split(".")] if node.module else base
            # `from PKG import NAME` names a module when NAME.py is there, else something PKG defines
            found = [[*stem, a.name] if kit.joinpath(*stem, a.name + ".py").exists()
                     or kit.joinpath(*stem, a.name, "__init__.py").exists() else stem for a in node.names]
            missing = [".".join(f) for f in found if not (kit.joinpath(*f).with_suffix(".py").exists()
                                                          or (kit.joinpath(*f) / "__init__.py").exists())]
            package = kit.joinpath(*stem) / "__init__.py"
            if package.exists():  # a name taken from a package that is not its module is defined in __init__.py
                defined = package.read_text(encoding="utf-8")
                missing += [a.name for a, f in zip(node.names, found) if f == stem and a.name not in defined]
            assert missing == [], f"{path.relative_to(ROOT)}:{node.lineno} imports what the kit lacks: {missing}"
            targets = [f[0] for f in found]
            wrong += [f"{path.relative_to(ROOT)} -> {t}" for t in targets
                      if t != own and t not in KIT_ARROWS[own]]
    assert set(KIT_ARROWS) == {p.stem if p.is_file() else p.name for p in kit.iterdir()
                               if (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
                               or (p.is_dir() and (p / "__init__.py").exists())}
    assert wrong == []
