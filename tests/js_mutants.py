"""Realistic porting bugs in the JavaScript port: the Node half of the conformance check's mutation set.

Each mutant is one bug a JavaScript or TypeScript engineer could make translating
the contract: a few exact text edits to a copy of ``conformance/ports/node``
(each ``old`` must occur exactly once), the CONTRACT rule it breaks, and the
mode the check runs in.  ``tests/mutation_score.py`` serves each mutated copy
and runs the whole check at ``--strict`` against it; ``tests/test_js_mutants.py``
makes sure every edit still applies to the port as it is today.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import NamedTuple, Tuple

PORT = pathlib.Path(__file__).resolve().parent.parent / "conformance" / "ports" / "node"
MODULE = "pipelines_port.mjs"


class Mutant(NamedTuple):
    name: str
    rule: str  # the CONTRACT rule the bug breaks
    edits: Tuple[Tuple[str, str], ...]  # (old, new) in pipelines_port.mjs, each old found exactly once
    mode: str = "normal"  # "misconfigured": served with its token variable unset, checked with --misconfigured


def _m(name: str, rule: str, *edits: Tuple[str, str], mode: str = "normal") -> Mutant:
    return Mutant(name, rule, tuple(edits), mode)


CREDENTIAL = "  return constantTimeEqual(received, expected);\n}"

MUTANTS = [
    # -- inbound auth (§2 step 1)
    _m("auth_prefix_match", "auth-401-no-echo",
       (CREDENTIAL, "  return received.length > 0 && expected.startsWith(received);\n}")),
    _m("auth_includes", "auth-401-no-echo", (CREDENTIAL, "  return received.includes(expected);\n}")),
    _m("auth_case_insensitive", "auth-401-no-echo",
       (CREDENTIAL, "  return constantTimeEqual(received.toLowerCase(), expected.toLowerCase());\n}")),
    _m("auth_any_scheme", "auth-401-no-echo", ('if (scheme.toLowerCase() !== "bearer") {', "if (false) {")),
    _m("auth_whitespace_removed", "auth-401-no-echo",
       (CREDENTIAL, '  return constantTimeEqual(received.replace(/\\s+/g, ""), expected);\n}')),
    _m("ping_before_auth", "auth-first",
       ("    const early = this.precheck(method, target, headers);\n",
        "    if (isPing((() => { try { return JSON.parse(body.toString()); } catch { return null; } })())) {\n"
        '      return { reply: jsonReply(200, { ok: true }), what: "ping" };\n    }\n'
        "    const early = this.precheck(method, target, headers);\n")),
    _m("misconfigured_runs_open", "auth-first",
       ("      if (!expected) {\n        return errorReply(503,", "      if (!expected) return null;\n      if (false) {\n        return errorReply(503,"),
       mode="misconfigured"),
    _m("misconfigured_401", "auth-env-unset-503",
       ("        return errorReply(503, `this agent's wrapper", "        return errorReply(401, `this agent's wrapper"),
       mode="misconfigured"),
    # -- ping and the 400s (§2 steps 2-5)
    _m("truthy_ping", "ping-strict",
       ("return isObject(body) && Object.keys(body).length === 1 && body.ping === true;",
        "return isObject(body) && Boolean(body.ping);")),
    _m("non_object_body_crashes", "non-object-body-400",
       ("    if (!isObject(payload)) return { reply: errorReply(400, `body must be a JSON object, got ${jsonType(payload)}`), what: \"rejected\" };",
        "    if (!isObject(payload)) return { reply: errorReply(500, \"TypeError: Cannot read properties of null (reading 'input')\"), what: \"rejected\" };")),
    # -- the envelope (§2.2)
    _m("task_input_not_nested", "task-input-nesting", ('task_input: typed("input", isObject) ?? {},', "task_input: task,")),
    _m("proxy_url_slash_kept", "proxy-url-source", ('url = url.trim().replace(/\\/+$/, "");', "url = url.trim();")),
    _m("no_proxy_url_header_fallback", "proxy-url-source",
       ("for (const name of [PROXY_URL_HEADER, PROXY_URL_HEADER_LEGACY]) {", "for (const name of []) {")),
    _m("header_ids_as_numbers", "native-id-types",
       ('if (typeof value === "string" && value.trim()) return value.trim();',
        'if (typeof value === "string" && value.trim()) return Number(value.trim());')),
    _m("sub_agents_untrimmed", "actor-label-trim", ("label = validateActorLabel(raw);", "label = validateActorLabel(raw) && raw;")),
    # -- the proxy client (§3.1-§3.3)
    _m("envelope_not_unwrapped", "unwrap-response",
       ('value: isJson && isObject(value) && "response" in value ? value.response : value', "value: value")),
    _m("string_decoded_twice", "no-double-decode",
       ('value: isJson && isObject(value) && "response" in value ? value.response : value',
        'value: isJson && isObject(value) && "response" in value ? (typeof value.response === "string" ? '
        "(() => { try { return JSON.parse(value.response); } catch { return value.response; } })() : value.response) : value")),
    _m("no_retry_429", "retry-transient",
       ("if (status === 429 || (status === 503 && TRANSIENT_503_CLASSES.has(errorClass))) {",
        "if (status === 503 && TRANSIENT_503_CLASSES.has(errorClass)) {")),
    _m("retries_every_5xx", "terminal-no-retry",
       ("if (status === 429 || (status === 503 && TRANSIENT_503_CLASSES.has(errorClass))) {",
        "if (status === 429 || status >= 500) {")),
    _m("new_key_per_attempt", "idempotency-key-reuse",
       ("        reply = await send();\n", '        headers["Idempotency-Key"] = randomUUID();\n        reply = await send();\n')),
    _m("retry_after_ignored", "honour-retry-after",
       ("  if (retryAfter !== null) return Math.min(retryAfter, policy.maxRetryAfterS);\n", "")),
    _m("no_backoff", "bounded-backoff",
       ("  const wait = policy.baseDelayS * 2 ** (retry - 1) * (1 - policy.jitter + Math.random() * 2 * policy.jitter);",
        "  const wait = 0;")),
    _m("retries_unbounded", "bounded-backoff", ("  maxAttempts: 4,", "  maxAttempts: 40,")),
    _m("stale_token_not_distinct", "stale-token-distinct",
       ("if (status === 401 && STALE_TOKEN_CLASSES.has(errorClass)) {", "if (false) {")),
    _m("jti_sent_as_run_token", "run-token-auth",
       ("      Authorization: `Bearer ${envelope.run_token}`,\n",
        "      Authorization: `Bearer ${envelope.run_token}`,\n"
        '      "X-Pipelines-Run-Token": envelope.run_token_jti ?? "",\n')),
    _m("tool_name_unencoded", "tool-name-pattern",
       ("      validateToolName(name);\n", ""),
       ("${kind}/${encodeURIComponent(name)}`", "${kind}/${name}`")),
    # -- actor labels (§3.5)
    _m("actor_not_trimmed", "actor-label-trim", ("  label = label.trim();\n  if (!label) return null;", "  if (!label.trim()) return null;")),
    _m("actor_header_when_empty", "actor-absent-no-header",
       ("    if (label) headers[ACTOR_ID_HEADER] = label;", '    headers[ACTOR_ID_HEADER] = label ?? "";')),
    _m("actor_not_validated", "actor-validate-locally",
       ("  if (problem) throw invalid(`invalid actor label", "  if (false) throw invalid(`invalid actor label")),
    _m("undeclared_actor_refused", "actor-undeclared-allowed",
       ("      if (label) warnIfUndeclared(envelope, label);",
        "      if (label && envelope.sub_agents.length && !envelope.sub_agents.includes(label)) "
        "throw new ProxyRequestError(`undeclared actor ${label}`);")),
    # -- trace events (§3.4)
    _m("no_occurred_at", "trace-occurred-at",
       ('      if (!Object.hasOwn(event, "__occurred_at")) event.__occurred_at = new Date().toISOString();\n', "")),
    _m("occurred_at_overwritten", "trace-occurred-at",
       ('      if (!Object.hasOwn(event, "__occurred_at")) event.__occurred_at = new Date().toISOString();',
        "      event.__occurred_at = new Date().toISOString();")),
    _m("self_handoff_sent", "self-handoff-dropped", ("  if (source === target) {", "  if (false) {")),
    _m("handoff_wrong_keys", "handoff-shape",
       ("  const event = { from_sub_agent: source, to_sub_agent: target };", "  const event = { from: source, to: target };")),
    # -- the response and errors (§2 step 8, §4)
    _m("empty_final_response_sent", "final-response-required",
       ("  if (errors.length) throw new ResponseError(errors);",
        '  if (errors.length && body.final_response !== "") throw new ResponseError(errors);')),
    _m("transcript_dropped", "response-as-built", ("  if (messages !== null) body.messages = flatMessages(messages);\n", "")),
    _m("agent_error_200", "agent-error-500",
       ("      return errorReply(500, short(scrub(describeError(err)), DETAIL_LIMIT - 1));",
        "      return jsonReply(200, { final_response: `The agent failed: ${scrub(describeError(err))}` });")),
    _m("stack_in_detail", "no-traceback-in-body",
       ("  return err.message ? `${err.name}: ${err.message}` : err.name;", "  return err.stack ?? err.name;")),
    _m("run_token_not_scrubbed", "run-token-secret",
       ("    const secrets = [envelope.run_token, this.#expectedToken()];", "    const secrets = [this.#expectedToken()];")),
    _m("response_token_not_redacted", "run-token-secret",
       ("      if (JSON.stringify(body).includes(envelope.run_token)) {", "      if (false) {")),
    # -- concurrency (§2 step 6)
    _m("module_level_envelope", "per-request-binding",
       ("    const { envelope } = context;\n", "    const { envelope } = context;\n    globalThis.currentDispatch = envelope;\n"),
       ("  const envelope = dispatchContext.getStore()?.envelope;", "  const envelope = globalThis.currentDispatch;")),
]


def materialise(mutant: Mutant, dest: pathlib.Path) -> pathlib.Path:
    """A copy of the Node port in ``dest`` with the mutant's edits applied; ValueError when one does not apply."""
    shutil.copytree(PORT, dest)
    path = dest / MODULE
    text = path.read_text(encoding="utf-8")
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise ValueError(f"mutant {mutant.name}: the text to replace occurs {count} times, not once: {old[:80]!r}")
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")
    return dest
