"""Benchmark: two copies of pipelines_port side by side, "before" and "after" (did a change cost speed?).

    python3 bench/bench_compare.py                     # about 2 minutes on 2 cores
    python3 bench/bench_compare.py --quick             # about 20 s
    python3 bench/bench_compare.py --before-rev HEAD~3 # or --before PATH; --after PATH (default: the working tree)

"before" defaults to ``git show df33ff0:pipelines_port.py``, "after" to the
working tree's pipelines_port.py.  Each is copied alone into a directory of
its own, and every process that measures it runs with that directory first on
PYTHONPATH (the repository root after it, so the kit's ``conformance`` package
stays importable for the mock proxy) and as its working directory.  Every such
process checks ``pipelines_port.__file__`` against the copy it should have
loaded, so the two sides cannot silently measure the same file.

Measured, in rounds that alternate which side goes first:

1. import time: ``python3 -c "import pipelines_port"`` minus ``python3 -c
   "pass"`` with bytecode cached (PYTHONPYCACHEPREFIX in a temp dir, warmed
   first); the same compiling the module at every import, as a fresh sandbox
   does (``python3 -B``, no cache for the copy; the standard library's own
   bytecode read as usual); and the module's own line of ``-X importtime``
   (self and cumulative);
2. proxy-call latency: sequential ``pp.ProxyClient(rate_per_minute=0).call(...)``
   against a MockProxy in its own process (plain HTTP, 127.0.0.1), each side in
   a worker process of its own, taking turns call by call with a bare
   keep-alive ``http.client`` connection in the same worker; overhead = the
   side's median minus its worker's bare median;
3. server throughput: each side's dispatch server (``pp.main(["serve",
   "bench/agents.py:three_calls", ...])`` in a process of its own) under
   bench/loadgen.py: pings and dispatches of an agent making three proxy
   calls, plus the server's CPU time per request.

Prints one table (before median, after median, after/before, the min-max of the
per-round ratios) and writes JSON to bench/results/.  A metric is "within
noise" when its per-round ratios fall on both sides of 1; "beyond noise" needs
all of at least 6 rounds to agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import benchlib
from benchlib import median, ratio, table

SIDES = ("before", "after")
DEFAULT_REV = "df33ff0"
MODULE = "pipelines_port"
# Settings: (default, --quick).  An option given on the command line wins over both.
SETTINGS: Dict[str, Tuple[Any, Any]] = {
    "import_rounds": (10, 4),
    "import_runs": (8, 4),
    "importtime_runs": (3, 2),
    "call_rounds": (30, 6),
    "calls": (150, 50),
    "call_warmup": (50, 20),
    "server_rounds": (6, 2),
    "duration": (3.0, 1.0),
    "warmup": (0.5, 0.3),
    "connections": (16, 16),
}
LOADED_MARK = "bench_compare: loaded "
# The server process: import the copy, say which file it is, then the module's own command line.
SERVER_LAUNCH = (f"import sys, pipelines_port as pp; print({LOADED_MARK!r} + pp.__file__, flush=True); "
                 "sys.exit(pp.main(sys.argv[1:]))")
REPLY_TIMEOUT_S = 120.0
MIN_ROUNDS = 6  # fewer rounds give no verdict beyond noise: 6 agreeing by chance is a 1-in-32 event


# -- the two copies ----------------------------------------------------------------


class Side:
    """One copy of the module, alone in a directory of its own."""

    def __init__(self, name: str, source: str, text: bytes, scratch: str) -> None:
        self.name = name
        self.source = source
        self.dir = os.path.join(scratch, name)
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, f"{MODULE}.py")
        with open(self.path, "wb") as fh:
            fh.write(text)
        self.sha256 = hashlib.sha256(text).hexdigest()
        self.lines = text.count(b"\n")

    def env(self, base: Dict[str, str]) -> Dict[str, str]:
        """``base`` with this copy's directory first on PYTHONPATH and the repository root after it."""
        return dict(base, PYTHONPATH=os.pathsep.join([self.dir, benchlib.ROOT]))

    def describe(self) -> Dict[str, Any]:
        return {"source": self.source, "copy": self.path, "sha256": self.sha256, "lines": self.lines}


def read_sides(args: argparse.Namespace, scratch: str) -> Dict[str, Side]:
    """Copy "before" and "after" into ``scratch``; stop if a source cannot be read."""
    texts: Dict[str, Tuple[str, bytes]] = {}
    if args.before:
        texts["before"] = (os.path.abspath(args.before), _read(args.before))
    else:
        shown = subprocess.run(["git", "-C", benchlib.ROOT, "show", f"{args.before_rev}:{MODULE}.py"],
                               capture_output=True, timeout=60)
        if shown.returncode != 0:
            benchlib.fail(f"git show {args.before_rev}:{MODULE}.py failed: {shown.stderr.decode(errors='replace')}")
        texts["before"] = (f"git show {args.before_rev}:{MODULE}.py", shown.stdout)
    after = args.after or os.path.join(benchlib.ROOT, f"{MODULE}.py")
    texts["after"] = (os.path.abspath(after), _read(after))
    sides = {name: Side(name, source, text, scratch) for name, (source, text) in texts.items()}
    if sides["before"].sha256 == sides["after"].sha256:
        print("note: before and after are the same file; every difference below is noise", flush=True)
    return sides


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        benchlib.fail(f"cannot read {path}: {exc.strerror}")
        raise


def base_env(pycache: str) -> Dict[str, str]:
    """The environment of every measured process: bytecode cached under ``pycache``, no inherited PYTHONPATH."""
    dropped = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "PYTHONPATH", "PYTHONSTARTUP",
               "AGENT_TOKEN", "BENCH_AGENT_TOKEN", "PIPELINES_DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def rotated(round_number: int) -> List[str]:
    """The order of the sides in a round: before first in even rounds, after first in odd ones."""
    return list(SIDES) if round_number % 2 == 0 else list(reversed(SIDES))


def run_python(argv: List[str], cwd: str, env: Dict[str, str], what: str) -> subprocess.CompletedProcess:
    """Run ``python3 ARGV``; stop the benchmark if it fails."""
    done = subprocess.run([sys.executable] + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        benchlib.fail(f"{what}: python3 {' '.join(argv)} failed: {last}")
    return done


def verify_copy(side: Side, env: Dict[str, str]) -> None:
    """Check that a process set up for ``side`` imports its copy, from cached bytecode."""
    program = ("import importlib.util, json, os, pipelines_port as pp; "
               "print(json.dumps({'file': os.path.realpath(pp.__file__), "
               "'cached': os.path.exists(importlib.util.cache_from_source(pp.__file__))}))")
    found = json.loads(run_python(["-c", program], side.dir, env, f"{side.name}: checking the copy").stdout)
    if found["file"] != os.path.realpath(side.path):
        benchlib.fail(f"{side.name}: a process set up for {side.path} imported {found['file']}")
    if not found["cached"]:
        benchlib.fail(f"{side.name}: no cached bytecode for {side.path} after the warm-up")


# -- 1. import time ----------------------------------------------------------------


def importtime_line(stderr: str) -> Tuple[float, float]:
    """``(self_us, cumulative_us)`` of the module's own line of ``-X importtime``."""
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == MODULE:
            fields = line[len("import time:"):].split("|")
            return float(fields[0]), float(fields[1])
    benchlib.fail(f"no `{MODULE}` line in the -X importtime output")
    raise AssertionError


def measure_import(sides: Dict[str, Side], env: Dict[str, str], args: argparse.Namespace) -> Dict[str, Any]:
    """Wall time of fresh interpreters importing each copy against ``pass``, and -X importtime lines."""
    envs = {name: side.env(env) for name, side in sides.items()}
    bare_env, bare_dir = dict(env, PYTHONPATH=benchlib.ROOT), sides["before"].dir
    # Compiling: no bytecode prefix (the copies' folders hold no __pycache__) and -B (none written).
    compiling = {name: {k: v for k, v in e.items() if k != "PYTHONPYCACHEPREFIX"} for name, e in envs.items()}
    compiling["bare"] = {k: v for k, v in bare_env.items() if k != "PYTHONPYCACHEPREFIX"}
    for name, side in sides.items():  # warm: the bytecode cache, the page cache, the binary
        for _ in range(2):
            run_python(["-c", f"import {MODULE}"], side.dir, envs[name], f"{name}: warm-up")
        verify_copy(side, envs[name])
    run_python(["-c", "pass"], bare_dir, bare_env, "warm-up")
    rounds: List[Dict[str, Any]] = []
    for round_number in range(args.import_rounds):
        order = rotated(round_number)
        wall: Dict[str, List[float]] = {"bare": [], **{name: [] for name in SIDES}}
        cold: Dict[str, List[float]] = {"bare": [], **{name: [] for name in SIDES}}
        for _ in range(args.import_runs):
            for name in ["bare"] + order:
                cwd, run_env = (bare_dir, bare_env) if name == "bare" else (sides[name].dir, envs[name])
                program = "pass" if name == "bare" else f"import {MODULE}"
                for times, flags, environment in ((wall, [], run_env), (cold, ["-B"], compiling[name])):
                    started = time.perf_counter()
                    run_python([*flags, "-c", program], cwd, environment, name)
                    times[name].append((time.perf_counter() - started) * 1000)
        importtime: Dict[str, List[Tuple[float, float]]] = {name: [] for name in SIDES}
        for _ in range(args.importtime_runs):
            for name in order:
                done = run_python(["-X", "importtime", "-c", f"import {MODULE}"], sides[name].dir, envs[name], name)
                importtime[name].append(importtime_line(done.stderr))
        bare = median(wall["bare"])
        rounds.append({
            "order": order,
            "wall_ms": wall,
            "adds_ms": {name: median(wall[name]) - bare for name in SIDES},
            "cold_ms": cold,
            "compiling_adds_ms": {name: median(cold[name]) - median(cold["bare"]) for name in SIDES},
            "self_us": {name: [s for s, _ in importtime[name]] for name in SIDES},
            "cumulative_us": {name: [c for _, c in importtime[name]] for name in SIDES},
        })
        print(f"  import round {round_number + 1}/{args.import_rounds}: adds before "
              f"{rounds[-1]['adds_ms']['before']:.1f} ms, after {rounds[-1]['adds_ms']['after']:.1f} ms", flush=True)
    pooled = {key: [v for r in rounds for v in r["wall_ms"][key]] for key in ("bare",) + SIDES}
    pooled_cold = {key: [v for r in rounds for v in r["cold_ms"][key]] for key in ("bare",) + SIDES}
    bare_all = median(pooled["bare"])
    metrics = {
        "import adds ms (cached)": metric(
            {name: median(pooled[name]) - bare_all for name in SIDES},
            [{name: r["adds_ms"][name] for name in SIDES} for r in rounds], lower_is_better=True),
        "import adds ms (compiling)": metric(
            {name: median(pooled_cold[name]) - median(pooled_cold["bare"]) for name in SIDES},
            [{name: r["compiling_adds_ms"][name] for name in SIDES} for r in rounds], lower_is_better=True),
        "importtime self us": metric(
            {name: median([v for r in rounds for v in r["self_us"][name]]) for name in SIDES},
            [{name: median(r["self_us"][name]) for name in SIDES} for r in rounds], lower_is_better=True),
        "importtime cumulative us": metric(
            {name: median([v for r in rounds for v in r["cumulative_us"][name]]) for name in SIDES},
            [{name: median(r["cumulative_us"][name]) for name in SIDES} for r in rounds], lower_is_better=True),
    }
    return {"metrics": metrics, "bare_ms": benchlib.summary(pooled["bare"]),
            "wall_ms": {name: benchlib.summary(pooled[name]) for name in SIDES}, "rounds": rounds}


# -- 2. proxy calls: a worker process per side ---------------------------------------


class Worker:
    """``bench_compare.py --worker`` for one side: times proxy calls when told to, over stdin/stdout."""

    def __init__(self, side: Side, env: Dict[str, str], proxy_url: str) -> None:
        self.side = side
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--expect", side.path,
                   "--proxy-url", proxy_url]
        self.process = subprocess.Popen(command, cwd=side.dir, env=side.env(env), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        hello = self.reply()
        if os.path.realpath(hello["file"]) != os.path.realpath(side.path):
            benchlib.fail(f"{side.name}: the worker imported {hello['file']}, not {side.path}")
        self.file = hello["file"]

    def ask(self, **command: Any) -> Dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.reply()

    def reply(self) -> Dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.close()
            benchlib.fail(f"{self.side.name}: the worker stopped answering")
        answer = json.loads(line)
        if "error" in answer:
            self.close()
            benchlib.fail(f"{self.side.name}: the worker says: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            try:
                self.process.stdin.close()  # the worker exits at end of input
            except OSError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            benchlib.stop(self.process)
        if self.process.stdout:
            self.process.stdout.close()


def worker_main(expect: str, proxy_url: str) -> int:
    """The worker: import the copy first, report it, then time calls as the driver asks, until end of input."""
    import pipelines_port as pp  # first, before anything else could import it

    def say(data: Dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(data) + "\n")
        sys.stdout.flush()

    if os.path.realpath(pp.__file__) != os.path.realpath(expect):
        say({"error": f"imported {pp.__file__}, expected {expect}"})
        return 2
    import bench_proxy  # its `import pipelines_port` finds this very copy in sys.modules
    from bench_proxy import ARGS, RUN_TOKEN, TOOL, BareKeepAlive

    client = pp.ProxyClient(rate_per_minute=0)
    envelope = pp.Envelope.from_run({"user_instruction": "bench", "input": {}}, proxy_url=proxy_url,
                                    run_token=RUN_TOKEN)
    bare = BareKeepAlive(proxy_url, RUN_TOKEN, benchlib.client_tls())
    calls: Dict[str, Callable[[], Any]] = {
        "pp": lambda: client.call(envelope, TOOL, ARGS),
        "bare": lambda: bare.call(TOOL, ARGS),
    }
    assert bench_proxy.pp is pp
    say({"file": pp.__file__})
    clock = time.perf_counter
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("count"):  # Python function calls per ProxyClient.call, by cProfile: no noise at all
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            for _ in range(command["n"]):
                calls["pp"]()
            profile.disable()
            say({"function_calls": pstats.Stats(profile).total_calls / command["n"]})  # type: ignore[attr-defined]
            continue
        if command.get("check"):  # the warm-up: untimed, every result checked
            for what, call in calls.items():
                for _ in range(command["n"]):
                    if call() != {"tool": TOOL, "args": ARGS}:
                        say({"error": f"{what} returned an unexpected tool result"})
                        return 2
            say({"ok": True})
            continue
        samples: Dict[str, List[float]] = {"pp": [], "bare": []}
        for i in range(command["n"]):  # one of each, taking turns on which goes first: paired in time
            for what in ("pp", "bare") if i % 2 == 0 else ("bare", "pp"):
                call, out = calls[what], samples[what]
                started = clock()
                call()
                out.append((clock() - started) * 1e6)
        say(samples)
    client.close()
    bare.close()
    return 0


def measure_calls(sides: Dict[str, Side], env: Dict[str, str], proxy_url: str, args: argparse.Namespace
                  ) -> Dict[str, Any]:
    """Per-call latency of each side's ProxyClient and of a bare keep-alive connection in each worker."""
    workers: Dict[str, Worker] = {}
    try:
        for name in SIDES:
            workers[name] = Worker(sides[name], env, proxy_url)
        for name in SIDES:
            workers[name].ask(n=args.call_warmup, check=True)
        rounds: List[Dict[str, Any]] = []
        for round_number in range(args.call_rounds):
            samples: Dict[str, Dict[str, List[float]]] = {}
            for name in rotated(round_number):
                samples[name] = workers[name].ask(n=args.calls)
            rounds.append({"order": rotated(round_number), "samples": samples})
        function_calls = {name: workers[name].ask(n=100, count=True)["function_calls"] for name in SIDES}
    finally:
        for worker in workers.values():
            worker.close()

    def per_side(round_: Dict[str, Any], what: str) -> Dict[str, float]:
        return {name: median(round_["samples"][name][what]) for name in SIDES}

    def overheads(rounds_: List[Dict[str, Any]]) -> Dict[str, float]:
        """Each side's call median minus the median of the bare calls its worker made in turn with them."""
        return {name: median([v for r in rounds_ for v in r["samples"][name]["pp"]])
                - median([v for r in rounds_ for v in r["samples"][name]["bare"]]) for name in SIDES}

    pooled = {name: {what: [v for r in rounds for v in r["samples"][name][what]] for what in ("pp", "bare")}
              for name in SIDES}
    metrics = {
        "proxy call median us": metric({name: median(pooled[name]["pp"]) for name in SIDES},
                                       [per_side(r, "pp") for r in rounds], lower_is_better=True),
        "proxy call p90 us": metric({name: benchlib.percentile(pooled[name]["pp"], 90) for name in SIDES},
                                    [{name: benchlib.percentile(r["samples"][name]["pp"], 90) for name in SIDES}
                                     for r in rounds], lower_is_better=True),
        "proxy overhead us (- bare)": metric(overheads(rounds), [overheads([r]) for r in rounds],
                                             lower_is_better=True),
        "bare keep-alive us (control)": metric({name: median(pooled[name]["bare"]) for name in SIDES},
                                               [per_side(r, "bare") for r in rounds], lower_is_better=True),
    }
    return {
        "metrics": metrics,
        "latency_us": {name: {what: benchlib.summary(pooled[name][what]) for what in ("pp", "bare")}
                       for name in SIDES},
        "function_calls_per_call": function_calls,
        "rounds": [{"order": r["order"], "median_us": {name: {what: median(r["samples"][name][what])
                                                                  for what in ("pp", "bare")} for name in SIDES}}
                   for r in rounds],
    }


# -- 3. server throughput --------------------------------------------------------------


def start_server(side: Side, env: Dict[str, str], proxy_url: str, kind: str = "asyncio") -> Any:
    """Start ``side``'s dispatch server (``serve --server KIND``), check it loaded its copy and answers a ping and
    a dispatch."""
    import bench_server
    from bench_server import AGENT_TOKEN, HOST, Server, check_once, dispatch_ok, dispatch_requests, ping_ok, \
        ping_request

    port = benchlib.free_port()
    command = [sys.executable, "-c", SERVER_LAUNCH, "serve", os.path.join(benchlib.BENCH, "agents.py:three_calls"),
               "--host", HOST, "--port", str(port), "--token-env", "BENCH_AGENT_TOKEN"]
    if kind != "asyncio":  # the default; a copy older than the asyncio server has no --server
        command += ["--server", kind]
    server = Server(f"compare-{side.name}", command, dict(side.env(env), BENCH_AGENT_TOKEN=AGENT_TOKEN), port)
    os.makedirs(benchlib.RESULTS, exist_ok=True)
    with open(server.log_path, "wb") as log:  # Server.start runs in the repository root, where the
        server.process = subprocess.Popen(    # other copy would shadow this one: start it in the copy's directory
            command, env=server.env, cwd=side.dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    benchlib.wait_for_port(HOST, port, server.process, 60, server.log_path)
    loaded = _loaded_file(server.log_path)
    if loaded is None or os.path.realpath(loaded) != os.path.realpath(side.path):
        server.stop()
        benchlib.fail(f"{side.name}: the server loaded {loaded}, not {side.path}")
    check_once(server, ping_request(port), ping_ok, "ping")
    check_once(server, dispatch_requests(port, proxy_url), dispatch_ok, "dispatch")
    assert bench_server.RUN_TOKEN == "bench-run-token-not-a-secret"
    return server


def _loaded_file(log_path: str) -> Optional[str]:
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith(LOADED_MARK):
                return line[len(LOADED_MARK):].strip()
    return None


def measure_servers(sides: Dict[str, Side], env: Dict[str, str], proxy: subprocess.Popen, proxy_url: str,
                    args: argparse.Namespace) -> Dict[str, Any]:
    """Ping and dispatch throughput of each side's server, and its CPU time per request."""
    from bench_server import RUN_TOKEN, dispatch_ok, dispatch_requests, ping_ok, ping_request
    from loadgen import run_load

    servers: Dict[str, Any] = {}
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {name: {"ping": [], "dispatch": []} for name in SIDES}
    rss: Dict[str, Optional[int]] = {}
    try:
        for name in SIDES:  # a first start compiles what the server imports beyond the module; then the real one
            start_server(sides[name], env, proxy_url, args.server_kind).stop()
        for name in SIDES:
            servers[name] = start_server(sides[name], env, proxy_url, args.server_kind)
        time.sleep(0.5)
        for name in SIDES:
            rss[name] = benchlib.rss_kib(servers[name].pid)
        for round_number in range(args.server_rounds):
            for name in rotated(round_number):
                server = servers[name]
                for kind, request, check in (("ping", ping_request(server.port), ping_ok),
                                             ("dispatch", dispatch_requests(server.port, proxy_url), dispatch_ok)):
                    seen = benchlib.proxy_stats(proxy_url, RUN_TOKEN)
                    cpu = benchlib.cpu_seconds(server.pid)
                    result = run_load("127.0.0.1", server.port, request, connections=args.connections,
                                      warmup=args.warmup, duration=args.duration, check=check)
                    cpu = benchlib.cpu_seconds(server.pid) - cpu
                    after = benchlib.proxy_stats(proxy_url, RUN_TOKEN)
                    result["proxy_calls"] = after["requests"] - seen["requests"] - 1
                    result["proxy_connections"] = after["connections"] - seen["connections"] - 1
                    result["server_cpu_us_per_request"] = cpu * 1e6 / result["requests"] if result["requests"] \
                        else None
                    runs[name][kind].append(result)
                    print(f"  server round {round_number + 1}/{args.server_rounds}  {name:<6} {kind:<8} "
                          f"{result['rps']:8.0f} req/s  errors {result['errors']}  server cpu us/req "
                          f"{_fmt(result['server_cpu_us_per_request'])}", flush=True)
                    if result["errors"]:
                        print(f"    first error: {result['first_error']}", flush=True)
        for name in SIDES:
            rss[f"{name}_after_load"] = benchlib.rss_kib(servers[name].pid)
    finally:
        for server in servers.values():
            server.stop()

    def per_round(kind: str, field: str) -> List[Dict[str, float]]:
        return [{name: runs[name][kind][i][field] or math.nan for name in SIDES} for i in range(args.server_rounds)]

    metrics: Dict[str, Any] = {}
    for kind in ("ping", "dispatch"):
        rounds_rps = per_round(kind, "rps")
        metrics[f"{kind} req/s"] = metric({name: median([r[name] for r in rounds_rps]) for name in SIDES},
                                          rounds_rps, lower_is_better=False)
    for kind in ("ping", "dispatch"):
        rounds_cpu = per_round(kind, "server_cpu_us_per_request")
        metrics[f"{kind} server cpu us/req"] = metric({name: median([r[name] for r in rounds_cpu]) for name in SIDES},
                                                      rounds_cpu, lower_is_better=True)
    return {
        "metrics": metrics,
        "errors": {name: sum(r["errors"] for kind in runs[name].values() for r in kind) for name in SIDES},
        "proxy_calls_per_connection": {
            name: ratio(sum(r["proxy_calls"] for r in runs[name]["dispatch"]),
                        sum(r["proxy_connections"] for r in runs[name]["dispatch"])) for name in SIDES},
        "rss_kib": rss,
        "runs": runs,
    }


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f}"


# -- the comparison ---------------------------------------------------------------------


def metric(medians: Dict[str, float], rounds: Sequence[Dict[str, float]], *, lower_is_better: bool
           ) -> Dict[str, Any]:
    """One metric: both medians, after/before, the per-round ratios and the verdict."""
    overall = ratio(medians["after"], medians["before"])
    per_round = [ratio(r["after"], r["before"]) for r in rounds]
    per_round = [r for r in per_round if not math.isnan(r)]
    low, high = (min(per_round), max(per_round)) if per_round else (math.nan, math.nan)
    worse = sum(1 for r in per_round if (r > 1) == lower_is_better and r != 1)
    if not per_round or math.isnan(overall):
        verdict = "n/a"
    elif low <= 1.0 <= high:
        verdict = "within noise"
    elif len(per_round) < MIN_ROUNDS:  # all of 2 or 3 rounds agreeing happens by chance too often
        verdict = f"too few rounds to tell ({len(per_round)})"
    else:
        after_better = (high < 1.0) == lower_is_better
        verdict = "after BETTER, beyond noise" if after_better else "after WORSE, beyond noise"
    return {
        "before": medians["before"],
        "after": medians["after"],
        "ratio": overall,
        "round_ratios": per_round,
        "round_ratio_min": low,
        "round_ratio_max": high,
        "rounds_worse": worse,
        "lower_is_better": lower_is_better,
        "verdict": verdict,
    }


def report(parts: Dict[str, Any]) -> None:
    rows = []
    for part in parts.values():
        if part is None:
            continue
        for name, m in part["metrics"].items():
            rows.append([name, "lower" if m["lower_is_better"] else "higher", m["before"], m["after"],
                         f"{m['ratio']:.3f}", f"{m['round_ratio_min']:.3f}-{m['round_ratio_max']:.3f}",
                         f"{m['rounds_worse']}/{len(m['round_ratios'])}", m["verdict"]])
    print("\nbefore vs after (medians; ratio = after / before; a round ratio compares the two sides within one round)")
    print(table(["metric", "better", "before", "after", "after/before", "round ratios min-max", "rounds worse",
                 "verdict"], rows))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Speed of two copies of pipelines_port, side by side.")
    parser.add_argument("--before", metavar="PATH", help=f"the before copy (default: git show {DEFAULT_REV}:...)")
    parser.add_argument("--before-rev", default=DEFAULT_REV, metavar="REV",
                        help=f"the commit whose {MODULE}.py is the before copy (default {DEFAULT_REV})")
    parser.add_argument("--after", metavar="PATH", help=f"the after copy (default: the working tree's {MODULE}.py)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and shorter runs (about 20 s)")
    for part in ("import", "calls", "server"):
        parser.add_argument(f"--skip-{part}", action="store_true", help=f"skip the {part} part")
    kinds = {"duration": benchlib.positive_float, "warmup": benchlib.positive_float}
    for key, (default, quick) in SETTINGS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=kinds.get(key, benchlib.positive_int), default=None,
                            help=f"default {default}, {quick} with --quick")
    parser.add_argument("--server-kind", choices=("asyncio", "threads"), default="asyncio",
                        help="which built-in server both sides run (serve --server; default asyncio)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    parser.add_argument("--proxy-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.expect, args.proxy_url)
    for key, (default, quick) in SETTINGS.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else default)

    started = time.monotonic()
    parts: Dict[str, Any] = {"import": None, "calls": None, "server": None}
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as scratch:
        sides = read_sides(args, scratch)
        for name in SIDES:
            print(f"{name}: {sides[name].source} ({sides[name].lines} lines, sha256 {sides[name].sha256[:12]}) "
                  f"-> {sides[name].path}", flush=True)
        env = base_env(os.path.join(scratch, "pycache"))
        if not args.skip_import:
            print(f"import time: {args.import_rounds} rounds x {args.import_runs} runs per program ...", flush=True)
            parts["import"] = measure_import(sides, env, args)
        if not (args.skip_calls and args.skip_server):
            from bench_server import RUN_TOKEN

            proxy, proxy_url = benchlib.start_proxy(RUN_TOKEN, tls=False)
            try:
                if not args.skip_calls:
                    print(f"proxy calls: {args.call_rounds} rounds x {args.calls} calls per side ...", flush=True)
                    parts["calls"] = measure_calls(sides, env, proxy_url, args)
                if not args.skip_server:
                    print(f"servers ({args.server_kind}): {args.server_rounds} rounds of {args.warmup:g} + "
                          f"{args.duration:g} s, "
                          f"{args.connections} connections ...", flush=True)
                    parts["server"] = measure_servers(sides, env, proxy, proxy_url, args)
            finally:
                benchlib.stop_proxy(proxy)
        described = {name: side.describe() for name, side in sides.items()}

    report(parts)
    if parts["calls"] is not None:
        counts = parts["calls"]["function_calls_per_call"]
        print("\nPython function calls per proxy call (cProfile, exact, no noise): "
              + ", ".join(f"{n} {counts[n]:.1f}" for n in SIDES)
              + f"; after/before {ratio(counts['after'], counts['before']):.3f}")
    if parts["server"] is not None:
        server = parts["server"]
        print(f"server sanity: errors {server['errors']}; proxy calls per connection "
              + ", ".join(f"{n} {server['proxy_calls_per_connection'][n]:.1f}" for n in SIDES)
              + "; idle RSS MiB " + ", ".join(f"{n} {(server['rss_kib'][n] or 0) / 1024:.1f}" for n in SIDES))
    elapsed = time.monotonic() - started
    print(f"(a verdict is 'within noise' when the round ratios fall on both sides of 1; 'beyond noise' needs "
          f"at least {MIN_ROUNDS} rounds all on one side; took {elapsed:.0f} s)")
    path = benchlib.write_results("bench_compare", {
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "expect", "proxy_url")},
        "sides": described,
        "import": parts["import"],
        "calls": parts["calls"],
        "server": parts["server"],
        "elapsed_s": elapsed,
    })
    print(f"results: {os.path.relpath(path, benchlib.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
