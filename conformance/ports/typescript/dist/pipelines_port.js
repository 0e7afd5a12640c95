// pipelines_port.ts: the Pipelines agent wire contract in strict TypeScript.
//
// Node 18+ built-ins only, no runtime npm packages.  A port of pipelines_port.py's
// contract logic; section numbers (§2, §3.3, ...) point into CONTRACT.md.
// The file reads top to bottom in the order a request flows:
//
//   types -> constants -> errors -> small helpers -> envelope (§2) -> dispatch context
//   -> inbound helpers (auth, ping) -> proxy client (§3) -> trace events (§3.4)
//   -> response envelope (§4) -> dispatch core (§2) -> server adapters (fetchHandler,
//   nodeHandler) -> server (startServer)
//
// Naming: data that is on the wire keeps the contract's snake_case words
// (envelope.proxy_url, envelope.user_instruction, body.final_response);
// functions, classes and options are ordinary TypeScript camelCase.
// `dist/pipelines_port.js` is this file compiled by `tsc`: the plain JavaScript port.
import { AsyncLocalStorage } from "node:async_hooks";
import { createHash, randomUUID, timingSafeEqual } from "node:crypto";
import http from "node:http";
import https from "node:https";
export const VERSION = "0.1.0";
// ---------------------------------------------------------------------------
// Constants: the contract's names and numbers
// ---------------------------------------------------------------------------
// §2 inbound headers, as the platform spells them (looked up case-insensitively).
const RUN_TOKEN_HEADER = "X-Pipelines-Run-Token";
const PROXY_URL_HEADER = "X-Pipelines-Odyssey-Proxy-Url";
const PROXY_URL_HEADER_LEGACY = "X-Pipelines-Pwsa-Proxy-Url";
const RUN_ID_HEADER = "X-Pipelines-Run-Id";
const TASK_ID_HEADER = "X-Pipelines-Task-Id";
const RUN_TOKEN_JTI_HEADER = "X-Pipelines-Run-Token-Jti";
// §3.5 outbound multi-agent attribution.
const ACTOR_ID_HEADER = "X-Pipelines-Actor-Id";
// §2 body fields.
const PROXY_URL_FIELD = "odyssey_proxy_url";
const PROXY_URL_FIELD_LEGACY = "pwsa_proxy_url";
// §3.1 tool names, §3.5 actor labels.
const TOOL_NAME_RE = /^[A-Za-z_][A-Za-z0-9_-]{0,127}$/;
const ACTOR_SEGMENT_RE = /^[A-Za-z0-9_.:-]{1,64}$/;
const ACTOR_MAX_SEGMENTS = 8;
const ACTOR_MAX_LENGTH = 256;
// §3.1 caps and the client timeout.
const MAX_REQUEST_BYTES = 1 << 20;
const MAX_REPLY_BYTES = 1 << 20;
const DEFAULT_PROXY_TIMEOUT_S = 120;
// §3.1 rate limit: the proxy answers 429 beyond 60 requests per minute per run token.
const RATE_LIMIT_PER_MINUTE = 60;
// §3.3 retry classification and policy.
const TRANSIENT_503_CLASSES = new Set(["lock_contention", "context_store_unavailable", "trace_sequence_contended"]);
const STALE_TOKEN_CLASSES = new Set(["run_token_expired", "run_token_invalid", "run_token_rejected"]);
/** The one retry policy of tool calls and trace posts (§3.3). */
export const RETRY_POLICY = Object.freeze({
    maxAttempts: 4,
    baseDelayS: 0.5,
    maxDelayS: 4,
    jitter: 0.25,
    maxRetryAfterS: 60,
    transportRetries: 2,
});
// §3.4 reserved trace event types.
export const TRACE_EVENT_TYPES = new Set([
    "assistant_message", "thinking", "system_prompt", "custom",
    "llm_payload", "handoff", "subagent_message", "subagent_final",
]);
// §4 response envelope.
const MESSAGE_ROLES = ["system", "user", "assistant", "tool"];
const FINAL_RESPONSE_SOFT_LIMIT = 50_000;
// §2 dispatch server defaults.
export const DEFAULT_DISPATCH_PATH = "/dispatch";
export const DEFAULT_TOKEN_ENV = "AGENT_TOKEN";
const DEFAULT_MAX_BODY_BYTES = 8 << 20;
const DEFAULT_RUN_TIMEOUT_S = 300;
const MAX_RUN_TIMEOUT_S = 1800;
const DETAIL_LIMIT = 500;
const PROBE_TOOL = "__reachability_probe__";
const REDACTED = "[redacted]";
const USER_AGENT = `pipelines-port-typescript/${VERSION}`;
// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------
/** Base class of every error this module throws on purpose. */
export class PipelinesError extends Error {
    constructor(message) {
        super(message);
        this.name = new.target.name;
    }
}
/** A dispatch envelope is missing, malformed, or not bound (§2). */
export class EnvelopeError extends PipelinesError {
}
/** A value cannot become a valid response envelope (§4); `problems` lists each one. */
export class ResponseError extends PipelinesError {
    problems;
    constructor(problems) {
        const list = typeof problems === "string" ? [problems] : [...problems];
        super(list.join("; "));
        this.problems = list;
    }
}
/**
 * A tool call or trace post failed (§3.3).  `statusCode` is the HTTP status
 * (null when no reply arrived or nothing was sent), `errorClass` the
 * platform's machine-readable class, `body` the parsed reply (its first 200
 * characters when not JSON).  Messages never contain the run token.
 */
export class ProxyError extends PipelinesError {
    statusCode;
    errorClass;
    body;
    toolName;
    retryAfter;
    constructor(message, { statusCode = null, errorClass = null, body = null, toolName = null, retryAfter = null } = {}) {
        super(message);
        this.statusCode = statusCode;
        this.errorClass = errorClass;
        this.body = body;
        this.toolName = toolName;
        this.retryAfter = retryAfter;
    }
    /** The failure as an `{"error": ...}` tool result a model can read. */
    toValue() {
        const value = { error: this.message };
        if (this.errorClass)
            value.error_class = this.errorClass;
        if (this.statusCode !== null)
            value.status_code = this.statusCode;
        return value;
    }
}
/** Refused locally, before anything was sent: bad tool name, arguments, size or actor label. */
export class ProxyRequestError extends ProxyError {
}
/** No usable reply arrived: timeout, refused or reset connection, TLS failure. */
export class ProxyTransportError extends ProxyError {
}
/** The proxy rejected the run token as expired, invalid or revoked: the run is over (§3.3). */
export class StaleRunTokenError extends ProxyError {
}
// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
/** A plain JSON-like object (not null, not an array). */
function isObject(value) {
    return value !== null && typeof value === "object" && !Array.isArray(value);
}
function jsonType(value) {
    if (value === null || value === undefined)
        return "null";
    if (Array.isArray(value))
        return "an array";
    const names = { boolean: "a boolean", number: "a number", string: "a string", object: "an object" };
    return names[typeof value] ?? typeof value;
}
/** At most `limit` characters of `text`, with an ellipsis when cut. */
function short(text, limit = 200) {
    return text.length <= limit ? text : text.slice(0, limit) + "…";
}
/** A value as it may appear in a message: JSON-quoted, shortened. */
function quoted(value, limit = 80) {
    return JSON.stringify(typeof value === "string" ? short(value, limit) : value) ?? String(value);
}
function deepFreeze(value) {
    if (value !== null && typeof value === "object" && !Object.isFrozen(value)) {
        Object.values(value).forEach(deepFreeze);
        Object.freeze(value);
    }
    return value;
}
function redact(value, secret) {
    if (!secret)
        return value;
    if (typeof value === "string")
        return value.split(secret).join(REDACTED);
    if (Array.isArray(value))
        return value.map((v) => redact(v, secret));
    if (isObject(value))
        return Object.fromEntries(Object.entries(value).map(([k, v]) => [redact(k, secret), redact(v, secret)]));
    return value;
}
/** Header names lower-cased (§2: case-insensitive); the first value of a repeated name wins. */
function lowerHeaders(headers) {
    const out = {};
    const pairs = headers == null ? []
        : Array.isArray(headers) ? headers : Object.entries(headers);
    for (const [name, value] of pairs) {
        const key = String(name).toLowerCase();
        if (!(key in out) && value != null)
            out[key] = String(Array.isArray(value) ? value[0] : value);
    }
    return out;
}
/** A header's trimmed value, or null when absent or blank. */
function header(lowered, name) {
    const value = (lowered[name.toLowerCase()] ?? "").trim();
    return value || null;
}
const sleepSeconds = (seconds) => new Promise((resolve) => setTimeout(resolve, seconds * 1000));
/** One line to stderr; callers never pass a secret. */
export function log(level, message) {
    process.stderr.write(`${new Date().toISOString()} ${level.toUpperCase()} pipelines_port: ${message}\n`);
}
// ---------------------------------------------------------------------------
// Envelope (§2): one run's dispatch context, read-only
// ---------------------------------------------------------------------------
/** The proxy base URL without its trailing `/`: http(s) with a host, no query or fragment. */
function checkProxyUrl(url, where) {
    if (typeof url !== "string" || !url.trim()) {
        throw new EnvelopeError(`proxy URL from ${where} must be a non-empty string`);
    }
    const trimmed = url.trim().replace(/\/+$/, "");
    const parts = /^([A-Za-z][A-Za-z0-9+.-]*):\/\/([^/?#]*)([^?#]*)(\?[^#]*)?(#.*)?$/.exec(trimmed);
    const scheme = parts ? (parts[1] ?? "").toLowerCase() : "";
    const hostPort = parts ? (parts[2] ?? "").replace(/^.*@/, "") : "";
    const port = /:(\d*)$/.exec(hostPort)?.[1];
    if (!parts || !["http", "https"].includes(scheme) || !hostPort.replace(/:\d*$/, "")) {
        throw new EnvelopeError(`proxy URL ${quoted(trimmed, 200)} from ${where} must be an http:// or https:// URL with a host`);
    }
    if (port && Number(port) > 65535) {
        throw new EnvelopeError(`proxy URL ${quoted(trimmed, 200)} from ${where} is not a valid URL: port out of range`);
    }
    if (parts[4] || parts[5]) {
        throw new EnvelopeError(`proxy URL ${quoted(trimmed, 200)} from ${where} must not carry a query or fragment`);
    }
    if (/[\x00-\x20\x7f]/.test(trimmed)) {
        throw new EnvelopeError(`proxy URL from ${where} contains whitespace or control characters`);
    }
    return trimmed;
}
function checkRunToken(token, where) {
    if (typeof token !== "string" || !token.trim())
        throw new EnvelopeError(`run token from ${where} must be a non-empty string`);
    const trimmed = token.trim();
    // Never echo it: it is a secret.
    if (/[\x00-\x1f\x7f]/.test(trimmed))
        throw new EnvelopeError(`run token from ${where} contains control characters`);
    return trimmed;
}
/** An id as the body carries it (integer or string); anything else counts as absent. */
function nativeId(value) {
    if (typeof value === "number" && Number.isInteger(value))
        return value;
    if (typeof value === "string" && value.trim())
        return value.trim();
    return null;
}
const firstId = (...candidates) => candidates.map(nativeId).find((id) => id !== null) ?? null;
/** §2 `sub_agents`: strings or `{"actor_id": ...}`; malformed entries and repeats skipped. */
function subAgentCatalog(value) {
    const labels = [];
    for (const entry of Array.isArray(value) ? value : []) {
        const raw = isObject(entry) ? entry["actor_id"] : entry;
        if (typeof raw !== "string")
            continue;
        let label;
        try {
            label = validateActorLabel(raw);
        }
        catch {
            continue;
        }
        if (label && !labels.includes(label))
            labels.push(label);
    }
    return labels;
}
/**
 * Parse an HTTP dispatch (§2): the JSON body (object, string or bytes) plus
 * the request headers.  Body fields win; ids, the jti and the proxy URL fall
 * back to the X-Pipelines-* headers and the legacy `pwsa` names; the run
 * token comes from X-Pipelines-Run-Token.  Returns a deeply frozen envelope
 * whose `run_token` is not enumerable (JSON.stringify and console.log skip it).
 * Throws EnvelopeError naming what is missing and where it was looked for.
 */
export function envelopeFromDispatch(body, headers = {}) {
    let parsed = body;
    if (typeof body === "string" || body instanceof Uint8Array) {
        try {
            parsed = JSON.parse(typeof body === "string" ? body : new TextDecoder("utf-8", { fatal: true }).decode(body));
        }
        catch (err) {
            throw new EnvelopeError(`dispatch body is not valid JSON: ${err instanceof Error ? err.message : String(err)}`);
        }
    }
    if (!isObject(parsed))
        throw new EnvelopeError(`dispatch body must be a JSON object, got ${jsonType(parsed)}`);
    const raw = structuredClone(parsed); // frozen below: the caller's object stays theirs
    const h = lowerHeaders(headers);
    let url = null;
    let where = "";
    for (const field of [PROXY_URL_FIELD, PROXY_URL_FIELD_LEGACY]) {
        const value = raw[field];
        if (url === null && typeof value === "string" && value.trim())
            [url, where] = [value, `body field '${field}'`];
    }
    for (const name of [PROXY_URL_HEADER, PROXY_URL_HEADER_LEGACY]) {
        const value = header(h, name);
        if (url === null && value)
            [url, where] = [value, `header ${name}`];
    }
    const token = header(h, RUN_TOKEN_HEADER);
    const missing = [];
    if (url === null) {
        missing.push(`proxy URL (looked for body field '${PROXY_URL_FIELD}', legacy '${PROXY_URL_FIELD_LEGACY}', ` +
            `and headers ${PROXY_URL_HEADER}, legacy ${PROXY_URL_HEADER_LEGACY})`);
    }
    if (token === null)
        missing.push(`run token (looked for header ${RUN_TOKEN_HEADER})`);
    if (url === null || token === null)
        throw new EnvelopeError(`dispatch is missing ${missing.join(" and ")}`);
    const task = isObject(raw["input"]) ? raw["input"] : {};
    const str = (v) => (typeof v === "string" ? v : null);
    const obj = (v) => (isObject(v) ? v : null);
    const list = (v) => (Array.isArray(v) ? v : null);
    const jti = str(raw["run_token_jti"])?.trim() || null;
    const proxy_url = checkProxyUrl(url, where);
    const envelope = {
        proxy_url,
        run_id: firstId(raw["run_id"], header(h, RUN_ID_HEADER)),
        task_id: firstId(raw["task_id"], task["task_id"], header(h, TASK_ID_HEADER)),
        agent_id: firstId(raw["agent_id"]),
        run_token_jti: jti ?? header(h, RUN_TOKEN_JTI_HEADER),
        user_instruction: str(task["user_instruction"]) ?? "",
        task_input: obj(task["input"]) ?? {},
        latest_user_prompt: str(task["latest_user_prompt"]),
        session_id: nativeId(task["session_id"]),
        turn_id: task["turn_id"] ?? null,
        messages: list(task["messages"]),
        scenario_state: obj(task["scenario_state"]),
        workspace: obj(task["workspace"]),
        tools_schema: list(raw["tools_schema"]),
        sub_agents: subAgentCatalog(raw["sub_agents"]),
        raw,
        api_url: (/^[^:]+:\/\/[^/]*/.exec(proxy_url) ?? [proxy_url])[0],
    };
    Object.defineProperty(envelope, "run_token", { value: checkRunToken(token, `header ${RUN_TOKEN_HEADER}`), enumerable: false });
    return deepFreeze(envelope);
}
// Each dispatch runs inside its own store: concurrent dispatches never see
// each other's envelope (and so never each other's run token).
const dispatchContext = new AsyncLocalStorage();
/** Run `fn` with `envelope` bound: proxyCall / postTrace inside it need no envelope argument. */
export function bindEnvelope(envelope, fn) {
    return dispatchContext.run({ envelope, cancelled: false, proxyCalls: 0 }, fn);
}
/** The envelope bound to this async context; EnvelopeError when none is. */
export function currentEnvelope() {
    const envelope = dispatchContext.getStore()?.envelope;
    if (!envelope) {
        throw new EnvelopeError("no dispatch envelope is bound to this context: call inside a dispatch, " +
            "wrap the code in bindEnvelope(envelope, fn), or pass { envelope }");
    }
    return envelope;
}
// ---------------------------------------------------------------------------
// Inbound helpers: auth (§2 step 1) and ping (§2 step 3)
// ---------------------------------------------------------------------------
/** Equal strings, compared in constant time whatever their lengths (SHA-256 both, then compare). */
function constantTimeEqual(a, b) {
    const digest = (s) => createHash("sha256").update(s, "utf8").digest();
    return timingSafeEqual(digest(a), digest(b));
}
/**
 * True when the request carries the expected credential, compared in constant
 * time.  With headerName "Authorization" the header must read `Bearer <expected>`
 * (scheme case-insensitive); a custom header (e.g. X-API-Key) carries the raw
 * value.  An empty `expected` never matches.
 */
export function checkCredential(headers, expected, headerName = "Authorization") {
    if (!expected)
        return false;
    let received = lowerHeaders(headers)[headerName.toLowerCase()];
    if (received === undefined)
        return false;
    received = received.trim();
    if (headerName.toLowerCase() === "authorization") {
        const space = received.indexOf(" ");
        const scheme = space < 0 ? received : received.slice(0, space);
        received = space < 0 ? "" : received.slice(space + 1).trim();
        if (scheme.toLowerCase() !== "bearer") {
            constantTimeEqual("", expected); // a wrong scheme costs the same time as a wrong token
            return false;
        }
    }
    return constantTimeEqual(received, expected);
}
/** True only for a body that is exactly `{"ping": true}`: one key, the boolean true (§2 step 3). */
export function isPing(body) {
    return isObject(body) && Object.keys(body).length === 1 && body["ping"] === true;
}
// ---------------------------------------------------------------------------
// Proxy client (§3): validation, reply interpretation, retries, transport
// ---------------------------------------------------------------------------
/** `name` when it matches ^[A-Za-z_][A-Za-z0-9_-]{0,127}$ (§3.1); ProxyRequestError otherwise. */
export function validateToolName(name) {
    if (typeof name !== "string" || !TOOL_NAME_RE.test(name)) {
        throw new ProxyRequestError(`invalid tool name ${quoted(name)}: must match ^[A-Za-z_][A-Za-z0-9_-]{0,127}$`, { toolName: typeof name === "string" ? name : null });
    }
    return name;
}
/**
 * The normalised actor label (§3.5), or null for an empty one: trimmed, at most
 * 8 `/`-separated segments of 1-64 characters from [A-Za-z0-9_.:-], at most 256
 * characters in all.  ProxyRequestError with errorClass "actor_id_invalid" otherwise.
 */
export function validateActorLabel(label) {
    if (label === null || label === undefined)
        return null;
    const invalid = (problem) => new ProxyRequestError(problem, { errorClass: "actor_id_invalid" });
    if (typeof label !== "string")
        throw invalid(`actor label must be a string, got ${jsonType(label)}`);
    const trimmed = label.trim();
    if (!trimmed)
        return null;
    const segments = trimmed.split("/");
    let problem = null;
    if (trimmed.length > ACTOR_MAX_LENGTH)
        problem = `is ${trimmed.length} characters long (at most ${ACTOR_MAX_LENGTH})`;
    else if (segments.length > ACTOR_MAX_SEGMENTS)
        problem = `has ${segments.length} segments (at most ${ACTOR_MAX_SEGMENTS})`;
    else {
        const bad = segments.find((segment) => !ACTOR_SEGMENT_RE.test(segment));
        if (bad !== undefined)
            problem = `has segment ${quoted(bad)}: each segment is 1-64 characters from [A-Za-z0-9_.:-]`;
    }
    if (problem)
        throw invalid(`invalid actor label ${quoted(trimmed)}: ${problem}`);
    return trimmed;
}
/** Seconds from a Retry-After header (delta-seconds or HTTP-date); null when absent or unreadable. */
function parseRetryAfter(value, now = Date.now()) {
    if (value === undefined || !value.trim())
        return null;
    const text = value.trim();
    const seconds = /^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$/.test(text) ? Number(text) : (Date.parse(text) - now) / 1000;
    if (Number.isNaN(seconds))
        return null;
    return Math.max(0, seconds);
}
/** [errorClass, message] from the three error body shapes (§3.3). */
function errorFields(body) {
    const str = (v) => (typeof v === "string" ? v : null);
    if (!isObject(body))
        return [null, null];
    const detail = body["detail"];
    if (isObject(detail))
        return [str(detail["error_class"]), str(detail["message"] || detail["detail"])];
    if (typeof detail === "string")
        return [str(body["error_class"]), detail];
    let message = body["message"] || body["error"];
    if (detail !== undefined && detail !== null && (message === undefined || message === null))
        message = JSON.stringify(detail).slice(0, 200);
    return [str(body["error_class"]), str(message)];
}
/** The parsed JSON, or the text when the body is not JSON. */
function decodeBody(bytes) {
    if (!bytes.length)
        return { value: null, isJson: false };
    const text = new TextDecoder("utf-8").decode(bytes);
    try {
        return { value: JSON.parse(text), isJson: true };
    }
    catch {
        return { value: text, isJson: false };
    }
}
/**
 * What one proxy reply means, with no I/O (§3.2, §3.3).
 *
 * 2xx: the unwrapped `response` (a legacy body without it whole, non-JSON text
 * as the string, never decoded twice).  429 and the transient 503 classes:
 * retry.  401 with a stale-token class: StaleRunTokenError.  Anything else:
 * ProxyError.  `runToken` is scrubbed from error bodies and messages.
 */
export function interpretReply(status, headers, bytes, { toolName, runToken = null }) {
    const decoded = decodeBody(bytes);
    const isJson = decoded.isJson;
    if (status >= 200 && status < 300) {
        const value = decoded.value;
        return { kind: "value", value: isJson && isObject(value) && "response" in value ? value["response"] ?? null : value };
    }
    const value = redact(decoded.value, runToken); // an error body is kept and shown: scrub the token from it
    let [errorClass, message] = isJson ? errorFields(value) : [null, null];
    if (message === null)
        message = short(typeof value === "string" ? value : value === null ? "" : JSON.stringify(value), 200);
    const retryAfter = parseRetryAfter(lowerHeaders(headers)["retry-after"]);
    let text = `proxy call ${quoted(toolName)} failed: HTTP ${status}`;
    if (errorClass)
        text += ` ${errorClass}`;
    if (message)
        text += `: ${message}`;
    const fields = {
        statusCode: status, errorClass, body: isJson || value === null ? value : short(String(value), 200), toolName, retryAfter,
    };
    if (status === 429 || (status === 503 && errorClass !== null && TRANSIENT_503_CLASSES.has(errorClass))) {
        return { kind: "retry", error: new ProxyError(text, fields), retryAfter };
    }
    if (status === 401 && errorClass !== null && STALE_TOKEN_CLASSES.has(errorClass)) {
        return { kind: "error", error: new StaleRunTokenError(`${text} (the run is over)`, fields) };
    }
    return { kind: "error", error: new ProxyError(text, fields) };
}
/**
 * A reply as the policy takes it (§7.4 kit-retry-after-cap): a retry whose Retry-After is longer than
 * `maxRetryAfterS` is not waited but fails at once, its message naming the wait the proxy asked for.
 */
export function settleReply(policy, outcome) {
    if (outcome.kind !== "retry" || outcome.retryAfter === null || outcome.retryAfter <= policy.maxRetryAfterS)
        return outcome;
    const { error } = outcome;
    const note = ` (the proxy asked to wait ${outcome.retryAfter} s before a retry, longer than the ${policy.maxRetryAfterS} s ` +
        "this client waits: not retried)";
    const fields = { statusCode: error.statusCode, errorClass: error.errorClass, body: error.body, toolName: error.toolName, retryAfter: error.retryAfter };
    return { kind: "error", error: new ProxyError(error.message + note, fields) };
}
/** Seconds to wait before retry number `retry` (1 for the first): Retry-After, else backoff with jitter. */
export function retryDelay(policy, retry, retryAfter = null) {
    if (retryAfter !== null)
        return Math.min(retryAfter, policy.maxRetryAfterS);
    const wait = policy.baseDelayS * 2 ** (retry - 1) * (1 - policy.jitter + Math.random() * 2 * policy.jitter);
    return Math.max(0, Math.min(wait, policy.maxDelayS));
}
/** No usable reply arrived; `failure` is the socket error, `reusedSocket` says whether it came on a pooled connection. */
class TransportFailure extends Error {
    failure;
    reusedSocket;
    constructor(failure, reusedSocket) {
        super(failure.message);
        this.failure = failure;
        this.reusedSocket = reusedSocket;
    }
}
/** A reply body over the cap, refused without reading it all. */
class ReplyTooLarge extends Error {
    status;
    constructor(status, cap, length) {
        super(length !== null ? `is ${length} bytes, over the ${cap}-byte cap` : `exceeds the ${cap}-byte cap`);
        this.status = status;
    }
}
// A keep-alive connection the server closed while it sat idle in the pool.
const STALE_CONNECTION_CODES = new Set(["ECONNRESET", "EPIPE", "ECONNABORTED"]);
/** Retry timeouts and refused, reset or dropped connections; never DNS or certificate failures. */
function isRetryableTransport(failure) {
    const code = String(failure.code ?? "");
    return !/^(ENOTFOUND|EAI_)/.test(code) && !/CERT|UNABLE_TO_|SELF_SIGNED/.test(code);
}
/**
 * One HTTP POST exchange: resolves the reply; rejects with TransportFailure or
 * ReplyTooLarge.  `timeoutS` bounds the whole exchange.
 */
function exchange({ url, headers, body, timeoutS, maxReply = MAX_REPLY_BYTES, agent }) {
    return new Promise((resolve, reject) => {
        const transport = url.protocol === "https:" ? https : http;
        const request = transport.request(url, { method: "POST", headers, agent });
        let settled = false;
        let timer;
        const settle = () => {
            if (settled)
                return false;
            settled = true;
            clearTimeout(timer);
            return true;
        };
        const fail = (err) => {
            if (settled)
                return; // e.g. the "close" that follows a complete reply
            request.destroy();
            if (settle())
                reject(err instanceof ReplyTooLarge ? err : new TransportFailure(err, Boolean(request.reusedSocket)));
        };
        timer = setTimeout(() => fail(Object.assign(new Error(`timed out after ${timeoutS} s`), { code: "ETIMEDOUT" })), timeoutS * 1000);
        request.on("error", fail);
        request.on("response", (response) => {
            const status = response.statusCode ?? 0;
            const length = Number(response.headers["content-length"]);
            if (length > maxReply)
                return fail(new ReplyTooLarge(status, maxReply, length));
            const chunks = [];
            let size = 0;
            response.on("data", (chunk) => {
                size += chunk.length;
                if (size > maxReply)
                    fail(new ReplyTooLarge(status, maxReply, null));
                else
                    chunks.push(chunk);
            });
            response.on("end", () => {
                if (settle())
                    resolve({ status, headers: response.headers, body: Buffer.concat(chunks) });
            });
            response.on("error", fail);
            response.on("close", () => fail(new Error("connection closed before the reply was complete")));
        });
        request.end(body);
    });
}
function envNumber(name, fallback) {
    const text = (process.env[name] ?? "").trim();
    if (!text)
        return fallback;
    const value = Number(text);
    if (!Number.isFinite(value) || value < 0) {
        throw new PipelinesError(`environment variable ${name} must be a non-negative number, got ${quoted(text, 40)}`);
    }
    return value;
}
/** Compact JSON for a request body: a JSON object under the 1 MiB cap (§3.1). */
function encodeObject(name, value, what) {
    const object = value === null || value === undefined ? {} : value;
    if (!isObject(object)) {
        throw new ProxyRequestError(`${what} for ${quoted(name)} must be a JSON object, got ${jsonType(object)}`, { toolName: name });
    }
    let body;
    try {
        body = Buffer.from(JSON.stringify(object), "utf8");
    }
    catch (err) {
        const reason = err instanceof Error ? err.message : String(err);
        throw new ProxyRequestError(`${what} for ${quoted(name)} are not JSON-serialisable: ${reason}`, { toolName: name });
    }
    if (body.length > MAX_REQUEST_BYTES) {
        throw new ProxyRequestError(`${what} for ${quoted(name)} are ${body.length} bytes as JSON, over the ` +
            `${MAX_REQUEST_BYTES}-byte cap`, { toolName: name });
    }
    return body;
}
const undeclaredSeen = new Set(); // bounded below: one warning per run and label
/** §3.5: a label off the declared catalog is accepted (shown as undeclared); warn once per run and label. */
function warnIfUndeclared(envelope, label) {
    const catalog = envelope.sub_agents;
    if (!catalog.length || catalog.includes(label) || catalog.includes(label.split("/").pop() ?? label))
        return;
    const key = JSON.stringify([envelope.run_id, envelope.run_token_jti, envelope.proxy_url, label]);
    if (undeclaredSeen.has(key))
        return;
    if (undeclaredSeen.size >= 4096) {
        const oldest = undeclaredSeen.values().next();
        if (!oldest.done)
            undeclaredSeen.delete(oldest.value);
    }
    undeclaredSeen.add(key);
    log("warning", `actor label ${quoted(label)} is not in this run's declared sub_agents ${JSON.stringify(catalog)}; ` +
        "the platform will show it as undeclared");
}
/**
 * Client-side pacing (§3.1 rate limit): at most `limit` requests per run token in
 * any `windowS` seconds.  A sliding log per token; a caller over the limit is told
 * how long to wait for its reserved slot, so a burst is spread out instead of
 * collecting 429s.  At most `maxTokens` runs are remembered (the oldest forgotten).
 */
export class Pacer {
    limit;
    windowS;
    maxTokens;
    slots = new Map();
    constructor(limit, windowS = 60, maxTokens = 4096) {
        this.limit = limit;
        this.windowS = windowS;
        this.maxTokens = maxTokens;
        if (!(Number.isInteger(limit) && limit >= 1))
            throw new RangeError(`pacing limit must be a positive integer, got ${limit}`);
    }
    /** Reserve the next slot for `key`; the seconds to wait for it.  `now` is in seconds (performance.now() / 1000). */
    reserve(key, now = performance.now() / 1000) {
        let log = this.slots.get(key);
        if (log === undefined) {
            log = [];
            if (this.slots.size >= this.maxTokens) {
                const oldest = this.slots.keys().next();
                if (!oldest.done)
                    this.slots.delete(oldest.value);
            }
        }
        else {
            this.slots.delete(key); // re-inserted below: the Map's order is least recently used first
        }
        this.slots.set(key, log);
        const first = log[0];
        const slot = log.length < this.limit || first === undefined ? now : Math.max(now, first + this.windowS);
        log.push(slot);
        if (log.length > this.limit)
            log.shift();
        return slot - now;
    }
}
/**
 * Calls the per-run proxy (§3): validation, keep-alive, pacing, retries.  One
 * instance serves any number of concurrent runs.
 */
export class ProxyClient {
    timeout;
    retry;
    pacer;
    sleep;
    agents;
    constructor({ timeout, ratePerMinute, retry = {}, sleep = sleepSeconds } = {}) {
        this.timeout = timeout ?? envNumber("PIPELINES_PROXY_TIMEOUT_S", DEFAULT_PROXY_TIMEOUT_S);
        if (!(this.timeout > 0))
            throw new PipelinesError(`the proxy timeout must be a positive number of seconds, got ${this.timeout}`);
        const rate = ratePerMinute ?? envNumber("PIPELINES_PROXY_RATE_PER_MINUTE", RATE_LIMIT_PER_MINUTE);
        this.pacer = rate >= 1 ? new Pacer(Math.floor(rate)) : null;
        this.retry = { ...RETRY_POLICY, ...retry };
        this.sleep = sleep;
        this.agents = { "http:": new http.Agent({ keepAlive: true }), "https:": new https.Agent({ keepAlive: true }) };
    }
    async call(envelope, name, args, { actor = null, timeout = null, idempotencyKey = null, errors = "raise" } = {}) {
        try {
            validateToolName(name);
            const label = validateActorLabel(actor);
            if (label)
                warnIfUndeclared(envelope, label);
            const body = encodeObject(name, args, "tool arguments");
            return await this.request(envelope, "tools", name, body, { label, timeout, idempotencyKey });
        }
        catch (err) {
            if (errors === "return" && err instanceof ProxyError && !(err instanceof StaleRunTokenError)) {
                log("info", `tool ${quoted(name)} failed, returning the error to the agent: ${err.message}`);
                return err.toValue();
            }
            throw err;
        }
    }
    /**
     * POST a live trace event to `{proxy_url}/traces/{eventType}` (§3.4).
     * Resolves the proxy's `{"accepted": true, "sequence": N}` (null for an empty
     * body).  `__occurred_at` is stamped once, before the first attempt.  With
     * `bestEffort` a failure is logged and null returned.
     */
    async trace(envelope, eventType, payload = null, { actor = null, timeout = null, bestEffort = false } = {}) {
        try {
            if (!TRACE_EVENT_TYPES.has(eventType)) {
                throw new ProxyRequestError(`unknown trace event type ${quoted(eventType, 60)}: expected one of ` +
                    [...TRACE_EVENT_TYPES].sort().join(", "), { toolName: String(eventType) });
            }
            const label = validateActorLabel(actor);
            if (payload !== null && payload !== undefined && !isObject(payload)) {
                throw new ProxyRequestError(`trace payload must be a JSON object, got ${jsonType(payload)}`, { toolName: eventType });
            }
            const event = { ...payload };
            if (!Object.hasOwn(event, "__occurred_at"))
                event["__occurred_at"] = new Date().toISOString();
            const body = encodeObject(eventType, event, "trace payload");
            const reply = await this.request(envelope, "traces", eventType, body, { label, timeout });
            return isObject(reply) ? reply : null;
        }
        catch (err) {
            if (bestEffort && err instanceof ProxyError) {
                log("warning", `trace event ${quoted(eventType)} not recorded: ${err.message}`);
                return null;
            }
            throw err;
        }
    }
    /** Close idle keep-alive connections. */
    close() {
        this.agents["http:"].destroy();
        this.agents["https:"].destroy();
    }
    /** One logical call: the retry loop of §3.3 around one exchange, one Idempotency-Key throughout. */
    async request(envelope, kind, name, body, { label, timeout, idempotencyKey = null }) {
        if (typeof envelope?.proxy_url !== "string" || typeof envelope.run_token !== "string") {
            throw new TypeError("envelope must be a dispatch envelope (envelopeFromDispatch)");
        }
        const context = dispatchContext.getStore();
        if (context)
            context.proxyCalls += 1;
        const url = new URL(`${envelope.proxy_url}/${kind}/${encodeURIComponent(name)}`);
        const headers = {
            "Content-Type": "application/json",
            "Content-Length": String(body.length),
            Accept: "application/json",
            Authorization: `Bearer ${envelope.run_token}`,
            "Idempotency-Key": idempotencyKey || randomUUID(),
            "User-Agent": USER_AGENT,
        };
        if (label)
            headers[ACTOR_ID_HEADER] = label;
        const timeoutS = timeout ?? this.timeout;
        const policy = this.retry;
        const agent = url.protocol === "https:" ? this.agents["https:"] : this.agents["http:"];
        // Before every attempt, retries included: an overrun dispatch runs no tool late, and pacing counts each one.
        const beforeAttempt = async () => {
            if (context?.cancelled) {
                throw new ProxyError(`proxy call ${quoted(name)} refused: this dispatch overran its run timeout and was ` +
                    "answered already", { toolName: name });
            }
            const wait = this.pacer?.reserve(envelope.run_token) ?? 0;
            if (wait > 0) {
                log("info", `pacing proxy calls under ${this.pacer?.limit}/min: waiting ${wait.toFixed(2)} s`);
                await this.sleep(wait);
            }
        };
        let transportFailures = 0;
        const send = async () => {
            await beforeAttempt();
            try {
                // After a transport failure, a fresh connection: the pool may hold more dead sockets, and Deno's client
                // silently resends a request whose pooled connection dropped (one logical attempt, two on the wire).
                return await exchange({ url, headers, body, timeoutS, agent: transportFailures > 0 ? false : agent });
            }
            catch (err) {
                if (!(err instanceof ReplyTooLarge))
                    throw err;
                throw new ProxyError(`proxy reply to ${quoted(name)} ${err.message}`, { statusCode: err.status, toolName: name });
            }
        };
        for (let attempt = 1;; attempt++) {
            let reply;
            try {
                reply = await send();
            }
            catch (err) {
                if (!(err instanceof TransportFailure))
                    throw err;
                const failure = err.failure;
                const error = new ProxyTransportError(`proxy call ${quoted(name)} failed before a reply arrived: ` +
                    `${failure.code ?? failure.name}: ${short(failure.message || String(failure), 200)}`, { toolName: name });
                transportFailures += 1;
                if (!isRetryableTransport(failure) || transportFailures > policy.transportRetries)
                    throw error;
                // A pooled connection the proxy closed while idle fails at once: retry it without waiting.
                const stale = err.reusedSocket && STALE_CONNECTION_CODES.has(failure.code ?? "");
                const wait = stale ? 0 : retryDelay(policy, transportFailures);
                log("warning", `${error.message}; retrying in ${wait.toFixed(2)} s`);
                await this.sleep(wait);
                continue;
            }
            const outcome = settleReply(policy, interpretReply(reply.status, reply.headers, reply.body, { toolName: name, runToken: envelope.run_token }));
            if (outcome.kind === "value")
                return outcome.value;
            if (outcome.kind === "retry" && attempt < policy.maxAttempts) {
                const wait = retryDelay(policy, attempt, outcome.retryAfter);
                log("warning", `${outcome.error.message}; retry ${attempt} in ${wait.toFixed(2)} s`);
                await this.sleep(wait);
                continue;
            }
            throw outcome.error;
        }
    }
}
let sharedClient = null;
/** The client behind proxyCall / postTrace, created on first use. */
export function defaultClient() {
    sharedClient ??= new ProxyClient();
    return sharedClient;
}
export async function proxyCall(name, args = null, { envelope = null, client = null, ...options } = {}) {
    const target = envelope ?? currentEnvelope();
    const using = client ?? defaultClient();
    return options.errors === "return" ? using.call(target, name, args, { ...options, errors: "return" })
        : using.call(target, name, args, { ...options, errors: "raise" });
}
// ---------------------------------------------------------------------------
// Trace events (§3.4)
// ---------------------------------------------------------------------------
/** Post a live trace event for the bound run; see ProxyClient.trace. */
export async function postTrace(eventType, payload = null, { envelope = null, client = null, ...options } = {}) {
    if (!envelope && options.bestEffort && !dispatchContext.getStore()) {
        log("warning", `trace event ${quoted(eventType)} not recorded: no dispatch envelope is bound`);
        return null;
    }
    return (client ?? defaultClient()).trace(envelope ?? currentEnvelope(), eventType, payload, options);
}
/**
 * Record a control transfer between sub-agents as a `handoff` event (§3.4).
 * Both labels are validated as §3.5; a self-handoff is dropped (resolves null, nothing sent).
 */
export async function postHandoff(fromSubAgent, toSubAgent, { reason = null, payload_preview = null, ...options } = {}) {
    const source = validateActorLabel(fromSubAgent);
    const target = validateActorLabel(toSubAgent);
    if (!source || !target) {
        throw new ProxyRequestError("a handoff needs non-empty from and to labels", { errorClass: "actor_id_invalid" });
    }
    if (source === target) {
        log("info", `dropping self-handoff ${quoted(source)} -> ${quoted(target)}`);
        return null;
    }
    const event = { from_sub_agent: source, to_sub_agent: target };
    if (reason !== null)
        event.reason = reason;
    if (payload_preview !== null)
        event.payload_preview = payload_preview;
    return postTrace("handoff", event, options);
}
/**
 * The final response as a string; a framework's structured output becomes JSON text.  A non-string
 * `final_response` is refused in strict mode, and becomes its JSON text otherwise.
 */
function finalText(value, key, strict = true) {
    if (value === null || value === undefined)
        return null;
    if (typeof value === "string")
        return value;
    if (key === "final_response" && strict)
        throw new ResponseError(`final_response must be a string, got ${jsonType(value)}`);
    if (typeof value === "object" || typeof value === "number" || typeof value === "boolean")
        return spacedJson(value, key);
    return String(value);
}
/**
 * JSON text with Python's default separators (`, ` and `: `), so both ports give the same final_response.
 * What JSON cannot carry goes as JSON.stringify sends it (a Date as its ISO text, NaN as null, undefined
 * dropped), and as Python's `default=str` would otherwise: a BigInt as its text, a Set as an array, a Map as
 * an object.  A circular value throws ResponseError.
 */
function spacedJson(value, key) {
    const replacer = (_, v) => {
        if (typeof v === "bigint")
            return v.toString();
        if (v instanceof Set)
            return [...v];
        if (v instanceof Map)
            return Object.fromEntries([...v].map(([k, item]) => [String(k), item]));
        return v;
    };
    let plain;
    try {
        plain = JSON.parse(JSON.stringify(value, replacer) ?? "null");
    }
    catch (err) {
        throw new ResponseError(`${key}: cannot become JSON text: ${err instanceof Error ? err.message : String(err)}`);
    }
    const spaced = (v) => {
        if (Array.isArray(v))
            return `[${v.map(spaced).join(", ")}]`;
        if (isObject(v))
            return `{${Object.entries(v).map(([k, item]) => `${JSON.stringify(k)}: ${spaced(item)}`).join(", ")}}`;
        return JSON.stringify(v);
    };
    return spaced(plain);
}
/**
 * What an agent returned, unpacked: a string, or an object.  Only an envelope-shaped object (with
 * `final_response`) gives its messages, metadata and extra top-level keys; a framework's result
 * (`final_output` / `output` / `message`) gives its text alone.
 */
function unpackResult(value, strict = true) {
    if (typeof value === "string")
        return { final: value, extra: {} };
    if (value === null || value === undefined)
        return { final: null, extra: {} };
    if (!isObject(value)) {
        throw new ResponseError(`cannot build a response from ${jsonType(value)}: return a string, an object with ` +
            "'final_response', or an object with final_output / output / message");
    }
    if ("final_response" in value) {
        const { final_response, messages, metadata, ...extra } = value;
        return { final: finalText(final_response, "final_response", strict), messages, metadata, extra };
    }
    const key = ["final_output", "output", "message"].find((k) => value[k] != null && typeof value[k] !== "function");
    return { final: key ? finalText(value[key], key) : null, extra: {} };
}
/** The resolvable name of a tool call (flat `name` or nested `function.name`), else null. */
function toolCallName(call) {
    if (!isObject(call))
        return null;
    if (typeof call["name"] === "string" && call["name"])
        return call["name"];
    const fn = call["function"];
    if (isObject(fn) && typeof fn["name"] === "string" && fn["name"])
        return fn["name"];
    return null;
}
/** OpenAI nested `{type: "function", function: {name, arguments}}` -> flat `{id?, name, arguments?}`. */
function flatToolCall(call) {
    if (!isObject(call))
        return call;
    const fn = call["function"];
    if ("name" in call || !isObject(fn))
        return { ...call };
    const { function: _fn, type: _type, ...flat } = call;
    flat["name"] = fn["name"];
    if ("arguments" in fn)
        flat["arguments"] = fn["arguments"];
    return flat;
}
function flatMessages(messages) {
    if (!Array.isArray(messages))
        return messages;
    return messages.map((message) => isObject(message) && Array.isArray(message["tool_calls"])
        ? { ...message, tool_calls: message["tool_calls"].map(flatToolCall) } : message);
}
const isPlainObject = (value) => isObject(value) && [Object.prototype, null].includes(Object.getPrototypeOf(value));
/** A name for a value's type in a note: `Date`, `Set`, `bigint`, `function`, a class name. */
function typeName(value) {
    if (value === null || typeof value !== "object")
        return typeof value;
    const constructor = value.constructor;
    return constructor?.name ?? "object";
}
/**
 * A JSON-safe copy of `value`: what JSON cannot carry is converted and noted with its path, the way
 * JSON.stringify would send it where it can, else the way Python's `_jsonable` does:
 *
 * - NaN and infinities -> null; a BigInt -> its text;
 * - an object property whose value is a function or a symbol is dropped, an array element null
 *   (JSON.stringify's rule); an undefined element null; an undefined property is dropped silently, since
 *   JSON.stringify never sends it (`{tool_calls: undefined}` is an absent key, not a null one);
 * - an object with toJSON (a Date: its ISO text; an invalid Date: null) -> what toJSON returns;
 * - a Set -> an array, a Map -> an object (keys as text), a Uint8Array / Buffer -> its UTF-8 text, another
 *   typed array -> an array, an Error -> "Name: message", a boxed primitive -> the primitive, any other
 *   class instance -> its enumerable fields.
 *
 * A circular value throws ResponseError naming where it loops.
 */
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g;
/** `text` as valid Unicode: each lone surrogate (a model's text cut mid-emoji) replaced by U+FFFD. */
export function wellFormed(text) {
    return text.replace(LONE_SURROGATE, "\uFFFD");
}
/** `text` made well-formed, the change noted with its path (§7.7 kit-json-safe-response). */
function wellFormedNoted(text, path, notes) {
    const fixed = wellFormed(text);
    if (fixed !== text)
        notes.push(`${path}: lone surrogates (text cut mid-character?) are not valid UTF-8; sent as U+FFFD`);
    return fixed;
}
function jsonable(value, path, notes, ancestors = new Set()) {
    if (typeof value === "string")
        return wellFormedNoted(value, path, notes);
    if (value === null || typeof value === "boolean")
        return value;
    if (typeof value === "number") {
        if (Number.isFinite(value))
            return value;
        notes.push(`${path}: ${value} is not JSON; sent as null`);
        return null;
    }
    if (typeof value === "bigint") {
        notes.push(`${path}: bigint is not JSON; sent as its text`);
        return value.toString();
    }
    if (typeof value !== "object") { // undefined, a function or a symbol, as an array element or at the top
        notes.push(`${path}: ${typeof value} is not JSON; sent as null`);
        return null;
    }
    if (ancestors.has(value))
        throw new ResponseError(`${path}: circular reference: JSON cannot carry it`);
    ancestors.add(value);
    try {
        const hasToJSON = typeof value.toJSON === "function";
        if (hasToJSON || !(Array.isArray(value) || isPlainObject(value))) {
            const [converted, how] = jsonLike(value);
            notes.push(`${path}: ${typeName(value)} is not JSON; sent as ${how}`);
            if (converted !== value)
                return jsonable(converted, path, notes, ancestors); // toJSON() may return `this`
        }
        if (Array.isArray(value))
            return value.map((item, i) => jsonable(item, `${path}[${i}]`, notes, ancestors));
        return jsonableFields(value, `${path}.`, notes, ancestors);
    }
    finally {
        ancestors.delete(value);
    }
}
/** The fields of a plain object through `jsonable`, each path `prefix + key`; see there for what is dropped. */
function jsonableFields(value, prefix, notes, ancestors = new Set()) {
    const out = {};
    for (const [key, item] of Object.entries(value)) {
        if (item === undefined)
            continue;
        if (typeof item === "function" || typeof item === "symbol") {
            notes.push(`${prefix}${key}: ${typeof item} is not JSON; dropped, as JSON.stringify drops it`);
            continue;
        }
        const name = wellFormedNoted(key, `${prefix || "body."}key`, notes);
        out[name] = jsonable(item, prefix + name, notes, ancestors);
    }
    return out;
}
/**
 * `value` with every undefined-valued property of its plain objects removed (in arrays too): JSON.stringify
 * never sends such a property, so it is an absent key, not a problem.  Anything else is left as it is.
 */
function withoutUndefined(value, ancestors = new Set()) {
    if (!(Array.isArray(value) || isPlainObject(value)) || ancestors.has(value))
        return value;
    ancestors.add(value);
    try {
        if (Array.isArray(value))
            return value.map((item) => withoutUndefined(item, ancestors));
        const out = {};
        for (const [key, item] of Object.entries(value))
            if (item !== undefined)
                out[key] = withoutUndefined(item, ancestors);
        return out;
    }
    finally {
        ancestors.delete(value);
    }
}
/** `[what JSON could carry instead, how the note names it]` for an object that is not a plain object or array. */
function jsonLike(value) {
    if (value instanceof Date)
        return Number.isNaN(value.getTime()) ? [null, "null (an invalid Date)"] : [value.toISOString(), "its ISO text"];
    if (value instanceof Uint8Array)
        return [new TextDecoder("utf-8").decode(value), "its UTF-8 text"];
    const toJSON = value.toJSON;
    if (typeof toJSON === "function")
        return [toJSON.call(value), "what its toJSON() returns"];
    if (value instanceof Set)
        return [[...value], "an array"];
    if (value instanceof Map)
        return [Object.fromEntries([...value].map(([k, v]) => [String(k), v])), "an object"];
    if (ArrayBuffer.isView(value) && typeof value.length === "number") {
        return [Array.from(value), "an array"];
    }
    if (value instanceof Error)
        return [describeError(value), "its text"];
    if (value instanceof String || value instanceof Number || value instanceof Boolean)
        return [value.valueOf(), "its primitive value"];
    return [{ ...value }, "its enumerable fields"];
}
/**
 * `body` changed the way the platform treats what it cannot use (§4), and a note per change: values JSON
 * cannot carry converted, tool calls with no resolvable name dropped, and `messages` / `metadata` that
 * still break the schema or the pairing rule dropped whole.  `final_response` is never touched.
 */
function asThePlatformKeeps(body) {
    const notes = [];
    const { final_response, ...rest } = body;
    const final = typeof final_response === "string" ? wellFormedNoted(final_response, "final_response", notes) : final_response;
    const out = { ...("final_response" in body ? { final_response: final } : {}), ...jsonableFields(rest, "", notes) };
    const messages = out["messages"];
    if (Array.isArray(messages)) {
        messages.forEach((message, i) => {
            if (!isObject(message) || !Array.isArray(message["tool_calls"]))
                return;
            const calls = message["tool_calls"];
            calls.forEach((call, j) => {
                if (toolCallName(call) === null)
                    notes.push(`messages[${i}].tool_calls[${j}]: no resolvable tool name; dropped`);
            });
            message["tool_calls"] = calls.filter((call) => toolCallName(call) !== null).map(flatToolCall);
        });
    }
    const problems = messageProblems(out["messages"], []);
    if (problems.length) {
        const more = problems.length > 1 ? ` (and ${problems.length - 1} more)` : "";
        notes.push(`${problems[0]}${more}; messages dropped, as the platform drops a malformed transcript`);
        delete out["messages"];
    }
    const metadataIssues = metadataProblems(out["metadata"]);
    if (metadataIssues.length) {
        notes.push(`${metadataIssues[0]}; metadata dropped, as the platform drops it`);
        delete out["metadata"];
    }
    return { body: out, notes };
}
/** Strict mode from the option, else from PIPELINES_PORT_STRICT. */
function strictMode(strict) {
    if (strict !== null && strict !== undefined)
        return Boolean(strict);
    return ["1", "true", "yes", "on"].includes(String(process.env["PIPELINES_PORT_STRICT"] || "").trim().toLowerCase());
}
/** A turn of a multi-turn run: the envelope carries `session_id` or `turn_id` (§2.2 multi-turn-fields). */
export function isMultiTurn(envelope) {
    return envelope.session_id !== null || envelope.turn_id !== null;
}
/** A turn reply (§4.2): an object with `message` and `session_done` and no `final_response`. */
function isTurnReply(value) {
    return isObject(value) && "message" in value && "session_done" in value && !("final_response" in value);
}
/** The soft problems (without `warning: `); ResponseError for the hard ones, in strict mode the soft ones too. */
function softProblems(problems, isStrict) {
    const errors = problems.filter((p) => !p.startsWith("warning:"));
    const soft = problems.filter((p) => p.startsWith("warning:")).map((p) => p.slice("warning: ".length));
    if (isStrict)
        errors.push(...soft.filter((w) => !(w.startsWith("final_response: ") && w.includes("truncates"))));
    if (errors.length)
        throw new ResponseError(errors);
    return soft;
}
/**
 * A turn reply as it goes out, its keys as built (§7.7 kit-turn-reply-checked).  Lenient: a `message` that is not
 * a string becomes its JSON text, a `session_done` that is not a boolean is sent as `false` (no hint), the rest as
 * the platform keeps an envelope's, each change logged; only a missing or empty `message` throws.  Strict: every
 * problem throws ResponseError, the soft ones too.
 */
function turnReplyBody(reply, isStrict) {
    let body = { ...reply };
    let notes = [];
    if (isStrict) {
        body = withoutUndefined(body);
    }
    else {
        const message = body["message"];
        if (message !== null && message !== undefined && typeof message !== "string")
            body["message"] = finalText(message, "message");
        if (typeof body["session_done"] !== "boolean") {
            notes.push(`session_done: must be a boolean, got ${jsonType(body["session_done"])}; sent as false (no hint)`);
            body["session_done"] = false;
        }
        const kept = asThePlatformKeeps(body);
        body = kept.body;
        notes = [...notes, ...kept.notes];
    }
    const soft = softProblems(turnReplyProblems(body), isStrict);
    [...notes, ...soft].forEach((w) => log("warning", `response: ${w}`));
    return body; // turnReplyProblems found no hard problem: it has the turn reply's shape
}
/** Every problem of a turn reply, worded as validateResponse words an envelope's. */
function turnReplyProblems(body) {
    const problems = [];
    const warnings = [];
    const message = body["message"];
    if (message === undefined || message === null || message === "")
        problems.push("message: required, a non-empty string (the user answers it)");
    else if (typeof message !== "string")
        problems.push(`message: must be a string, got ${jsonType(message)}`);
    else if (!message.trim())
        warnings.push("warning: message: blank (only whitespace): the user has nothing to answer");
    if (typeof body["session_done"] !== "boolean")
        problems.push(`session_done: must be a boolean, got ${jsonType(body["session_done"])}`);
    problems.push(...sharedProblems(body, warnings));
    return [...problems, ...warnings];
}
/**
 * A multi-turn per-turn reply `{message, session_done, metadata?}` (§4.2), checked as a strict server checks it:
 * a `message` that is not a string becomes its JSON text; a blank one, a `sessionDone` that is not a boolean or
 * metadata the platform cannot use throws ResponseError (§7.7 kit-turn-reply-checked).
 */
export function buildTurnReply(message, { metadata = null, sessionDone = false } = {}) {
    const reply = { message: typeof message === "string" ? message : finalText(message, "message"), session_done: sessionDone };
    if (metadata !== null && metadata !== undefined)
        reply["metadata"] = isPlainObject(metadata) ? { ...metadata } : metadata;
    return turnReplyBody(reply, true);
}
export function buildResponse(value, { messages = null, metadata = null, strict = null, multiTurn = false } = {}) {
    const isStrict = strictMode(strict);
    const converted = [];
    if (isTurnReply(value)) {
        if (multiTurn)
            return turnReplyBody(value, isStrict);
        const { message, session_done: _done, ...rest } = value;
        value = { ...rest, final_response: message };
        converted.push("session_done: a single-turn dispatch has no session to end; the turn reply is sent as the " +
            "response envelope, its message as final_response");
    }
    const found = unpackResult(value, isStrict);
    const transcript = messages ?? found.messages ?? null;
    const meta = metadata ?? found.metadata ?? null;
    let body = { ...found.extra, final_response: found.final };
    if (transcript !== null)
        body["messages"] = flatMessages(transcript);
    if (meta !== null)
        body["metadata"] = isPlainObject(meta) ? { ...meta } : meta;
    let notes = converted;
    try {
        if (isStrict)
            body = withoutUndefined(body);
        else {
            const kept = asThePlatformKeeps(body);
            body = kept.body;
            notes = [...converted, ...kept.notes];
        }
    }
    catch (err) {
        if (err instanceof RangeError)
            throw new ResponseError("body: nested too deeply to encode");
        throw err;
    }
    const soft = softProblems(validateResponse(body), isStrict);
    [...notes, ...soft].forEach((w) => log("warning", `response: ${w}`));
    return body; // validateResponse found no hard problem: it has the envelope's shape
}
/** Schema problems of `metadata`: an object or null (any keys). */
function metadataProblems(metadata) {
    if (metadata === null || metadata === undefined || isObject(metadata))
        return [];
    return [`metadata: must be an object or null, got ${jsonType(metadata)} (the platform drops it)`];
}
/** Mistyped first-class metadata: the schema allows it, the renderer cannot use it. */
function metadataWarnings(metadata) {
    if (!isObject(metadata))
        return [];
    const warnings = [];
    const has = (key) => metadata[key] !== undefined && metadata[key] !== null;
    for (const key of ["model", "system_prompt_id"]) {
        if (has(key) && typeof metadata[key] !== "string")
            warnings.push(`warning: metadata.${key}: should be a string, got ${jsonType(metadata[key])}`);
    }
    for (const key of ["total_input_tokens", "total_output_tokens"]) {
        const v = metadata[key];
        if (has(key) && !(typeof v === "number" && Number.isInteger(v) && v >= 0)) {
            warnings.push(`warning: metadata.${key}: should be a non-negative integer, got ${quoted(v, 40)}`);
        }
    }
    const runtime = metadata["agent_runtime_ms"];
    if (has("agent_runtime_ms") && !(typeof runtime === "number" && Number.isFinite(runtime) && runtime >= 0)) {
        warnings.push(`warning: metadata.agent_runtime_ms: should be a non-negative number, got ${quoted(runtime, 40)}`);
    }
    return warnings;
}
/** A tool call against the schema's oneOf: exactly one of the flat and the nested shape. */
function toolCallProblems(call, at, seenCallIds, warnings) {
    if (!isObject(call))
        return [`${at}: must be an object, got ${jsonType(call)}`];
    const fn = call["function"];
    const flat = typeof call["name"] === "string";
    const nested = isObject(fn) && typeof fn["name"] === "string" && (!("type" in call) || call["type"] === "function");
    if (flat && nested)
        return [`${at}: has both 'name' and 'function': send one of the flat and the nested form`];
    if (!flat && !nested) {
        if ("type" in call && call["type"] !== "function" && isObject(fn))
            return [`${at}.type: must be "function" in the nested form, got ${quoted(call["type"], 40)}`];
        return [`${at}.name: no resolvable tool name (neither 'name' nor 'function.name'); the platform drops it`];
    }
    const problems = [];
    if ("id" in call) {
        if (typeof call["id"] !== "string")
            problems.push(`${at}.id: must be a string, got ${jsonType(call["id"])}`);
        else
            seenCallIds.add(call["id"]);
    }
    const args = flat ? call["arguments"] : isObject(fn) ? fn["arguments"] : undefined;
    if (args !== undefined && args !== null && !isObject(args) && typeof args !== "string") {
        warnings.push(`warning: ${at}.arguments: should be an object or a JSON-encoded string, got ${jsonType(args)}`);
    }
    return problems;
}
/** Schema and pairing problems of `messages`; soft ones are pushed onto `warnings`. */
function messageProblems(messages, warnings) {
    if (messages === null || messages === undefined)
        return [];
    if (!Array.isArray(messages))
        return [`messages: must be an array or null, got ${jsonType(messages)} (the platform drops it)`];
    const problems = [];
    const seenCallIds = new Set();
    messages.forEach((message, i) => {
        const at = `messages[${i}]`;
        if (!isObject(message)) {
            problems.push(`${at}: must be an object, got ${jsonType(message)}`);
            return;
        }
        const role = message["role"];
        const content = message["content"];
        if (typeof role !== "string" || !MESSAGE_ROLES.includes(role))
            problems.push(`${at}.role: must be one of ${MESSAGE_ROLES.join(", ")}, got ${quoted(role, 40)}`);
        if (content !== undefined && content !== null && typeof content !== "string" && !Array.isArray(content)) {
            problems.push(`${at}.content: must be a string, an array of parts or null, got ${jsonType(content)}`);
        }
        if ("tool_calls" in message) {
            const toolCalls = message["tool_calls"];
            if (!Array.isArray(toolCalls))
                problems.push(`${at}.tool_calls: must be an array, got ${jsonType(toolCalls)}`);
            else {
                if (role !== "assistant" && toolCalls.length)
                    warnings.push(`warning: ${at}.tool_calls: only assistant messages carry tool calls, this one is ${quoted(role)}`);
                toolCalls.forEach((call, j) => problems.push(...toolCallProblems(call, `${at}.tool_calls[${j}]`, seenCallIds, warnings)));
            }
        }
        if ("thinking" in message) {
            const thinking = message["thinking"];
            if (!Array.isArray(thinking))
                problems.push(`${at}.thinking: must be an array of objects, got ${jsonType(thinking)}`);
            else
                thinking.forEach((block, j) => isObject(block) || problems.push(`${at}.thinking[${j}]: must be an object, got ${jsonType(block)}`));
        }
        const callId = message["tool_call_id"];
        if ("tool_call_id" in message && typeof callId !== "string") {
            problems.push(`${at}.tool_call_id: must be a string, got ${jsonType(callId)}`);
        }
        else if (role === "tool") {
            if (typeof callId !== "string" || !callId)
                problems.push(`${at}.tool_call_id: required on role 'tool'`);
            else if (!seenCallIds.has(callId)) {
                problems.push(`${at}.tool_call_id: ${quoted(callId, 60)} does not match the id of an earlier assistant tool_calls entry`);
            }
        }
    });
    return problems;
}
/** The first place in `value` JSON cannot carry, or null. */
function unencodable(value, path) {
    if (value === null || typeof value === "string" || typeof value === "boolean")
        return null;
    if (typeof value === "number")
        return Number.isFinite(value) ? null : `${path}: ${value} is not JSON`;
    if (Array.isArray(value)) {
        for (let i = 0; i < value.length; i++) {
            const found = unencodable(value[i], `${path}[${i}]`);
            if (found)
                return found;
        }
        return null;
    }
    if (isPlainObject(value)) {
        for (const [key, item] of Object.entries(value)) {
            const found = unencodable(item, `${path}.${key}`);
            if (found)
                return found;
        }
        return null;
    }
    const kind = value === undefined ? "undefined" : typeof value === "object" ? typeName(value) : typeof value;
    return `${path}: ${kind} is not a JSON type`;
}
/**
 * Every problem of a response body against §4 and its JSON Schema, each starting with its JSON path.
 * Hard problems (no prefix): what the schema rejects, the contract's rules (a non-empty final_response,
 * tool_call_id pairing) and values JSON cannot carry.  Soft ones start with `warning:` (a truncated or
 * blank final response, mistyped first-class metadata, odd tool arguments).  Empty: accepted as sent.
 */
export function validateResponse(body) {
    if (!isObject(body))
        return [`body: must be a JSON object, got ${jsonType(body)}`];
    const problems = [];
    const warnings = [];
    const final = body["final_response"];
    if (final === undefined || final === null)
        problems.push("final_response: required, a non-empty string (the judge grades it)");
    else if (typeof final !== "string")
        problems.push(`final_response: must be a string, got ${jsonType(final)}`);
    else if (!final)
        problems.push("final_response: must not be empty (the judge has nothing to grade)");
    else if (!final.trim())
        warnings.push("warning: final_response: blank (only whitespace): the judge has nothing to grade");
    else if (final.length > FINAL_RESPONSE_SOFT_LIMIT && [...final].length > FINAL_RESPONSE_SOFT_LIMIT) {
        warnings.push(`warning: final_response: ${[...final].length} characters; the platform truncates it at ` +
            `~${FINAL_RESPONSE_SOFT_LIMIT} with a soft warning`);
    }
    problems.push(...sharedProblems(body, warnings));
    return [...problems, ...warnings];
}
/** The problems of what a turn reply shares with the envelope (messages, metadata, JSON); soft ones go to `warnings`. */
function sharedProblems(body, warnings) {
    const problems = [...messageProblems(body["messages"], warnings), ...metadataProblems(body["metadata"])];
    warnings.push(...metadataWarnings(body["metadata"]));
    let found;
    try {
        found = unencodable(body, "body");
    }
    catch {
        found = "body: nested too deeply to encode";
    }
    if (found)
        problems.push(found.startsWith("body.") ? found.slice("body.".length) : found);
    return problems;
}
function jsonReply(status, payload, extraHeaders = []) {
    // Valid UTF-8 whatever a string holds: JSON.stringify would escape a lone surrogate, which the platform
    // then parses back into text no UTF-8 store accepts.
    const body = Buffer.from(JSON.stringify(payload, (_key, v) => (typeof v === "string" ? wellFormed(v) : v)), "utf8");
    return { status, headers: [["Content-Type", "application/json"], ["Content-Length", String(body.length)], ...extraHeaders], body };
}
const errorReply = (status, detail, extraHeaders = []) => jsonReply(status, { detail }, extraHeaders);
/** `"ErrorName: message"` of what an agent threw: what the platform is shown. */
function describeError(err) {
    if (!(err instanceof Error))
        return `thrown value: ${short(String(err), 200)}`;
    return err.message ? `${err.name}: ${err.message}` : err.name;
}
class DeadlineExceeded extends Error {
}
/**
 * §3.7 reachability probe.  POSTs `{}` to `{proxy_url}/tools/__reachability_probe__`
 * with a fake bearer: 401/403 (or 2xx) means reachable; a connection or DNS
 * error means egress is blocked.  Never rejects.
 */
export async function probeProxy(proxyUrl, { timeout = 10 } = {}) {
    const started = performance.now();
    const elapsed = () => Math.round((performance.now() - started) * 10) / 10;
    try {
        const url = new URL(`${checkProxyUrl(proxyUrl, "the probe")}/tools/${PROBE_TOOL}`);
        const headers = { "Content-Type": "application/json", "Content-Length": "2", Authorization: "Bearer fake-token", "User-Agent": USER_AGENT };
        const { status } = await exchange({ url, headers, body: "{}", timeoutS: timeout, maxReply: 64 << 10, agent: false });
        const reachable = status === 401 || status === 403 || (status >= 200 && status < 300);
        return { reachable, status_code: status, latency_ms: elapsed(), error: reachable ? null : `unexpected HTTP ${status} from the proxy` };
    }
    catch (err) {
        const cause = err instanceof TransportFailure ? err.failure : err;
        const status = err instanceof ReplyTooLarge ? err.status : null;
        return { reachable: false, status_code: status, latency_ms: elapsed(), error: short(describeError(cause), 200) };
    }
}
/**
 * An agent function and its endpoint settings; `handle` decides every reply (§2).
 *
 * `agent(envelope)` may be sync or async and may return anything
 * buildResponse accepts.  Auth uses `token` or, by default, the environment
 * variable `tokenEnv` read at each request; it is off only with `noAuth: true`.
 */
export class DispatchApp {
    agent;
    path;
    token;
    tokenEnv;
    authHeader;
    noAuth;
    maxBody;
    runTimeoutS;
    strict;
    routes;
    constructor(agent, { path = DEFAULT_DISPATCH_PATH, token = null, tokenEnv = DEFAULT_TOKEN_ENV, authHeader = "Authorization", noAuth = false, maxBody = DEFAULT_MAX_BODY_BYTES, runTimeoutS = DEFAULT_RUN_TIMEOUT_S, strict = null, } = {}) {
        if (typeof agent !== "function")
            throw new TypeError(`agent must be a function, got ${jsonType(agent)}`);
        if (!path.startsWith("/"))
            throw new RangeError(`path must start with '/', got ${quoted(path)}`);
        if (noAuth && token)
            throw new RangeError("noAuth and a token contradict each other: choose one");
        if (!noAuth && !token && !tokenEnv)
            throw new RangeError("auth needs a token or a tokenEnv; pass noAuth: true to disable it explicitly");
        if (!(runTimeoutS > 0 && runTimeoutS <= MAX_RUN_TIMEOUT_S))
            throw new RangeError(`runTimeoutS must be in (0, ${MAX_RUN_TIMEOUT_S}], got ${runTimeoutS}`);
        if (!(Number.isInteger(maxBody) && maxBody >= 1))
            throw new RangeError(`maxBody must be a positive number of bytes, got ${maxBody}`);
        if (!/^[A-Za-z0-9-]+$/.test(authHeader))
            throw new RangeError(`authHeader must be an HTTP header name, got ${quoted(authHeader)}`);
        this.agent = agent;
        this.token = token;
        this.tokenEnv = token ? null : tokenEnv;
        this.authHeader = authHeader;
        this.noAuth = noAuth;
        this.maxBody = maxBody;
        this.runTimeoutS = runTimeoutS;
        this.strict = strict;
        this.path = path.replace(/\/+$/, "") || "/";
        this.routes = { [this.path]: ["POST"], "/healthz": ["GET"] };
    }
    /** How auth is configured, for a start-up line (never the token). */
    describeAuth() {
        if (this.noAuth)
            return "DISABLED (--no-auth): anyone who can reach this endpoint can dispatch";
        const value = this.authHeader.toLowerCase() === "authorization" ? "Bearer <token>" : "<token>";
        let line = `${this.authHeader}: ${value} (token from ${this.token ? "the configured token" : `$${this.tokenEnv}`})`;
        if (this.tokenEnv && !process.env[this.tokenEnv])
            line += `; ${this.tokenEnv} is NOT set: every request gets 503 until it is`;
        return line;
    }
    /** The agent token, or "" (read per request, so a rotated env var takes effect). */
    expectedToken() {
        return this.token || process.env[this.tokenEnv ?? ""] || "";
    }
    /**
     * The reply decided before the body is read, or null to read it and call
     * `handle`: routing (404, 405), auth (503, 401), then the body's framing
     * (411 for a chunked or length-less body, 413 over maxBody).
     */
    precheck(method, target, headers) {
        const path = routePath(target);
        const allowed = this.routes[path];
        const verb = method.toUpperCase();
        if (!allowed)
            return errorReply(404, `no route for ${short(path, 100)}: dispatches go to POST ${this.path}`);
        if (!allowed.includes(verb)) {
            return errorReply(405, `${verb} is not allowed on ${path}: use ${allowed.join(" or ")}`, [["Allow", allowed.join(", ")]]);
        }
        if (path === "/healthz")
            return null;
        const h = lowerHeaders(headers);
        if (!this.noAuth) {
            const expected = this.expectedToken();
            if (!expected) {
                return errorReply(503, `this agent's wrapper is misconfigured: auth reads environment variable ${this.tokenEnv}, which is not set`);
            }
            if (!checkCredential(h, expected, this.authHeader)) {
                return errorReply(401, `missing or invalid credential in the ${this.authHeader} header`, this.authHeader.toLowerCase() === "authorization" ? [["WWW-Authenticate", "Bearer"]] : []);
            }
        }
        if ((h["transfer-encoding"] ?? "").toLowerCase().includes("chunked")) {
            return errorReply(411, "chunked request bodies are not supported: send the JSON body with a Content-Length header");
        }
        const length = (h["content-length"] ?? "").trim();
        if (!/^\d+$/.test(length))
            return errorReply(411, "a Content-Length header is required: send the JSON body with its length");
        if (Number(length) > this.maxBody) {
            return errorReply(413, `request body of ${Number(length)} bytes is over this endpoint's ${this.maxBody}-byte cap`);
        }
        return null;
    }
    /**
     * The reply to one request, in §2's order: auth, JSON, ping, connectivity,
     * envelope, agent, response envelope.  Every failure is one status with a
     * JSON `detail` naming it.  Writes one log line per request to the
     * dispatch path: ids, status, duration, proxy calls (never a token).
     */
    async handle(method, target, headers, body) {
        const started = performance.now();
        const context = { envelope: null, cancelled: false, proxyCalls: 0 };
        const { reply, what } = await this.decide(method, target, headers, body, context);
        if (what === "health")
            return reply;
        const h = lowerHeaders(headers);
        const env = context.envelope;
        const ids = env ? [env.run_id, env.task_id, env.run_token_jti]
            : [header(h, RUN_ID_HEADER), header(h, TASK_ID_HEADER), header(h, RUN_TOKEN_JTI_HEADER)];
        const detail = reply.status >= 400 ? String(JSON.parse(reply.body.toString("utf8")).detail) : "";
        const note = what === "dispatch" ? "" : reply.status >= 400 ? ` (rejected: ${short(detail, 200)})` : ` (${what})`;
        log("info", `${method} ${routePath(target)} status=${reply.status} run_id=${ids[0]} task_id=${ids[1]} jti=${ids[2]} ` +
            `duration_ms=${(performance.now() - started).toFixed(1)} proxy_calls=${context.proxyCalls}${note}`);
        return reply;
    }
    async decide(method, target, headers, body, context) {
        const early = this.precheck(method, target, headers);
        if (early)
            return { reply: early, what: "rejected" };
        if (routePath(target) === "/healthz")
            return { reply: jsonReply(200, { ok: true, version: VERSION }), what: "health" };
        if (body.length > this.maxBody) {
            return { reply: errorReply(413, `request body of ${body.length} bytes is over this endpoint's ${this.maxBody}-byte cap`), what: "rejected" };
        }
        let payload;
        try {
            payload = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(body));
        }
        catch (err) {
            return { reply: errorReply(400, `body is not valid JSON: ${short(err instanceof Error ? err.message : String(err), 200)}`), what: "rejected" };
        }
        if (isPing(payload))
            return { reply: jsonReply(200, { ok: true }), what: "ping" };
        if (!isObject(payload))
            return { reply: errorReply(400, `body must be a JSON object, got ${jsonType(payload)}`), what: "rejected" };
        if (payload["connectivity_check"] === true)
            return { reply: await this.connectivityCheck(payload, headers), what: "connectivity check" };
        try {
            context.envelope = envelopeFromDispatch(payload, headers);
        }
        catch (err) {
            if (!(err instanceof EnvelopeError))
                throw err;
            return { reply: errorReply(400, err.message), what: "rejected" };
        }
        return { reply: await this.runAgent(context, context.envelope), what: "dispatch" };
    }
    /** §2 step 4: probe the proxy with a fake bearer; never runs user code. */
    async connectivityCheck(payload, headers) {
        const url = payload[PROXY_URL_FIELD] || payload[PROXY_URL_FIELD_LEGACY] || header(lowerHeaders(headers), PROXY_URL_HEADER);
        if (!url) {
            return errorReply(400, `connectivity_check needs a proxy URL: body field '${PROXY_URL_FIELD}' or header ${PROXY_URL_HEADER}`);
        }
        let proxyUrl;
        try {
            proxyUrl = checkProxyUrl(url, "the connectivity check");
        }
        catch (err) {
            return errorReply(400, err instanceof Error ? err.message : String(err));
        }
        return jsonReply(200, { ok: true, outbound: await probeProxy(proxyUrl) });
    }
    /** §2 steps 6-8: the agent with its envelope bound, within runTimeoutS; 500 on any failure. */
    async runAgent(context, envelope) {
        const secrets = [envelope.run_token, this.expectedToken()];
        const scrub = (text) => secrets.reduce((t, secret) => (secret ? t.split(secret).join(REDACTED) : t), text);
        let timer;
        const deadline = new Promise((_, reject) => {
            timer = setTimeout(() => reject(new DeadlineExceeded()), this.runTimeoutS * 1000);
        });
        try {
            const result = await Promise.race([dispatchContext.run(context, async () => this.agent(envelope)), deadline]);
            const body = buildResponse(result, { strict: this.strict, multiTurn: isMultiTurn(envelope) });
            if (JSON.stringify(body).includes(envelope.run_token)) {
                log("warning", "the agent's response contained the run token; it was redacted");
                return jsonReply(200, redact(body, envelope.run_token));
            }
            return jsonReply(200, body);
        }
        catch (err) {
            if (err instanceof DeadlineExceeded) {
                context.cancelled = true; // an overrunning agent keeps running, but its proxy calls now fail fast
                log("error", `run ${envelope.run_id}: the agent did not finish within ${this.runTimeoutS} s; answering 504`);
                return errorReply(504, `agent did not finish within run_timeout_s=${this.runTimeoutS} s`);
            }
            if (err instanceof ResponseError) {
                return errorReply(500, short(scrub(`agent returned a value that cannot become a response: ${err.message}`), DETAIL_LIMIT - 1));
            }
            log("error", `run ${envelope.run_id}: the agent threw:\n${scrub(err instanceof Error ? err.stack ?? describeError(err) : String(err))}`);
            return errorReply(500, short(scrub(describeError(err)), DETAIL_LIMIT - 1));
        }
        finally {
            clearTimeout(timer);
        }
    }
}
/** The path of a request target, query dropped, trailing `/` stripped. */
function routePath(target) {
    return (target.split(/[?#]/)[0] ?? "").replace(/\/+$/, "") || "/";
}
// ---------------------------------------------------------------------------
// Server adapters: node:http and the Web-standard fetch handler, each a thin
// layer over DispatchApp.handle (precheck says whether the body is read)
// ---------------------------------------------------------------------------
/** `agentOrApp` itself, or a DispatchApp serving the agent with `options`. */
function appOf(agentOrApp, options) {
    const app = agentOrApp instanceof DispatchApp ? agentOrApp : new DispatchApp(agentOrApp, options);
    if (app.noAuth)
        log("warning", "auth is DISABLED: anyone who can reach this endpoint can dispatch");
    return app;
}
/** `app.handle`, and the last line of defence should it throw: a JSON 500, never a dropped connection or a text page. */
async function replyOf(app, method, target, headers, body) {
    try {
        return await app.handle(method, target, headers, body);
    }
    catch (err) {
        log("error", `building the reply failed: ${err instanceof Error ? err.name : typeof err}`);
        return errorReply(500, `internal error while building the reply: ${err instanceof Error ? err.name : "Error"}`);
    }
}
/** The 500 for a body something else read first: the wrapper is mounted wrong, and the agent must not run on nothing. */
function bodyAlreadyRead() {
    log("error", "the request body was read before the dispatch handler: mount it before any body parser");
    return errorReply(500, "this agent's wrapper is misconfigured: the request body was read before the dispatch handler " +
        "(a body parser such as express.json() mounted before it?)");
}
/**
 * A DispatchApp (or an agent function plus DispatchApp options) as a Node
 * `(req, res)` listener, for a server or framework you run yourself.  It reads
 * the body itself: mount it before any body parser (express.json() would
 * leave it nothing to read: a 500 says so).  Keep-alive, timeouts and shutdown
 * are the host server's; startServer adds graceful draining.
 */
export function nodeHandler(agentOrApp, options = {}) {
    const app = appOf(agentOrApp, options);
    return (req, res) => serveNode(app, req, res, () => false);
}
/**
 * A DispatchApp (or an agent function plus DispatchApp options) as a
 * Web-standard `Request -> Response` handler.  `path` is matched against the
 * request URL's whole path, so a handler behind a prefix (Next.js
 * `app/api/dispatch/route.ts`) is created with `{ path: "/api/dispatch" }`.
 *
 * The body is read as the host framed it: a `Request` made in code (Hono's
 * `app.request()`), streamed, or re-chunked by a proxy carries no
 * Content-Length, and needs none.  It is read only when the request passes
 * routing and auth, and never past `maxBody` (413, the stream cancelled
 * there); a declared Content-Length over `maxBody` is a 413 before reading,
 * and one the body disagrees with a 400.  A body something else already read
 * (`request.bodyUsed`) gets a 500 naming the mistake.
 */
export function fetchHandler(agentOrApp, options = {}) {
    const app = appOf(agentOrApp, options);
    return async (request) => {
        const { pathname, search } = new URL(request.url);
        const method = request.method;
        const target = pathname + search;
        const declared = request.headers.get("content-length")?.trim() ?? null;
        const length = declared !== null && /^\d+$/.test(declared) ? declared : null;
        // DispatchApp is shown the framing of the bytes it is handed: the declared length before reading (0 when
        // there is none: the host framed the body), the length read after.  Transfer-Encoding was the host's to undo.
        const headers = [];
        request.headers.forEach((value, name) => void (name === "content-length" || name === "transfer-encoding" || headers.push([name, value])));
        const framed = (bytes) => [...headers, ["content-length", bytes]];
        const refuse = (status, detail) => {
            log("info", `${method} ${routePath(target)} status=${status} (rejected: ${short(detail, 200)})`);
            return responseOf(errorReply(status, detail));
        };
        if (request.body === null || app.precheck(method, target, framed(length ?? "0")) !== null) {
            return responseOf(await replyOf(app, method, target, framed(length ?? "0"), new Uint8Array(0)));
        }
        if (request.bodyUsed)
            return responseOf(bodyAlreadyRead());
        let body;
        try {
            body = await readAtMost(request.body, app.maxBody);
        }
        catch (err) {
            return refuse(400, `the request body could not be read: ${short(describeError(err), 200)}`);
        }
        if (body.length > app.maxBody) {
            return refuse(413, `request body of more than ${app.maxBody} bytes is over this endpoint's ${app.maxBody}-byte cap`);
        }
        if (declared !== null && (length === null || Number(length) !== body.length)) {
            const truncated = length !== null && Number(length) > body.length ? ": truncated" : "";
            return refuse(400, `the request body is ${body.length} bytes but its Content-Length says ${quoted(declared, 40)}${truncated}`);
        }
        return responseOf(await replyOf(app, method, target, framed(String(body.length)), body));
    };
}
/** The bytes of `stream`, the read stopped (and the stream cancelled) once past `limit`. */
async function readAtMost(stream, limit) {
    const reader = stream.getReader();
    const chunks = [];
    let size = 0;
    for (;;) {
        const { done, value } = await reader.read();
        if (done)
            break;
        chunks.push(value);
        size += value.length;
        if (size > limit) {
            await reader.cancel();
            break;
        }
    }
    return Buffer.concat(chunks);
}
function responseOf(reply) {
    return new Response(reply.body, { status: reply.status, headers: reply.headers });
}
/**
 * Serve a DispatchApp (or an agent function plus DispatchApp options) over
 * HTTP/1.1 with keep-alive.  Resolves once listening.
 */
export async function startServer(agentOrApp, { host = "127.0.0.1", port = 0, readTimeoutS = 30, ...options } = {}) {
    const app = appOf(agentOrApp, options);
    let inFlight = 0;
    let draining = false;
    let idle = () => { };
    const server = http.createServer({ requestTimeout: readTimeoutS * 1000, headersTimeout: readTimeoutS * 1000 }, (req, res) => {
        inFlight += 1;
        void serveNode(app, req, res, () => draining).finally(() => {
            inFlight -= 1;
            if (inFlight === 0)
                idle();
        });
    });
    server.on("connection", (socket) => socket.setNoDelay(true));
    await new Promise((resolve, reject) => {
        server.once("error", reject);
        server.listen(port, host, () => {
            server.off("error", reject);
            resolve();
        });
    });
    const address = server.address();
    if (address === null || typeof address === "string")
        throw new PipelinesError(`unexpected listening address ${quoted(address)}`);
    const shownHost = address.address.includes(":") ? `[${address.address}]` : address.address;
    const url = `http://${shownHost}:${address.port}${app.path}`;
    async function close(graceS = 5) {
        draining = true;
        server.close();
        server.closeIdleConnections?.(); // idle keep-alive sockets would hold close() open
        const finished = inFlight === 0 || await new Promise((resolve) => {
            const timer = setTimeout(() => resolve(false), graceS * 1000);
            idle = () => {
                clearTimeout(timer);
                resolve(true);
            };
        });
        server.closeAllConnections?.();
        return finished;
    }
    return { server, url, app, close };
}
/** serveOne, with a JSON 500 should anything outside `handle` throw. */
function serveNode(app, req, res, isDraining) {
    return serveOne(app, req, res, isDraining).catch((err) => {
        log("error", `request failed inside the server: ${err instanceof Error ? err.stack ?? err.message : String(err)}`);
        if (!res.headersSent)
            send(res, errorReply(500, "internal error in the dispatch server"), true);
    });
}
/** Read one request's body (only when it is small enough), decide, answer. */
async function serveOne(app, req, res, isDraining) {
    if (isDraining())
        return send(res, errorReply(503, "server is shutting down: retry on another instance"), true);
    const method = req.method ?? "GET";
    const target = req.url ?? "/";
    const refused = app.precheck(method, target, req.headers) !== null;
    const lengthHeader = req.headers["content-length"];
    const length = (typeof lengthHeader === "string" ? lengthHeader : "").trim();
    // A refused request's body is read (and dropped) only when small, to keep the
    // connection; otherwise the connection closes instead of reading it.
    const readable = /^\d+$/.test(length) && Number(length) <= app.maxBody;
    const close = refused && !readable && method !== "GET";
    if (!refused && readable && Number(length) > 0 && req.readableEnded)
        return send(res, bodyAlreadyRead());
    let body = Buffer.alloc(0);
    if (readable) {
        const chunks = [];
        try {
            for await (const chunk of req)
                chunks.push(chunk);
        }
        catch {
            return; // the client went away mid-body: nobody to answer
        }
        body = Buffer.concat(chunks);
    }
    const reply = await replyOf(app, method, target, req.headers, body);
    send(res, reply, close || isDraining()); // a dispatch that finishes while draining closes its connection
}
function send(res, reply, close = false) {
    const headers = [...reply.headers];
    if (close)
        headers.push(["Connection", "close"]);
    res.writeHead(reply.status, headers.flat());
    res.end(reply.body);
}
