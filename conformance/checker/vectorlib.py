"""Load the JSON test vectors in ``conformance/checker/vectors/`` (format: vectors/README.md)."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Dict, List

VECTORS_DIR = pathlib.Path(__file__).resolve().parent / "vectors"

__all__ = ["VECTORS_DIR", "load", "cases", "expand", "path_of"]


def expand(value: Any) -> Any:
    """Replace every ``{"$repeat": s, "count": n}`` with ``s * n``."""
    if isinstance(value, dict):
        if set(value) == {"$repeat", "count"}:
            return value["$repeat"] * value["count"]
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v) for v in value]
    return value


def load(name: str) -> Dict[str, Any]:
    """The whole vector file ``name`` (with or without ``.json``), expanded."""
    path = VECTORS_DIR / (name if name.endswith(".json") else name + ".json")
    with open(path, encoding="utf-8") as f:
        return expand(json.load(f))


def cases(name: str) -> List[Dict[str, Any]]:
    return load(name)["cases"]


def path_of(problem: str) -> str:
    """The JSON path a validate_response problem string starts with."""
    if problem.startswith("warning: "):
        problem = problem[len("warning: "):]
    return problem.split(": ", 1)[0]
