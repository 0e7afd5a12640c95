"""``pipelines-port init``: scaffold an agent project from a template.

From a checkout: ``python3 -m conformance init``.  Kit tooling: it needs the
templates shipped beside it (``templates/`` in a checkout, package data when
installed), so it lives in the kit, not in the module a user copies into a sandbox.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import pipelines_port as pp

from ..kit import KIT_ROOT, installed, prog
from ..simulator.dataset import SAMPLES_DIR


class UsageError(Exception):
    """A command-line problem: printed as one line, exit status 2."""


_TEMPLATES_DIR = "templates"
_INIT_README = """# {name}

Scaffolded by `{init}` from the `{template}` template.

- `agent.py` - your agent: edit it. `agent(envelope)` serves both ways below.
- `tools_schema.json` - the tools it may call (register the same list on the platform).
- `pipelines_port.py` - the runtime module (standard library only); keep it beside `agent.py`.
- `tasks.csv`, `fixtures.json` - a sample dataset and its tool fixtures: replace them with yours.
{keys}
Every command below runs from this folder.

1. Check the setup (`{doctor}` is the kit's `doctor`; {doctor_note}):

       export AGENT_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
       {doctor} --app agent.py:agent --tools-schema tools_schema.json --csv tasks.csv

2. Simulate the agent against the dataset, every row through a local proxy, and open the report:

       {simulate} --csv tasks.csv --code agent.py --responses fixtures.json --html report.html --jobs 4

3. Serve it as an HTTP dispatch endpoint (`-m` finds the `pipelines_port.py` here):

       python3 -m pipelines_port serve agent.py:agent --port 8080

   and, in a second terminal, a mock proxy that prints a `curl` dispatch to paste:

       {proxy} --csv tasks.csv --row 1 --responses fixtures.json

4. Or upload this folder in code mode: the sandbox calls `agent.run(task_input, proxy_url=..., run_token=...)`.
"""

_KEYS_NOTE = """- The agent calls a model API: set {keys} before a platform run (`doctor` checks it). Without it,
  `simulate` runs the agent against a scripted stand-in of the API (`--model real` to insist on the key).
"""


def _kit_command(command: str) -> str:
    """A kit command as the user can run it from the new project's folder."""
    if installed():
        return prog(command)
    checkout = os.path.dirname(KIT_ROOT)
    return f"PYTHONPATH={shlex.quote(checkout)} python3 -m conformance {command}"


def _doctor_command() -> str:
    return _kit_command("doctor")


def _doctor_note() -> str:
    if installed():
        return "`pipelines-port` is the kit's command: `pipx install` or `pip install` the kit"
    return "from the kit's checkout, which `PYTHONPATH` points to"


def _required_env(source: str) -> List[str]:
    """The names a template's ``REQUIRED_ENV = (...)`` lists, read without running it."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REQUIRED_ENV" for t in node.targets):
            with contextlib.suppress(ValueError):
                value = ast.literal_eval(node.value)
                if isinstance(value, (list, tuple)):
                    return [str(v) for v in value]
    return []


def template_dir() -> str:
    """The templates: package data when installed, else the checkout's ``templates/`` beside this package."""
    here = KIT_ROOT
    for candidate in (os.path.join(here, _TEMPLATES_DIR), os.path.join(os.path.dirname(here), _TEMPLATES_DIR)):
        if os.path.isdir(candidate):
            return candidate
    return os.path.join(here, _TEMPLATES_DIR)


def available_templates() -> Dict[str, str]:
    """``{name: one-line description}`` of the templates beside this file (empty when there are none)."""
    import ast

    found: Dict[str, str] = {}
    directory = template_dir()
    if not os.path.isdir(directory):
        return found
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".py") and not entry.startswith("_"):
            path = os.path.join(directory, entry)
            try:
                with open(path, encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read())) or ""
            except (OSError, SyntaxError, ValueError):
                doc = ""
            found[entry[:-3]] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def init_project(directory: str, template: str = "minimal", *, force: bool = False) -> List[str]:
    """Write ``agent.py`` (from ``template``), ``tools_schema.json``, ``README.md`` and this module into ``directory``.

    Nothing is overwritten unless ``force``; every target is checked before the
    first is written, and each file is written to a temporary name and renamed,
    so a refusal or failure leaves no half-written project.  Returns the paths written.
    """
    templates = available_templates()
    if not templates:
        raise ValueError(f"no templates found in {template_dir()}: init needs the kit's templates "
                         "(package data when installed, templates/ beside conformance/ in a checkout)")
    if template not in templates:
        raise ValueError(f"unknown template {template!r}: choose one of {', '.join(templates)}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory} exists and is not a directory")
    here = os.path.abspath(pp.__file__)
    with open(os.path.join(template_dir(), template + ".py"), encoding="utf-8") as f:
        agent_source = f.read()
    schema_path = os.path.join(template_dir(), "tools_schema.json")
    with open(schema_path, encoding="utf-8") as f:
        schema_source = f.read()
    with open(here, encoding="utf-8") as f:
        module_source = f.read()
    keys = _required_env(agent_source)
    readme = _INIT_README.format(name=os.path.basename(os.path.abspath(directory)), template=template,
                                 init=prog("init"), doctor=_doctor_command(), doctor_note=_doctor_note(),
                                 simulate=_kit_command("simulate"), proxy=_kit_command("proxy"),
                                 keys=_KEYS_NOTE.format(keys=" and ".join(f"`{k}`" for k in keys)) if keys else "")
    with open(os.path.join(SAMPLES_DIR, "orders.csv"), encoding="utf-8") as f:
        tasks_source = f.read()
    with open(os.path.join(SAMPLES_DIR, "orders_fixtures.json"), encoding="utf-8") as f:
        fixtures_source = f.read()
    files = {"agent.py": agent_source, "tools_schema.json": schema_source, "README.md": readme,
             "pipelines_port.py": module_source, "tasks.csv": tasks_source, "fixtures.json": fixtures_source}
    targets = {name: os.path.join(directory, name) for name in files}
    existing = [name for name, path in targets.items() if os.path.exists(path)]
    if existing and not force:
        raise ValueError(f"{', '.join(existing)} already exist(s) in {directory}: nothing written "
                         "(use --force to overwrite)")
    os.makedirs(directory, exist_ok=True)
    written = []
    for name, content in files.items():
        path = targets[name]
        if os.path.abspath(path) == here:
            continue  # initialising the kit's own folder: the module is already there
        # A fresh, exclusively created temporary file in the target folder (never a planted name or a
        # symlink), renamed over the target: a failure leaves no half-written file.
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(content)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        written.append(path)
    return written


def run(args: Any) -> int:
    if args.list:
        templates = available_templates()
        if not templates:
            raise UsageError(f"no templates found in {template_dir()}")
        width = max(map(len, templates))
        for name, doc in templates.items():
            print(f"{name:<{width}}  {doc}")
        return 0
    if not args.directory:
        raise UsageError("init needs a DIR (or --list to see the templates)")
    try:
        written = init_project(args.directory, args.template, force=args.force)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {shlex.quote(args.directory)} && export AGENT_TOKEN=...   (a long random secret: the platform "
          "sends it as Bearer)")
    keys = _required_env(open(os.path.join(args.directory, "agent.py"), encoding="utf-8").read())
    if keys:
        print(f"      export {'=... '.join(keys)}=...   (the model API's key; without it simulate uses a scripted "
              "model)")
    print(f"      {_doctor_command()} --app agent.py:agent --tools-schema tools_schema.json --csv tasks.csv")
    print(f"      {_kit_command('simulate')} --csv tasks.csv --code agent.py --responses fixtures.json "
          "--html report.html")
    print("      python3 -m pipelines_port serve agent.py:agent --port 8080")
    print("      README.md in the project says more")
    return 0




def add_parser(commands: Any) -> None:
    """The ``init`` sub-command on an ``argparse`` sub-parsers object."""
    init_ = commands.add_parser(
        "init", help="scaffold an agent project from a template",
        description="Write agent.py (from a template), tools_schema.json, README.md, pipelines_port.py and a sample "
                    "dataset (tasks.csv, fixtures.json) into DIR.",
    )
    init_.add_argument("directory", metavar="DIR", nargs="?", help="the project folder (created if missing)")
    init_.add_argument("--template", default="minimal", metavar="NAME", help="template to start from (default minimal)")
    init_.add_argument("--force", action="store_true", help="overwrite files that already exist")
    init_.add_argument("--list", action="store_true", help="list the templates and exit")
    init_.set_defaults(run=run)



def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog())
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["init", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except UsageError as exc:
        print(f"{prog('init')}: {exc}", file=sys.stderr)
        return 2
