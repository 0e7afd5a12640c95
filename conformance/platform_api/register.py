"""``pipelines-port register``: create or update an agent on the platform from the project folder.

HTTP agents (``--endpoint URL``): the endpoint, the auth header the platform sends (``--auth-header``,
default ``Authorization``) and its credential, read from ``--credential-env`` (default ``AGENT_TOKEN``)
and sent write-only (``Bearer <token>`` under ``Authorization``, the bare token under a custom header,
as ``pipelines_port``'s server checks it).  Code agents (``--code DIR --entrypoint FILE.py:run``): the
folder's Python files, ``pipelines_port.py`` included, uploaded for the sandbox.

Both: the tools (``--tools FILE.json``, else ``tools_schema.json`` in the folder), each ``sandbox`` unless
``--passthrough TOOL`` names it (given at all, the flags are the whole choice), the concurrency cap, the
run timeout and an optional ledger schema.  An agent of the same name is updated, not duplicated:
``PUT /api/agents/{id}`` with what changes; otherwise ``POST /api/agents``.  ``--dry-run`` prints the
body and sends nothing.  Stdout: the agent's id (the body with ``--dry-run``); the rest goes to stderr.

The request bodies are the SDK's (``pipelines-sdk`` 0.1.15, ``build_http_agent_payload`` /
``build_code_agent_payload`` / ``update_*_agent``): ``tests/interop/test_platform_oracle.py`` holds them equal.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import ipaddress
import json
import os
import re
import sys
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import pipelines_port as pp

from ..kit import prog
from . import client as api

__all__ = ["Upload", "walk_upload", "load_tools", "http_config", "build_body", "update_body",
           "masked", "main"]

# The platform's limits on a code agent's files (the SDK mirrors them from the platform's validator, 0.1.15).
MAX_FILE_BYTES = 200_000
MAX_TOTAL_BYTES = 1_000_000
MAX_FILES = 50
PATH_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_\-]*/)*[A-Za-z0-9_][A-Za-z0-9_\-]*\.py")
HEADER_RE = re.compile(r"[A-Za-z0-9-]+")
DEFAULT_CONCURRENCY = 5  # the SDK's defaults on create
DEFAULT_RUN_TIMEOUT_S = 300
MASK = "********"
MODULE = "pipelines_port.py"
TOOLING_DIRS = {"__pycache__", "node_modules", "build", "dist", "site-packages"}
VENV_DIRS = {"venv", "env"}


class SetupError(api.SetupError):
    """Flags or files that cannot make a registration: exit status 2."""


# ---------------------------------------------------------------------------
# Code agents: the upload
# ---------------------------------------------------------------------------


class Upload(NamedTuple):
    """What a code agent ships: ``files`` (POSIX path -> source), what was ``skipped`` (path -> why) and notes."""

    files: Dict[str, str]
    skipped: Dict[str, str]
    notes: List[str]


def _ignore_globs(root: str) -> List[str]:
    """The globs of ``.pipelinesignore`` at the folder's root (one a line, ``#`` comments), as the SDK reads it."""
    path = os.path.join(root, ".pipelinesignore")
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    except (OSError, UnicodeDecodeError) as exc:
        raise SetupError(f"cannot read {path}: {exc}") from None


def _ignored(path: str, globs: Sequence[str]) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(path, g) or fnmatch.fnmatch(name, g) for g in globs)


def _skip_dir(full: str, name: str) -> Optional[str]:
    if name.startswith("."):
        return "hidden"
    if os.path.isfile(os.path.join(full, "pyvenv.cfg")) or name in VENV_DIRS:
        return "a virtualenv"
    if name in TOOLING_DIRS or name.endswith(".egg-info"):
        return "tooling"
    return None


def _skip_file(name: str) -> Optional[str]:
    if name == ".env" or name.startswith(".env.") or name.endswith((".pem", ".key", ".p12")):
        return "a secret: it stays local"
    if name.startswith("."):
        return "hidden"
    if name.endswith((".pyc", ".pyo")):
        return "tooling"
    if not name.endswith(".py"):
        return "not Python: code agents upload .py files only"
    return None


def walk_upload(root: str, *, module_source: Optional[str] = None,
                secrets: Optional[Mapping[str, str]] = None) -> Upload:
    """The files of a code agent in ``root``: its ``.py`` files, nothing hidden, secret, tooling or venv.

    ``pipelines_port.py`` is the folder's own copy, else ``module_source`` (the kit's), uploaded as it is, like
    every file (within the platform's per-file limit).  ``secrets`` (variable -> value): a file that
    holds one of the values is refused, naming the file and the variable.  Raises :class:`SetupError`.
    """
    root = os.path.abspath(root)
    real_root = os.path.realpath(root)
    globs = _ignore_globs(root)
    files: Dict[str, str] = {}
    skipped: Dict[str, str] = {}
    for here, dirs, names in os.walk(root):
        rel_here = os.path.relpath(here, root).replace(os.sep, "/")
        rel_here = "" if rel_here == "." else rel_here + "/"
        kept = []
        for name in sorted(dirs):
            why = _skip_dir(os.path.join(here, name), name)
            if why:
                skipped[rel_here + name + "/"] = why
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            rel = rel_here + name
            full = os.path.join(here, name)
            why = _skip_file(name)
            if why is None and _ignored(rel, globs):
                why = ".pipelinesignore"
            if why is None and os.path.commonpath([real_root, os.path.realpath(full)]) != real_root:
                why = "a link out of the folder"
            if why:
                skipped[rel] = why
                continue
            if not PATH_RE.fullmatch(rel):
                raise SetupError(f"{rel}: the platform takes file paths of letters, digits, _ and - only "
                                 "(a package path with a .py name): rename it, or list it in .pipelinesignore")
            try:
                with open(full, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError:
                raise SetupError(f"{rel} is not UTF-8: the platform takes Python source as UTF-8 text") from None
            except OSError as exc:
                raise SetupError(f"cannot read {rel}: {exc.strerror or exc}") from None
            if not text and name != "__init__.py":
                raise SetupError(f"{rel} is empty: the platform refuses empty files other than __init__.py "
                                 "(delete it, or list it in .pipelinesignore)")
            files[rel] = text
    notes: List[str] = []
    source = files.pop(MODULE, None)
    if source is None:
        if module_source is None:
            raise SetupError(f"{MODULE} is not in {root}: copy it there (code agents import it in the sandbox)")
        source = module_source
        notes.append(f"{MODULE}: the kit's copy (version {pp.__version__}); the folder has none")
    files[MODULE] = source
    lowered: Dict[str, str] = {}
    for path in files:
        if path.lower() in lowered:
            raise SetupError(f"{lowered[path.lower()]} and {path} differ only in case: the platform refuses that "
                             "(a case-insensitive file system would merge them)")
        lowered[path.lower()] = path
    _check_limits(files)
    for variable, value in (secrets or {}).items():
        if len(value) >= 8:
            for path, text in files.items():
                if value in text:
                    raise SetupError(f"{path} contains the value of ${variable}: a secret is never uploaded; read it "
                                     "from the environment instead")
    return Upload(dict(sorted(files.items())), skipped, notes)


def _check_limits(files: Mapping[str, str]) -> None:
    if len(files) > MAX_FILES:
        raise SetupError(f"{len(files)} Python files: the platform takes at most {MAX_FILES} (list the rest in "
                         ".pipelinesignore)")
    total = 0
    for path, text in files.items():
        size = len(text.encode("utf-8"))
        if size > MAX_FILE_BYTES:
            raise SetupError(f"{path} is {size:,} bytes: the platform takes at most {MAX_FILE_BYTES:,} per file")
        total += size
    if total > MAX_TOTAL_BYTES:
        raise SetupError(f"the upload is {total:,} bytes: the platform takes at most {MAX_TOTAL_BYTES:,} in all")


def parse_entrypoint(text: str) -> Tuple[str, str]:
    """``FILE.py:NAME`` as ``(file, name)``; raises :class:`SetupError`."""
    where, _, name = text.rpartition(":")
    where = where.strip().replace("\\", "/")
    while where.startswith("./"):
        where = where[2:]
    if not where.endswith(".py") or not name.isidentifier():
        raise SetupError(f"--entrypoint {text!r}: expected FILE.py:NAME, the file in --code DIR and the function "
                         "the sandbox calls (e.g. agent.py:run, where run = pp.code_mode(agent))")
    return where, name


def _defines(source: str, name: str) -> bool:
    """True when ``source`` visibly binds ``name`` at top level (a def, class, assignment or import)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


# ---------------------------------------------------------------------------
# Tools, the ledger schema, the HTTP config
# ---------------------------------------------------------------------------


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise SetupError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SetupError(f"{what} {path} is not valid JSON: {exc}") from None


def load_tools(path: Optional[str], passthrough: Sequence[str]) -> List[Dict[str, Any]]:
    """The tools as the platform takes them, each with its ``default_execution_mode`` (see the module docstring).

    An entry already in the platform's shape is sent as written; OpenAI / Chat Completions shapes are
    converted (``pipelines_port.load_tools_schema``).  A passthrough tool without a ``passthrough_binding``
    (where the platform forwards its calls) is sent as asked, with a warning.
    """
    if path is None:
        if passthrough:
            raise SetupError("--passthrough names a tool, but there is no tools file (--tools FILE.json, or "
                             "tools_schema.json in the project folder)")
        return []
    try:
        converted = pp.load_tools_schema(path)
    except ValueError as exc:
        raise SetupError(str(exc)) from None
    raw = _read_json(path, "the tools schema")  # the entries as written (load_tools_schema checked them)
    if isinstance(raw, dict):
        raw = raw.get("tools_schema", raw.get("tools", raw))
    tools: List[Dict[str, Any]] = []
    for entry, platform in zip(raw, converted):
        as_written = isinstance(entry, dict) and "input_schema" in entry and "function" not in entry
        tools.append(dict(entry) if as_written else platform)
    names = [t["name"] for t in tools]
    unknown = [name for name in passthrough if name not in names]
    if unknown:
        raise SetupError(f"--passthrough {unknown[0]}: no such tool in {path} (tools: {', '.join(names) or 'none'})")
    for tool in tools:
        if passthrough:
            tool["default_execution_mode"] = "passthrough" if tool["name"] in passthrough else "sandbox"
        mode = tool.setdefault("default_execution_mode", "sandbox")
        if mode not in ("sandbox", "passthrough"):
            raise SetupError(f"{path}: tool {tool['name']}: default_execution_mode must be sandbox or passthrough, "
                             f"got {mode!r}")
        binding = tool.get("passthrough_binding")
        if mode == "passthrough" and not (isinstance(binding, dict) and binding.get("tool_name")
                                          and (binding.get("endpoint_id") or binding.get("endpoint_name"))):
            _say(f"warning: tool {tool['name']} is passthrough, but its entry in {path} has no passthrough_binding: "
                 'the platform forwards its calls to the endpoint it names; add "passthrough_binding": '
                 '{"endpoint_name": "<a tool endpoint registered on the platform>", "tool_name": "<its tool>"} '
                 '(or "endpoint_id"), or bind it on the platform')
    return tools


def _credential(header: str, environ: Mapping[str, str], variable: str) -> Optional[str]:
    """The credential value the platform sends under ``header``: ``Bearer <token>`` for Authorization."""
    token = (environ.get(variable) or "").strip()
    if not token:
        return None
    if re.search(r"[\x00-\x1f\x7f]", token):
        raise SetupError(f"${variable} holds a line break or control character (not shown): set it again")
    if header.lower() == "authorization" and not token.lower().startswith("bearer "):
        return f"Bearer {token}"
    return token


def http_config(endpoint: str, header: str, credential: Optional[str], timeout_s: Optional[int]) -> Dict[str, Any]:
    """The ``external_http`` config: ``endpoint_url``, ``auth_header_name``, the credential, ``timeout_s``."""
    endpoint = endpoint.strip()
    try:
        parts = urlsplit(endpoint)
        ok = parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise SetupError(f"--endpoint {endpoint!r}: expected the agent's http(s):// dispatch URL")
    if not HEADER_RE.fullmatch(header):
        raise SetupError(f"--auth-header {header!r}: a header name is letters, digits and hyphens")
    config: Dict[str, Any] = {"endpoint_url": endpoint, "auth_header_name": header}
    if credential is not None:
        config["auth_credential_value"] = credential
    if timeout_s is not None:
        config["timeout_s"] = timeout_s
    return config


def _unreachable(endpoint: str) -> Optional[str]:
    """Why the platform cannot call ``endpoint`` (a loopback or private host), or ``None``."""
    host = (urlsplit(endpoint).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return f"{host} is this machine"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_loopback or address.is_private or address.is_link_local or address.is_unspecified:
        return f"{host} is a loopback or private address"
    return None


def build_body(name: str, mode: str, config: Mapping[str, Any], tools: Sequence[Mapping[str, Any]],
               concurrency: Optional[int], run_timeout: Optional[int], ledger: Any) -> Dict[str, Any]:
    """The ``POST /api/agents`` body (the SDK's shape: mode ``external_http`` or ``sandbox``)."""
    body: Dict[str, Any] = {
        "name": name, "mode": mode, "config": dict(config), "tools_schema": [dict(t) for t in tools],
        "concurrency_cap": DEFAULT_CONCURRENCY if concurrency is None else concurrency,
        "run_timeout_s": DEFAULT_RUN_TIMEOUT_S if run_timeout is None else run_timeout,
    }
    if ledger is not None:
        body["ledger_schema"] = ledger
    return body


def update_body(body: Mapping[str, Any], *, tools_given: bool, concurrency_given: bool,
                run_timeout_given: bool) -> Dict[str, Any]:
    """The ``PUT /api/agents/{id}`` body: what the flags and files set, nothing else (omitted is unchanged)."""
    keep = {"config": True, "tools_schema": tools_given, "concurrency_cap": concurrency_given,
            "run_timeout_s": run_timeout_given, "ledger_schema": True}
    return {key: value for key, value in body.items() if keep.get(key)}


def masked(body: Mapping[str, Any]) -> Dict[str, Any]:
    """``body`` with the credential value masked (the ``Bearer`` scheme shown), for printing."""
    out = dict(body)
    config = dict(out.get("config") or {})
    value = config.get("auth_credential_value")
    if isinstance(value, str):
        config["auth_credential_value"] = "Bearer " + MASK if value.lower().startswith("bearer ") else MASK
    out["config"] = config
    return out


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _int_in(low: int, high: int, flag: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be from {low} to {high}, got {value}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog("register"),
        description="Create or update an agent on the platform (an HTTP endpoint, or code for the sandbox). "
                    f"The API key is read from {api.ENV_API_KEY}.",
        epilog="Stdout: the agent's id (with --dry-run, the request body). "
               "Exit status: 0 registered, 1 the platform could not be reached or failed, "
               "2 bad flags or files, or the platform refused them (key, permissions, name, fields).")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", metavar="URL", help="an HTTP agent: its public dispatch URL")
    where.add_argument("--code", metavar="DIR", help="a code agent: the folder to upload (its .py files)")
    parser.add_argument("--name", required=True, help="the agent's name on the platform (an agent of this name is "
                                                      "updated)")
    parser.add_argument("--entrypoint", metavar="FILE.py:run", help="with --code: the file and the function the "
                                                                    "sandbox calls")
    parser.add_argument("--tools", metavar="FILE.json", help="the tools (default: tools_schema.json in the folder)")
    parser.add_argument("--auth-header", metavar="NAME", help="HTTP: the header the platform sends the credential in "
                                                              "(default: Authorization, as Bearer TOKEN)")
    parser.add_argument("--credential-env", metavar="VAR", help="HTTP: the variable holding the agent's token "
                                                                "(default: AGENT_TOKEN); sent write-only")
    parser.add_argument("--passthrough", metavar="TOOL", action="append", default=[],
                        help="a tool the platform forwards to its live endpoint (repeat; the others are sandbox)")
    parser.add_argument("--timeout", metavar="S", type=_int_in(1, 1800, "--timeout"),
                        help="HTTP: seconds the platform waits for one dispatch (1-1800)")
    parser.add_argument("--concurrency", metavar="N", type=_int_in(1, 100, "--concurrency"),
                        help=f"runs at once (1-100; default {DEFAULT_CONCURRENCY} when created)")
    parser.add_argument("--run-timeout", metavar="S", type=_int_in(1, 1800, "--run-timeout"),
                        help=f"seconds one run may take (1-1800; default {DEFAULT_RUN_TIMEOUT_S} when created)")
    parser.add_argument("--ledger-schema", metavar="FILE.json", help="the ledger's declared entities (JSON object)")
    parser.add_argument("--dry-run", action="store_true", help="print the request body (credential masked), send "
                                                               "nothing")
    parser.add_argument("--api-url", metavar="URL", help=f"the platform's API (default: ${api.ENV_API_URL}, else "
                                                         f"{api.DEFAULT_API_URL})")
    return parser


def _say(text: str) -> None:
    print(f"register: {text}", file=sys.stderr)


def _listing(paths: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _prepare(args: argparse.Namespace, environ: Mapping[str, str]) -> Tuple[Dict[str, Any], Dict[str, bool]]:
    """The create body and what the flags set, with the upload and the choices told on stderr."""
    folder = args.code if args.code else os.getcwd()
    if args.code:
        for flag, value in (("--auth-header", args.auth_header), ("--credential-env", args.credential_env),
                            ("--timeout", args.timeout)):
            if value is not None:
                raise SetupError(f"{flag} is for HTTP agents (--endpoint); a code agent runs in the sandbox")
        if not args.entrypoint:
            raise SetupError("--code needs --entrypoint FILE.py:NAME (e.g. agent.py:run)")
        if not os.path.isdir(args.code):
            raise SetupError(f"--code {args.code}: not a folder")
    elif args.entrypoint:
        raise SetupError("--entrypoint is for code agents (--code DIR)")
    tools_path = args.tools
    if tools_path is None and os.path.isfile(os.path.join(folder, "tools_schema.json")):
        tools_path = os.path.join(folder, "tools_schema.json")
    tools = load_tools(tools_path, args.passthrough)
    ledger = None
    if args.ledger_schema:
        ledger = _read_json(args.ledger_schema, "the ledger schema")
        if not isinstance(ledger, dict):
            raise SetupError(f"the ledger schema {args.ledger_schema} must be a JSON object")
    if args.code:
        entry_file, entry_name = parse_entrypoint(args.entrypoint)
        with open(pp.__file__, encoding="utf-8") as f:
            kit_copy = f.read()
        hidden = {v: environ[v] for v in (api.ENV_API_KEY, "AGENT_TOKEN") if environ.get(v)}
        upload = walk_upload(args.code, module_source=kit_copy, secrets=hidden)
        if entry_file not in upload.files:
            raise SetupError(f"--entrypoint {args.entrypoint}: {entry_file} is not among the files uploaded from "
                             f"{args.code} ({_listing(list(upload.files))})")
        if not _defines(upload.files[entry_file], entry_name):
            _say(f"warning: {entry_file} binds no top-level {entry_name!r} that can be seen without running it; "
                 "the sandbox calls it")
        config: Dict[str, Any] = {"source_files": upload.files, "entrypoint_file": entry_file,
                                  "entrypoint": entry_name}
        mode = "sandbox"
        size = sum(len(t.encode("utf-8")) for t in upload.files.values())
        _say(f"upload: {len(upload.files)} files, {size:,} bytes: {_listing(list(upload.files))}")
        for note in upload.notes:
            _say(note)
        by_reason: Dict[str, List[str]] = {}
        for path, why in upload.skipped.items():
            by_reason.setdefault(why, []).append(path)
        for why, paths in by_reason.items():
            _say(f"skipped ({why}): {_listing(paths)}")
    else:
        header = args.auth_header or "Authorization"
        variable = args.credential_env or "AGENT_TOKEN"
        credential = _credential(header, environ, variable)
        config = http_config(args.endpoint, header, credential, args.timeout)
        mode = "external_http"
        why_not = _unreachable(config["endpoint_url"])
        if why_not:
            _say(f"warning: the platform calls the endpoint from outside: {why_not} (serve it behind a public URL or "
                 "a tunnel; the platform refuses loopback and private hosts)")
        if credential is None:
            _say(f"${variable} is not set: no credential is sent (an agent being updated keeps the one it has; "
                 f"a new one would have none, so register with ${variable} set)")
    modes = ", ".join(f"{t['name']} ({t['default_execution_mode']})" for t in tools)
    _say(f"tools: {modes or 'none'}" + (f" from {tools_path}" if tools_path else " (no tools file)"))
    body = build_body(args.name, mode, config, tools, args.concurrency, args.run_timeout, ledger)
    given = {"tools_given": tools_path is not None, "concurrency_given": args.concurrency is not None,
             "run_timeout_given": args.run_timeout is not None}
    return body, given


def _register(client: api.Client, body: Dict[str, Any], given: Mapping[str, bool]) -> Tuple[Dict[str, Any], str]:
    """Update the one agent of this name, else create it; ``(agent, "created" | "updated")``."""
    name = body["name"]

    def update(found: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
        if found.get("mode") not in (None, body["mode"]):
            raise SetupError(f"agent {name!r} (#{found.get('id')}) is a {found.get('mode')} agent, and this registers "
                             f"a {body['mode']} one: the platform does not change an agent's mode; choose another "
                             "--name")
        changes = update_body(body, **given)
        return client.update_agent(found.get("id"), changes), "updated"

    def one(matches: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if len(matches) > 1:
            ids = ", ".join(f"#{m.get('id')}" for m in matches)
            raise SetupError(f"{len(matches)} agents are named {name!r} ({ids}): rename all but one on the platform, "
                             "or register under another --name")
        return matches[0] if matches else None

    found = one(client.agents_named(name))
    if found is not None:
        return update(found)
    try:
        return client.create_agent(body), "created"
    except api.PlatformError as exc:
        if exc.status != 409:
            raise
        found = one(client.agents_named(name))  # created meanwhile (or by a retried POST): update it
        if found is not None:
            return update(found)
        raise api.PlatformError(
            f"409 Conflict: the name {name!r} is taken on the platform by an agent this API key cannot list "
            f"(another organisation's, or archived){': ' + exc.detail if exc.detail else ''}; choose another --name",
            status=409, detail=exc.detail) from None


def main(argv: Optional[List[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        body, given = _prepare(args, environ)
        if args.dry_run:
            print(json.dumps(masked(body), indent=2, ensure_ascii=False))
            _say(f"dry run: nothing sent. For real: agents named {args.name!r} are looked up; the one found is updated "
                 "(PUT /api/agents/ID with config and what the flags set), else this body is sent (POST /api/agents)")
            return 0
        with api.connect(args.api_url, environ) as client:
            agent, what = _register(client, body, given)
    except api.SetupError as exc:
        _say(str(exc))
        return 2
    except api.PlatformError as exc:
        _say(str(exc))
        return 2 if exc.usage else 1
    agent_id = agent.get("id")
    status = f" ({agent['status']})" if agent.get("status") else ""
    _say(f"{what} agent #{agent_id} {args.name!r}{status} at {client.origin}")
    print(agent_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
