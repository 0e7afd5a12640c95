"""The Rust port (conformance/ports/rust/): its own tests, the conformance check, and its server over 127.0.0.1.

The server (``src/bin/conformance-server``, serving the conformance agent) is built once with ``cargo build``
into the one shared target directory of ``tests/rust_mutants.py`` (the dependencies compile once for the port,
its tests and the mutants) and run as a subprocess; the agent's tool calls go to a MockProxy. Skipped when
``cargo`` is missing, or crates.io when the crates are not in cargo's cache (``tests/registries.py``).
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
from typing import Dict, Iterator, Optional

import pytest

from conformance.harness.mock_proxy import MockProxy
from tests.port_process import (
    PortServer, assert_a_custom_auth_header_and_the_misconfigured_mode,
    assert_a_script_through_the_proxy_and_a_failing_agent, assert_auth_ping_and_the_refusals,
    assert_bad_arguments_are_one_line, assert_sigterm_lets_a_dispatch_finish, assert_the_check_passes_at_strict)
from tests.registries import cargo_fetch, need
from tests.rust_mutants import CARGO, PORT, build, target_dir

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENT_TOKEN = "rust-agent-token-5d5d5d5d"
RUN_TOKEN = "rust-run-token-6e6e6e6e"

pytestmark = pytest.mark.skipif(CARGO is None, reason="cargo is not on PATH: the Rust port cannot be built")


@pytest.fixture(autouse=True, scope="module")
def crates() -> None:
    """The port's locked crates, in cargo's registry cache (skipped when crates.io is unreachable)."""
    need(cargo_fetch, PORT, CARGO)


def cargo(*args: str, cwd: pathlib.Path = PORT, timeout: float = 900) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    env = {**os.environ, "CARGO_TARGET_DIR": str(target_dir()), "CARGO_TERM_COLOR": "never"}
    return subprocess.run([str(CARGO), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``cargo build`` of the conformance server, once per module, copied out of the shared target directory."""
    return build(PORT, tmp_path_factory.mktemp("rust-port") / "conformance-server")


class RustServer(PortServer):
    """The built conformance server as a subprocess on a free port; ``url`` is its dispatch URL."""

    def __init__(self, exe: pathlib.Path, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__([str(exe)], *args, agent_token=AGENT_TOKEN, env=env)


@pytest.fixture(scope="module")
def server(binary: pathlib.Path) -> Iterator[RustServer]:
    rust = RustServer(binary)
    yield rust
    log = rust.log()
    assert rust.stop() == 0
    assert AGENT_TOKEN not in log and RUN_TOKEN not in log  # no token in any log line


@pytest.fixture
def proxy() -> Iterator[MockProxy]:
    with MockProxy(tokens=[RUN_TOKEN]) as p:
        yield p


# -- the port's own gates ------------------------------------------------------------------------


def test_cargo_fmt_clippy_and_cargo_test_pass() -> None:
    fmt = cargo("fmt", "--check")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    clippy = cargo("clippy", "--locked", "--all-targets", "--all-features", "--", "-D", "warnings")
    assert clippy.returncode == 0, clippy.stderr[-4000:]
    done = cargo("test", "--locked", "--test", "vectors", "--", "--nocapture")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (counts,) = [line for line in done.stdout.splitlines() if line.startswith("vectors:")]
    passed = int(counts.split("vectors:")[1].split(" passed")[0])
    assert passed > 250 and " 0 failed" in counts, counts
    done = cargo("test", "--locked")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_the_crate_keeps_its_promises() -> None:
    manifest = (PORT / "Cargo.toml").read_text()
    assert re.search(r'^rust-version = "1\.\d+"', manifest, re.M)
    assert (PORT / "Cargo.lock").exists()
    lib = (PORT / "src" / "lib.rs").read_text()
    assert "#![forbid(unsafe_code)]" in lib and "#![deny(missing_docs)]" in lib
    # ready to publish (CI runs cargo package): no publish = false, what crates.io and docs.rs read
    assert "publish = false" not in manifest
    for field in ("description", "license", "readme", "documentation", "keywords", "categories"):
        assert re.search(rf"^{field} = ", manifest, re.M), field
    assert "[package.metadata.docs.rs]\nall-features = true" in manifest
    for example in ("quick_start", "blocking_agent", "axum_router"):  # built by cargo test
        assert f'name = "{example}"' in manifest and (PORT / "examples" / f"{example}.rs").exists()
    core = cargo("tree", "--locked", "--no-default-features", "-e", "normal", "--depth", "1")
    assert core.returncode == 0, core.stderr
    direct = sorted(line.split()[1] for line in core.stdout.splitlines()[1:] if line.strip())
    # the contract core depends on serde and serde_json, and on sha2, subtle and httpdate (pure functions, no I/O)
    assert direct == ["httpdate", "serde", "serde_json", "sha2", "subtle"], direct


# -- the conformance check -----------------------------------------------------------------------


def test_the_conformance_check_passes_at_strict(server: RustServer) -> None:
    assert_the_check_passes_at_strict(server, AGENT_TOKEN)


def test_a_custom_auth_header_and_the_misconfigured_mode(binary: pathlib.Path) -> None:
    assert_a_custom_auth_header_and_the_misconfigured_mode(functools.partial(RustServer, binary), AGENT_TOKEN)


# -- direct HTTP ---------------------------------------------------------------------------------


def test_auth_ping_and_the_refusals(server: RustServer) -> None:
    assert_auth_ping_and_the_refusals(server, AGENT_TOKEN)


def test_a_script_through_the_proxy_and_a_failing_agent(server: RustServer, proxy: MockProxy) -> None:
    assert_a_script_through_the_proxy_and_a_failing_agent(server, proxy, agent_token=AGENT_TOKEN, run_token=RUN_TOKEN)


def test_bad_arguments_are_one_line(binary: pathlib.Path) -> None:
    assert_bad_arguments_are_one_line([str(binary)])


def test_sigterm_lets_an_in_flight_dispatch_finish(binary: pathlib.Path, proxy: MockProxy) -> None:
    assert_sigterm_lets_a_dispatch_finish(RustServer(binary), proxy, agent_token=AGENT_TOKEN, run_token=RUN_TOKEN)


def test_the_readme_quick_start_builds(tmp_path: pathlib.Path) -> None:
    """The README's Rust quick start, as printed, is a complete program that builds against the port."""
    readme = (PORT / "README.md").read_text()
    quick = re.search(r"## Quick start: your own agent\n.*?```rust\n(.*?)```", readme, re.S)
    assert quick is not None and len(quick.group(1).splitlines()) <= 40
    assert quick.group(1) == (PORT / "examples" / "quick_start.rs").read_text()  # cargo builds it there too
    crate = tmp_path / "agent"
    (crate / "src").mkdir(parents=True)
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "quick-start"\nversion = "0.1.0"\nedition = "2021"\n\n[dependencies]\n'
        f'pipelines-port = {{ path = "{PORT}" }}\nserde_json = "1"\n'
        'tokio = { version = "1", features = ["macros", "rt-multi-thread", "signal", "net"] }\n')
    (crate / "src" / "main.rs").write_text(quick.group(1))
    shutil_lock = (PORT / "Cargo.lock").read_text()
    (crate / "Cargo.lock").write_text(shutil_lock)  # the port's pinned versions, so nothing new is resolved
    done = cargo("build", "--offline", cwd=crate)
    assert done.returncode == 0, done.stderr[-3000:]
