"""The TypeScript half of the mutation set still applies to the TypeScript port as it is.

Each mutant is a set of exact text edits (tests/ts_mutants.py); an edit whose text the port no longer contains
would silently stop testing anything, so each must apply exactly once and change the module.  The mutants are
compiled, served and checked by tests/mutation_score.py (a CI step); that each one still type-checks is tested
here when the port's tsc is installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checker import rules
from tests.ts_mutants import MODULE, MUTANTS, PORT, build, materialise


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_applies_once_and_breaks_a_rule_of_the_contract(mutant: object, tmp_path: Path) -> None:
    copy = materialise(mutant, tmp_path / "port")  # type: ignore[arg-type]
    assert (copy / MODULE).read_text() != (PORT / MODULE).read_text()
    rule = rules.rule(mutant.rule)  # type: ignore[attr-defined]
    assert rule.level in ("MUST", "SHOULD") or rule.id.startswith("kit-")  # a kit rule: caught by --profile api
    assert mutant.mode in ("normal", "misconfigured")  # type: ignore[attr-defined]


def test_the_set_is_large_and_names_are_unique() -> None:
    assert len(MUTANTS) >= 30 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert len({m.rule for m in MUTANTS}) >= 20  # spread over the contract, not one rule many times


def test_an_edit_that_no_longer_applies_is_an_error(tmp_path: Path) -> None:
    broken = MUTANTS[0]._replace(edits=(("no such text in the port", "x"),))
    with pytest.raises(ValueError, match="occurs 0 times"):
        materialise(broken, tmp_path / "port")


def test_a_mutant_type_checks_and_builds_a_server(tmp_path: Path, tsc: Path) -> None:
    """A realistic bug compiles: one mutant through build(), which runs the port's tsc in strict mode."""
    mutant = next(m for m in MUTANTS if m.name == "retry_after_ignored")
    server = build(materialise(mutant, tmp_path / "port"))
    compiled = (server.parent / "pipelines_port.js").read_text()
    assert server.is_file() and "policy.maxRetryAfterS" not in compiled.split("function retryDelay", 1)[1][:300]


def test_a_mutant_that_does_not_type_check_is_refused(tmp_path: Path, tsc: Path) -> None:
    broken = MUTANTS[0]._replace(edits=(("  maxAttempts: 4,", "  maxAttempts: \"four\","),))
    with pytest.raises(RuntimeError, match="does not type-check"):
        build(materialise(broken, tmp_path / "port"))
