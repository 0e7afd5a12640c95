"""The one way a mutant's text edits are applied to a copy of a port (Go and Rust mutants alike)."""

from __future__ import annotations

import pathlib
from typing import Dict, Sequence, Tuple

Edit = Tuple[str, str, str]  # (file relative to the port, old, new)


def apply_edits(name: str, edits: Sequence[Edit], dest: pathlib.Path) -> pathlib.Path:
    """Replace each edit's ``old`` (which must occur exactly once in its file) by ``new`` in the copy ``dest``;
    a ValueError naming mutant ``name`` when one does not apply, and then no file is written."""
    texts: Dict[str, str] = {}
    for file, old, new in edits:
        text = texts.get(file)
        if text is None:
            text = (dest / file).read_text(encoding="utf-8")
        count = text.count(old)
        if count != 1:
            raise ValueError(f"mutant {name}: the text to replace in {file} occurs {count} times, not once: "
                             f"{old[:80]!r}")
        texts[file] = text.replace(old, new)
    for file, text in texts.items():
        (dest / file).write_text(text, encoding="utf-8")
    return dest
