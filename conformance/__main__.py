"""``python3 -m conformance COMMAND ...``: the conformance suite and the offline dev loop.

Each command lives in its own module with a ``main(argv) -> int``.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "init": ("conformance.init", "scaffold an agent project from a template"),
    "doctor": ("conformance.doctor", "check an agent's setup before a platform run"),
    "check": ("conformance.check", "check a port's dispatch endpoint against the contract"),
    "dataset": ("conformance.dataset", "validate a task-seeding CSV (CONTRACT §6)"),
    "simulate": ("conformance.simulate", "run every dataset row against an agent through a local proxy"),
    "demo": ("conformance.demo", "run the bundled sample dataset against the minimal template"),
}


def usage() -> str:
    lines = ["usage: python3 -m conformance COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "python3 -m conformance COMMAND --help for a command's options"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"conformance: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
