"""CONTRACT.md is what every section reference in the repository points into.

Every ``§N`` / ``§N.M`` cited by the module, the README, the conformance kit
(code, docs, the TypeScript and Go reference ports, the JSON vectors' ``contract`` fields, the
``section`` of every conformance case), the templates and the tests must land
on a ``§N`` heading of CONTRACT.md; ``§2 step N`` must land on a step of §2.
CONTRACT.md's own rules must be well formed: ``- **rule-id** (LEVEL): ...``
with a unique kebab-case id and exactly one of MUST, SHOULD, MAY; the rules of
§7 are the kit's choices, ``kit-`` ids at level MAY, and no other rule is.
"""

from __future__ import annotations

import pathlib
import re
from typing import Dict, Iterator, List, NamedTuple, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "CONTRACT.md"
THIS = pathlib.Path(__file__).resolve()
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
SECTION_HEADING = re.compile(r"§(\d+(?:\.\d+)*)\s+\S")
# "§3.3", "§ 2", "§2 step 5", "§2 steps 1-2", "§2 steps 1 and 3".
REFERENCE = re.compile(r"§ ?(\d+(?:\.\d+)*)(?:\s+steps?\s+(\d+)(?:\s*(-|–|and)\s*(\d+))?)?")
# A § right after "RFC 9112 " (or a PEP or ISO number) cites that document, not CONTRACT.md.
EXTERNAL = re.compile(r"\b(?:RFC|PEP|ISO)[ -]?\d+,?\s*$")
STEP = re.compile(r"^\*\*Step (\d+)\b")
RULE_LINE = re.compile(r"^\s*[-*+]\s+\*\*")
RULE = re.compile(r"^- \*\*(?P<id>[^*]+)\*\* \((?P<level>[^)]*)\): \S")
KEBAB = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
LEVELS = ("MUST", "SHOULD", "MAY")


class Ref(NamedTuple):
    section: str
    steps: Tuple[int, ...]  # the steps cited ("§2 steps 1-3" -> 1, 2, 3), empty for none
    text: str


class Contract(NamedTuple):
    headings: Dict[str, int]  # "3.3" -> line
    steps: Dict[str, Set[int]]  # section (and each of its ancestors) -> step numbers in it
    rules: List[Tuple[int, str, str, str]]  # (line, id, level, top-level section)
    problems: List[str]  # malformed headings and rule lines


def refs_in(text: str) -> Iterator[Ref]:
    """The CONTRACT references in ``text`` (one line), citations of other documents left out."""
    for match in REFERENCE.finditer(text):
        if EXTERNAL.search(text[: match.start()]):
            continue
        steps: Tuple[int, ...] = ()
        if match.group(2):
            first, last = int(match.group(2)), int(match.group(4) or match.group(2))
            steps = (first, last) if match.group(3) == "and" else tuple(range(first, max(first, last) + 1))
        yield Ref(match.group(1), steps, match.group(0))


def outside_code(lines: List[str]) -> Iterator[Tuple[int, str]]:
    """``(line number, line)`` of the Markdown lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def parse_contract() -> Contract:
    lines = CONTRACT.read_text(encoding="utf-8").splitlines()
    headings: Dict[str, int] = {}
    steps: Dict[str, Set[int]] = {}
    rules: List[Tuple[int, str, str, str]] = []
    problems: List[str] = []
    current = ""
    for number, line in outside_code(lines):
        heading = HEADING.match(line)
        if heading:
            found = SECTION_HEADING.match(heading.group(2))
            if "§" in heading.group(2) and not found:
                problems.append(f"CONTRACT.md:{number}: a heading with § must start with it: {line!r}")
            if found:
                section = found.group(1)
                depth = len(heading.group(1))
                if depth != section.count(".") + 2:
                    problems.append(f"CONTRACT.md:{number}: §{section} belongs under {'#' * (section.count('.') + 2)}, "
                                    f"not {heading.group(1)}")
                if section in headings:
                    problems.append(f"CONTRACT.md:{number}: §{section} is also the heading at line {headings[section]}")
                headings.setdefault(section, number)
                current = section
            continue
        step = STEP.match(line)
        if step and current:
            parts = current.split(".")
            for i in range(1, len(parts) + 1):
                steps.setdefault(".".join(parts[:i]), set()).add(int(step.group(1)))
        if RULE_LINE.match(line):
            rule = RULE.match(line)
            if not rule:
                problems.append(f"CONTRACT.md:{number}: a bold bullet is a rule and reads "
                                f"'- **rule-id** (MUST|SHOULD|MAY): ...': {line[:80]!r}")
                continue
            rules.append((number, rule.group("id"), rule.group("level"), current.split(".")[0]))
    return Contract(headings, steps, rules, problems)


def unresolved(ref: Ref, contract: Contract) -> str:
    """Why ``ref`` does not resolve, or ``""`` when it does."""
    if ref.section not in contract.headings:
        return f"no heading §{ref.section} in CONTRACT.md"
    missing = [n for n in ref.steps if n not in contract.steps.get(ref.section, set())]
    if missing:
        return f"§{ref.section} has no step {', '.join(map(str, missing))}"
    return ""


def sources() -> List[pathlib.Path]:
    """Every file whose § references must resolve (CONTRACT.md and this test excluded)."""
    found = [ROOT / "pipelines_port.py", ROOT / "README.md"]
    for pattern in ("*.py", "*.md", "*.ts", "*.go"):
        found += (ROOT / "conformance").rglob(pattern)
    found += (ROOT / "conformance" / "checker" / "vectors").glob("*.json")
    found += (ROOT / "templates").glob("*.py")
    found += (ROOT / "tests").glob("*.py")
    keep = {
        path.resolve() for path in found
        if path.is_file() and not SKIP_DIRS & set(path.relative_to(ROOT).parts)
    }
    return sorted(keep - {CONTRACT.resolve(), THIS})


def file_refs(path: pathlib.Path) -> Iterator[Tuple[int, Ref]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":  # JSON may spell § as an escape
        text = re.sub(r"\\u00[aA]7", "§", text)
    for number, line in enumerate(text.splitlines(), 1):
        for ref in refs_in(line):
            yield number, ref


# ---------------------------------------------------------------------------


def test_contract_structure() -> None:
    contract = parse_contract()
    assert contract.problems == [], "\n".join(contract.problems)
    required = [str(n) for n in range(1, 8)] + [f"3.{n}" for n in range(1, 8)]
    missing = [f"§{s}" for s in required if s not in contract.headings]
    assert missing == [], f"CONTRACT.md lacks the headings {missing}"
    assert any(s.startswith("7.") for s in contract.headings), "§7 needs subsections (§7.1, ...)"
    text = CONTRACT.read_text(encoding="utf-8")
    preamble = text.split("## §1 ", 1)[0]
    assert "RFC 2119" in preamble and "RFC 8174" in preamble, "the levels paragraph before §1 cites RFC 2119 and 8174"
    assert re.search(r"^### §7\.\d+ Deliberate differences from the platform SDK", text, re.M), \
        "§7 keeps a subsection 'Deliberate differences from the platform SDK'"
    assert contract.steps.get("2", set()) >= set(range(1, 9)), "§2 numbers its steps 1 to 8 (**Step N ...**)"


def test_rule_ids_are_unique_kebab_case_with_one_level() -> None:
    contract = parse_contract()
    assert contract.rules, "CONTRACT.md has no rule bullets"
    problems = list(contract.problems)
    first_seen: Dict[str, int] = {}
    for line, rule_id, level, section in contract.rules:
        where = f"CONTRACT.md:{line}: {rule_id}"
        if not KEBAB.fullmatch(rule_id):
            problems.append(f"{where}: the id is not kebab-case")
        if level not in LEVELS:
            problems.append(f"{where}: the level is {level!r}, not exactly one of {', '.join(LEVELS)}")
        if rule_id in first_seen:
            problems.append(f"{where}: the id is used already at line {first_seen[rule_id]}")
        first_seen.setdefault(rule_id, line)
        if not section:
            problems.append(f"{where}: a rule before the first § heading")
        elif section == "7":
            if not rule_id.startswith("kit-") or level != "MAY":
                problems.append(f"{where}: §7 holds the kit's choices: ids start with 'kit-', the level is MAY")
        elif rule_id.startswith("kit-"):
            problems.append(f"{where}: 'kit-' ids belong in §7 (the kit's choices), not in §{section}")
    assert problems == [], "\n".join(problems)


def test_contract_cites_itself_correctly() -> None:
    contract = parse_contract()
    lines = CONTRACT.read_text(encoding="utf-8").splitlines()
    bad = []
    for number, line in outside_code(lines):
        if HEADING.match(line):
            continue
        for ref in refs_in(line):
            why = unresolved(ref, contract)
            if why:
                bad.append(f"CONTRACT.md:{number}: {ref.text!r}: {why}")
    assert bad == [], "references inside CONTRACT.md that resolve to nothing:\n" + "\n".join(bad)


def test_every_section_reference_in_the_repository_resolves() -> None:
    contract = parse_contract()
    bad, count = [], 0
    for path in sources():
        for number, ref in file_refs(path):
            count += 1
            why = unresolved(ref, contract)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{number}: {ref.text!r}: {why}")
    assert count > 0, "no § references found at all: the scan itself is broken"
    assert bad == [], f"{len(bad)} § reference(s) that CONTRACT.md does not resolve:\n" + "\n".join(bad)


def test_every_vector_file_names_sections_that_resolve() -> None:
    import json

    contract = parse_contract()
    bad = []
    for path in sorted((ROOT / "conformance" / "checker" / "vectors").glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        refs = list(refs_in(str(doc.get("contract", ""))))
        if not refs:
            bad.append(f"{path.relative_to(ROOT)}: 'contract' {doc.get('contract')!r} cites no § of CONTRACT.md")
        bad += [f"{path.relative_to(ROOT)}: 'contract' {ref.text!r}: {unresolved(ref, contract)}"
                for ref in refs if unresolved(ref, contract)]
    assert bad == [], "\n".join(bad)


def test_every_conformance_case_section_resolves() -> None:
    from conformance.checker import check

    contract = parse_contract()
    bad = []
    for case in check.all_cases():
        refs = list(refs_in(case.section))
        if not refs and case.section != check.AGENT_SPEC:
            bad.append(f"{case.id}: section {case.section!r} cites no § of CONTRACT.md")
        bad += [f"{case.id}: section {ref.text!r}: {unresolved(ref, contract)}"
                for ref in refs if unresolved(ref, contract)]
    assert bad == [], "conformance cases whose section does not resolve:\n" + "\n".join(bad)


def test_references_to_other_documents_are_not_taken_for_contract_sections() -> None:
    assert [r.section for r in refs_in("A chunked body (RFC 9112 §7.1), see §3.3")] == ["3.3"]
    assert [(r.section, r.steps) for r in refs_in("§2 steps 1-2, §2 step 8, §2 steps 1 and 3")] == [
        ("2", (1, 2)), ("2", (8,)), ("2", (1, 3))]


def test_rules_json_is_the_contract_documents_rules() -> None:
    """conformance/checker/rules.json (what the installed kit reads) equals CONTRACT.md's rules: regenerate it with
    ``python3 -m conformance.checker.rules CONTRACT.md > conformance/checker/rules.json``."""
    from conformance.checker import rules

    parsed = rules.parse(CONTRACT.read_text(encoding="utf-8"))
    assert (ROOT / "conformance" / "checker" / "rules.json").read_text(encoding="utf-8") == rules.to_json(parsed)
    assert rules.load() == parsed and len(parsed) == len(parse_contract().rules)
    assert all(r.section.startswith("§") and r.text for r in parsed.values())


def test_every_conformance_case_checks_rules_of_the_contract() -> None:
    """Each case names the rules it checks; its level is the strongest of theirs, its profile set by the first."""
    from conformance.checker import check
    from conformance.checker import rules

    cases = check.all_cases()
    for case in cases:
        assert case.rules, case.id
        for rule_id in case.rules:
            rules.rule(rule_id)
        assert case.level == rules.level_of(case.rules)
        assert case.profile == ("api" if case.rules[0].startswith("kit-") else "wire")
    assert {c.level for c in cases} == {"MUST", "SHOULD", "MAY"}
