"""Where the kit is and how its commands are spelled there.

The one module every sub-package may import (it imports nothing of the kit): from a checkout the
commands run as ``python3 -m conformance COMMAND``; installed, the package is ``pipelines_port_kit``
and the command ``pipelines-port COMMAND``.
"""

from __future__ import annotations

import os

__all__ = ["KIT_ROOT", "PROG", "installed", "prog"]

PROG = "pipelines-port"
KIT_ROOT = os.path.dirname(os.path.abspath(__file__))  # conformance/ in a checkout, pipelines_port_kit/ installed


def installed() -> bool:
    """True when the kit runs as the installed ``pipelines_port_kit`` package, False from a checkout."""
    return (__package__ or __name__).split(".")[0] != "conformance"


def prog(command: str = "") -> str:
    """How to run ``command``: ``pipelines-port init`` installed, ``python3 -m conformance init`` in a checkout."""
    base = PROG if installed() else "python3 -m conformance"
    return f"{base} {command}" if command else base
