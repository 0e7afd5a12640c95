"""The judge's cost on wall time: ``simulate --judge`` against the same run without one, and a cached re-run.

    python3 bench/bench_judge.py [--rows 500] [--jobs 32] [--model-s 1.0] [--judge-s 0.5] [--repeat 3]

The dataset and agent are ``bench_simulate.py``'s (the sample rows repeated; a code-mode agent whose "model
call" takes ``--model-s`` seconds, then one tool call).  The judge is an OpenAI-compatible stand-in on
127.0.0.1 that answers each request after ``--judge-s`` seconds (``tests/fake_chat_server.py``).  Per
repeat, three runs, each ``python3 -m conformance simulate`` in its own process:

1. no judge;
2. ``--judge`` with an empty answer cache (every row asks the stand-in);
3. the same again, with the cache the second run filled (nothing is asked).

Prints the median wall time of each, the judge's added time (run 2 minus run 1) as a share of run 1, and the
cached re-run's added time (run 3 minus run 1) against the first's.  Every run must succeed and judge every
row; the third must ask nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_simulate import AGENT, FIXTURES, write_dataset  # noqa: E402
from tests.fake_chat_server import FakeChatServer, Reply  # noqa: E402


def run(folder: pathlib.Path, dataset: pathlib.Path, agent: pathlib.Path, jobs: int, model_s: float,
        extra: List[str], name: str) -> Dict[str, float]:
    out = folder / f"{name}.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "conformance", "simulate", "--csv", str(dataset), "--code", str(agent),
                           "--responses", str(FIXTURES), "--jobs", str(jobs), "--json", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "BENCH_MODEL_S": str(model_s)})
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    summary = json.loads(out.read_text(encoding="utf-8"))["summary"]
    judge = summary.get("judge") or {}
    if extra and judge.get("not_judged"):
        raise SystemExit(f"{name}: {judge['not_judged']} rows not judged")
    usage = judge.get("usage") or {}
    return {"wall": wall, "requests": usage.get("requests", 0), "cached": usage.get("cached", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--model-s", type=float, default=1.0)
    parser.add_argument("--judge-s", type=float, default=0.5)
    parser.add_argument("--judge-jobs", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    walls: Dict[str, List[float]] = {"plain": [], "judged": [], "cached": []}
    with tempfile.TemporaryDirectory() as tmp, FakeChatServer([Reply(delay=args.judge_s)]) as judge:
        folder = pathlib.Path(tmp)
        dataset = write_dataset(folder / "tasks.csv", args.rows)
        agent = folder / "agent.py"
        agent.write_text(AGENT, encoding="utf-8")
        for i in range(args.repeat):
            cache = folder / f"cache-{i}"
            judged = ["--judge", "bench-judge", "--judge-url", judge.base_url, "--judge-key-env", "",
                      "--judge-jobs", str(args.judge_jobs), "--model-cache", str(cache)]
            plain = run(folder, dataset, agent, args.jobs, args.model_s, [], f"plain-{i}")
            first = run(folder, dataset, agent, args.jobs, args.model_s, judged, f"judged-{i}")
            again = run(folder, dataset, agent, args.jobs, args.model_s, judged, f"cached-{i}")
            if first["requests"] < args.rows or again["requests"] or again["cached"] != args.rows:
                raise SystemExit(f"repeat {i}: the judge asked {first['requests']} then {again['requests']} "
                                 f"(cached {again['cached']}): expected {args.rows} then 0")
            for key, value in (("plain", plain), ("judged", first), ("cached", again)):
                walls[key].append(value["wall"])
            print(f"repeat {i + 1}: no judge {plain['wall']:.1f} s, judged {first['wall']:.1f} s "
                  f"({first['requests']} requests), cached re-run {again['wall']:.1f} s (0 requests)", flush=True)
    plain, judged, cached = (statistics.median(walls[k]) for k in ("plain", "judged", "cached"))
    added, added_cached = judged - plain, cached - plain
    print(f"\n{args.rows} rows, --jobs {args.jobs}, agent {args.model_s:g} s, judge {args.judge_s:g} s "
          f"at {args.judge_jobs} at once; medians of {args.repeat}:")
    print(f"  no judge        {plain:7.1f} s")
    print(f"  judged          {judged:7.1f} s   the judge adds {added:+.1f} s = {added / plain:+.1%} of the run")
    print(f"  cached re-run   {cached:7.1f} s   adds {added_cached:+.1f} s "
          f"({added_cached / added:.2f}x the first run's judge time)" if added > 0 else
          f"  cached re-run   {cached:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
