"""``python3 -m conformance demo``: the bundled sample dataset against ``templates/minimal.py``.

Runs ``conformance/samples/orders.csv`` with its fixtures through the local
simulator in code mode and prints the report: the quickest way to see a
dataset, failure rules and the trace view working before writing any agent.
``--html OUT`` / ``--json OUT`` write the reports as ``simulate`` does.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import List, Optional

from conformance import simulate

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "conformance" / "samples"
DATASET = SAMPLES / "orders.csv"
FIXTURES = SAMPLES / "orders_fixtures.json"
AGENT = ROOT / "templates" / "minimal.py"


def _shown(path: pathlib.Path) -> str:
    """``path`` relative to the working directory when that is shorter (for readable reports)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return relative if len(relative) < len(str(path)) else str(path)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m conformance demo",
        description="Run the sample dataset (conformance/samples/orders.csv) against templates/minimal.py "
                    "in code mode.",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the JSON report to OUT")
    parser.add_argument("--html", metavar="OUT", help="also write the HTML report to OUT")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    forwarded = ["--csv", _shown(DATASET), "--code", _shown(AGENT) + ":run", "--responses", _shown(FIXTURES)]
    if args.json:
        forwarded += ["--json", args.json]
    if args.html:
        forwarded += ["--html", args.html]
    return simulate.main(forwarded)
