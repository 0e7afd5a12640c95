"""The model-backed roles' prompts, one Markdown file each, shipped with the kit for users to read and replace.

``judge.md`` (the judge's rubric, ``--judge-prompt``), ``simulator.md`` (the simulated backend's rules,
``--simulator-prompt``), ``user.md`` (the simulated user's, ``--user-prompt``).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["JUDGE", "SIMULATOR", "USER", "load"]

_HERE = os.path.dirname(os.path.abspath(__file__))
JUDGE = os.path.join(_HERE, "judge.md")
SIMULATOR = os.path.join(_HERE, "simulator.md")
USER = os.path.join(_HERE, "user.md")


def load(path: Optional[str], *, default: str, option: str) -> str:
    """The prompt at ``path`` (a user's file) or ``default`` (the kit's); ``ValueError`` naming ``option``."""
    where = path or default
    try:
        with open(where, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{option}: {where} is not UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"{option}: {where} is empty")
    return text
