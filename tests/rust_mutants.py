"""Realistic porting bugs in the Rust port: the Rust half of the conformance check's mutation set.

Each mutant is one bug a Rust engineer could make translating the contract: a
few exact text edits to a copy of ``conformance/ports/rust`` (each edit names
the file it changes, and its ``old`` text must occur there exactly once), the
CONTRACT rule it breaks, and the mode the check runs in. A mutated copy is
built with ``cargo build`` (``build``) into one shared target directory, so
the dependencies compile once for every mutant, and served; the whole check at
``--strict`` must fail against it (``--misconfigured`` for a mutant served
with its token variable unset). ``tests/test_rust_mutants.py`` makes sure every
edit still applies to the port as it is today.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from typing import NamedTuple, Optional, Tuple

from tests.mutant_edits import Edit, apply_edits

PORT = pathlib.Path(__file__).resolve().parent.parent / "conformance" / "ports" / "rust"
MODULE = "src/lib.rs"  # the crate's root; an edit names the file it changes
CARGO = shutil.which("cargo") or (str(pathlib.Path.home() / ".cargo" / "bin" / "cargo")
                                  if (pathlib.Path.home() / ".cargo" / "bin" / "cargo").exists() else None)



class Mutant(NamedTuple):
    name: str
    rule: str  # the CONTRACT rule the bug breaks
    edits: Tuple[Edit, ...]  # each old found exactly once in its file
    mode: str = "normal"  # "misconfigured": served with its token variable unset, checked with --misconfigured


def _m(name: str, rule: str, *edits: Edit, mode: str = "normal") -> Mutant:
    return Mutant(name, rule, tuple(edits), mode)


INBOUND, ENVELOPE, ENCODING = "src/contract/inbound.rs", "src/contract/envelope.rs", "src/contract/encoding.rs"
REPLY, RESPONSE, SERVER, AIO = "src/contract/reply.rs", "src/contract/response.rs", "src/server.rs", "src/aio.rs"

CREDENTIAL = "    constant_time_eq(received, expected)\n}"
AGENT_500 = "                return HttpReply::refuse(500, detail);"

MUTANTS = [
    # -- inbound auth (§2 step 1)
    _m("auth_prefix_match", "auth-401-no-echo",
       (INBOUND, CREDENTIAL, "    !received.is_empty() && expected.starts_with(received)\n}")),
    _m("auth_case_insensitive", "auth-401-no-echo", (INBOUND, CREDENTIAL, "    received.eq_ignore_ascii_case(expected)\n}")),
    _m("auth_digest_compared_with_itself", "auth-401-no-echo",  # a copy-paste slip: every token matches
       (INBOUND, "let (x, y) = (sha256(a.as_bytes()), sha256(b.as_bytes()));",
        "let (x, y) = (sha256(a.as_bytes()), sha256(a.as_bytes()));")),
    _m("auth_any_scheme", "auth-401-no-echo",
       (INBOUND, 'if !scheme.eq_ignore_ascii_case("bearer") {', "if scheme.is_empty() {")),
    _m("misconfigured_runs_open", "auth-first", (SERVER, "_ => Auth::Unset(o.token_env.clone()),", "_ => Auth::Disabled,"),
       mode="misconfigured"),
    _m("misconfigured_401", "auth-env-unset-503",
       (INBOUND, "            return refuse(HttpReply::refuse(\n                503,\n                format!(\n"
                 "                    \"this agent's wrapper",
        "            return refuse(HttpReply::refuse(\n                401,\n                format!(\n"
        "                    \"this agent's wrapper"),
       mode="misconfigured"),
    # -- ping and the 400s (§2 steps 2-5)
    _m("ping_any_keys", "ping-strict", (INBOUND, "if map.len() == 1 && map.get", "if map.get")),
    _m("invalid_json_500", "invalid-json-400",
       (INBOUND, '                400,\n                format!("body is not valid JSON: {}"',
        '                500,\n                format!("body is not valid JSON: {}"')),
    _m("envelope_error_500", "envelope-missing-400",
       (INBOUND, "Err(e) => refuse(HttpReply::refuse(400, e.0)),", "Err(e) => refuse(HttpReply::refuse(500, e.0)),")),
    # -- the envelope (§2.2)
    _m("task_input_not_nested", "task-input-nesting",
       (ENVELOPE, 'task_input: object_of("input").unwrap_or_default(),', "task_input: task.clone(),")),
    _m("proxy_url_slash_kept", "proxy-url-source",
       (ENVELOPE, "text.trim().trim_end_matches('/').to_string()", "text.trim().to_string()")),
    _m("no_proxy_url_header_fallback", "proxy-url-source",
       (ENVELOPE, "for name in [HEADER_PROXY_URL, HEADER_PROXY_URL_LEGACY] {", "for name in [HEADER_PROXY_URL_LEGACY] {")),
    _m("legacy_header_first", "legacy-proxy-url-names",
       (ENVELOPE, "for name in [HEADER_PROXY_URL, HEADER_PROXY_URL_LEGACY] {",
        "for name in [HEADER_PROXY_URL_LEGACY, HEADER_PROXY_URL] {")),
    _m("run_id_no_header_fallback", "ids-body-then-headers",
       (ENVELOPE, 'run_id: first_id([object.get("run_id").cloned(), header_id(HEADER_RUN_ID)]),',
        'run_id: first_id([object.get("run_id").cloned()]),')),
    # -- the proxy client (§3.1-§3.3)
    _m("envelope_not_unwrapped", "unwrap-response",
       (REPLY, 'if let Some(response) = object.remove("response") {\n                return ProxyOutcome::Value(response);',
        'if object.contains_key("response") {\n                return ProxyOutcome::Value(Value::Object(object));')),
    _m("string_decoded_twice", "no-double-decode",
       (REPLY, "                return ProxyOutcome::Value(response);",
        "                if let Some(again) = response.as_str().and_then(|t| decode(t.as_bytes()).ok()) {\n"
        "                    return ProxyOutcome::Value(again);\n                }\n"
        "                return ProxyOutcome::Value(response);")),
    _m("no_retry_transient_503", "retry-transient",
       (REPLY, "        503 if TRANSIENT_503_CLASSES.contains(&class) => RetryDecision::Retry,\n", "")),
    _m("retries_every_5xx", "terminal-no-retry",
       (REPLY, "        _ => RetryDecision::Fail,", "        500..=599 => RetryDecision::Retry,\n        _ => RetryDecision::Fail,")),
    _m("retries_unbounded", "bounded-backoff", (REPLY, "            max_attempts: 4,", "            max_attempts: 40,")),
    _m("no_backoff", "bounded-backoff",
       (REPLY, "        Duration::from_secs_f64(wait.clamp(0.0, self.max_delay.as_secs_f64()))",
        "        let _ = wait;\n        Duration::ZERO")),
    _m("no_jitter", "bounded-backoff",
       (REPLY, "        let factor = 1.0 - self.jitter + unit * 2.0 * self.jitter;",
        "        let factor = 1.0 + 0.0 * unit;")),
    _m("retry_after_ignored", "honour-retry-after",
       (REPLY, "let wait = self.policy.delay(self.attempts, error.retry_after, unit);",
        "let wait = self.policy.delay(self.attempts, None, unit);")),
    _m("retry_after_date_reversed", "honour-retry-after",  # now minus the date: a past date waits years
       (REPLY, "when.duration_since(now)", "now.duration_since(when)")),
    _m("retry_after_waited_out", "kit-retry-after-cap", (REPLY, "match self.policy.settle(outcome) {", "match outcome {")),
    _m("new_key_per_attempt", "idempotency-key-reuse",
       (AIO, "                builder = builder.header(name, value);",
        '                builder = if name == "Idempotency-Key" {\n                    builder.header(name, new_uuid())\n'
        "                } else {\n                    builder.header(name, value)\n                };")),
    _m("stale_token_on_403", "stale-token-distinct",
       (REPLY, "        401 if STALE_TOKEN_CLASSES.contains(&class)", "        403 if STALE_TOKEN_CLASSES.contains(&class)")),
    # -- actor labels (§3.5), trace events (§3.4)
    _m("actor_not_trimmed", "actor-label-trim",
       (ENCODING, "        Value::String(text) => text.trim(),",
        "        Value::String(text) if text.trim().is_empty() => return Ok(None),\n"
        "        Value::String(text) => text.as_str(),")),
    _m("actor_header_when_empty", "actor-absent-no-header",
       (ENCODING, "if let Some(label) = actor.filter(|l| !l.is_empty()) {", 'if let Some(label) = actor.or(Some("")) {')),
    _m("occurred_at_overwritten", "trace-occurred-at",
       (ENCODING, '    event\n        .entry("__occurred_at")\n        .or_insert_with(|| Value::String(occurred_at.to_string()));',
        '    event.insert("__occurred_at".into(), Value::String(occurred_at.to_string()));')),
    _m("self_handoff_sent", "self-handoff-dropped", (ENCODING, "    if source == target {\n        return Ok(None);\n    }\n", "")),
    _m("handoff_wrong_keys", "handoff-shape",
       (ENCODING, 'event.insert("from_sub_agent".into(), Value::String(source));',
        'event.insert("from".into(), Value::String(source));')),
    # -- the response and errors (§2 step 8, §4)
    _m("turn_reply_folded", "turn-reply-as-built",  # the multi-turn flag never passed: every reply an envelope
       (SERVER, "match build_reply(&value, strict, state.envelope.is_multi_turn()) {",
        "match build_reply(&value, strict, false) {")),
    _m("empty_final_response_sent", "final-response-required",
       (RESPONSE, '        Some(Value::String(text)) if text.is_empty() => problems.push(hard(\n            "final_response",\n'
                  '            "must not be empty (the judge has nothing to grade)",\n        )),\n', "")),
    _m("agent_error_200", "agent-error-500",
       (SERVER, AGENT_500,
        '                return HttpReply::ok(serde_json::json!({"final_response": format!("The agent failed: {detail}")}));')),
    _m("run_token_in_detail", "run-token-secret",
       (SERVER, "let detail = agent_error_detail(&error.describe(), &secrets);",
        "let detail = agent_error_detail(&error.describe(), &[]);")),
    _m("response_token_not_redacted", "run-token-secret",
       (SERVER, "if contains_secret(&body, &secrets) {", "if contains_secret(&body, &[agent_token]) {")),
    # -- concurrency (§2 step 6): the first dispatch's state cached for every later one
    _m("run_state_cached", "per-request-binding",
       (SERVER, "                let run = Run::from_state(\n                    Arc::new(crate::transport::RunState::new(*envelope)),",
        "                static SHARED: std::sync::OnceLock<Arc<crate::transport::RunState>> = std::sync::OnceLock::new();\n"
        "                let run = Run::from_state(\n"
        "                    SHARED.get_or_init(|| Arc::new(crate::transport::RunState::new(*envelope))).clone(),")),
]


def materialise(mutant: Mutant, dest: pathlib.Path) -> pathlib.Path:
    """A copy of the Rust port in ``dest`` with the mutant's edits applied; ValueError when one does not apply."""
    shutil.copytree(PORT, dest, ignore=shutil.ignore_patterns("target"))
    return apply_edits(mutant.name, mutant.edits, dest)


def target_dir() -> pathlib.Path:
    """The one cargo target directory every build shares: $CARGO_TARGET_DIR, else a stable one under the temp dir."""
    configured = os.environ.get("CARGO_TARGET_DIR")
    return pathlib.Path(configured) if configured else pathlib.Path(tempfile.gettempdir()) / "pipelines-port-rust-target"


_BUILD_LOCK = threading.Lock()  # cargo serialises builds in one target dir anyway; the lock keeps each binary ours


def _forget_the_crate(target: pathlib.Path) -> None:
    """Removes the crate's own artefacts from the shared target directory, the dependencies' stay.

    Every copy of the port is the same package to cargo (its fingerprint hashes the path relative to the
    workspace root), and a copy's sources may be older than the last build: without this, cargo could take one
    copy's binary as up to date for another copy, or for the port itself.
    """
    for pattern in ("debug/.fingerprint/pipelines-port-*", "debug/deps/*pipelines_port-*",
                    "debug/deps/conformance_server-*", "debug/conformance-server"):
        for stale in target.glob(pattern):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def build(port_dir: pathlib.Path, exe: pathlib.Path, timeout: float = 900) -> pathlib.Path:
    """``cargo build`` of a port copy's conformance server, copied to ``exe``; RuntimeError with cargo's output."""
    if CARGO is None:
        raise RuntimeError("cargo is not on PATH")
    target = target_dir()
    env = {**os.environ, "CARGO_TARGET_DIR": str(target), "CARGO_TERM_COLOR": "never"}
    with _BUILD_LOCK:
        _forget_the_crate(target)
        try:
            done = subprocess.run([CARGO, "build", "--locked", "--bin", "conformance-server"], cwd=port_dir, env=env,
                                  capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"cargo build failed: {done.stderr[-800:]}")
            exe.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target / "debug" / "conformance-server", exe)
        finally:
            _forget_the_crate(target)  # nor may a later build of the port itself take this copy's artefacts
    return exe


def cargo() -> Optional[str]:
    return CARGO
