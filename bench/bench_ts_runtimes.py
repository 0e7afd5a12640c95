"""The TypeScript port's fetch handler on Node, Bun and Deno against its Node server (startServer), same run.

    python3 bench/bench_ts_runtimes.py                       # about 2 minutes after the first install
    python3 bench/bench_ts_runtimes.py --rounds 5 --duration 3 --connections 16

The package is packed from the checkout and installed beside the locked hosts of the tests
(``tests/data/typescript_package`` for @hono/node-server, ``tests/data/typescript_runtimes`` for bun and deno)
in ``bench/.ts-runtimes/``.  Four servers run the same agent, which makes one proxy call
(``proxyCall("get_order")``) and answers: ``startServer`` on Node (the reference), ``fetchHandler`` under
@hono/node-server's ``serve`` on Node, under ``Bun.serve`` and under ``Deno.serve``.  Two workloads, each on
``--connections`` keep-alive connections for ``--duration`` seconds: the platform's ping, and a dispatch whose
agent calls a lean proxy (``bench/lean_proxy.py``, answering at once).  Rounds take turns in which server goes
first; the table shows each server's median requests per second and its ratio to the Node server's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

from benchlib import machine, median, ratio, table, write_results
from loadgen import build_request, run_load

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from tests.port_process import PortServer  # noqa: E402
from tests.ts_package import DATA, NPM, pack  # noqa: E402

AGENT_TOKEN = "bench-agent-token-4b4b4b4b"
RUN_TOKEN = "bench-run-token"
AGENT = """async function agent() {
  await proxyCall("get_order", { order_id: "4521" });
  return "done";
}
"""
SERVERS = {  # name -> (project, file, its code)
    "node startServer": ("typescript_package", "node_server.mjs", 'import { proxyCall, startServer } from "pipelines-port";\n'
                         + AGENT + 'const { url } = await startServer(agent, { host: "127.0.0.1", port: 0 });\n'
                         'console.log(`listening on ${url}`);\n'),
    "node fetchHandler": ("typescript_package", "node_fetch.mjs", 'import { serve } from "@hono/node-server";\n'
                          'import { fetchHandler, proxyCall } from "pipelines-port";\n' + AGENT
                          + 'serve({ fetch: fetchHandler(agent), hostname: "127.0.0.1", port: 0 },\n'
                          '  (info) => console.log(`listening on http://127.0.0.1:${info.port}/dispatch`));\n'),
    "bun fetchHandler": ("typescript_runtimes", "bun_fetch.ts", 'import { fetchHandler, proxyCall } from "pipelines-port";\n'
                         + AGENT + 'const server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: fetchHandler(agent) });\n'
                         'console.log(`listening on ${server.url}dispatch`);\n'),
    "deno fetchHandler": ("typescript_runtimes", "deno_fetch.ts", 'import { fetchHandler, proxyCall } from "pipelines-port";\n'
                          + AGENT + 'Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: ({ port }) =>\n'
                          '  console.log(`listening on http://127.0.0.1:${port}/dispatch`) }, fetchHandler(agent));\n'),
}


def prepare(work: pathlib.Path) -> Dict[str, pathlib.Path]:
    """The two projects in ``work`` with the package freshly packed and installed; the servers' scripts in them."""
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "pack", ignore_errors=True)
    (work / "pack").mkdir()
    tarball = pack(work / "pack")
    projects = {}
    for project in {p for p, _, _ in SERVERS.values()}:
        app = work / project
        if not (app / "node_modules").exists():
            shutil.rmtree(app, ignore_errors=True)
            shutil.copytree(DATA / project, app)
            subprocess.run([str(NPM), "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=app, check=True)
        subprocess.run([str(NPM), "install", "--no-save", str(tarball.path), "--no-audit", "--no-fund",
                        "--loglevel=error"], cwd=app, check=True)
        projects[project] = app
    for project, name, code in SERVERS.values():
        (projects[project] / name).write_text(code)
    return projects


def command(name: str, app: pathlib.Path) -> List[str]:
    script = SERVERS[name][1]
    if name.startswith("bun"):
        return [str(app / "node_modules" / ".bin" / "bun"), script]
    if name.startswith("deno"):
        return [str(app / "node_modules" / ".bin" / "deno"), "run", "--allow-net", "--allow-env", "--allow-read", script]
    return [str(shutil.which("node")), script]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=2.0, help="measured seconds per server and workload")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--work", default=str(BENCH / ".ts-runtimes"))
    args = parser.parse_args(argv)
    projects = prepare(pathlib.Path(args.work))
    proxy = subprocess.Popen([sys.executable, str(BENCH / "lean_proxy.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "BENCH_RUN_TOKEN": RUN_TOKEN})
    proxy_url = json.loads(proxy.stdout.readline())["url"] if proxy.stdout else ""
    env = {"PIPELINES_PROXY_RATE_PER_MINUTE": "0"}  # one run token for every dispatch: pacing off
    servers = {name: PortServer(command(name, projects[SERVERS[name][0]]), agent_token=AGENT_TOKEN, env=env,
                                cwd=str(projects[SERVERS[name][0]])) for name in SERVERS}
    auth = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    bodies = {"ping": (b'{"ping": true}', auth, b'{"ok":true}'),
              "dispatch + 1 proxy call": (json.dumps({"odyssey_proxy_url": proxy_url, "input": {"user_instruction": "x"}}).encode(),
                                          {**auth, "X-Pipelines-Run-Token": f"{RUN_TOKEN}-1"}, b'{"final_response":"done"}')}
    rps: Dict[str, Dict[str, List[float]]] = {w: {n: [] for n in SERVERS} for w in bodies}
    try:
        names = list(SERVERS)
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for workload, (body, headers, want) in bodies.items():
                for name in order:
                    server = servers[name]
                    path = "/" + server.url.split("//", 1)[1].split("/", 1)[1]
                    request = build_request(server.host, server.port, path, body, headers)
                    result = run_load(server.host, server.port, request, connections=args.connections,
                                      duration=args.duration, check=lambda status, reply: status == 200 and reply == want)
                    assert result["errors"] == 0, (name, workload, result["first_error"])
                    rps[workload][name].append(result["rps"])
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()
        if proxy.stdin:
            proxy.stdin.close()
        proxy.wait(10)
    for workload in bodies:
        base = median(rps[workload]["node startServer"])
        rows = [[name, f"{median(v):.0f}", f"{ratio(median(v), base):.2f}x"] for name, v in rps[workload].items()]
        print(f"\n{workload}: requests per second, median of {args.rounds} rounds, {args.connections} connections")
        print(table(["server", "req/s", "vs node startServer"], rows))
    path = write_results("ts_runtimes", {"machine": machine(), "args": vars(args), "rps": rps})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
