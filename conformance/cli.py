"""``pipelines-port COMMAND ...``: the kit's one command.

Installed (``pip install .`` / ``pipx install .``) it is the console command
``pipelines-port``; from a checkout the same table runs as
``python3 -m conformance COMMAND ...``.

``serve`` and ``mcp`` are the runtime module's own command line
(``pipelines_port.main``); every other command is a kit module here with a
``main(argv) -> int``.  Usage errors are one line on stderr and exit status 2,
never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pipelines_port as pp

from .kit import PROG, prog

# name: (kit module, or None for the runtime module's own CLI; one line of help)
COMMANDS: Dict[str, Tuple[Optional[str], str]] = {
    "serve": (None, "serve an agent as a dispatch endpoint (CONTRACT §2)"),
    "init": ("project.init", "scaffold an agent project from a template"),
    "doctor": ("project.doctor", "check an agent's setup before a platform run"),
    "mcp": (None, "a stdio MCP server whose tools go through the run's proxy"),
    "check": ("checker.check", "check a port's dispatch endpoint against the contract"),
    "dataset": ("simulator.dataset", "validate a task-seeding CSV (CONTRACT §6)"),
    "simulate": ("simulator.simulate", "run every dataset row against an agent through a local proxy"),
    "merge": ("simulator.shards", "merge simulate --jsonl result files (one per shard) into one report"),
    "compare": ("simulator.compare", "compare two judged reports: the rows that regressed, were fixed, added, removed"),
    "demo": ("project.demo", "the bundled sample dataset against a template agent, judged, all offline"),
    "model": ("models.scripted", "a scripted stand-in for the OpenAI and Anthropic APIs, to run agents offline"),
    "proxy": ("simulator.proxy_cli", "a mock per-run proxy and a curl dispatch to paste, to try an agent by hand"),
    "register": ("platform_api.register", "create or update the agent on the platform (an HTTP endpoint or code)"),
    "test": ("platform_api.testrun", "run a dataset on the platform, follow it to the end, gate CI on the verdicts"),
}


def usage() -> str:
    width = max(len(name) for name in [*COMMANDS, "--version"])
    lines = [f"usage: {prog()} COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "options:", f"  {'--version':<{width}}  print the version and exit",
              f"  {'--help':<{width}}  print this help and exit",
              "", f"{prog('COMMAND')} --help for a command's options"]
    return "\n".join(lines)


def _runner(command: str) -> Callable[[List[str]], Optional[int]]:
    """The ``main(argv)`` that runs ``command``: the runtime module's for serve / mcp, else the kit module's."""
    module_name = COMMANDS[command][0]
    if module_name is None:
        return lambda rest: pp.main([command, *rest], prog=prog())
    module = importlib.import_module("." + module_name, __package__)
    run: Callable[[List[str]], Optional[int]] = module.main
    return run


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 a check failed, 2 bad usage)."""
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away (`pipelines-port --help | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit fails no more
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(f"{prog()}: give a COMMAND ({', '.join(COMMANDS)}); {prog()} --help says more", file=sys.stderr)
        return 2
    first, rest = args[0], args[1:]
    if first in ("-h", "--help"):
        print(usage())
        return 0
    if first == "--version":
        print(f"{PROG} {pp.__version__}")
        return 0
    if first == "help":  # `help` alone, or `help COMMAND` as `COMMAND --help`
        if not rest:
            print(usage())
            return 0
        first, rest = rest[0], ["--help"]
    if first not in COMMANDS:
        what = "option" if first.startswith("-") else "command"
        print(f"{prog()}: unknown {what} {first!r}: choose one of {', '.join(COMMANDS)} ({prog()} --help)",
              file=sys.stderr)
        return 2
    try:
        return int(_runner(first)(rest) or 0)
    except SystemExit as exc:  # argparse after --help (0) or a usage error it has already printed (2)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
