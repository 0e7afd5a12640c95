"""The contract's rules as data: ``conformance/checker/rules.json``, made from CONTRACT.md.

    python3 -m conformance.checker.rules CONTRACT.md > conformance/checker/rules.json

Every rule of CONTRACT.md is one bullet ``- **rule-id** (LEVEL): text``.  The
conformance check tags each case and each failure with a rule id and reads its
level (MUST, SHOULD, MAY) here, so the kit needs no copy of CONTRACT.md when
installed.  ``tests/test_contract_doc.py`` keeps the JSON equal to the document.
A port's own test runner may read the file too: it is plain JSON.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import threading
from typing import Dict, List, NamedTuple, Optional, Sequence

__all__ = ["Rule", "LEVELS", "parse", "load", "level_of", "rule"]

RULES_JSON = pathlib.Path(__file__).resolve().parent / "rules.json"
LEVELS = ("MUST", "SHOULD", "MAY")  # strongest first
_RULE = re.compile(r"^- \*\*(?P<id>[a-z0-9-]+)\*\* \((?P<level>MUST|SHOULD|MAY)\): (?P<text>.+)$")
_SECTION = re.compile(r"^#{2,6} (§\d+(?:\.\d+)*)\s")


class Rule(NamedTuple):
    id: str
    level: str  # "MUST" | "SHOULD" | "MAY"
    section: str  # "§3.3"
    text: str


def parse(markdown: str) -> Dict[str, Rule]:
    """Every rule of a CONTRACT.md text, by id, in document order."""
    rules: Dict[str, Rule] = {}
    section = ""
    for line in markdown.splitlines():
        heading = _SECTION.match(line)
        if heading:
            section = heading.group(1)
            continue
        match = _RULE.match(line)
        if match:
            rules[match["id"]] = Rule(match["id"], match["level"], section, match["text"].strip())
    return rules


_loaded: Optional[Dict[str, Rule]] = None
_lock = threading.Lock()


def load() -> Dict[str, Rule]:
    """The rules of ``rules.json`` (read once)."""
    global _loaded
    with _lock:
        if _loaded is None:
            with open(RULES_JSON, encoding="utf-8") as f:
                doc = json.load(f)
            _loaded = {r["id"]: Rule(r["id"], r["level"], r["section"], r["text"]) for r in doc["rules"]}
        return _loaded


def rule(rule_id: str) -> Rule:
    """The rule ``rule_id``; a ``KeyError`` naming it when CONTRACT.md has no such rule."""
    try:
        return load()[rule_id]
    except KeyError:
        raise KeyError(f"no rule {rule_id!r} in CONTRACT.md (conformance/checker/rules.json)") from None


def level_of(rule_ids: Sequence[str]) -> str:
    """The strongest level among ``rule_ids``."""
    return min((rule(r).level for r in rule_ids), key=LEVELS.index)


def to_json(rules: Dict[str, Rule]) -> str:
    doc = {"source": "CONTRACT.md", "levels": list(LEVELS),
           "rules": [r._asdict() for r in rules.values()]}
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m conformance.checker.rules CONTRACT.md > conformance/checker/rules.json",
              file=sys.stderr)
        return 2
    sys.stdout.write(to_json(parse(pathlib.Path(args[0]).read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
