"""The Rust half of the mutation set still applies to the Rust port as it is.

Each mutant is a set of exact text edits, each naming its file (tests/rust_mutants.py); an edit whose text the
port no longer contains would silently stop testing anything, so each must apply exactly once and change its
file. The mutants are built, served and checked by tests/mutation_score.py (a CI step); with ``cargo`` present
this test also builds each of them (one shared target directory), so an edit that no longer compiles shows here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checker import rules
from tests.registries import cargo_fetch, need
from tests.rust_mutants import CARGO, MODULE, MUTANTS, PORT, build, materialise


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutant_applies_once_and_breaks_a_rule_of_the_contract(mutant: object, tmp_path: Path) -> None:
    copy = materialise(mutant, tmp_path / "port")  # type: ignore[arg-type]
    for file in {edit[0] for edit in mutant.edits}:  # type: ignore[attr-defined]
        assert (copy / file).read_text() != (PORT / file).read_text()
    assert (copy / MODULE).exists()
    rule = rules.rule(mutant.rule)  # type: ignore[attr-defined]
    assert rule.level in ("MUST", "SHOULD") or rule.id.startswith("kit-")  # a kit rule: caught by --profile api
    assert mutant.mode in ("normal", "misconfigured")  # type: ignore[attr-defined]


def test_the_set_is_large_and_names_are_unique() -> None:
    assert len(MUTANTS) >= 15 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert len({m.rule for m in MUTANTS}) >= 10  # spread over the contract, not one rule many times


def test_an_edit_that_no_longer_applies_is_an_error(tmp_path: Path) -> None:
    broken = MUTANTS[0]._replace(edits=(("src/contract/inbound.rs", "no such text in the port", "x"),))
    with pytest.raises(ValueError, match="occurs 0 times"):
        materialise(broken, tmp_path / "port")


@pytest.mark.skipif(CARGO is None, reason="cargo is not on PATH")
def test_every_mutant_still_compiles(tmp_path: Path) -> None:
    """A mutant that no longer compiles would count as missed: each is built, one after another, in the shared
    target directory (the dependencies compile once)."""
    need(cargo_fetch, PORT, CARGO)
    failures = []
    for mutant in MUTANTS:
        where = tmp_path / mutant.name
        try:
            build(materialise(mutant, where / "port"), where / "server")
        except RuntimeError as exc:
            failures.append(f"{mutant.name}: {exc}")
    assert not failures, failures
