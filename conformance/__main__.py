"""``python3 -m conformance COMMAND ...`` from a checkout (``python3 -m pipelines_port_kit`` installed).

The same command table as the installed ``pipelines-port`` console command: see ``cli.py``.
"""

from __future__ import annotations

import sys

from .cli import COMMANDS, main, usage

__all__ = ["COMMANDS", "main", "usage"]

if __name__ == "__main__":
    sys.exit(main())
