"""Realistic porting bugs in the TypeScript port: its half of the conformance check's mutation set.

Each mutant is one bug a TypeScript engineer could make translating the
contract: a few exact text edits to ``src/pipelines_port.ts`` in a copy of
``conformance/ports/typescript`` (each ``old`` must occur exactly once), the
CONTRACT rule it breaks, and the mode the check runs in.  Every mutant still
type-checks in strict mode: ``build`` compiles the copy with the port's own
``tsc`` (unused-name checks off, since an edit may leave a helper unused) and
fails when it does not.  ``tests/mutation_score.py`` serves each build and runs
the whole check at ``--strict`` against it; ``tests/test_ts_mutants.py`` makes
sure every edit still applies to the port as it is today.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from typing import NamedTuple, Tuple

PORT = pathlib.Path(__file__).resolve().parent.parent / "conformance" / "ports" / "typescript"
MODULE = "src/pipelines_port.ts"
TSC = PORT / "node_modules" / ".bin" / "tsc"


class Mutant(NamedTuple):
    name: str
    rule: str  # the CONTRACT rule the bug breaks
    edits: Tuple[Tuple[str, str], ...]  # (old, new) in src/pipelines_port.ts, each old found exactly once
    mode: str = "normal"  # "misconfigured": served with its token variable unset, checked with --misconfigured


def _m(name: str, rule: str, *edits: Tuple[str, str], mode: str = "normal") -> Mutant:
    return Mutant(name, rule, tuple(edits), mode)


CREDENTIAL = "  return constantTimeEqual(received, expected);\n}"
RETRYABLE = "if (status === 429 || (status === 503 && errorClass !== null && TRANSIENT_503_CLASSES.has(errorClass))) {"
UNWRAP = 'value: isJson && isObject(value) && "response" in value ? value["response"] ?? null : value'
STAMP = '      if (!Object.hasOwn(event, "__occurred_at")) event["__occurred_at"] = new Date().toISOString();'

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
        '    if (isPing((() => { try { return JSON.parse(new TextDecoder("utf-8").decode(body)) as unknown; } catch { return null; } })())) {\n'
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
       ('return isObject(body) && Object.keys(body).length === 1 && body["ping"] === true;',
        'return isObject(body) && Boolean(body["ping"]);')),
    _m("non_object_body_crashes", "kit-non-object-body-400",
       ("    if (!isObject(payload)) return { reply: errorReply(400, `body must be a JSON object, got ${jsonType(payload)}`), what: \"rejected\" };",
        "    if (!isObject(payload)) return { reply: errorReply(500, \"TypeError: Cannot read properties of null (reading 'input')\"), what: \"rejected\" };")),
    # -- the envelope (§2.2)
    _m("task_input_not_nested", "task-input-nesting", ('task_input: obj(task["input"]) ?? {},', "task_input: task,")),
    _m("proxy_url_slash_kept", "proxy-url-source", ('const trimmed = url.trim().replace(/\\/+$/, "");', "const trimmed = url.trim();")),
    _m("no_proxy_url_header_fallback", "proxy-url-source",
       ("for (const name of [PROXY_URL_HEADER, PROXY_URL_HEADER_LEGACY]) {", "for (const name of [] as string[]) {")),
    _m("header_ids_as_numbers", "native-id-types",
       ('if (typeof value === "string" && value.trim()) return value.trim();',
        'if (typeof value === "string" && value.trim()) return Number(value.trim());')),
    _m("sub_agents_untrimmed", "actor-label-trim", ("      label = validateActorLabel(raw);", "      label = validateActorLabel(raw) && raw;")),
    # -- the proxy client (§3.1-§3.3)
    _m("envelope_not_unwrapped", "unwrap-response", (UNWRAP, "value: value")),
    _m("string_decoded_twice", "no-double-decode",
       (UNWRAP, 'value: isJson && isObject(value) && "response" in value ? (typeof value["response"] === "string" ? '
                '(() => { try { return JSON.parse(value["response"] as string) as Json; } catch { return value["response"] ?? null; } })() '
                ': value["response"] ?? null) : value')),
    _m("no_retry_429", "retry-429",
       (RETRYABLE, "if (status === 503 && errorClass !== null && TRANSIENT_503_CLASSES.has(errorClass)) {")),
    _m("retries_every_5xx", "terminal-no-retry", (RETRYABLE, "if (status === 429 || status >= 500) {")),
    _m("new_key_per_attempt", "idempotency-key-reuse",
       ("        reply = await send();\n", '        headers["Idempotency-Key"] = randomUUID();\n        reply = await send();\n')),
    _m("retry_after_ignored", "honour-retry-after",
       ("  if (retryAfter !== null) return Math.min(retryAfter, policy.maxRetryAfterS);\n", "")),
    _m("retry_after_waited_out", "kit-retry-after-cap",
       ("      const outcome = settleReply(policy, interpretReply(reply.status, reply.headers, reply.body, "
        "{ toolName: name, runToken: envelope.run_token }));",
        "      const outcome = interpretReply(reply.status, reply.headers, reply.body, "
        "{ toolName: name, runToken: envelope.run_token });")),
    _m("no_backoff", "bounded-backoff",
       ("  const wait = policy.baseDelayS * 2 ** (retry - 1) * (1 - policy.jitter + Math.random() * 2 * policy.jitter);",
        "  const wait = 0;")),
    _m("no_jitter", "bounded-backoff",
       ("  const wait = policy.baseDelayS * 2 ** (retry - 1) * (1 - policy.jitter + Math.random() * 2 * policy.jitter);",
        "  const wait = policy.baseDelayS * 2 ** (retry - 1);")),
    _m("retries_unbounded", "bounded-backoff", ("  maxAttempts: 4,", "  maxAttempts: 40,")),
    _m("stale_token_not_distinct", "stale-token-distinct",
       ("if (status === 401 && errorClass !== null && STALE_TOKEN_CLASSES.has(errorClass)) {", "if (false) {")),
    _m("jti_sent_as_run_token", "run-token-auth",
       ("      Authorization: `Bearer ${envelope.run_token}`,\n",
        "      Authorization: `Bearer ${envelope.run_token}`,\n"
        '      "X-Pipelines-Run-Token": envelope.run_token_jti ?? "",\n')),
    _m("tool_name_unencoded", "tool-name-pattern",
       ("      validateToolName(name);\n", ""),
       ("${kind}/${encodeURIComponent(name)}`", "${kind}/${name}`")),
    # -- actor labels (§3.5)
    _m("actor_not_trimmed", "actor-label-trim",
       ("  const trimmed = label.trim();\n  if (!trimmed) return null;", "  const trimmed = label;\n  if (!trimmed.trim()) return null;")),
    _m("actor_header_when_empty", "actor-absent-no-header",
       ("    if (label) headers[ACTOR_ID_HEADER] = label;", '    headers[ACTOR_ID_HEADER] = label ?? "";')),
    _m("actor_not_validated", "actor-validate-locally",
       ("  if (problem) throw invalid(`invalid actor label", "  if (false) throw invalid(`invalid actor label")),
    _m("undeclared_actor_refused", "actor-undeclared-allowed",
       ("      if (label) warnIfUndeclared(envelope, label);",
        "      if (label && envelope.sub_agents.length && !envelope.sub_agents.includes(label)) "
        "throw new ProxyRequestError(`undeclared actor ${label}`);")),
    # -- trace events (§3.4)
    _m("no_occurred_at", "trace-occurred-at", (STAMP + "\n", "")),
    _m("occurred_at_overwritten", "trace-occurred-at", (STAMP, '      event["__occurred_at"] = new Date().toISOString();')),
    _m("self_handoff_sent", "self-handoff-dropped", ("  if (source === target) {", "  if (false) {")),
    _m("handoff_wrong_keys", "handoff-shape",
       ("  const event: HandoffEvent = { from_sub_agent: source, to_sub_agent: target };",
        "  const event: Record<string, unknown> = { from: source, to: target };")),
    # -- the response and errors (§2 step 8, §4)
    _m("empty_final_response_sent", "final-response-required",
       ("  const soft = softProblems(validateResponse(body), isStrict);",
        '  const soft = body["final_response"] === "" ? [] : softProblems(validateResponse(body), isStrict);')),
    _m("transcript_dropped", "response-as-built", ('  if (transcript !== null) body["messages"] = flatMessages(transcript);\n', "")),
    _m("turn_reply_folded", "turn-reply-as-built",
       ("      const body = buildResponse(result, { strict: this.strict, multiTurn: isMultiTurn(envelope) });",
        "      const body = buildResponse(result, { strict: this.strict });")),
    _m("agent_error_200", "agent-error-500",
       ("      return errorReply(500, short(scrub(describeError(err)), DETAIL_LIMIT - 1));",
        "      return jsonReply(200, { final_response: `The agent failed: ${scrub(describeError(err))}` });")),
    _m("stack_in_detail", "no-traceback-in-body",
       ("  return err.message ? `${err.name}: ${err.message}` : err.name;", "  return err.stack ?? err.name;")),
    _m("run_token_not_scrubbed", "run-token-secret",
       ("    const secrets = [envelope.run_token, this.expectedToken()];", "    const secrets = [this.expectedToken()];")),
    _m("response_token_not_redacted", "run-token-secret",
       ("      if (JSON.stringify(body).includes(envelope.run_token)) {", "      if (false) {")),
    # -- concurrency (§2 step 6)
    _m("module_level_envelope", "per-request-binding",
       ("    const secrets = [envelope.run_token, this.expectedToken()];\n",
        "    const secrets = [envelope.run_token, this.expectedToken()];\n"
        "    (globalThis as unknown as { currentDispatch?: Envelope }).currentDispatch = envelope;\n"),
       ("  const envelope = dispatchContext.getStore()?.envelope;",
        "  const envelope = (globalThis as unknown as { currentDispatch?: Envelope }).currentDispatch;")),
    # -- from an independent set, written without this file: what the check missed until it grew a case
    _m('401_echo_prefix', 'auth-401-no-echo', ('return errorReply(401, `missing or invalid credential in the ${this.authHeader} header`,', 'return errorReply(401, `missing or invalid credential in the ${this.authHeader} header (got ${quoted(h[this.authHeader.toLowerCase()] ?? "", 12)})`,')),
    _m('zero_id_falsy', 'native-id-types', ('candidates.map(nativeId).find((id) => id !== null) ?? null;', 'candidates.map(nativeId).find((id) => id) ?? null;')),
    _m('jti_header_first', 'ids-body-then-headers', ('run_token_jti: jti ?? header(h, RUN_TOKEN_JTI_HEADER),', 'run_token_jti: header(h, RUN_TOKEN_JTI_HEADER) ?? jti,')),
    _m('task_id_input_first', 'ids-body-then-headers', ('task_id: firstId(raw["task_id"], task["task_id"], header(h, TASK_ID_HEADER)),', 'task_id: firstId(task["task_id"], raw["task_id"], header(h, TASK_ID_HEADER)),')),
    _m('redact_final_only', 'run-token-secret', ('      if (JSON.stringify(body).includes(envelope.run_token)) {\n        log("warning", "the agent\'s response contained the run token; it was redacted");\n        return jsonReply(200, redact(body, envelope.run_token));\n      }', '      if (String(body["final_response"]).includes(envelope.run_token)) {\n        log("warning", "the agent\'s response contained the run token; it was redacted");\n        return jsonReply(200, { ...body, final_response: redact(body["final_response"], envelope.run_token) });\n      }')),
    _m('scrub_run_token_only', 'run-token-secret', ('const secrets = [envelope.run_token, this.expectedToken()];', 'const secrets = [envelope.run_token];')),
    _m('self_handoff_raw', 'self-handoff-dropped', ('  if (source === target) {', '  if (fromSubAgent === toSubAgent) {')),
]


def materialise(mutant: Mutant, dest: pathlib.Path) -> pathlib.Path:
    """A copy of the port's sources in ``dest`` with the mutant's edits applied; ValueError when one does not apply."""
    shutil.copytree(PORT, dest, ignore=shutil.ignore_patterns("node_modules", "dist"))
    if (PORT / "node_modules").is_dir():
        os.symlink(PORT / "node_modules", dest / "node_modules")
    path = dest / MODULE
    text = path.read_text(encoding="utf-8")
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise ValueError(f"mutant {mutant.name}: the text to replace occurs {count} times, not once: {old[:80]!r}")
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")
    return dest


def build(copy: pathlib.Path) -> pathlib.Path:
    """Compile a materialised copy with the port's tsc; the path of its server.  RuntimeError when it does not type-check."""
    if not TSC.exists():
        raise RuntimeError(f"{TSC} is missing: run `npm ci` in {PORT}")
    done = subprocess.run([str(TSC), "-p", str(copy), "--noUnusedLocals", "false", "--noUnusedParameters", "false"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the mutant does not type-check: {(done.stdout + done.stderr)[-1500:]}")
    return copy / "dist" / "server.js"
