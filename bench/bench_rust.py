"""The Rust port's conformance server against the Python one on the fan-out workload, in the same run.

    python3 bench/bench_rust.py [--dispatches 300,1000] [--latency 1.0] [--repeat 3] [--cap 120]

N dispatches are sent at once (each on a connection of its own, with a run token of its own); each makes three
tool calls, one after another, against a proxy (bench/lean_proxy.py, a process of its own) that answers each
after ``--latency`` seconds, as a simulated tool does. Servers, taking turns so that drift on the machine hits
both alike:

- ``rust``: ``conformance/ports/rust``'s ``conformance-server`` (release build, axum on tokio, the reqwest
  driver), whose conformance agent runs the three calls as a script (``{"steps": [{"call": ...}, ...]}``);
- ``python``: ``python3 -m pipelines_port serve bench/agents.py:three_calls_async`` (the asyncio server, every
  dispatch on one event loop, the same three calls).

Both get the same request bytes. Measured per server and count: the median time until the last dispatch is
answered (and as a multiple of the agent's own time, 3 × latency), the server's CPU time per dispatch and its
peak resident memory; then the ratio python / rust of each median. Results go to
bench/results/rust-latest.json (and rust-<UTC time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional

import benchlib
from bench_fanout import _raise_file_limit, fan_out, start_proxy
from bench_server import AGENT_TOKEN, HOST, Server

PORT_DIR = os.path.join(benchlib.ROOT, "conformance", "ports", "rust")
SCRIPT = json.dumps({"steps": [{"call": "get_order", "args": {"order_id": "4521"}},
                               {"call": "get_customer", "args": {"customer_id": "cust_99"}},
                               {"call": "issue_refund", "args": {"order_id": "4521", "reason": "late"}}]})


def build_rust() -> str:
    """``cargo build --release`` of the conformance server (the shared target directory of tests/rust_mutants.py)."""
    sys.path.insert(0, benchlib.ROOT)
    from tests.rust_mutants import CARGO, target_dir

    if CARGO is None:
        benchlib.fail("cargo is not on PATH: the Rust port cannot be built")
    target = target_dir()
    done = subprocess.run([str(CARGO), "build", "--release", "--locked", "--bin", "conformance-server"], cwd=PORT_DIR,
                          env=dict(os.environ, CARGO_TARGET_DIR=str(target)), capture_output=True, text=True)
    if done.returncode != 0:
        benchlib.fail(f"cargo build failed: {done.stderr[-800:]}")
    exe = os.path.join(tempfile.mkdtemp(prefix="bench-rust-"), "conformance-server")
    shutil.copy2(os.path.join(str(target), "release", "conformance-server"), exe)
    return exe


def servers(rust_exe: str) -> List[Server]:
    base = {k: v for k, v in os.environ.items() if k not in ("AGENT_TOKEN", "BENCH_AGENT_TOKEN")}
    base["PIPELINES_PROXY_RATE_PER_MINUTE"] = "0"  # one run token per dispatch: pacing never waits; off for both
    rust_port, python_port = benchlib.free_port(), benchlib.free_port()
    return [
        Server("rust", [rust_exe, "--host", HOST, "--port", str(rust_port), "--token-env", "BENCH_AGENT_TOKEN"],
               dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN), rust_port),
        Server("python", [sys.executable, "-m", "pipelines_port", "serve", "bench/agents.py:three_calls_async",
                          "--host", HOST, "--port", str(python_port), "--token-env", "BENCH_AGENT_TOKEN"],
               dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN), python_port),
    ]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatches", default="300,1000", help="comma-separated counts (default 300,1000)")
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3, help="fan-outs per server and count; medians reported")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a server gets for one fan-out")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.dispatches.split(",") if c]
    _raise_file_limit()
    rust_exe = build_rust()
    proxy, proxy_url = start_proxy("lean", args.latency)
    agent_s = 3 * args.latency
    both = servers(rust_exe)
    runs: Dict[str, Dict[int, List[Dict[str, Any]]]] = {s.name: {c: [] for c in counts} for s in both}
    summary: Dict[str, Dict[str, Any]] = {}
    first = 1
    try:
        for server in both:
            server.start()
        for server in both:
            fan_out(server, proxy_url, 20, 30, 0, SCRIPT)  # warm: imports, pools
        for count in counts:
            for _ in range(args.repeat):
                for server in both:
                    runs[server.name][count].append(fan_out(server, proxy_url, count, args.cap, first, SCRIPT))
                    first += count
            medians: Dict[str, Optional[float]] = {}
            for server in both:
                done = [r["all_done_s"] for r in runs[server.name][count]]
                median = statistics.median(done) if all(d is not None for d in done) else None
                cpu = statistics.median(r["cpu_ms_per_dispatch"] for r in runs[server.name][count])
                rss = max(r["peak_rss_mib"] for r in runs[server.name][count])
                ok = min(r["ok"] for r in runs[server.name][count])
                medians[server.name] = median
                summary.setdefault(server.name, {})[str(count)] = {
                    "all_done_median_s": median, "multiple_of_agent_time": median and median / agent_s,
                    "cpu_ms_per_dispatch_median": cpu, "peak_rss_mib": rss, "min_ok": ok,
                    "runs": runs[server.name][count]}
                shown = f"{median:6.2f} s = {median / agent_s:4.2f}x" if median else f"not all within {args.cap:g} s"
                print(f"{count:>5} at once  {server.name:<7} {ok:>5}/{count} ok  all done {shown:<22} "
                      f"CPU {cpu:6.2f} ms/dispatch  peak RSS {rss} MiB", flush=True)
            rust_cpu = summary["rust"][str(count)]["cpu_ms_per_dispatch_median"]
            python_cpu = summary["python"][str(count)]["cpu_ms_per_dispatch_median"]
            ratio = {"all_done": (medians["python"] / medians["rust"]) if medians["python"] and medians["rust"] else None,
                     "cpu_per_dispatch": python_cpu / rust_cpu if rust_cpu else None}
            summary.setdefault("ratio_python_over_rust", {})[str(count)] = ratio
            print(f"{count:>5} at once  python / rust: all done {ratio['all_done'] or float('nan'):.2f}x, "
                  f"CPU per dispatch {ratio['cpu_per_dispatch'] or float('nan'):.2f}x", flush=True)
    finally:
        for server in both:
            server.stop()
        assert proxy.stdin is not None
        proxy.stdin.close()
        proxy.wait(timeout=10)
    out = benchlib.write_results("rust", {"dispatches": counts, "latency_s": args.latency, "repeat": args.repeat,
                                          "machine": benchlib.machine(), "results": summary})
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
