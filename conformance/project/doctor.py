"""``pipelines-port doctor``: check an agent's setup before a platform run, one line per check.

From a checkout: ``python3 -m conformance doctor``.  Kit tooling (it validates
datasets with the kit's own validator), so it lives in the kit, not in the
module a user copies into a sandbox.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import pipelines_port as pp

from ..kit import prog
from .init import UsageError


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


DEFAULT_PROBE_PROXY_URL = "https://api.pipelines.tech/api/odyssey-proxy"

_Check = Tuple[str, str, str]  # (state "ok" | "fail" | "skip" | "warn", label, detail)


def _http_exchange(url: str, method: str, headers: Dict[str, str], body: bytes,
                   timeout: float = 30.0) -> Tuple[int, Any]:
    """``(status, parsed JSON or text)`` of one request; a failure to get a reply raises ``ValueError``."""
    base = urlsplit(url)
    path = (base.path or "/") + (f"?{base.query}" if base.query else "")
    connection_class = http.client.HTTPSConnection if base.scheme == "https" else http.client.HTTPConnection
    conn = connection_class(base.hostname or "", base.port, timeout=timeout)
    try:
        conn.request(method, path, body or None, headers)
        reply = conn.getresponse()
        data = reply.read(pp.MAX_REPLY_BYTES + 1)
    except (OSError, http.client.HTTPException, UnicodeError) as exc:
        raise ValueError(pp.describe_error(exc, 200)) from None
    finally:
        conn.close()
    if len(data) > pp.MAX_REPLY_BYTES:
        raise ValueError(f"reply exceeds the {pp.MAX_REPLY_BYTES}-byte cap")
    try:
        return reply.status, json.loads(data) if data else None
    except ValueError:
        return reply.status, data.decode("utf-8", "replace")


class _Doctor:
    """The doctor's checks, in order; each yields one line: ✓ green, ✗ red, - not checked."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.token = (os.environ.get(args.token_env or "") or "").strip()
        self.url: Optional[str] = args.url
        self.server: Any = None
        self.app_tools: Optional[List[Dict[str, Any]]] = None  # what the app declares (--app) or serves (--url)
        header = args.auth_header
        bearer = header.lower() == "authorization"
        self.auth = {header: ("Bearer " if bearer else "") + self.token} if self.token else {}
        self.wrong_auth = {header: ("Bearer " if bearer else "") + "wrong-doctor-token"}

    def checks(self) -> Iterator[_Check]:
        if self.args.app:
            yield self.agent_imports()
            yield from self.required_environment()
        yield self.answers_ping()
        yield self.auth_before_ping()
        yield self.proxy_hosts()
        if self.args.tools_schema:
            yield from self.tools_schema()
        yield self.proxy_reachable()
        if self.args.csv:
            yield self.dataset()

    def proxy_hosts(self) -> _Check:
        """CONTRACT §7.1 kit-proxy-host-allow-list: without one, the agent token alone can aim the server anywhere."""
        label = "proxy host allow-list"
        app = getattr(self, "app", None)
        if app is None:
            return "skip", label, (f"cannot tell from outside: set {pp.ENV_PROXY_ALLOWED_HOSTS} (or serve "
                                   "--proxy-hosts) on the server in production")
        if app.endpoint.proxy_hosts is None:
            return "warn", label, (f"not set: dispatches may name any proxy host; set {pp.ENV_PROXY_ALLOWED_HOSTS}="
                                   ".pipelines.tech (or serve --proxy-hosts) in production")
        return "ok", label, app.describe_proxy_hosts()

    def close(self) -> None:
        if self.server is not None:
            self.server.close(1)

    def _ping(self, headers: Dict[str, str]) -> Tuple[int, Any]:
        headers = {"Content-Type": "application/json", **headers}
        return _http_exchange(self.url or "", "POST", headers, b'{"ping": true}')

    def agent_imports(self) -> _Check:
        """Load the agent and serve it here, on a private port, as ``serve`` would."""
        try:
            agent = pp.load_agent(self.args.app)
        except ValueError as exc:
            return "fail", "agent imports", str(exc)
        try:
            app = agent if isinstance(agent, pp.DispatchApp) else pp.DispatchApp(
                agent, token_env=self.args.token_env, auth_header=self.args.auth_header, no_auth=self.args.no_auth,
                tools_schema=pp.tools_schema_beside(self.args.app), strict=True)  # the look-up `serve` makes
            self.server = pp.start_server(app, host="127.0.0.1", port=0)
        except (ValueError, OSError) as exc:
            why = pp.describe_error(exc, 300)
            return "fail", "agent imports", f"{self.args.app} imports but cannot be served: {why}"
        self.url, self.app_tools, self.app = self.server.url, app.tools_schema, app
        self.module = sys.modules.get(getattr(getattr(app, "agent", agent), "__module__", "") or "")
        return "ok", "agent imports", f"{self.args.app} ({type(agent).__name__})"

    def required_environment(self) -> Iterator[_Check]:
        """The variables the agent's module lists in ``REQUIRED_ENV`` (the templates list their API keys)."""
        names = getattr(getattr(self, "module", None), "REQUIRED_ENV", None)
        if not isinstance(names, (list, tuple)):
            return
        for name in names:
            label = f"{name} is set"
            if (os.environ.get(str(name)) or "").strip():
                yield "ok", label, "set (its value is not shown)"
            else:
                yield "fail", label, (f"not set: the agent needs it (export {name}=...; `simulate` can run without "
                                      "it against a scripted model, see --model)")

    def answers_ping(self) -> _Check:
        label = "server answers ping"
        if self.url is None:
            return "skip", label, "no server to ask (the agent did not import)"
        if not self.token and not self.args.no_auth:
            return "fail", label, (f"environment variable {self.args.token_env} is not set: the server answers every "
                                   "dispatch with 503 (set it, or pass --no-auth for an endpoint without auth)")
        try:
            status, value = self._ping(self.auth)
        except ValueError as exc:
            return "fail", label, f"{self.url} unreachable: {exc}"
        if status == 200 and value == {"ok": True}:
            return "ok", label, f'{self.url} -> 200 {{"ok": true}}'
        got = _short(json.dumps(value), 200)
        return "fail", label, f'{self.url} -> HTTP {status} {got} (expected 200 {{"ok": true}})'

    def auth_before_ping(self) -> _Check:
        label = "auth runs before ping"
        if self.url is None:
            return "skip", label, "no server to ask"
        if self.args.no_auth:
            return "skip", label, "--no-auth: the endpoint has no auth to check"
        try:
            status, _ = self._ping(self.wrong_auth)
        except ValueError as exc:
            return "fail", label, f"{self.url} unreachable: {exc}"
        if status == 401:
            return "ok", label, "a ping with a wrong credential gets 401"
        if status == 503 and not self.token:
            return "fail", label, f"cannot tell: {self.args.token_env} is not set (503)"
        return "fail", label, (f"a ping with a wrong credential got HTTP {status}, expected 401: run auth before "
                               "the ping short-circuit (CONTRACT §2)")

    def tools_schema(self) -> Iterator[_Check]:
        try:
            tools = pp.load_tools_schema(self.args.tools_schema)
        except ValueError as exc:
            yield "fail", "tools_schema is valid", str(exc)
            return
        yield "ok", "tools_schema is valid", f"{len(tools)} tools: {_short(', '.join(t['name'] for t in tools), 200)}"
        label = "tools_schema matches the app"
        if self.url is None:
            return
        status = 200
        if self.server is None:  # --url: ask the running server what it serves
            try:
                origin = urlsplit(self.url)
                status, value = _http_exchange(f"{origin.scheme}://{origin.netloc}/tools_schema", "GET", self.auth, b"")
            except ValueError:
                status, value = 0, None
            served = value.get("tools_schema", value.get("tools")) if isinstance(value, dict) else None
            if status == 200 and isinstance(served, list):  # {"tools_schema": [...]}; older kits said "tools"
                self.app_tools = served
        if self.app_tools is None:
            if self.server is not None:
                yield "fail", label, "the app declares no tools: put tools_schema.json beside the agent file"
            else:
                yield "skip", label, f"the server does not serve GET /tools_schema (HTTP {status})"
            return
        served = {t.get("name"): t.get("input_schema") for t in self.app_tools if isinstance(t, dict)}
        mine = {t["name"]: t["input_schema"] for t in tools}
        if served == mine:
            yield "ok", label, f"the app declares the same {len(mine)} tools"
            return
        differ = sorted(n for n in set(mine) & set(served) if mine[n] != served[n])
        yield "fail", label, (f"only in the file: {sorted(set(mine) - set(served)) or 'none'}; only in the app: "
                              f"{sorted(set(served) - set(mine)) or 'none'}; "
                              f"different input_schema: {differ or 'none'}")

    def proxy_reachable(self) -> _Check:
        """§3.7: a fake bearer; 401 means the proxy is reachable.  Only with --proxy-url: offline is no failure."""
        if not self.args.proxy_url:
            return "skip", "outbound proxy reachable", (f"not checked: give --proxy-url URL (e.g. "
                                                        f"{DEFAULT_PROBE_PROXY_URL}) to check this machine's egress")
        probe = pp.probe_proxy(self.args.proxy_url)
        if probe["reachable"]:
            return "ok", "outbound proxy reachable", (f"{self.args.proxy_url} -> HTTP {probe['status_code']} "
                                                      f"in {probe['latency_ms']:.0f} ms")
        return "fail", "outbound proxy reachable", f"{self.args.proxy_url}: {probe['error']}"

    def dataset(self) -> _Check:
        label = "dataset is valid"
        try:
            from ..simulator import dataset as datasets
        except ImportError as exc:  # the kit is incomplete
            return "fail", label, f"the dataset check needs the kit's dataset module: {exc}"
        loaded = datasets.load_dataset(self.args.csv)
        if loaded.ok:
            return "ok", label, datasets.summary(loaded)
        problems = datasets.format_problems(loaded)
        listed = "".join("\n    " + p for p in problems[:10]) + ("\n    ..." if len(problems) > 10 else "")
        return "fail", label, datasets.summary(loaded) + listed


def run(args: Any) -> int:
    for flag, url in (("--url", args.url), ("--proxy-url", args.proxy_url)):
        if url is not None:
            try:
                pp.validate_proxy_url(url, flag)
            except pp.EnvelopeError as exc:
                raise UsageError(str(exc).replace("proxy URL ", "URL ", 1)) from None
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    marks = {"ok": ("✓", "32"), "fail": ("✗", "31"), "skip": ("-", "33"), "warn": ("!", "33")}
    doctor = _Doctor(args)
    red = 0
    try:
        for state, label, detail in doctor.checks():
            mark, code = marks[state]
            red += state == "fail"
            line = f"{mark} {label}: {detail}"
            print(f"\033[{code}m{line}\033[0m" if color else line, flush=True)
    finally:
        doctor.close()
    return 1 if red else 0



DEFAULT_TOKEN_ENV = pp.DEFAULT_TOKEN_ENV


def add_parser(commands: Any) -> None:
    """The ``doctor`` sub-command on an ``argparse`` sub-parsers object."""
    doctor_ = commands.add_parser(
        "doctor", help="check an agent's setup before a platform run",
        description="One line per check, green or red: the agent imports, ping answers, auth runs before ping, "
                    "tools_schema is valid and matches the app, the outbound proxy is reachable, the dataset is valid.",
    )
    target = doctor_.add_mutually_exclusive_group(required=True)
    target.add_argument("--app", metavar="PATH_OR_MODULE:FUNCTION", help="the agent, served here on a private port")
    target.add_argument("--url", metavar="URL", help="a running dispatch endpoint")
    doctor_.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, metavar="NAME",
                         help="environment variable holding the agent token (default AGENT_TOKEN)")
    doctor_.add_argument("--auth-header", default="Authorization", metavar="NAME", help="header carrying it")
    doctor_.add_argument("--no-auth", action="store_true", help="the endpoint has no inbound auth")
    doctor_.add_argument("--tools-schema", metavar="FILE", help="tools list to validate and compare with the app's")
    doctor_.add_argument("--csv", metavar="FILE", help="a task-seeding dataset to validate (CONTRACT §6)")
    doctor_.add_argument("--proxy-url", metavar="URL",
                         help=f"a proxy to probe for egress, e.g. {DEFAULT_PROBE_PROXY_URL} (without it the check is "
                              "skipped, so doctor passes offline)")
    doctor_.set_defaults(run=run)



def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog())
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except UsageError as exc:
        print(f"{prog('doctor')}: {exc}", file=sys.stderr)
        return 2
