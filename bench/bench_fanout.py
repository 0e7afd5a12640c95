"""Fan-out: the platform dispatches many runs at once.  How long until all are answered, and at what memory?

    python3 bench/bench_fanout.py [--dispatches 300] [--latency 1.0] [--cap 120]
                                  [--servers pipelines_port,pipelines_port_uvicorn,pipelines_port_gunicorn,reference,tuned]

Each server (a process of its own, as in bench_server.py) serves an agent making three proxy calls one after
another; the proxy (bench/proxy_process.py, its own process) answers each after ``--latency`` seconds, as a
simulated tool does.  ``--dispatches`` dispatches are sent at once, each on a connection of its own with a run
token of its own; measured per server, all in the same run:

- the time until the last one is answered (3 × latency at best), and how many were answered 200;
- the server's peak resident memory (VmHWM, of the process and its children for gunicorn).

Servers: ``pipelines_port`` (http.server, ``python3 -m pipelines_port serve``), ``pipelines_port_uvicorn``
(the ASGI app under uvicorn), ``pipelines_port_gunicorn`` (the WSGI app under gunicorn, gthread, one worker,
``--threads`` threads: the README's recipe), ``reference`` (FastAPI + uvicorn shaped like the platform docs'
wrapper: a synchronous ``httpx.post`` per tool call) and ``tuned`` (one shared ``httpx.AsyncClient``).  A
server that has not answered every dispatch within ``--cap`` seconds is reported with how many it had.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import benchlib
from bench_server import AGENT_TOKEN, HOST, PATH, RUN_TOKEN, Server, make_servers, venv_python

OURS_GUNICORN = "pipelines_port_gunicorn"
DEFAULT = ["pipelines_port", "pipelines_port_uvicorn", OURS_GUNICORN, "reference", "tuned"]


def rss_peak_kib(pid: int) -> int:
    """VmHWM of ``pid`` plus that of its children (gunicorn's worker)."""
    total = 0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def dispatch(port: int, proxy_url: str, number: int, timeout: float) -> int:
    body = json.dumps({"task_id": number, "run_id": number, "odyssey_proxy_url": proxy_url,
                       "input": {"task_id": number, "user_instruction": "Refund order #4521.",
                                 "input": {"customer_id": "cust_99", "order_id": "4521"}}}).encode()
    headers = {"Authorization": f"Bearer {AGENT_TOKEN}", "Content-Type": "application/json",
               "X-Pipelines-Run-Token": f"{RUN_TOKEN}-{number:08d}", "X-Pipelines-Odyssey-Proxy-Url": proxy_url}
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", PATH, body=body, headers=headers)
        reply = conn.getresponse()
        reply.read()
        return reply.status
    except OSError:
        return 0
    finally:
        conn.close()


def fan_out(server: Server, proxy_url: str, count: int, cap: float) -> Dict[str, Any]:
    answered: List[float] = []
    statuses: Dict[int, int] = {}
    lock = threading.Lock()
    started = time.monotonic()

    def one(number: int) -> None:
        status = dispatch(server.port, proxy_url, number, cap)
        with lock:
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                answered.append(time.monotonic() - started)

    pool = ThreadPoolExecutor(max_workers=count)
    for number in range(1, count + 1):
        pool.submit(one, number)
    pool.shutdown(wait=True)
    within = [t for t in answered if t <= cap]
    return {"ok": len(within), "statuses": statuses, "all_done_s": max(answered) if len(within) == count else None,
            "median_s": sorted(answered)[len(answered) // 2] if answered else None,
            "peak_rss_mib": round(rss_peak_kib(server.pid) / 1024, 1)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dispatches", type=int, default=300)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a server gets for the whole fan-out")
    parser.add_argument("--threads", type=int, default=64, help="gunicorn gthread threads (default 64)")
    parser.add_argument("--servers", default=",".join(DEFAULT))
    args = parser.parse_args(argv)
    names = [n for n in args.servers.split(",") if n]
    python = venv_python() if any(n != "pipelines_port" for n in names) else None
    proxy = subprocess.Popen([sys.executable, os.path.join(benchlib.BENCH, "proxy_process.py"), "--latency",
                              str(args.latency)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, BENCH_RUN_TOKEN=RUN_TOKEN))
    assert proxy.stdout is not None
    proxy_url = json.loads(proxy.stdout.readline())["url"]
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as pycache:
        plain = [n for n in names if n != OURS_GUNICORN]
        servers = make_servers(plain, python, pycache, access_log=False)
        if OURS_GUNICORN in names:
            assert python is not None
            port = benchlib.free_port()
            env = {k: v for k, v in os.environ.items() if k not in ("AGENT_TOKEN",)}
            env.update(BENCH_AGENT_TOKEN=AGENT_TOKEN, PYTHONPATH=benchlib.ROOT, PYTHONPYCACHEPREFIX=pycache)
            servers.append(Server(OURS_GUNICORN, [python, "-m", "gunicorn", "wsgi_app:application", "--chdir",
                                                  benchlib.BENCH, "-k", "gthread", "--threads", str(args.threads),
                                                  "--timeout", "330", "--bind", f"{HOST}:{port}"], env, port))
        try:
            for server in servers:
                server.start()
                try:
                    dispatch(server.port, proxy_url, 0, 30)  # warm: imports, connections
                    results[server.name] = fan_out(server, proxy_url, args.dispatches, args.cap)
                finally:
                    server.stop()
                r = results[server.name]
                done = f"{r['all_done_s']:.1f} s" if r["all_done_s"] is not None else f"not all within {args.cap:g} s"
                print(f"{server.name:<26} {r['ok']:>4}/{args.dispatches} answered 200, all done: {done:<22} "
                      f"median {r['median_s'] or 0:.1f} s, peak RSS {r['peak_rss_mib']} MiB", flush=True)
        finally:
            proxy.stdin.close()  # type: ignore[union-attr]
            proxy.wait(timeout=10)
    os.makedirs(benchlib.RESULTS, exist_ok=True)
    out = os.path.join(benchlib.RESULTS, "fanout.json")
    with open(out, "w") as f:
        json.dump({"dispatches": args.dispatches, "latency_s": args.latency, "results": results}, f, indent=1)
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
