"""The JavaScript half of the mutation set still applies to the Node port as it is.

Each mutant is a set of exact text edits (tests/js_mutants.py); an edit whose text the port no longer contains
would silently stop testing anything, so each must apply exactly once and change the module.  The mutants are
served and checked by tests/mutation_score.py (a CI step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance import rules
from tests.js_mutants import MODULE, MUTANTS, PORT, materialise


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_applies_once_and_breaks_a_rule_of_the_contract(mutant: object, tmp_path: Path) -> None:
    copy = materialise(mutant, tmp_path / "port")  # type: ignore[arg-type]
    assert (copy / MODULE).read_text() != (PORT / MODULE).read_text()
    assert rules.rule(mutant.rule).level in ("MUST", "SHOULD")  # type: ignore[attr-defined]
    assert mutant.mode in ("normal", "misconfigured")  # type: ignore[attr-defined]


def test_the_set_is_large_and_names_are_unique() -> None:
    assert len(MUTANTS) >= 30 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert len({m.rule for m in MUTANTS}) >= 20  # spread over the contract, not one rule many times


def test_an_edit_that_no_longer_applies_is_an_error(tmp_path: Path) -> None:
    broken = MUTANTS[0]._replace(edits=(("no such text in the port", "x"),))
    with pytest.raises(ValueError, match="occurs 0 times"):
        materialise(broken, tmp_path / "port")
