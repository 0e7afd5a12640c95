"""``pipelines-port demo`` (``python3 -m conformance demo``): the bundled sample dataset against the minimal template.

Runs ``samples/orders.csv`` (beside this file) with its fixtures through the local
simulator in code mode and prints the report: the quickest way to see a
dataset, failure rules and the trace view working before writing any agent.
``--html OUT`` / ``--json OUT`` write the reports as ``simulate`` does.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import List, Optional

from . import simulate
from .cli import prog
from .init import template_dir

SAMPLES = pathlib.Path(__file__).resolve().parent / "samples"  # package data when installed
DATASET = SAMPLES / "orders.csv"
FIXTURES = SAMPLES / "orders_fixtures.json"
AGENT = pathlib.Path(template_dir()) / "minimal.py"  # templates/minimal.py in a checkout


def _shown(path: pathlib.Path) -> str:
    """``path`` relative to the working directory when that is shorter (for readable reports)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return relative if len(relative) < len(str(path)) else str(path)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog("demo"),
        description="Run the bundled sample dataset (samples/orders.csv) against the minimal template "
                    "(templates/minimal.py) in code mode.",
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
