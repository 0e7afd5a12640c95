"""Realistic porting bugs in the Go port: the Go half of the conformance check's mutation set.

Each mutant is one bug a Go engineer could make translating the contract: a
few exact text edits to a copy of ``conformance/ports/go`` (each edit names the
file it changes, and its ``old`` text must occur there exactly once), the
CONTRACT rule it breaks, and the mode the check runs in. A mutated copy is
built with ``go build`` (``build``) and served; the whole check at
``--strict`` must fail against it (``--misconfigured`` for a mutant served with
its token variable unset). ``tests/test_go_mutants.py`` makes sure every edit
still applies to the port as it is today.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from typing import Dict, NamedTuple, Optional, Tuple

from tests.mutant_edits import Edit, apply_edits

PORT = pathlib.Path(__file__).resolve().parent.parent / "conformance" / "ports" / "go"
MODULE = "pipelinesport.go"  # the package's main file; an edit names the file it changes
SERVER_PACKAGE = "./cmd/conformance-server"



class Mutant(NamedTuple):
    name: str
    rule: str  # the CONTRACT rule the bug breaks
    edits: Tuple[Edit, ...]  # each old found exactly once in its file
    mode: str = "normal"  # "misconfigured": served with its token variable unset, checked with --misconfigured


def _m(name: str, rule: str, *edits: Edit, mode: str = "normal") -> Mutant:
    return Mutant(name, rule, tuple(edits), mode)


INBOUND, ENVELOPE, CLIENT, RESPONSE, SERVER = "inbound.go", "envelope.go", "client.go", "response.go", "server.go"

CREDENTIAL = "\treturn constantTimeEqual(received, expected)\n}"
RETRYABLE = ("if status == http.StatusTooManyRequests || (status == http.StatusServiceUnavailable && "
             "transient503Classes[errorClass]) {")
AGENT_500 = "\t\treturn refuse(http.StatusInternalServerError, oneLine(detail, detailLimit))"

MUTANTS = [
    # -- inbound auth (§2 step 1)
    _m("auth_prefix_match", "auth-401-no-echo",
       (INBOUND, CREDENTIAL, '\treturn received != "" && strings.HasPrefix(expected, received)\n}')),
    _m("auth_case_insensitive", "auth-401-no-echo", (INBOUND, CREDENTIAL, "\treturn strings.EqualFold(received, expected)\n}")),
    _m("auth_any_scheme", "auth-401-no-echo", (INBOUND, 'if !strings.EqualFold(scheme, "bearer") {', "if scheme == \"\" {")),
    _m("auth_spaces_removed", "auth-401-no-echo",
       (INBOUND, CREDENTIAL, '\treturn constantTimeEqual(strings.ReplaceAll(received, " ", ""), expected)\n}')),
    _m("misconfigured_runs_open", "auth-first", (SERVER, "\tif !h.opts.NoAuth {", '\tif !h.opts.NoAuth && expected != "" {'),
       mode="misconfigured"),
    _m("misconfigured_401", "auth-env-unset-503",
       (SERVER, "return refuse(http.StatusServiceUnavailable, fmt.Sprintf(\"this agent's wrapper",
        "return refuse(http.StatusUnauthorized, fmt.Sprintf(\"this agent's wrapper"),
       mode="misconfigured"),
    # -- ping and the 400s (§2 steps 2-5)
    _m("ping_any_keys", "ping-strict", (INBOUND, "if !ok || len(object) != 1 {", "if !ok {")),
    _m("invalid_json_500", "invalid-json-400",
       (SERVER, 'return refuse(http.StatusBadRequest, "body is not valid JSON: "',
        'return refuse(http.StatusInternalServerError, "body is not valid JSON: "')),
    _m("non_object_body_500", "kit-non-object-body-400",
       (SERVER, 'return refuse(http.StatusBadRequest, "body must be a JSON object, got "+jsonType(payload))',
        'return refuse(http.StatusInternalServerError, "interface conversion: interface {} is not map[string]interface {}")')),
    _m("envelope_error_500", "envelope-missing-400",
       (SERVER, "\t\treturn refuse(StatusOf(err), err.Error())\n\t}\n\tstate.envelope = env",
        "\t\treturn refuse(http.StatusInternalServerError, err.Error())\n\t}\n\tstate.envelope = env")),
    # -- the envelope (§2.2)
    _m("task_input_not_nested", "task-input-nesting",
       (ENVELOPE, "\tif input, ok := task[\"input\"].(map[string]any); ok {\n\t\tenv.TaskInput = input\n\t}",
        "\tenv.TaskInput = task")),
    _m("proxy_url_slash_kept", "proxy-url-source",
       (ENVELOPE, 'text = strings.TrimRight(strings.TrimSpace(text), "/")', "text = strings.TrimSpace(text)")),
    _m("no_proxy_url_header_fallback", "proxy-url-source",
       (ENVELOPE, "for _, name := range []string{HeaderProxyURL, HeaderProxyURLLegacy} {", "for _, name := range []string{} {")),
    _m("legacy_proxy_url_field_ignored", "legacy-proxy-url-names",
       (ENVELOPE, "for _, field := range []string{FieldProxyURL, FieldProxyURLLegacy} {",
        "for _, field := range []string{FieldProxyURL} {")),
    _m("run_id_no_header_fallback", "ids-body-then-headers",
       (ENVELOPE, 'RunID:       firstID(object["run_id"], headerValue(headers, HeaderRunID)),',
        'RunID:       firstID(object["run_id"]),')),
    _m("sub_agents_untrimmed", "actor-label-trim",
       (ENVELOPE, "\t\tif err != nil || label == \"\" {\n\t\t\tcontinue\n\t\t}\n",
        "\t\tif err != nil || label == \"\" {\n\t\t\tcontinue\n\t\t}\n\t\tlabel = text\n")),
    # -- the proxy client (§3.1-§3.3)
    _m("jti_sent_as_run_token", "run-token-auth",
       (CLIENT, '\theader.Set("Authorization", "Bearer "+env.RunToken)\n',
        '\theader.Set("Authorization", "Bearer "+env.RunToken)\n\theader.Set(HeaderRunToken, env.RunTokenJTI)\n')),
    _m("tool_name_unescaped", "tool-name-pattern",
       (CLIENT, "\tif _, err := ValidateToolName(name); err != nil {\n\t\treturn nil, err\n\t}\n\tlabel, err := actorLabel(ctx, o)",
        "\tlabel, err := actorLabel(ctx, o)"),
       (CLIENT, '"/" + kind + "/" + url.PathEscape(name)', '"/" + kind + "/" + name')),
    _m("envelope_not_unwrapped", "unwrap-response",
       (CLIENT, "\t\t\tif response, has := object[\"response\"]; has {\n\t\t\t\treturn Reply{Kind: ReplyValue, Value: response}",
        "\t\t\tif _, has := object[\"response\"]; has {\n\t\t\t\treturn Reply{Kind: ReplyValue, Value: object}")),
    _m("string_decoded_twice", "no-double-decode",
       (CLIENT, "\t\t\t\treturn Reply{Kind: ReplyValue, Value: response}",
        "\t\t\t\tif text, ok := response.(string); ok {\n"
        "\t\t\t\t\tif again, err := decodeJSON([]byte(text)); err == nil {\n"
        "\t\t\t\t\t\treturn Reply{Kind: ReplyValue, Value: again}\n\t\t\t\t\t}\n\t\t\t\t}\n"
        "\t\t\t\treturn Reply{Kind: ReplyValue, Value: response}")),
    _m("no_retry_transient_503", "retry-transient", (CLIENT, RETRYABLE, "if status == http.StatusTooManyRequests {")),
    _m("retries_every_5xx", "terminal-no-retry",
       (CLIENT, RETRYABLE, "if status == http.StatusTooManyRequests || status >= 500 {")),
    _m("retries_unbounded", "bounded-backoff", (CLIENT, "\tMaxAttempts:      4,", "\tMaxAttempts:      40,")),
    _m("no_backoff", "bounded-backoff",
       (CLIENT, "\twait := float64(p.BaseDelay) * math.Pow(2, float64(retry-1)) * (1 - p.Jitter + jitterFactor()*2*p.Jitter)",
        "\twait := 0.0")),
    _m("retry_after_ignored", "honour-retry-after",
       (CLIENT, "wait := policy.Delay(attempt, outcome.RetryAfter)", "wait := policy.Delay(attempt, nil)")),
    _m("new_key_per_attempt", "idempotency-key-reuse",
       (CLIENT, "\t\tstatus, replyHeader, reply, reused, err := c.exchange(ctx, target, header, body, timeout)",
        '\t\theader.Set("Idempotency-Key", newUUID())\n'
        "\t\tstatus, replyHeader, reply, reused, err := c.exchange(ctx, target, header, body, timeout)")),
    _m("stale_token_on_403", "stale-token-distinct",
       (CLIENT, "if status == http.StatusUnauthorized && staleTokenClasses[errorClass] {",
        "if status == http.StatusForbidden && staleTokenClasses[errorClass] {")),
    # -- actor labels (§3.5)
    _m("actor_not_trimmed", "actor-label-trim",
       (CLIENT, '\ttext = strings.TrimSpace(text)\n\tif text == "" {\n\t\treturn "", nil\n\t}',
        '\tif strings.TrimSpace(text) == "" {\n\t\treturn "", nil\n\t}')),
    _m("actor_header_when_empty", "actor-absent-no-header",
       (CLIENT, '\tif label != "" {\n\t\theader.Set(HeaderActorID, label)\n\t}', "\theader.Set(HeaderActorID, label)")),
    # -- trace events (§3.4)
    _m("occurred_at_restamped_per_attempt", "trace-occurred-at",
       (CLIENT, "\t\tstatus, replyHeader, reply, reused, err := c.exchange(ctx, target, header, body, timeout)",
        '\t\tif kind == "traces" {\n'
        "\t\t\tvar event map[string]any\n"
        "\t\t\t_ = json.Unmarshal(body, &event)\n"
        '\t\t\tevent["__occurred_at"] = time.Now().UTC().Format(time.RFC3339Nano)\n'
        "\t\t\tbody, _ = json.Marshal(event)\n\t\t}\n"
        "\t\tstatus, replyHeader, reply, reused, err := c.exchange(ctx, target, header, body, timeout)")),
    _m("self_handoff_sent", "self-handoff-dropped",
       (CLIENT, '\tif source == target {\n\t\tlogf("info", "dropping self-handoff %s -> %s", quoted(source, 80), '
                'quoted(target, 80))\n\t\treturn nil, nil\n\t}\n', "")),
    _m("handoff_wrong_keys", "handoff-shape",
       (CLIENT, 'event := map[string]any{"from_sub_agent": source, "to_sub_agent": target}',
        'event := map[string]any{"from": source, "to": target}')),
    # -- the response and errors (§2 step 8, §4)
    _m("turn_reply_folded", "turn-reply-as-built",  # the reply read as a framework result: message kept alone
       (SERVER, "BuildReply(result.value, h.opts.Strict || StrictFromEnv(), env.IsMultiTurn())",
        "BuildReply(result.value, h.opts.Strict || StrictFromEnv(), false)")),
    _m("empty_final_response_sent", "final-response-required",
       (RESPONSE, '\tcase text == "":\n\t\tproblems = append(problems, hard("final_response", "must not be empty '
                  '(the judge has nothing to grade)"))\n', "")),
    _m("agent_error_200", "agent-error-500",
       (SERVER, AGENT_500, '\t\treturn reply{status: http.StatusOK, body: map[string]any{"final_response": '
                           '"The agent failed: " + oneLine(detail, detailLimit)}, what: "dispatch"}')),
    _m("stack_in_detail", "no-traceback-in-body",
       (SERVER, AGENT_500, '\t\treturn refuse(http.StatusInternalServerError, detail+"\\n"+string(debug.Stack()))')),
    _m("run_token_in_detail", "run-token-secret",
       (SERVER, "\t\tdetail := scrub(DescribeError(result.err))", "\t\tdetail := DescribeError(result.err)")),
    _m("response_token_not_redacted", "run-token-secret",
       (SERVER, "if text := CompactJSON(body); strings.Contains(text, env.RunToken) || "
                "(agentToken != \"\" && strings.Contains(text, agentToken)) {",
        'if text := CompactJSON(body); agentToken != "" && strings.Contains(text, agentToken) {')),
    # -- concurrency (§2 step 6)
    _m("package_level_envelope", "per-request-binding",
       (ENVELOPE, "type dispatchKey struct{}\n",
        "type dispatchKey struct{}\n\n// current is the running dispatch, shared by every request.\nvar current *dispatchState\n"),
       (ENVELOPE, "\tstate, _ := ctx.Value(dispatchKey{}).(*dispatchState)\n",
        "\tstate, _ := ctx.Value(dispatchKey{}).(*dispatchState)\n\tif current != nil {\n\t\tstate = current\n\t}\n"),
       (SERVER, "\tenv := state.envelope\n\tscrub :=", "\tcurrent = state\n\tenv := state.envelope\n\tscrub :=")),
    # -- from an independent set, written without this file: what the check missed until it grew a case
    _m('legacy_header_first', 'legacy-proxy-url-names', (ENVELOPE, '[]string{HeaderProxyURL, HeaderProxyURLLegacy}', '[]string{HeaderProxyURLLegacy, HeaderProxyURL}')),
    _m('retry_after_date_sign', 'honour-retry-after', (CLIENT, '\t\tseconds = when.Sub(now).Seconds()', '\t\tseconds = now.Sub(when).Seconds()')),
    _m('retry_after_429_only', 'honour-retry-after', (CLIENT, '\tretryAfter := ParseRetryAfter(header.Get("Retry-After"), time.Now())', '\tvar retryAfter *time.Duration\n\tif status == http.StatusTooManyRequests { // Retry-After comes with 429 (RFC 6585)\n\t\tretryAfter = ParseRetryAfter(header.Get("Retry-After"), time.Now())\n\t}')),
    _m('retry_after_waited_out', 'kit-retry-after-cap',
       (CLIENT, '\t\toutcome := policy.Settle(InterpretReply(status, replyHeader, reply, name, env.RunToken))',
        '\t\toutcome := InterpretReply(status, replyHeader, reply, name, env.RunToken)')),
    _m('no_jitter', 'bounded-backoff', (CLIENT, ' * math.Pow(2, float64(retry-1)) * (1 - p.Jitter + jitterFactor()*2*p.Jitter)', ' * math.Pow(2, float64(retry-1))')),
    _m('self_handoff_raw', 'self-handoff-dropped', (CLIENT, '\tif source == target {', '\tif h.From == h.To {')),
    _m('scrub_after_cut', 'run-token-secret', (SERVER, '\t\tdetail := scrub(DescribeError(result.err))', '\t\tdetail := DescribeError(result.err)'), (SERVER, '\t\treturn refuse(http.StatusInternalServerError, oneLine(detail, detailLimit))', '\t\treturn refuse(http.StatusInternalServerError, scrub(oneLine(detail, detailLimit)))')),
]


def materialise(mutant: Mutant, dest: pathlib.Path) -> pathlib.Path:
    """A copy of the Go port in ``dest`` with the mutant's edits applied; ValueError when one does not apply."""
    shutil.copytree(PORT, dest)
    return apply_edits(mutant.name, mutant.edits, dest)


def go_env(cache: Optional[pathlib.Path] = None) -> Dict[str, str]:
    """``go``'s environment: no network (standard library only), and a build cache even without $HOME."""
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GO111MODULE": "on"}
    if cache is not None and not (env.get("GOCACHE") or env.get("HOME") or env.get("XDG_CACHE_HOME")):
        env["GOCACHE"] = str(cache)
    return env


def build(port_dir: pathlib.Path, exe: pathlib.Path) -> pathlib.Path:
    """``go build`` of the conformance server of a port copy into ``exe``; RuntimeError with the compiler's output."""
    done = subprocess.run(["go", "build", "-o", str(exe), SERVER_PACKAGE], cwd=port_dir,
                          env=go_env(exe.parent / "gocache"), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"go build failed: {done.stderr[-500:]}")
    return exe
