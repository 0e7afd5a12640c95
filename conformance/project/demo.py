"""``pipelines-port demo`` (``python3 -m conformance demo``): the bundled sample dataset against a template.

Runs ``samples/orders.csv`` (beside this file) with its fixtures through the local
simulator in code mode and prints the report: the quickest way to see a
dataset, failure rules and the trace view working before writing any agent.
Every model-backed role runs too, on the kit's scripted stand-in: the judge grades each run, the simulated
backend answers ``change_shipping_address`` (a tool with no fixture), and the simulated user carries the
multi-turn row (``turn_mode`` ``model_as_user``) past its first turn.
The default template, ``openai_chat``, is a whole agent loop (model turns, tool
calls, injected failures, ledger changes); its model is the scripted stand-in
(``pipelines-port model``), so the demo needs no key and no network
(``--model real`` uses the real API and your key).  ``--html OUT`` / ``--json
OUT`` write the reports as ``simulate`` does.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import List, Optional

from ..simulator import simulate
from ..simulator.dataset import SAMPLES_DIR
from ..kit import prog
from .init import template_dir

SAMPLES = pathlib.Path(SAMPLES_DIR)
DATASET = SAMPLES / "orders.csv"
FIXTURES = SAMPLES / "orders_fixtures.json"
TEMPLATES = pathlib.Path(template_dir())  # templates/ in a checkout


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
        description="Run the bundled sample dataset (samples/orders.csv) against a template in code mode, "
                    "offline.",
    )
    parser.add_argument("--template", default="openai_chat", metavar="NAME",
                        help="the template to run (default openai_chat: a model-API agent loop; minimal: one call)")
    parser.add_argument("--model", choices=("scripted", "real"), default="scripted",
                        help="scripted (default): the model is a local stand-in; real: the API with your key")
    parser.add_argument("--judge", default="scripted", metavar="MODEL",
                        help="the judge's model (default scripted: the kit's offline stand-in; see simulate --help "
                             "for --judge-url and --judge-key-env, given here too)")
    parser.add_argument("--simulator", default="scripted", metavar="MODEL",
                        help="the model that answers tools with no fixture (default scripted; --simulator-url and "
                             "--simulator-key-env given here too)")
    parser.add_argument("--user-model", default="scripted", metavar="MODEL",
                        help="the model that plays the user of the multi-turn row (default scripted; --user-url and "
                             "--user-key-env given here too)")
    parser.add_argument("--json", metavar="OUT", help="also write the JSON report to OUT")
    parser.add_argument("--html", metavar="OUT", help="also write the HTML report to OUT")
    try:
        args, judge_options = parser.parse_known_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    forwarded_prefixes = ("--judge-", "--simulator-", "--user-")
    unknown = [a for a in judge_options if a.startswith("-") and not a.startswith(forwarded_prefixes)]
    if unknown:
        parser.print_usage(sys.stderr)
        print(f"{prog('demo')}: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    agent = TEMPLATES / f"{args.template}.py"
    if not agent.is_file():
        names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.py") if not p.stem.startswith("_")))
        print(f"{prog('demo')}: no template {args.template!r}: choose one of {names}", file=sys.stderr)
        return 2
    forwarded = ["--csv", _shown(DATASET), "--code", _shown(agent) + ":run", "--responses", _shown(FIXTURES),
                 "--model", args.model, "--judge", args.judge, "--simulator", args.simulator, "--user-model",
                 args.user_model, *judge_options]
    if args.json:
        forwarded += ["--json", args.json]
    if args.html:
        forwarded += ["--html", args.html]
    return simulate.main(forwarded)
