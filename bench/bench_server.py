"""Benchmark: the dispatch server of pipelines_port against FastAPI + uvicorn peers (issue 3).

    python3 bench/bench_server.py [--rounds 5] [--duration 3] [--connections 16]
                                  [--servers pipelines_port,reference,tuned] [--no-access-log]

Servers, each a process of its own:

- ``pipelines_port``: ``python3 pipelines_port.py serve bench/agents.py:three_calls
  --host 127.0.0.1 --port PORT --token-env BENCH_AGENT_TOKEN``;
- ``pipelines_port_m`` (on request): the same started as ``python3 -m pipelines_port serve``;
- ``pipelines_port_uvicorn`` (on request): ``DispatchApp`` as an ASGI app under uvicorn with its
  default flags (bench/uvicorn_app.py), in the peers' venv;
- ``reference``: bench/peer_app.py under uvicorn, shaped like the platform
  docs' reference wrapper (a synchronous ``httpx.post`` per tool call);
- ``tuned``: the same app with one shared ``httpx.AsyncClient`` and an async agent.

Each server is started twice with one shared PYTHONPYCACHEPREFIX (the first
start compiles everything) and measured on the second start.

The peers run in bench/.venv, created on first use with fastapi, uvicorn and
httpx from PyPI (no dependency of the project).  The proxy is a plain-HTTP
MockProxy in its own process.  The load generator (bench/loadgen.py, asyncio
raw sockets, keep-alive) runs in this process.

Measured, in rounds that rotate which server goes first:

- requests per second of a ping (``{"ping": true}`` with the right bearer);
- requests per second of a dispatch whose agent makes three proxy calls;
- server CPU time per request (from /proc/PID/stat), less sensitive to the
  load generator sharing the machine;
- resident memory (VmRSS) of each server idle after start-up and one ping,
  and again after the load;
- proxy calls per proxy connection (keep-alive reuse), counted by the proxy.

Targets, against the reference peer: ping >= 1.5x, dispatch >= 5x, idle
memory <= half.  Prints tables and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import benchlib
from benchlib import median, ratio, table, verdict
from loadgen import Check, RequestSource, build_request, exchange_once, run_load

HOST = "127.0.0.1"
PATH = "/dispatch"
AGENT_TOKEN = "bench-agent-token-not-a-secret"
RUN_TOKEN = "bench-run-token-not-a-secret"
VENV = os.path.join(benchlib.BENCH, ".venv")
PEER_PACKAGES = ["fastapi", "uvicorn", "httpx", "aiohttp"]
OURS = "pipelines_port"
OURS_MODULE = "pipelines_port_m"  # the same server started as `python3 -m pipelines_port serve`
OURS_UVICORN = "pipelines_port_uvicorn"  # DispatchApp as an ASGI app under uvicorn, default flags (bench venv)
PEERS = ("reference", "tuned")
NAMES = (OURS, OURS_MODULE, OURS_UVICORN) + PEERS
DEFAULT_NAMES = (OURS,) + PEERS
TARGETS = {"ping_ratio_min": 1.5, "dispatch_ratio_min": 5.0, "idle_rss_ratio_max": 0.5}


# -- the peers' environment ------------------------------------------------------


def venv_python() -> str:
    """The Python of bench/.venv, created and filled with the peer packages if needed."""
    python = os.path.join(VENV, "bin", "python")
    probe = [python, "-c", "import fastapi, uvicorn, httpx, aiohttp"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {os.path.relpath(VENV, benchlib.ROOT)} with {', '.join(PEER_PACKAGES)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    install = subprocess.run([python, "-m", "pip", "install", "-q"] + PEER_PACKAGES, capture_output=True, text=True)
    if install.returncode != 0:
        benchlib.fail("pip could not install the peer packages:\n" + install.stderr[-2000:])
    return python


def peer_versions(python: str) -> Dict[str, str]:
    """Installed versions of the peer packages."""
    code = ("import json, importlib.metadata as m; "
            f"print(json.dumps({{p: m.version(p) for p in {PEER_PACKAGES + ['starlette', 'pydantic']!r}}}))")
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def serve_available() -> bool:
    """Whether ``pipelines_port.py serve`` exists yet."""
    command = [sys.executable, os.path.join(benchlib.ROOT, "pipelines_port.py"), "serve", "--help"]
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# -- servers -----------------------------------------------------------------------


class Server:
    """One server process under test, listening on ``HOST:port``."""

    def __init__(self, name: str, command: List[str], env: Dict[str, str], port: int) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.port = port
        self.log_path = os.path.join(benchlib.RESULTS, f"server-{name}.log")
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        os.makedirs(benchlib.RESULTS, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command, env=self.env, cwd=benchlib.ROOT, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        benchlib.wait_for_port(HOST, self.port, self.process, 60, self.log_path)

    def stop(self) -> None:
        if self.process is not None:
            benchlib.stop(self.process)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


def make_servers(names: List[str], python: Optional[str], pycache: str, access_log: bool) -> List[Server]:
    """The servers to compare, each on a port of its own, all caching bytecode under ``pycache``."""
    dropped = ("AGENT_TOKEN", "BENCH_AGENT_TOKEN", "PEER_STYLE", "PYTHONDONTWRITEBYTECODE")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    base["PYTHONPYCACHEPREFIX"] = pycache
    servers = []
    for name in names:
        port = benchlib.free_port()
        if name in (OURS, OURS_MODULE):
            launch = ["pipelines_port.py"] if name == OURS else ["-m", "pipelines_port"]
            command = [sys.executable] + launch + ["serve", "bench/agents.py:three_calls", "--host", HOST,
                                                   "--port", str(port), "--token-env", "BENCH_AGENT_TOKEN"]
            command += [] if access_log else ["--no-access-log"]
            env = dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN)
        elif name == OURS_UVICORN:
            assert python is not None
            command = [python, "-m", "uvicorn", "uvicorn_app:app", "--app-dir", benchlib.BENCH, "--host", HOST,
                       "--port", str(port)] + ([] if access_log else ["--no-access-log"])
            env = dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN, PYTHONPATH=benchlib.ROOT)
        else:
            assert python is not None
            command = [python, "-m", "uvicorn", "peer_app:app", "--app-dir", benchlib.BENCH, "--host", HOST,
                       "--port", str(port)] + ([] if access_log else ["--no-access-log"])
            env = dict(base, AGENT_TOKEN=AGENT_TOKEN, PEER_STYLE=name)
        servers.append(Server(name, command, env, port))
    return servers


# -- requests ------------------------------------------------------------------------


def ping_request(port: int) -> bytes:
    """The platform's "Test connection": ``{"ping": true}`` with the right bearer."""
    return build_request(HOST, port, PATH, b'{"ping": true}', {"Authorization": f"Bearer {AGENT_TOKEN}"})


def dispatch_requests(port: int, proxy_url: str) -> Callable[[], bytes]:
    """A source of dispatch requests, each with a run token of its own (as each platform run has).

    One shared token would make pipelines_port's client pace its calls at the
    platform's 60 per minute per token.
    """
    body = {
        "task_id": 42, "run_id": 17, "agent_id": 8,
        "input": {
            "task_id": 42,
            "user_instruction": "Refund order #4521 if it shipped more than 30 days ago.",
            "input": {"customer_id": "cust_99", "order_id": "4521"},
        },
        "odyssey_proxy_url": proxy_url,
        "run_token_jti": "bench-jti",
    }
    headers = {
        "Authorization": f"Bearer {AGENT_TOKEN}",
        "X-Pipelines-Run-Token": RUN_TOKEN + "-00000000",
        "X-Pipelines-Odyssey-Proxy-Url": proxy_url,
        "X-Pipelines-Run-Id": "17",
        "X-Pipelines-Task-Id": "42",
    }
    template = build_request(HOST, port, PATH, json.dumps(body).encode(), headers)
    placeholder = (RUN_TOKEN + "-00000000").encode()
    runs = itertools.count(1)
    return lambda: template.replace(placeholder, b"%s-%08d" % (RUN_TOKEN.encode(), next(runs)))


def ping_ok(status: int, body: bytes) -> bool:
    """Whether a ping was answered ``200 {"ok": true}``."""
    return status == 200 and json.loads(body) == {"ok": True}


EXPECTED_ANSWER = "issue_refund done for order 4521 of cust_99"


def dispatch_ok(status: int, body: bytes) -> bool:
    """Whether a dispatch was answered 200 with the agent's expected ``final_response``."""
    reply = json.loads(body) if status == 200 else None
    return isinstance(reply, dict) and reply.get("final_response") == EXPECTED_ANSWER


def check_once(server: Server, request: RequestSource, check: Check, what: str) -> None:
    """One request on a fresh connection; stop the benchmark with the reply if it is wrong."""
    try:
        status, body = exchange_once(HOST, server.port, request if isinstance(request, bytes) else request())
        reply = f"HTTP {status}: {body[:300]!r}"
        good = check(status, body)
    except (OSError, ValueError) as exc:
        reply, good = f"no reply ({exc})", False
    if not good:
        benchlib.fail(f"{server.name} answered the {what} wrongly: {reply}; its log:\n{benchlib.tail(server.log_path)}")


# -- measurement ---------------------------------------------------------------------


def start_all(servers: List[Server], proxy_url: str) -> Dict[str, Dict[str, Optional[int]]]:
    """Start every server twice, reading its idle RSS after start-up and one ping each time.

    The first start compiles everything (an empty PYTHONPYCACHEPREFIX), the
    second finds it all cached: the steady state, and the figure compared.
    """
    rss: Dict[str, Dict[str, Optional[int]]] = {}
    for phase in ("first_start", "idle"):
        for server in servers:
            server.start()
            check_once(server, ping_request(server.port), ping_ok, "ping")
            time.sleep(0.5)  # let start-up settle before reading memory
            rss.setdefault(server.name, {})[phase] = benchlib.rss_kib(server.pid)
            check_once(server, dispatch_requests(server.port, proxy_url), dispatch_ok, "dispatch")
            if phase == "first_start":
                server.stop()
    return rss


def measure(servers: List[Server], proxy: subprocess.Popen, proxy_url: str, args: argparse.Namespace
            ) -> Dict[str, Any]:
    """Every load run's figures, by server and kind; each round rotates which server goes first."""
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {s.name: {"ping": [], "dispatch": []} for s in servers}
    for round_number in range(args.rounds):
        shift = round_number % len(servers)
        for server in servers[shift:] + servers[:shift]:
            for kind, request, check in (("ping", ping_request(server.port), ping_ok),
                                         ("dispatch", dispatch_requests(server.port, proxy_url), dispatch_ok)):
                server_cpu, proxy_cpu = benchlib.cpu_seconds(server.pid), benchlib.cpu_seconds(proxy.pid)
                seen = benchlib.proxy_stats(proxy_url, RUN_TOKEN)
                result = run_load(HOST, server.port, request, connections=args.connections, warmup=args.warmup,
                                  duration=args.duration, check=check)
                server_cpu = benchlib.cpu_seconds(server.pid) - server_cpu
                proxy_cpu = benchlib.cpu_seconds(proxy.pid) - proxy_cpu
                after = benchlib.proxy_stats(proxy_url, RUN_TOKEN)
                result["proxy_calls"] = after["requests"] - seen["requests"] - 1
                result["proxy_connections"] = after["connections"] - seen["connections"] - 1
                per_request = 1e6 / result["requests"] if result["requests"] else None
                result["server_cpu_us_per_request"] = server_cpu * per_request if per_request else None
                result["proxy_cpu_us_per_request"] = proxy_cpu * per_request if per_request else None
                runs[server.name][kind].append(result)
                print(f"  round {round_number + 1}/{args.rounds}  {server.name:<15} {kind:<8} "
                      f"{result['rps']:8.0f} req/s  errors {result['errors']}  "
                      f"cpu us/req: server {_us(result['server_cpu_us_per_request'])}, "
                      f"proxy {_us(result['proxy_cpu_us_per_request'])}, "
                      f"load generator {_us(result['client_cpu_us_per_request'])}", flush=True)
                if result["errors"]:
                    print(f"    first error: {result['first_error']}", flush=True)
    return runs


def _us(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def summarise(runs: Dict[str, Any], rss: Dict[str, Dict[str, Optional[int]]]) -> Dict[str, Any]:
    """Medians per server and kind, and our ratios against each peer."""
    figures: Dict[str, Any] = {}
    for name, kinds in runs.items():
        figures[name] = {"rss_kib": rss[name]}
        for kind, results in kinds.items():
            cpu = [r["server_cpu_us_per_request"] for r in results if r["server_cpu_us_per_request"] is not None]
            figures[name][kind] = {
                "rps_median": median([r["rps"] for r in results]),
                "rps_rounds": [round(r["rps"], 1) for r in results],
                "latency_median_us": median([r["latency_median_us"] for r in results if r["latency_median_us"]]),
                "server_cpu_us_per_request": median(cpu),
                "proxy_cpu_us_per_request": median([r["proxy_cpu_us_per_request"] for r in results
                                                    if r["proxy_cpu_us_per_request"] is not None]),
                "client_cpu_us_per_request": median([r["client_cpu_us_per_request"] for r in results
                                                     if r["client_cpu_us_per_request"] is not None]),
                "proxy_calls_per_connection": ratio(sum(r["proxy_calls"] for r in results),
                                                    sum(r["proxy_connections"] for r in results)),
                "errors": sum(r["errors"] for r in results),
            }
    comparisons: Dict[str, Any] = {}
    for mine in (n for n in (OURS, OURS_MODULE, OURS_UVICORN) if n in figures):
        ours = figures[mine]
        for peer in (n for n in PEERS if n in figures):
            theirs = figures[peer]
            per_round = {
                kind: median([ratio(a["rps"], b["rps"]) for a, b in zip(runs[mine][kind], runs[peer][kind])])
                for kind in ("ping", "dispatch")
            }
            comparisons[f"{mine} / {peer}"] = {
                "ping_ratio": ratio(ours["ping"]["rps_median"], theirs["ping"]["rps_median"]),
                "dispatch_ratio": ratio(ours["dispatch"]["rps_median"], theirs["dispatch"]["rps_median"]),
                "ping_ratio_per_round_median": per_round["ping"],
                "dispatch_ratio_per_round_median": per_round["dispatch"],
                "idle_rss_ratio": ratio(float(ours["rss_kib"]["idle"] or 0), float(theirs["rss_kib"]["idle"] or 0)),
            }
    return {"servers": figures, "comparisons": comparisons}


def report(summary: Dict[str, Any], args: argparse.Namespace) -> None:
    """Print the tables and the verdicts on the targets."""
    figures = summary["servers"]
    print(f"\nMedians over {args.rounds} rounds of {args.duration:g} s at {args.connections} keep-alive connections "
          f"(dispatch = an agent making three proxy calls)")
    rows = [[name, f["ping"]["rps_median"], f["dispatch"]["rps_median"], f["dispatch"]["latency_median_us"] / 1000,
             f["ping"]["server_cpu_us_per_request"], f["dispatch"]["server_cpu_us_per_request"],
             f["dispatch"]["proxy_cpu_us_per_request"], f["ping"]["errors"] + f["dispatch"]["errors"]]
            for name, f in figures.items()]
    print(table(["server", "ping req/s", "dispatch req/s", "dispatch p50 ms", "ping cpu us", "dispatch cpu us",
                 "proxy cpu us", "errors"], rows))
    print("(cpu us = CPU time per request of the server process; proxy cpu us = of the mock proxy, per dispatch)")
    rows = [[name, _mib(f["rss_kib"]["idle"]), _mib(f["rss_kib"]["first_start"]), _mib(f["rss_kib"]["after_load"]),
             f["dispatch"]["proxy_calls_per_connection"]]
            for name, f in figures.items()]
    print()
    print(table(["server", "idle RSS MiB", "idle RSS MiB, nothing cached", "RSS MiB after load",
                 "proxy calls per connection"], rows))
    if not summary["comparisons"]:
        return
    rows = [[pair, c["ping_ratio"], c["dispatch_ratio"], c["idle_rss_ratio"],
             c["ping_ratio_per_round_median"], c["dispatch_ratio_per_round_median"]]
            for pair, c in summary["comparisons"].items()]
    print("\nRatios (throughput: higher is better for us; memory: lower is better)")
    print(table(["", "ping", "dispatch", "idle RSS", "ping (per-round median)", "dispatch (per-round median)"],
                rows))
    reference = summary["comparisons"].get(f"{OURS} / reference")
    if reference:
        print(f"\ntargets, {OURS} against the reference peer: "
              f"ping >= {TARGETS['ping_ratio_min']}x: {reference['ping_ratio']:.3f}x "
              f"{verdict(reference['ping_ratio'], TARGETS['ping_ratio_min'])}; "
              f"dispatch >= {TARGETS['dispatch_ratio_min']:.0f}x: {reference['dispatch_ratio']:.3f}x "
              f"{verdict(reference['dispatch_ratio'], TARGETS['dispatch_ratio_min'])}; "
              f"idle RSS <= {TARGETS['idle_rss_ratio_max']}x: {reference['idle_rss_ratio']:.3f}x "
              f"{verdict(reference['idle_rss_ratio'], TARGETS['idle_rss_ratio_max'], at_most=True)}")


def _mib(kib: Optional[int]) -> float:
    return kib / 1024 if kib else math.nan


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Dispatch-server throughput and memory: pipelines_port vs FastAPI.")
    parser.add_argument("--rounds", type=benchlib.positive_int, default=5, help="rounds (default 5)")
    parser.add_argument("--duration", type=benchlib.positive_float, default=3.0,
                        help="measured seconds per run (default 3)")
    parser.add_argument("--warmup", type=benchlib.positive_float, default=0.5,
                        help="unmeasured seconds before each run (default 0.5)")
    parser.add_argument("--connections", type=benchlib.positive_int, default=16,
                        help="concurrent keep-alive connections (default 16)")
    parser.add_argument("--servers", default=",".join(DEFAULT_NAMES),
                        help=f"comma-separated, from {','.join(NAMES)} (default {','.join(DEFAULT_NAMES)})")
    parser.add_argument("--no-access-log", "--peer-no-access-log", dest="no_access_log", action="store_true",
                        help="start every server with --no-access-log (by default each logs a line per request)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        benchlib.fail(f"--servers takes names from {','.join(NAMES)}; got {args.servers!r}")
    if (OURS in names or OURS_MODULE in names) and not serve_available():
        print("note: `pipelines_port.py serve` is not available yet; measuring the peers only", flush=True)
        names = [n for n in names if n not in (OURS, OURS_MODULE)]
    python = venv_python() if any(n in PEERS or n == OURS_UVICORN for n in names) else None
    versions = peer_versions(python) if python else {}

    proxy, proxy_url = benchlib.start_proxy(RUN_TOKEN, tls=False)
    with tempfile.TemporaryDirectory(prefix="bench-pycache-") as pycache:
        servers = make_servers(names, python, pycache, access_log=not args.no_access_log)
        try:
            rss = start_all(servers, proxy_url)
            print("servers up: " + ", ".join(f"{s.name} (pid {s.pid}, port {s.port})" for s in servers), flush=True)
            runs = measure(servers, proxy, proxy_url, args)
            for server in servers:
                rss[server.name]["after_load"] = benchlib.rss_kib(server.pid)
        finally:
            for server in servers:
                server.stop()
            benchlib.stop_proxy(proxy)

    summary = summarise(runs, rss)
    report(summary, args)
    path = benchlib.write_results("bench_server", {
        "settings": vars(args),
        "peer_versions": versions,
        "summary": summary,
        "runs": runs,
        "targets": TARGETS,
    })
    print(f"\nresults: {os.path.relpath(path, benchlib.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
