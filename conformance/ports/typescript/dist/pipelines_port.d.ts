import type { IncomingHttpHeaders, IncomingMessage, Server, ServerResponse } from "node:http";
export declare const VERSION = "0.1.0";
/** Any JSON value. */
export type Json = null | boolean | number | string | Json[] | {
    [key: string]: Json;
};
/** A JSON object. */
export type JsonObject = {
    [key: string]: Json;
};
/** An id as the dispatch carries it (§2): a number stays a number, a string a string. */
export type Id = number | string | null;
/**
 * One run's dispatch context (§2), read-only.  `run_token` is a secret: it is
 * not enumerable, so JSON.stringify and console.log leave it out.
 */
export interface Envelope {
    readonly proxy_url: string;
    readonly run_token: string;
    readonly run_id: Id;
    readonly task_id: Id;
    readonly agent_id: Id;
    readonly run_token_jti: string | null;
    readonly user_instruction: string;
    readonly task_input: Readonly<JsonObject>;
    readonly latest_user_prompt: string | null;
    readonly session_id: Id;
    readonly turn_id: Json;
    readonly messages: readonly Json[] | null;
    readonly scenario_state: Readonly<JsonObject> | null;
    readonly workspace: Readonly<JsonObject> | null;
    readonly tools_schema: readonly Json[] | null;
    /** The declared sub-agent labels (§2 `sub_agents`), normalised as §3.5. */
    readonly sub_agents: readonly string[];
    /** Origin of the proxy URL (`scheme://host[:port]`, PIPELINES_API_URL in code mode, §5). */
    readonly api_url: string;
    /** The whole dispatch body as received, unknown fields included. */
    readonly raw: Readonly<JsonObject>;
}
/** Request headers: a Node header object, or name/value pairs; names are matched case-insensitively. */
export type HeadersInit = IncomingHttpHeaders | Readonly<Record<string, string | undefined>> | ReadonlyArray<readonly [string, string]>;
/** The reserved live trace event types (§3.4). */
export type TraceEventType = "assistant_message" | "thinking" | "system_prompt" | "custom" | "llm_payload" | "handoff" | "subagent_message" | "subagent_final";
/** A live trace event body as posted to `{proxy_url}/traces/{type}` (§3.4): the payload, stamped once. */
export interface TraceEvent extends JsonObject {
    __occurred_at: string;
}
/** The proxy's answer to a trace post. */
export interface TraceReply {
    accepted: boolean;
    sequence: number;
    [extra: string]: Json;
}
/** A `handoff` event's payload (§3.4). */
export interface HandoffEvent {
    from_sub_agent: string;
    to_sub_agent: string;
    reason?: Json;
    payload_preview?: Json;
}
/** A tool call in a transcript, flat form (§4); the nested OpenAI form is flattened by buildResponse. */
export interface ToolCall {
    id?: string;
    name: string;
    arguments?: JsonObject | string | null;
    [extra: string]: unknown;
}
/** A transcript message (§4). */
export interface Message {
    role: "system" | "user" | "assistant" | "tool";
    content?: string | Json[] | null;
    tool_calls?: ToolCall[];
    tool_call_id?: string;
    thinking?: JsonObject[];
    [extra: string]: unknown;
}
/** First-class metadata the platform renders (§4); any other key is kept. */
export interface ResponseMetadata {
    model?: string;
    system_prompt_id?: string;
    total_input_tokens?: number;
    total_output_tokens?: number;
    agent_runtime_ms?: number;
    [extra: string]: unknown;
}
/** The v1 response envelope (§4): what a dispatch answers with 200. */
export interface ResponseEnvelope {
    final_response: string;
    messages?: Message[] | null;
    metadata?: ResponseMetadata | null;
    [extra: string]: unknown;
}
/**
 * A multi-turn per-turn reply (§4.2): what buildTurnReply builds.  In a multi-turn dispatch (the envelope carries
 * `session_id` or `turn_id`) it is sent as built; in a single-turn one it becomes the response envelope.
 */
export interface TurnReply {
    message: string;
    session_done: boolean;
    metadata?: ResponseMetadata | null;
    [extra: string]: unknown;
}
/** What an agent may return: text, a response envelope, a turn reply, or a framework's result object (§4). */
export type AgentResult = string | ResponseEnvelope | TurnReply | {
    final_output?: unknown;
    output?: unknown;
    message?: unknown;
} | object | null | undefined;
/** An agent: the envelope in, a result out (sync or async). */
export type Agent = (envelope: Envelope) => AgentResult | Promise<AgentResult>;
/** The retry policy of tool calls and trace posts (§3.3). */
export interface RetryPolicy {
    /** Attempts for 429 / transient 503, counting the first try. */
    readonly maxAttempts: number;
    /** The first backoff in seconds; doubles on each retry, ±jitter. */
    readonly baseDelayS: number;
    readonly maxDelayS: number;
    readonly jitter: number;
    /** A Retry-After header replaces the computed wait, capped here. */
    readonly maxRetryAfterS: number;
    /** Timeouts, refused or reset connections: retried with the same Idempotency-Key. */
    readonly transportRetries: number;
}
/** The one retry policy of tool calls and trace posts (§3.3). */
export declare const RETRY_POLICY: RetryPolicy;
export declare const TRACE_EVENT_TYPES: ReadonlySet<TraceEventType>;
export declare const DEFAULT_DISPATCH_PATH = "/dispatch";
export declare const DEFAULT_TOKEN_ENV = "AGENT_TOKEN";
/** Base class of every error this module throws on purpose. */
export declare class PipelinesError extends Error {
    constructor(message: string);
}
/** A dispatch envelope is missing, malformed, or not bound (§2). */
export declare class EnvelopeError extends PipelinesError {
}
/** A value cannot become a valid response envelope (§4); `problems` lists each one. */
export declare class ResponseError extends PipelinesError {
    readonly problems: readonly string[];
    constructor(problems: string | readonly string[]);
}
/** The fields a ProxyError carries besides its message. */
export interface ProxyErrorFields {
    statusCode?: number | null;
    errorClass?: string | null;
    body?: Json;
    toolName?: string | null;
    retryAfter?: number | null;
}
/** A failure as the `{"error": ...}` tool result a model can read. */
export interface ToolErrorValue {
    error: string;
    error_class?: string;
    status_code?: number;
}
/**
 * A tool call or trace post failed (§3.3).  `statusCode` is the HTTP status
 * (null when no reply arrived or nothing was sent), `errorClass` the
 * platform's machine-readable class, `body` the parsed reply (its first 200
 * characters when not JSON).  Messages never contain the run token.
 */
export declare class ProxyError extends PipelinesError {
    readonly statusCode: number | null;
    readonly errorClass: string | null;
    readonly body: Json;
    readonly toolName: string | null;
    readonly retryAfter: number | null;
    constructor(message: string, { statusCode, errorClass, body, toolName, retryAfter }?: ProxyErrorFields);
    /** The failure as an `{"error": ...}` tool result a model can read. */
    toValue(): ToolErrorValue;
}
/** Refused locally, before anything was sent: bad tool name, arguments, size or actor label. */
export declare class ProxyRequestError extends ProxyError {
}
/** No usable reply arrived: timeout, refused or reset connection, TLS failure. */
export declare class ProxyTransportError extends ProxyError {
}
/** The proxy rejected the run token as expired, invalid or revoked: the run is over (§3.3). */
export declare class StaleRunTokenError extends ProxyError {
}
/** One line to stderr; callers never pass a secret. */
export declare function log(level: "info" | "warning" | "error", message: string): void;
/**
 * Parse an HTTP dispatch (§2): the JSON body (object, string or bytes) plus
 * the request headers.  Body fields win; ids, the jti and the proxy URL fall
 * back to the X-Pipelines-* headers and the legacy `pwsa` names; the run
 * token comes from X-Pipelines-Run-Token.  Returns a deeply frozen envelope
 * whose `run_token` is not enumerable (JSON.stringify and console.log skip it).
 * Throws EnvelopeError naming what is missing and where it was looked for.
 */
export declare function envelopeFromDispatch(body: unknown, headers?: HeadersInit): Envelope;
/** Run `fn` with `envelope` bound: proxyCall / postTrace inside it need no envelope argument. */
export declare function bindEnvelope<R>(envelope: Envelope, fn: () => R): R;
/** The envelope bound to this async context; EnvelopeError when none is. */
export declare function currentEnvelope(): Envelope;
/**
 * True when the request carries the expected credential, compared in constant
 * time.  With headerName "Authorization" the header must read `Bearer <expected>`
 * (scheme case-insensitive); a custom header (e.g. X-API-Key) carries the raw
 * value.  An empty `expected` never matches.
 */
export declare function checkCredential(headers: HeadersInit, expected: string, headerName?: string): boolean;
/** True only for a body that is exactly `{"ping": true}`: one key, the boolean true (§2 step 3). */
export declare function isPing(body: unknown): boolean;
/** `name` when it matches ^[A-Za-z_][A-Za-z0-9_-]{0,127}$ (§3.1); ProxyRequestError otherwise. */
export declare function validateToolName(name: unknown): string;
/**
 * The normalised actor label (§3.5), or null for an empty one: trimmed, at most
 * 8 `/`-separated segments of 1-64 characters from [A-Za-z0-9_.:-], at most 256
 * characters in all.  ProxyRequestError with errorClass "actor_id_invalid" otherwise.
 */
export declare function validateActorLabel(label: unknown): string | null;
/** What one proxy reply means (§3.2, §3.3). */
export type ReplyOutcome = {
    kind: "value";
    value: Json;
} | {
    kind: "retry";
    error: ProxyError;
    retryAfter: number | null;
} | {
    kind: "error";
    error: ProxyError;
};
/**
 * What one proxy reply means, with no I/O (§3.2, §3.3).
 *
 * 2xx: the unwrapped `response` (a legacy body without it whole, non-JSON text
 * as the string, never decoded twice).  429 and the transient 503 classes:
 * retry.  401 with a stale-token class: StaleRunTokenError.  Anything else:
 * ProxyError.  `runToken` is scrubbed from error bodies and messages.
 */
export declare function interpretReply(status: number, headers: HeadersInit | null, bytes: Uint8Array, { toolName, runToken }: {
    toolName: string;
    runToken?: string | null;
}): ReplyOutcome;
/**
 * A reply as the policy takes it (§7.4 kit-retry-after-cap): a retry whose Retry-After is longer than
 * `maxRetryAfterS` is not waited but fails at once, its message naming the wait the proxy asked for.
 */
export declare function settleReply(policy: RetryPolicy, outcome: ReplyOutcome): ReplyOutcome;
/** Seconds to wait before retry number `retry` (1 for the first): Retry-After, else backoff with jitter. */
export declare function retryDelay(policy: RetryPolicy, retry: number, retryAfter?: number | null): number;
/**
 * Client-side pacing (§3.1 rate limit): at most `limit` requests per run token in
 * any `windowS` seconds.  A sliding log per token; a caller over the limit is told
 * how long to wait for its reserved slot, so a burst is spread out instead of
 * collecting 429s.  At most `maxTokens` runs are remembered (the oldest forgotten).
 */
export declare class Pacer {
    readonly limit: number;
    readonly windowS: number;
    private readonly maxTokens;
    private readonly slots;
    constructor(limit: number, windowS?: number, maxTokens?: number);
    /** Reserve the next slot for `key`; the seconds to wait for it.  `now` is in seconds (performance.now() / 1000). */
    reserve(key: string, now?: number): number;
}
/** Options of ProxyClient. */
export interface ProxyClientOptions {
    /** Seconds per attempt; default PIPELINES_PROXY_TIMEOUT_S or 120. */
    timeout?: number;
    /** Client-side pacing per run token; default PIPELINES_PROXY_RATE_PER_MINUTE or 60; 0 turns it off. */
    ratePerMinute?: number;
    /** Overrides of RETRY_POLICY. */
    retry?: Partial<RetryPolicy>;
    /** How to wait `seconds` between attempts (tests pass a fake). */
    sleep?: (seconds: number) => Promise<void>;
}
/** Options of one tool call. */
export interface CallOptions {
    /** The sub-agent label sent as X-Pipelines-Actor-Id (§3.5). */
    actor?: string | null;
    /** Seconds per attempt, instead of the client's. */
    timeout?: number | null;
    /** The key of this logical call; a fresh UUID by default. */
    idempotencyKey?: string | null;
    /** "return": a failure becomes an `{"error": ...}` value for the model (a stale run token still throws). */
    errors?: "raise" | "return";
}
/** Options of one trace post. */
export interface TraceOptions {
    actor?: string | null;
    timeout?: number | null;
    /** Log a failure and resolve null instead of throwing. */
    bestEffort?: boolean;
}
/**
 * Calls the per-run proxy (§3): validation, keep-alive, pacing, retries.  One
 * instance serves any number of concurrent runs.
 */
export declare class ProxyClient {
    readonly timeout: number;
    readonly retry: RetryPolicy;
    private readonly pacer;
    private readonly sleep;
    private readonly agents;
    constructor({ timeout, ratePerMinute, retry, sleep }?: ProxyClientOptions);
    /**
     * POST `args` to `{proxy_url}/tools/{name}`; resolves the unwrapped `response`.
     * `errors: "return"` turns a failure into an `{"error": ...}` value for the
     * model instead of a rejection; a stale run token still rejects (the run is over).
     */
    call(envelope: Envelope, name: string, args: unknown, options?: CallOptions & {
        errors?: "raise";
    }): Promise<Json>;
    call(envelope: Envelope, name: string, args: unknown, options: CallOptions & {
        errors: "return";
    }): Promise<Json | ToolErrorValue>;
    /**
     * POST a live trace event to `{proxy_url}/traces/{eventType}` (§3.4).
     * Resolves the proxy's `{"accepted": true, "sequence": N}` (null for an empty
     * body).  `__occurred_at` is stamped once, before the first attempt.  With
     * `bestEffort` a failure is logged and null returned.
     */
    trace(envelope: Envelope, eventType: TraceEventType | string, payload?: unknown, { actor, timeout, bestEffort }?: TraceOptions): Promise<TraceReply | null>;
    /** Close idle keep-alive connections. */
    close(): void;
    /** One logical call: the retry loop of §3.3 around one exchange, one Idempotency-Key throughout. */
    private request;
}
/** The client behind proxyCall / postTrace, created on first use. */
export declare function defaultClient(): ProxyClient;
/** Where a call runs: an explicit envelope and client, or the bound envelope and the default client. */
export interface Target {
    envelope?: Envelope | null;
    client?: ProxyClient | null;
}
/**
 * Call tool `name` through the per-run proxy; resolves the unwrapped `response` (§3).
 * Uses `options.envelope` or the one bound to this context.
 */
export declare function proxyCall(name: string, args?: unknown, options?: CallOptions & Target & {
    errors?: "raise";
}): Promise<Json>;
export declare function proxyCall(name: string, args: unknown, options: CallOptions & Target & {
    errors: "return";
}): Promise<Json | ToolErrorValue>;
/** Post a live trace event for the bound run; see ProxyClient.trace. */
export declare function postTrace(eventType: TraceEventType | string, payload?: unknown, { envelope, client, ...options }?: TraceOptions & Target): Promise<TraceReply | null>;
/** Options of postHandoff. */
export interface HandoffOptions extends TraceOptions, Target {
    reason?: Json;
    payload_preview?: Json;
}
/**
 * Record a control transfer between sub-agents as a `handoff` event (§3.4).
 * Both labels are validated as §3.5; a self-handoff is dropped (resolves null, nothing sent).
 */
export declare function postHandoff(fromSubAgent: string, toSubAgent: string, { reason, payload_preview, ...options }?: HandoffOptions): Promise<TraceReply | null>;
/** `text` as valid Unicode: each lone surrogate (a model's text cut mid-emoji) replaced by U+FFFD. */
export declare function wellFormed(text: string): string;
/** Options of buildResponse. */
export interface BuildOptions {
    /** Override the transcript found in the value. */
    messages?: unknown;
    /** Override the metadata found in the value. */
    metadata?: unknown;
    /** Refuse what the platform would drop or soften; default PIPELINES_PORT_STRICT. */
    strict?: boolean | null;
    /** The dispatch is a turn of a multi-turn run (isMultiTurn): a turn reply is sent as built (§4.2). */
    multiTurn?: boolean;
}
/** A turn of a multi-turn run: the envelope carries `session_id` or `turn_id` (§2.2 multi-turn-fields). */
export declare function isMultiTurn(envelope: Envelope): boolean;
/** Options of buildTurnReply. */
export interface TurnReplyOptions {
    /** The turn's metadata (§4 metadata-keys). */
    metadata?: ResponseMetadata | null;
    /** The agent's hint that the conversation is finished; the platform decides (§4.2). */
    sessionDone?: boolean;
}
/**
 * A multi-turn per-turn reply `{message, session_done, metadata?}` (§4.2), checked as a strict server checks it:
 * a `message` that is not a string becomes its JSON text; a blank one, a `sessionDone` that is not a boolean or
 * metadata the platform cannot use throws ResponseError (§7.7 kit-turn-reply-checked).
 */
export declare function buildTurnReply(message: unknown, { metadata, sessionDone }?: TurnReplyOptions): TurnReply;
/**
 * The v1 response envelope (§4) from what an agent returned.  `messages` and `metadata` override those
 * found in `value`; nested OpenAI tool calls become the flat form.  A turn reply (§4.2) is sent as built when
 * `multiTurn` (see turnReplyBody); in a single-turn dispatch it becomes the envelope, `message` as
 * `final_response`, `session_done` dropped with a warning (§7.7 kit-turn-reply-detected, kit-turn-reply-single-turn).
 *
 * Lenient by default: the body the platform would grade goes out, what it would drop is dropped the
 * same way, and each change is logged once as a warning naming its JSON path; only a missing or empty
 * final response (or a circular or too deeply nested value) throws.  `strict: true` (or
 * PIPELINES_PORT_STRICT=1) throws ResponseError listing every problem instead, the soft ones too, except
 * the truncation warning.
 */
export declare function buildResponse(value: unknown, options?: BuildOptions & {
    multiTurn?: false;
}): ResponseEnvelope;
export declare function buildResponse(value: unknown, options: BuildOptions): ResponseEnvelope | TurnReply;
/**
 * Every problem of a response body against §4 and its JSON Schema, each starting with its JSON path.
 * Hard problems (no prefix): what the schema rejects, the contract's rules (a non-empty final_response,
 * tool_call_id pairing) and values JSON cannot carry.  Soft ones start with `warning:` (a truncated or
 * blank final response, mistyped first-class metadata, odd tool arguments).  Empty: accepted as sent.
 */
export declare function validateResponse(body: unknown): string[];
/** A reply decided by the dispatch core: status, header pairs, body bytes. */
export interface Reply {
    status: number;
    headers: Array<[string, string]>;
    body: Buffer;
}
/** The §3.7 reachability probe's result. */
export interface ProbeResult {
    reachable: boolean;
    status_code: number | null;
    latency_ms: number;
    error: string | null;
}
/**
 * §3.7 reachability probe.  POSTs `{}` to `{proxy_url}/tools/__reachability_probe__`
 * with a fake bearer: 401/403 (or 2xx) means reachable; a connection or DNS
 * error means egress is blocked.  Never rejects.
 */
export declare function probeProxy(proxyUrl: string, { timeout }?: {
    timeout?: number;
}): Promise<ProbeResult>;
/** Options of DispatchApp (and startServer). */
export interface DispatchOptions {
    /** The dispatch path; default /dispatch. */
    path?: string;
    /** The agent token itself; by default it is read from `tokenEnv` at each request. */
    token?: string | null;
    /** The environment variable holding the agent token; default AGENT_TOKEN. */
    tokenEnv?: string | null;
    /** "Authorization" (`Bearer <token>`) or a custom header carrying the raw value. */
    authHeader?: string;
    /** Turn auth off: an explicit choice, logged loudly. */
    noAuth?: boolean;
    /** Bodies over this many bytes get 413; default 8 MiB. */
    maxBody?: number;
    /** The run timeout in seconds, in (0, 1800]; default 300. */
    runTimeoutS?: number;
    /** Strict response building (see buildResponse); default PIPELINES_PORT_STRICT. */
    strict?: boolean | null;
}
/**
 * An agent function and its endpoint settings; `handle` decides every reply (§2).
 *
 * `agent(envelope)` may be sync or async and may return anything
 * buildResponse accepts.  Auth uses `token` or, by default, the environment
 * variable `tokenEnv` read at each request; it is off only with `noAuth: true`.
 */
export declare class DispatchApp {
    readonly agent: Agent;
    readonly path: string;
    readonly token: string | null;
    readonly tokenEnv: string | null;
    readonly authHeader: string;
    readonly noAuth: boolean;
    readonly maxBody: number;
    readonly runTimeoutS: number;
    readonly strict: boolean | null;
    private readonly routes;
    constructor(agent: Agent, { path, token, tokenEnv, authHeader, noAuth, maxBody, runTimeoutS, strict, }?: DispatchOptions);
    /** How auth is configured, for a start-up line (never the token). */
    describeAuth(): string;
    /** The agent token, or "" (read per request, so a rotated env var takes effect). */
    private expectedToken;
    /**
     * The reply decided before the body is read, or null to read it and call
     * `handle`: routing (404, 405), auth (503, 401), then the body's framing
     * (411 for a chunked or length-less body, 413 over maxBody).
     */
    precheck(method: string, target: string, headers: HeadersInit): Reply | null;
    /**
     * The reply to one request, in §2's order: auth, JSON, ping, connectivity,
     * envelope, agent, response envelope.  Every failure is one status with a
     * JSON `detail` naming it.  Writes one log line per request to the
     * dispatch path: ids, status, duration, proxy calls (never a token).
     */
    handle(method: string, target: string, headers: HeadersInit, body: Uint8Array): Promise<Reply>;
    private decide;
    /** §2 step 4: probe the proxy with a fake bearer; never runs user code. */
    private connectivityCheck;
    /** §2 steps 6-8: the agent with its envelope bound, within runTimeoutS; 500 on any failure. */
    private runAgent;
}
/** A Node request listener: what `http.createServer` and Express (`app.post(path, handler)`) take. */
export type NodeHandler = (req: IncomingMessage, res: ServerResponse) => Promise<void>;
/**
 * A DispatchApp (or an agent function plus DispatchApp options) as a Node
 * `(req, res)` listener, for a server or framework you run yourself.  It reads
 * the body itself: mount it before any body parser (express.json() would
 * leave it nothing to read: a 500 says so).  Keep-alive, timeouts and shutdown
 * are the host server's; startServer adds graceful draining.
 */
export declare function nodeHandler(agentOrApp: Agent | DispatchApp, options?: DispatchOptions): NodeHandler;
/** A Web-standard handler: what Hono, Next.js route handlers, Bun.serve, Deno.serve and Cloudflare Workers call. */
export type FetchHandler = (request: Request) => Promise<Response>;
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
export declare function fetchHandler(agentOrApp: Agent | DispatchApp, options?: DispatchOptions): FetchHandler;
/** A running dispatch server. */
export interface RunningServer {
    server: Server;
    /** The dispatch URL, `http://HOST:PORT/PATH`. */
    url: string;
    app: DispatchApp;
    /** Refuse new dispatches, let in-flight ones finish within graceS seconds; true when all did. */
    close(graceS?: number): Promise<boolean>;
}
/** Options of startServer: where to listen, plus DispatchApp's options when given an agent. */
export interface ServerOptions extends DispatchOptions {
    host?: string;
    /** 0 picks a free port. */
    port?: number;
    /** How long a client may take to send one request, in seconds. */
    readTimeoutS?: number;
}
/**
 * Serve a DispatchApp (or an agent function plus DispatchApp options) over
 * HTTP/1.1 with keep-alive.  Resolves once listening.
 */
export declare function startServer(agentOrApp: Agent | DispatchApp, { host, port, readTimeoutS, ...options }?: ServerOptions): Promise<RunningServer>;
