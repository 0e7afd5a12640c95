"""``simulate --jobs``: wall time of a 500-row dataset against an agent whose model call takes 1 s.

    python3 bench/bench_simulate.py [--rows 500] [--jobs 1,32] [--model-s 1.0] [--trials 1]

Writes the dataset (the sample rows, repeated) and a code-mode agent that waits ``--model-s`` seconds (its
"model call"), then calls one tool through the proxy, into a temporary folder; runs
``python3 -m conformance simulate --csv ... --code ... --jobs N --trials K`` once per N, as its own process, and
prints the wall time of each, the runs per second, and the speed-up against the first.  Every run must succeed
(exit 0).  ``--trials K`` runs every row K times: ``--rows 100 --trials 3`` and ``--rows 300`` are both 300 runs,
so their times show what a trial costs beside a row.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "conformance" / "simulator" / "samples" / "orders.csv"
FIXTURES = ROOT / "conformance" / "simulator" / "samples" / "orders_fixtures.json"
AGENT = '''
import os, time
import pipelines_port as pp

def agent(envelope):
    time.sleep(float(os.environ.get("BENCH_MODEL_S", "1")))  # the model thinking
    result = pp.proxy_call("search_kb", {"query": envelope.user_instruction}, errors="return")
    return "The knowledge base says: " + str(result)[:200]

run = pp.code_mode(agent)
'''


def write_dataset(path: pathlib.Path, count: int) -> pathlib.Path:
    """``count`` rows: the sample's, repeated, each instruction made unique with its number."""
    with open(SAMPLE, newline="", encoding="utf-8") as f:
        sample = list(csv.DictReader(f))
    rows = [dict(sample[i % len(sample)], user=f"{sample[i % len(sample)]['user']} (#{i})") for i in range(count)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(sample[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--jobs", default="1,32")
    parser.add_argument("--model-s", type=float, default=1.0)
    parser.add_argument("--trials", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        dataset = write_dataset(folder / "tasks.csv", args.rows)
        agent = folder / "agent.py"
        agent.write_text(AGENT, encoding="utf-8")
        times = {}
        for jobs in [int(j) for j in args.jobs.split(",")]:
            out = folder / f"report-{jobs}.json"
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "conformance", "simulate", "--csv", str(dataset), "--code",
                                   str(agent), "--responses", str(FIXTURES), "--jobs", str(jobs), "--trials",
                                   str(args.trials), "--json", str(out)],
                                  cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "BENCH_MODEL_S": str(args.model_s)})
            times[jobs] = time.monotonic() - started
            summary = json.loads(out.read_text())["summary"]
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            over = f" ({args.rows} rows x {args.trials} trials)" if args.trials > 1 else ""
            print(f"--jobs {jobs:>3}: {times[jobs]:7.1f} s wall for {summary['runs']} runs{over} "
                  f"({summary['runs'] / times[jobs]:.1f} runs/s, {summary['tool_calls']} tool calls, "
                  f"{summary['injected']} injected)", flush=True)
        first = next(iter(times))
        for jobs, seconds in times.items():
            if jobs != first:
                print(f"--jobs {jobs} is {times[first] / seconds:.1f}x faster than --jobs {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
