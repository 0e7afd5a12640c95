"""Benchmark: proxy-call latency of pipelines_port against the naive stdlib shim, and import time (issue 2).

    python3 bench/bench_proxy.py [--rounds 20] [--calls 50] [--import-runs 40] [--skip-import]

Part 1 makes sequential tool calls to a MockProxy running in its own process
(TLS with tests/data/test_cert.pem, then plain HTTP for reference) with:

- ``pipelines_port``: ``pp.ProxyClient(ssl_context=<CA context>, rate_per_minute=0).call(...)``;
- ``naive shim``: what the platform's code-mode docs suggest, a fresh
  ``urllib.request.urlopen`` per call with the bearer header and
  ``json.loads(...)["response"]``, given the same CA context;
- ``bare keep-alive``: one ``http.client`` connection reused with no
  validation, retries or ids: the floor a client cannot go under, used to
  split each latency into round trip and client overhead.

Rounds alternate which contender goes first, so machine noise hits all alike.

Part 2 times ``python3 -c "import pipelines_port"`` against ``python3 -c
"pass"`` in fresh subprocesses, with bytecode cached (PYTHONPYCACHEPREFIX in a
temp dir, warmed once) and cold (PYTHONDONTWRITEBYTECODE=1, no cached .pyc).

Prints tables and writes JSON to bench/results/.  Targets: client overhead
(median minus the bare keep-alive median) at least 5x lower than the naive shim
over TLS; import adds at most 30 ms.  The whole-call ratio is printed too: it
is the stricter figure, since the round trip both clients share is in it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Callable, Dict, List, Optional
from urllib.parse import urlsplit

import benchlib
from benchlib import ratio, summary, table, verdict

import pipelines_port as pp

RUN_TOKEN = "bench-run-token-not-a-secret"
TOOL = "get_order"
ARGS = {"order_id": "4521", "customer_id": "cust_99"}
OVERHEAD_TARGET = 5.0
IMPORT_TARGET_MS = 30.0

Call = Callable[[], Any]


# -- the contenders ------------------------------------------------------------------


def naive_call(proxy_url: str, run_token: str, name: str, args: Dict[str, Any], context: ssl.SSLContext) -> Any:
    """The shim the code-mode docs describe: one urlopen per call, unwrap ``response``."""
    request = urllib.request.Request(
        f"{proxy_url}/tools/{name}",
        data=json.dumps(args).encode("utf-8"),
        headers={"Authorization": f"Bearer {run_token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120, context=context) as reply:
        return json.loads(reply.read())["response"]


class BareKeepAlive:
    """One reused ``http.client`` connection and nothing else: the floor of a call."""

    def __init__(self, proxy_url: str, run_token: str, context: ssl.SSLContext) -> None:
        parts = urlsplit(proxy_url)
        if parts.scheme == "https":
            self.conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=120, context=context)
        else:
            self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        self.path = parts.path
        self.headers = {"Authorization": f"Bearer {run_token}", "Content-Type": "application/json"}

    def call(self, name: str, args: Dict[str, Any]) -> Any:
        self.conn.request("POST", f"{self.path}/tools/{name}", json.dumps(args).encode("utf-8"), self.headers)
        return json.loads(self.conn.getresponse().read())["response"]

    def close(self) -> None:
        self.conn.close()


def contenders(proxy_url: str, context: ssl.SSLContext) -> "tuple[Dict[str, Call], Callable[[], None]]":
    """The calls to time, by name, and a function that releases their connections."""
    client = pp.ProxyClient(ssl_context=context, rate_per_minute=0)
    envelope = pp.Envelope.from_run({"user_instruction": "bench", "input": {}}, proxy_url=proxy_url,
                                    run_token=RUN_TOKEN)
    bare = BareKeepAlive(proxy_url, RUN_TOKEN, context)
    calls: Dict[str, Call] = {
        "pipelines_port": lambda: client.call(envelope, TOOL, ARGS),
        "naive shim": lambda: naive_call(proxy_url, RUN_TOKEN, TOOL, ARGS, context),
        "bare keep-alive": lambda: bare.call(TOOL, ARGS),
    }

    def close() -> None:
        client.close()
        bare.close()

    return calls, close


def time_calls(calls: Dict[str, Call], rounds: int, per_round: int, warmup: int) -> Dict[str, List[float]]:
    """Per-call latencies in microseconds, by contender; rounds rotate who goes first."""
    expected = {"tool": TOOL, "args": ARGS}
    for name, call in calls.items():
        for _ in range(warmup):
            if call() != expected:
                benchlib.fail(f"{name} returned an unexpected tool result")
    samples: Dict[str, List[float]] = {name: [] for name in calls}
    names = list(calls)
    clock = time.perf_counter
    for round_number in range(rounds):
        shift = round_number % len(names)
        for name in names[shift:] + names[:shift]:
            call, out = calls[name], samples[name]
            for _ in range(per_round):
                started = clock()
                call()
                out.append((clock() - started) * 1e6)
    return samples


def measure_latency(rounds: int, per_round: int, warmup: int) -> Dict[str, Any]:
    """Latency figures over TLS and plain HTTP."""
    context = benchlib.client_tls()
    results: Dict[str, Any] = {}
    for scheme, tls in (("https", True), ("http", False)):
        process, url = benchlib.start_proxy(RUN_TOKEN, tls=tls)
        try:
            calls, close = contenders(url, context)
            try:
                samples = time_calls(calls, rounds, per_round, warmup)
            finally:
                close()
        finally:
            benchlib.stop_proxy(process)
        stats = {name: summary(values) for name, values in samples.items()}
        floor = stats["bare keep-alive"]["median"]
        ours, naive = stats["pipelines_port"]["median"], stats["naive shim"]["median"]
        results[scheme] = {
            "latency_us": stats,
            "latency_ratio": ratio(naive, ours),
            "p90_ratio": ratio(stats["naive shim"]["p90"], stats["pipelines_port"]["p90"]),
            "overhead_us": {"pipelines_port": ours - floor, "naive shim": naive - floor},
            "overhead_ratio": ratio(naive - floor, ours - floor),
        }
    return results


# -- import time ---------------------------------------------------------------------


def run_python(program: str, cwd: str, env: Dict[str, str]) -> str:
    """Run ``python3 -c program`` and return its stdout; stop the benchmark if it fails."""
    done = subprocess.run([sys.executable, "-c", program], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        benchlib.fail(f"python3 -c {program!r} failed: {last}")
    return done.stdout


def measure_import(runs: int) -> Dict[str, Any]:
    """Median wall time of fresh interpreters with and without ``import pipelines_port``."""
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pp-import-") as scratch:
        module_dir = os.path.join(scratch, "module")
        os.makedirs(module_dir)
        shutil.copy2(os.path.join(benchlib.ROOT, "pipelines_port.py"), module_dir)
        base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
        modes = {
            "cached": dict(base, PYTHONPYCACHEPREFIX=os.path.join(scratch, "pycache")),
            "cold": dict(base, PYTHONDONTWRITEBYTECODE="1"),
        }
        count = "import sys; n = len(sys.modules); import pipelines_port; print(len(sys.modules) - n)"
        new_modules = int(run_python(count, module_dir, modes["cold"]))
        for mode, env in modes.items():
            programs = {"bare": "pass", "import": "import pipelines_port"}
            for program in programs.values():  # warm: the cache, the page cache, the binary
                run_python(program, module_dir, env)
            if mode == "cold" and os.path.isdir(os.path.join(module_dir, "__pycache__")):
                benchlib.fail("a cached .pyc appeared next to the module copy; the cold figure would be warm")
            samples: Dict[str, List[float]] = {name: [] for name in programs}
            for run in range(runs):
                order = list(programs.items())
                if run % 2:
                    order.reverse()
                for name, program in order:
                    started = time.perf_counter()
                    run_python(program, module_dir, env)
                    samples[name].append((time.perf_counter() - started) * 1000)
            stats = {name: summary(values) for name, values in samples.items()}
            results[mode] = {
                "wall_ms": stats,
                "import_adds_ms": stats["import"]["median"] - stats["bare"]["median"],
            }
        results["modules_added"] = new_modules
    return results


# -- report --------------------------------------------------------------------------


def report(latency: Dict[str, Any], imports: Optional[Dict[str, Any]]) -> None:
    """Print the tables and the verdicts on the targets."""
    rows = []
    for scheme, figures in latency.items():
        for name, stats in figures["latency_us"].items():
            overhead = figures["overhead_us"].get(name, 0.0)
            rows.append([scheme, name, stats["median"], stats["p90"], overhead, stats["n"]])
    print("\nSequential proxy calls (microseconds per call; overhead = median - bare keep-alive median)")
    print(table(["scheme", "client", "median us", "p90 us", "overhead us", "calls"], rows))
    rows = []
    for scheme, figures in latency.items():
        rows.append([scheme, figures["latency_ratio"], figures["p90_ratio"], figures["overhead_ratio"]])
    print("\nnaive shim / pipelines_port")
    print(table(["scheme", "median ratio", "p90 ratio", "overhead ratio"], rows))
    tls = latency["https"]
    print(f"\ntarget: client overhead >= {OVERHEAD_TARGET:.0f}x lower than the naive shim over TLS: "
          f"{tls['overhead_ratio']:.1f}x {verdict(tls['overhead_ratio'], OVERHEAD_TARGET)} "
          f"(whole-call median ratio, round trip included: {tls['latency_ratio']:.1f}x "
          f"{verdict(tls['latency_ratio'], OVERHEAD_TARGET)})")
    if imports is None:
        return
    rows = []
    for mode in ("cached", "cold"):
        figures = imports[mode]
        rows.append([mode, figures["wall_ms"]["bare"]["median"], figures["wall_ms"]["import"]["median"],
                     figures["import_adds_ms"], figures["wall_ms"]["import"]["n"]])
    print(f"\nImport time (fresh interpreters, milliseconds; the import pulls in "
          f"{imports['modules_added']} modules)")
    print(table(["bytecode", "python -c pass", "import pipelines_port", "adds", "runs"], rows))
    cached = imports["cached"]["import_adds_ms"]
    print(f"\ntarget: import adds <= {IMPORT_TARGET_MS:.0f} ms (cached): {cached:.1f} ms "
          f"{verdict(cached, IMPORT_TARGET_MS, at_most=True)}; cold: {imports['cold']['import_adds_ms']:.1f} ms "
          f"{verdict(imports['cold']['import_adds_ms'], IMPORT_TARGET_MS, at_most=True)}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Proxy-call latency and import time of pipelines_port.")
    parser.add_argument("--rounds", type=benchlib.positive_int, default=20, help="rounds per scheme (default 20)")
    parser.add_argument("--calls", type=benchlib.positive_int, default=50,
                        help="calls per contender per round (default 50)")
    parser.add_argument("--warmup", type=benchlib.positive_int, default=20, help="untimed calls first (default 20)")
    parser.add_argument("--import-runs", type=benchlib.positive_int, default=40,
                        help="interpreter starts per program and mode (default 40)")
    parser.add_argument("--skip-import", action="store_true", help="skip the import-time part")
    args = parser.parse_args(argv)
    print(f"proxy calls: {args.rounds} rounds x {args.calls} calls per contender, TLS then plain HTTP ...",
          flush=True)
    latency = measure_latency(args.rounds, args.calls, args.warmup)
    imports = None
    if not args.skip_import:
        print(f"import time: {args.import_runs} runs per program and mode ...", flush=True)
        imports = measure_import(args.import_runs)
    report(latency, imports)
    path = benchlib.write_results("bench_proxy", {
        "settings": vars(args),
        "latency": latency,
        "import": imports,
        "targets": {"tls_overhead_ratio_min": OVERHEAD_TARGET, "import_adds_ms_max": IMPORT_TARGET_MS},
    })
    print(f"\nresults: {os.path.relpath(path, benchlib.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
