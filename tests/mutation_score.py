"""The conformance check's mutation score: the whole check against every broken port and legal variation.

    python3 tests/mutation_score.py [--jobs N] [--only NAME[,NAME]] [--json OUT]

Each *mutant* is a port with one realistic porting bug: the Python variants of
``tests/broken_ports.py`` (pipelines_port patched in its own process) and the
TypeScript mutants of ``tests/ts_mutants.py`` (a patched copy of
``conformance/ports/typescript``, compiled with its ``tsc``), the Go mutants
of ``tests/go_mutants.py`` (a patched copy of ``conformance/ports/go``, built
with ``go build``) and the Rust mutants of ``tests/rust_mutants.py`` (a patched
copy of ``conformance/ports/rust``, built with ``cargo build`` in one shared
target directory).  A language whose toolchain is missing is left out, and
said so; ``--require typescript,go,rust`` makes that an error.  Each is served on
127.0.0.1 and checked with ``python3 -m conformance check URL --strict`` in full
(``--misconfigured`` for a variant served with its token variable unset).  A
mutant is *caught* when the check fails (exit 1); a Python variant must also
fail the case it names.  Each *legal variation* (a choice the contract leaves
open) must pass every case, warnings included: anything else is a false failure.

Prints one line per port, then the score; exit status 1 when the score is under
95 % or a legal variation failed, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.broken_ports import VARIANTS  # noqa: E402

TOKEN = "mutation-score-token-7f7f7f"
TARGET_SCORE = 0.95


class Port(NamedTuple):
    name: str
    language: str  # "python" | "typescript" | "go" | "rust"
    legal: bool  # a legal variation: must pass everything
    fails: Optional[str]  # the case a Python variant must fail
    mode: str  # "normal" | "misconfigured"
    rule: Optional[str] = None


class Outcome(NamedTuple):
    port: Port
    ok: bool  # caught (a mutant) or clean (a legal variation)
    flagged: List[str]  # the cases that did not pass
    seconds: float
    error: Optional[str] = None


def toolchains() -> Dict[str, Optional[str]]:
    """Each port language's toolchain problem, or None when it can build and run that language's mutants (what
    they need from a registry fetched first, as the tests fetch it: ``tests/registries.py``)."""
    from tests.registries import FetchFailed, cargo_fetch, npm_ci
    from tests.rust_mutants import CARGO
    from tests.rust_mutants import PORT as RUST_PORT
    from tests.ts_mutants import PORT as TS_PORT

    def fetched(fetch: Callable[..., None], *args: Any) -> Optional[str]:
        try:
            fetch(*args)
            return None
        except FetchFailed as exc:
            return str(exc)

    return {
        "typescript": fetched(npm_ci, TS_PORT) if shutil.which("node") else "node is not on PATH",
        "go": None if shutil.which("go") else "go is not on PATH",
        "rust": fetched(cargo_fetch, RUST_PORT, CARGO),
    }


def ports(only: Sequence[str] = ()) -> List[Port]:
    found = [Port(name, "python", v.fails is None, v.fails, v.mode) for name, v in VARIANTS.items() if name != "correct"]
    missing = toolchains()
    if missing["typescript"] is None:
        from tests.ts_mutants import MUTANTS as TS_MUTANTS

        found += [Port(f"typescript:{m.name}", "typescript", False, None, m.mode, m.rule) for m in TS_MUTANTS]
    if missing["go"] is None:
        from tests.go_mutants import MUTANTS as GO_MUTANTS

        found += [Port(f"go:{m.name}", "go", False, None, m.mode, m.rule) for m in GO_MUTANTS]
    if missing["rust"] is None:
        from tests.rust_mutants import MUTANTS as RUST_MUTANTS

        found += [Port(f"rust:{m.name}", "rust", False, None, m.mode, m.rule) for m in RUST_MUTANTS]
    return [p for p in found if not only or p.name in only]


def build_mutant(port: Port, workdir: pathlib.Path) -> List[str]:
    """Materialise and build a TypeScript, Go or Rust mutant in ``workdir``; the command that serves it."""
    if port.language == "typescript":
        from tests import ts_mutants

        (mutant,) = [m for m in ts_mutants.MUTANTS if f"typescript:{m.name}" == port.name]
        return ["node", str(ts_mutants.build(ts_mutants.materialise(mutant, workdir / "port"))), "--port", "0"]
    if port.language == "rust":
        from tests import rust_mutants

        (rust_mutant,) = [m for m in rust_mutants.MUTANTS if f"rust:{m.name}" == port.name]
        return [str(rust_mutants.build(rust_mutants.materialise(rust_mutant, workdir / "port"), workdir / "server")),
                "--port", "0"]
    from tests import go_mutants

    (go_mutant,) = [m for m in go_mutants.MUTANTS if f"go:{m.name}" == port.name]
    return [str(go_mutants.build(go_mutants.materialise(go_mutant, workdir / "port"), workdir / "server")), "--port", "0"]


@contextlib.contextmanager
def serving(port: Port, workdir: pathlib.Path) -> Iterator[str]:
    """Start the port's server; yield its dispatch URL; stop it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if port.language == "python":
        cmd = [sys.executable, str(ROOT / "tests" / "broken_ports.py"), port.name, "--port", "0", "--token", TOKEN]
    else:
        cmd = build_mutant(port, workdir)
        env["AGENT_TOKEN"] = "" if port.mode == "misconfigured" else TOKEN
    log = open(workdir / "server.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        url = None
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            match = re.search(r"listening on (http://\S+)", line)
            url = match.group(1) if match else None
        if url is None:
            raise RuntimeError(f"server did not start: {(workdir / 'server.log').read_text()[-500:]}")
        if not url.rstrip("/").endswith("/dispatch"):
            url = url.rstrip("/") + "/dispatch"
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def check(port: Port) -> Outcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        try:
            with serving(port, pathlib.Path(tmp)) as url:
                cmd = [sys.executable, "-m", "conformance", "check", url, "--token", TOKEN, "--strict", "--json", "-",
                       "--timeout", "20"]
                if not port.legal:  # a broken kit-* rule is caught by the api profile; legal variants keep the wire one
                    cmd += ["--profile", "api"]
                if port.mode == "misconfigured":
                    cmd.append("--misconfigured")
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                                      env={k: v for k, v in os.environ.items() if k != "AGENT_TOKEN"})
            report: Dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            return Outcome(port, False, [], time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    flagged = [c["id"] for c in report.get("cases", []) if c["status"] not in ("pass", "skip")]
    if port.legal:
        ok = done.returncode == 0 and not flagged
    else:
        ok = done.returncode == 1 and (port.fails is None or port.fails in flagged)
    return Outcome(port, ok, flagged, time.monotonic() - started,
                   None if done.returncode in (0, 1) else f"check exited {done.returncode}: {done.stderr[-300:]}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mutation_score.py", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4, help="ports checked at once (default 4)")
    parser.add_argument("--only", help="these ports only (names, comma-separated; typescript:NAME, go:NAME, rust:NAME)")
    parser.add_argument("--require", default="", help="languages whose toolchain must be present (e.g. typescript,go,rust)")
    parser.add_argument("--json", metavar="OUT", help="also write the outcomes as JSON")
    args = parser.parse_args(argv)
    missing = toolchains()
    for language, problem in missing.items():
        if problem is not None:
            required = language in [r.strip() for r in args.require.split(",")]
            print(f"mutation_score: {'ERROR' if required else 'note'}: the {language} mutants are left out: {problem}",
                  file=sys.stderr)
            if required:
                return 2
    chosen = ports([n.strip() for n in (args.only or "").split(",") if n.strip()])
    if not chosen:
        print("mutation_score: no port to check", file=sys.stderr)
        return 2
    started = time.monotonic()
    outcomes: List[Outcome] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for outcome in pool.map(check, chosen):
            outcomes.append(outcome)
            p = outcome.port
            word = ("CLEAN" if outcome.ok else "FALSE FAILURE") if p.legal else ("CAUGHT" if outcome.ok else "ESCAPED")
            shown = ", ".join(outcome.flagged[:4]) + (f" (+{len(outcome.flagged) - 4})" if len(outcome.flagged) > 4 else "")
            print(f"{word:<13} {p.name:<40} {outcome.seconds:5.1f}s  {outcome.error or shown}", flush=True)
    lines = []
    for language in ("python", "typescript", "go", "rust"):
        mutants = [o for o in outcomes if o.port.language == language and not o.port.legal]
        if mutants:
            caught = sum(o.ok for o in mutants)
            lines.append(f"{language} mutants: {caught}/{len(mutants)} caught ({100 * caught / len(mutants):.1f} %)")
    mutants = [o for o in outcomes if not o.port.legal]
    legal = [o for o in outcomes if o.port.legal]
    score = sum(o.ok for o in mutants) / len(mutants) if mutants else 1.0
    lines.append(f"mutation score: {sum(o.ok for o in mutants)}/{len(mutants)} = {100 * score:.1f} % "
                 f"(target {100 * TARGET_SCORE:.0f} %)")
    lines.append(f"legal variations: {sum(o.ok for o in legal)}/{len(legal)} passed every case "
                 f"({sum(not o.ok for o in legal)} false failures)")
    lines.append(f"wall time {time.monotonic() - started:.0f} s with --jobs {args.jobs}")
    print("\n".join(lines))
    if args.json:
        doc = {"score": score, "summary": lines, "ports": [
            {"name": o.port.name, "language": o.port.language, "legal": o.port.legal, "ok": o.ok,
             "flagged": o.flagged, "seconds": round(o.seconds, 1), "error": o.error} for o in outcomes]}
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0 if score >= TARGET_SCORE and all(o.ok for o in legal) else 1


if __name__ == "__main__":
    sys.exit(main())
