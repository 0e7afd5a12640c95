"""Fan-out: the platform dispatches many runs at once.  How long until all are answered, at what CPU and memory?

    python3 bench/bench_fanout.py [--dispatches 300,1000,2000] [--latency 1.0] [--repeat 3] [--cap 120]
                                  [--servers sync,async,async_uvicorn,aiohttp,tuned] [--proxy lean|mock] [--steps]
                                  [--before-rev REV]

Each server (a process of its own) serves an agent making three proxy calls one after another; the proxy (a
process of its own: ``lean``, bench/lean_proxy.py, asyncio, or ``mock``, the threaded MockProxy of
bench/proxy_process.py) answers each after ``--latency`` seconds, as a simulated tool does.  For each count of
``--dispatches``, that many dispatches are sent at once by an asyncio load generator (each on a connection
of its own with a run token of its own), ``--repeat`` times per server, the servers taking turns; measured
per server, all in the same run:

- the time until the last one is answered, as a multiple of the agent's own time (3 × latency), and how
  many were answered 200;
- the server's CPU time per dispatch (user + system, of the process and its children, from /proc);
- the server's peak resident memory (VmHWM, of the process and its children).

Servers: ``sync`` (``python3 -m pipelines_port serve`` with a sync agent: a thread per dispatch, its calls
on the blocking driver), ``async`` (the same server, an ``async def`` agent awaiting ``pp.aproxy_call``:
every dispatch on one event loop), ``async_uvicorn`` (the ASGI app with the async agent under uvicorn),
``threads`` (the sync agent under ``serve --server threads``: a thread per connection), ``sync_before``,
``async_before``, ``threads_before`` (the same from the module at ``--before-rev``, to compare a change), ``aiohttp`` (an aiohttp server and
one ``ClientSession``, the same agent: bench/aiohttp_peer.py), ``tuned`` (FastAPI + uvicorn with one
``httpx.AsyncClient``), ``reference`` (FastAPI with a synchronous ``httpx.post`` per call, as the platform
docs' wrapper) and ``pipelines_port_gunicorn`` (the WSGI app under gunicorn gthread).  The peers run in
bench/.venv (made on first use).  ``lean`` (bench/lean_server.py, standard library) is the floor: an asyncio
server and pooled keep-alive client with no validation, retries or timeouts, the same agent.  A server that has not answered every dispatch within ``--cap`` seconds is
reported with how many it had.  Medians over the repeats go to bench/results/fanout.json.  With ``--steps`` the
lean proxy records every call it reads, and a second table shows where each dispatch's time went: until its
request was written (the load generator), until its first proxy call (the server accepting, reading, checking
and starting it), from each call to the next and from the last to its reply, less the proxy's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import benchlib
from bench_server import AGENT_TOKEN, HOST, PATH, RUN_TOKEN, Server, make_servers, venv_python

DEFAULT = ["sync", "async", "async_uvicorn", "aiohttp", "tuned"]
# Like every peer here (uvicorn --no-access-log, aiohttp access_log=None), without a log line per request.
OURS = {"sync": ["bench/agents.py:three_calls", "--no-access-log"],
        "async": ["bench/agents.py:three_calls_async", "--no-access-log"],
        "threads": ["bench/agents.py:three_calls", "--server", "threads", "--no-access-log"]}
BEFORE = "_before"  # sync_before, async_before, threads_before: the same server from the module at --before-rev
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _family(pid: int) -> List[int]:
    """``pid`` and its children (gunicorn's and uvicorn's workers)."""
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return pids


def rss_peak_kib(pid: int) -> int:
    """VmHWM of ``pid`` plus that of its children."""
    total = 0
    for p in _family(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and its children so far."""
    total = 0
    for p in _family(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            pass
    return total / CLK_TCK


INSTRUCTION = "Refund order #4521."


def request_bytes(proxy_url: str, number: int, instruction: str = INSTRUCTION) -> bytes:
    body = json.dumps({"task_id": number, "run_id": number, "odyssey_proxy_url": proxy_url,
                       "input": {"task_id": number, "user_instruction": instruction,
                                 "input": {"customer_id": "cust_99", "order_id": "4521"}}}).encode()
    head = (f"POST {PATH} HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {AGENT_TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"X-Pipelines-Run-Token: {RUN_TOKEN}-{number:08d}\r\nX-Pipelines-Odyssey-Proxy-Url: {proxy_url}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


async def _one(port: int, data: bytes, started: float, cap: float) -> Tuple[int, float, float]:
    """Status, completion time and time its request was written, of one dispatch on a connection of its own
    (status 0: no reply)."""
    written = float("nan")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), cap)
        writer.write(data)
        written = time.monotonic() - started
        reply = await asyncio.wait_for(reader.read(), cap)
        writer.close()
        return int(reply.split(b" ", 2)[1]), time.monotonic() - started, written
    except (OSError, asyncio.TimeoutError, IndexError, ValueError):
        return 0, time.monotonic() - started, written


async def _fan_out(port: int, proxy_url: str, count: int, cap: float, first: int,
                   instruction: str = INSTRUCTION) -> Tuple[float, List[Tuple[int, float, float]]]:
    requests = [request_bytes(proxy_url, first + i, instruction) for i in range(count)]
    started = time.monotonic()
    return started, await asyncio.gather(*(_one(port, data, started, cap) for data in requests))


def fan_out(server: Server, proxy_url: str, count: int, cap: float, first: int,
            instruction: str = INSTRUCTION, timings: bool = False) -> Dict[str, Any]:
    """``count`` dispatches at once (user_instruction ``instruction``): how many answered 200, by when, at what
    server CPU and memory; with ``timings``, also when the fan-out started and each dispatch's write and
    completion, for :func:`steps`."""
    cpu_before = cpu_seconds(server.pid)
    started, results = asyncio.run(_fan_out(server.port, proxy_url, count, cap, first, instruction))
    cpu = cpu_seconds(server.pid) - cpu_before
    statuses: Dict[int, int] = {}
    for status, _, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    answered = sorted(t for status, t, _ in results if status == 200 and t <= cap)
    out = {"ok": len(answered), "statuses": statuses,
           "all_done_s": answered[-1] if len(answered) == count else None,
           "cpu_ms_per_dispatch": 1000 * cpu / count, "peak_rss_mib": round(rss_peak_kib(server.pid) / 1024, 1)}
    if timings:
        out["timings"] = (first, started, [(written, done) for _, done, written in results])
    return out


STEPS = ("requests written", "to the 1st call", "1st to 2nd call", "2nd to 3rd call", "3rd call to reply")


def steps(record: List[Tuple[float, str, str]], run: Dict[str, Any], latency: float) -> Dict[str, List[float]]:
    """Where each dispatch of one fan-out spent its time, from the proxy's record (bench/lean_proxy.py
    ``--record``): its request written, its first call, each later call and its reply, less the proxy's
    ``latency`` per call (seconds; dispatches whose three calls are not all recorded are left out)."""
    calls: Dict[str, List[float]] = {}
    for at, token, _ in record:
        calls.setdefault(token, []).append(at)
    first, started, timings = run["timings"]
    out: Dict[str, List[float]] = {name: [] for name in STEPS}
    for i, (written, done) in enumerate(timings):
        at = sorted(calls.get(f"{RUN_TOKEN}-{first + i:08d}", ()))
        if len(at) != 3:
            continue
        for name, value in zip(STEPS, (written, at[0] - started, at[1] - at[0] - latency, at[2] - at[1] - latency,
                                       started + done - at[2] - latency)):
            out[name].append(value)
    return out


def print_steps(record: List[Tuple[float, str, str]], runs: Dict[str, Dict[int, List[Dict[str, Any]]]],
                latency: float) -> None:
    print("\nwhere the time went (ms; p50 / max over the dispatches, median over the repeats):")
    print(f"{'':24}" + "".join(f"{name:>20}" for name in STEPS))
    for name, by_count in runs.items():
        for count, fan_outs in by_count.items():
            cells = []
            each = [steps(record, run, latency) for run in fan_outs]
            for step in STEPS:
                p50 = statistics.median(statistics.median(s[step]) for s in each if s[step])
                top = statistics.median(max(s[step]) for s in each if s[step])
                cells.append(f"{p50 * 1000:9.0f} / {top * 1000:6.0f}")
            print(f"{count:>5} {name:<18}" + "".join(f"{c:>20}" for c in cells))


def build_servers(names: List[str], python: Optional[str], pycache: str, threads: int) -> List[Server]:
    dropped = ("AGENT_TOKEN", "BENCH_AGENT_TOKEN", "PEER_STYLE", "PYTHONDONTWRITEBYTECODE", "BENCH_AGENT_ASYNC")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    base.update(PYTHONPYCACHEPREFIX=pycache)
    servers = []
    for name in names:
        port = benchlib.free_port()
        if name in OURS or name.endswith(BEFORE) and name[:-len(BEFORE)] in OURS:
            before = os.path.join(pycache, "before", "pipelines_port.py")
            launch = ["-m", "pipelines_port"] if name in OURS else [before]
            command = [sys.executable, *launch, "serve", *OURS[name.replace(BEFORE, "")], "--host", HOST, "--port",
                       str(port), "--token-env", "BENCH_AGENT_TOKEN"]
            servers.append(Server(name, command, dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN), port))
        elif name == "async_uvicorn":
            assert python is not None
            command = [python, "-m", "uvicorn", "uvicorn_app:app", "--app-dir", benchlib.BENCH, "--host", HOST,
                       "--port", str(port), "--no-access-log", "--backlog", "4096"]
            env = dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN, BENCH_AGENT_ASYNC="1", PYTHONPATH=benchlib.ROOT)
            servers.append(Server(name, command, env, port))
        elif name == "lean":
            command = [sys.executable, os.path.join(benchlib.BENCH, "lean_server.py"), "--port", str(port)]
            servers.append(Server(name, command, dict(base, AGENT_TOKEN=AGENT_TOKEN), port))
        elif name == "aiohttp":
            assert python is not None
            command = [python, os.path.join(benchlib.BENCH, "aiohttp_peer.py"), "--port", str(port)]
            servers.append(Server(name, command, dict(base, AGENT_TOKEN=AGENT_TOKEN), port))
        elif name == "pipelines_port_gunicorn":
            assert python is not None
            env = dict(base, BENCH_AGENT_TOKEN=AGENT_TOKEN, PYTHONPATH=benchlib.ROOT)
            servers.append(Server(name, [python, "-m", "gunicorn", "wsgi_app:application", "--chdir",
                                         benchlib.BENCH, "-k", "gthread", "--threads", str(threads),
                                         "--timeout", "330", "--bind", f"{HOST}:{port}"], env, port))
        elif name in ("reference", "tuned"):
            servers.extend(make_servers([name], python, pycache, access_log=False))
        else:
            benchlib.fail(f"unknown server {name!r}")
    return servers


def start_proxy(kind: str, latency: float, record: Optional[str] = None) -> Tuple[subprocess.Popen, str]:
    script = "lean_proxy.py" if kind == "lean" else "proxy_process.py"
    extra = ["--record", record] if record else []
    proxy = subprocess.Popen([sys.executable, os.path.join(benchlib.BENCH, script), "--latency", str(latency), *extra],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, BENCH_RUN_TOKEN=RUN_TOKEN))
    assert proxy.stdout is not None
    return proxy, json.loads(proxy.stdout.readline())["url"]


def _raise_file_limit() -> None:
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))  # inherited by the servers and the proxy


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatches", default="300,1000,2000", help="comma-separated counts (default 300,1000,2000)")
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3, help="fan-outs per server and count; medians reported")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a server gets for one fan-out")
    parser.add_argument("--threads", type=int, default=64, help="gunicorn gthread threads (default 64)")
    parser.add_argument("--servers", default=",".join(DEFAULT))
    parser.add_argument("--proxy", choices=("lean", "mock"), default="lean")
    parser.add_argument("--before-rev", default="40680a5", metavar="REV",
                        help="the module the *_before servers run (git show REV:pipelines_port.py; default 40680a5, "
                             "the module before issue 40's reshape)")
    parser.add_argument("--steps", action="store_true",
                        help="also show where each dispatch's time went: its request written, its first proxy call, "
                             "each later one, its reply (from the lean proxy's record)")
    args = parser.parse_args(argv)
    if args.steps and args.proxy != "lean":
        parser.error("--steps needs --proxy lean (the proxy that records the calls)")
    names = [n for n in args.servers.split(",") if n]
    counts = [int(c) for c in args.dispatches.split(",") if c]
    _raise_file_limit()
    python = venv_python() if any(n.replace(BEFORE, "") not in OURS and n != "lean" for n in names) else None
    record = os.path.join(tempfile.gettempdir(), f"fanout-record-{os.getpid()}.json") if args.steps else None
    proxy, proxy_url = start_proxy(args.proxy, args.latency, record)
    agent_s = 3 * args.latency
    runs: Dict[str, Dict[int, List[Dict[str, Any]]]] = {n: {c: [] for c in counts} for n in names}
    summary: Dict[str, Dict[str, Any]] = {}
    first = 1
    with tempfile.TemporaryDirectory() as pycache:
        if any(n.endswith(BEFORE) for n in names):
            os.mkdir(os.path.join(pycache, "before"))
            with open(os.path.join(pycache, "before", "pipelines_port.py"), "wb") as f:
                f.write(subprocess.run(["git", "show", f"{args.before_rev}:pipelines_port.py"], cwd=benchlib.ROOT,
                                       check=True, capture_output=True).stdout)
        servers = build_servers(names, python, pycache, args.threads)
        try:
            for server in servers:
                server.start()
            for server in servers:
                asyncio.run(_fan_out(server.port, proxy_url, 20, 30, 0))  # warm: imports, pools
            for count in counts:
                for _ in range(args.repeat):
                    for server in servers:  # taking turns, so drift on the machine hits every server alike
                        runs[server.name][count].append(fan_out(server, proxy_url, count, args.cap, first,
                                                                timings=args.steps))
                        first += count
                for server in servers:
                    done = [r["all_done_s"] for r in runs[server.name][count]]
                    complete = [d for d in done if d is not None]
                    median = statistics.median(complete) if len(complete) == len(done) else None
                    cpu = statistics.median(r["cpu_ms_per_dispatch"] for r in runs[server.name][count])
                    rss = max(r["peak_rss_mib"] for r in runs[server.name][count])
                    ok = min(r["ok"] for r in runs[server.name][count])
                    summary.setdefault(server.name, {})[str(count)] = {
                        "all_done_median_s": median, "multiple_of_agent_time": median and median / agent_s,
                        "cpu_ms_per_dispatch_median": cpu, "peak_rss_mib": rss, "min_ok": ok,
                        "runs": [{k: v for k, v in r.items() if k != "timings"} for r in runs[server.name][count]]}
                    shown = f"{median:6.2f} s = {median / agent_s:4.2f}x" if median else f"not all within {args.cap:g} s"
                    print(f"{count:>5} at once  {server.name:<16} {ok:>5}/{count} ok  all done {shown:<22} "
                          f"CPU {cpu:5.2f} ms/dispatch  peak RSS {rss} MiB", flush=True)
        finally:
            for server in servers:
                server.stop()
            assert proxy.stdin is not None
            proxy.stdin.close()
            proxy.wait(timeout=10)
    if record is not None:
        with open(record) as f:
            calls = json.load(f)
        os.unlink(record)
        print_steps(calls, runs, args.latency)
    os.makedirs(benchlib.RESULTS, exist_ok=True)
    out = os.path.join(benchlib.RESULTS, "fanout.json")
    with open(out, "w") as f:
        json.dump({"dispatches": counts, "latency_s": args.latency, "repeat": args.repeat, "proxy": args.proxy,
                   "cpus": os.cpu_count(), "results": summary}, f, indent=1)
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
