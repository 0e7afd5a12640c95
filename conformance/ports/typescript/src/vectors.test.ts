// vectors.test.ts: the language-neutral JSON vectors of conformance/checker/vectors/, run against this port.
//
//   npm test            (node --test dist/, after npm run build)
//
// Pure cases call the port's functions directly; request, reply and trace
// cases go over a socket to a small recording proxy on 127.0.0.1 (the Python
// suite uses conformance/harness/mock_proxy.py the same way).  Code-mode cases
// (`from: run|env`) and build_response's `object` cases are Python-specific
// and skipped.  One test per vector file, one subtest per case.

import { readFileSync } from "node:fs";
import http from "node:http";
import type { IncomingHttpHeaders } from "node:http";
import { after, before, test } from "node:test";
import { isDeepStrictEqual } from "node:util";

import {
  EnvelopeError, ProxyClient, ProxyError, ProxyRequestError, ProxyTransportError, ResponseError, StaleRunTokenError,
  buildResponse, buildTurnReply, checkCredential, envelopeFromDispatch, interpretReply, isPing, postHandoff, RETRY_POLICY, settleReply,
  validateActorLabel, validateResponse, validateToolName,
} from "./pipelines_port.js";
import type { Envelope, HeadersInit, Json, JsonObject } from "./pipelines_port.js";

const VECTORS = new URL("../../../checker/vectors/", import.meta.url);

/** One vector case: a JSON object whose fields each suite reads by name. */
type Case = Record<string, Json> & { name: string; expect: Expect };
type Expect = Record<string, Json> & {
  error?: keyof typeof ERROR_KINDS;
  mentions?: string[];
  never_mentions?: string[];
};
type Doc = Record<string, Json> & { cases: Case[] };

/** A vector file with every {"$repeat": s, "count": n} expanded. */
function load(name: string): Doc {
  const expand = (v: Json): Json => {
    if (Array.isArray(v)) return v.map(expand);
    if (v === null || typeof v !== "object") return v;
    const keys = Object.keys(v);
    const repeat = v["$repeat"];
    const count = v["count"];
    if (keys.length === 2 && typeof repeat === "string" && typeof count === "number") return repeat.repeat(count);
    return Object.fromEntries(keys.map((k) => [k, expand(v[k] ?? null)]));
  };
  return expand(JSON.parse(readFileSync(new URL(`${name}.json`, VECTORS), "utf8")) as Json) as Doc;
}

class Failure extends Error {}

function check(condition: boolean, message: string): void {
  if (!condition) throw new Failure(message);
}

const same = (got: unknown, wanted: unknown): boolean => isDeepStrictEqual(got, wanted);
const show = (v: unknown): string => (JSON.stringify(v) ?? String(v)).slice(0, 200);
const str = (v: Json | undefined): string => (typeof v === "string" ? v : "");

const ERROR_KINDS = {
  envelope: EnvelopeError,
  proxy: ProxyError,
  proxy_request: ProxyRequestError,
  stale_run_token: StaleRunTokenError,
  response: ResponseError,
} as const;

function checkError(err: unknown, expect: Expect): void {
  if (err instanceof Failure) throw err;
  const kind = ERROR_KINDS[expect.error ?? "proxy"];
  check(err instanceof kind, `expected ${kind.name}, got ${show(err instanceof Error ? `${err.name}: ${err.message}` : err)}`);
  const error = err as Error;
  if (expect.error === "proxy") {
    check(!(err instanceof StaleRunTokenError || err instanceof ProxyRequestError || err instanceof ProxyTransportError),
      `expected a plain ProxyError, got ${error.name}`);
  }
  if (err instanceof ProxyError) {
    if ("status_code" in expect) check(err.statusCode === expect["status_code"], `status_code ${err.statusCode} != ${show(expect["status_code"])}`);
    if ("error_class" in expect) check(err.errorClass === expect["error_class"], `error_class ${err.errorClass} != ${show(expect["error_class"])}`);
  }
  for (const text of expect.mentions ?? []) check(error.message.includes(text), `${show(text)} not in ${show(error.message)}`);
  for (const text of expect.never_mentions ?? []) {
    const body = err instanceof ProxyError ? JSON.stringify(err.body) ?? "" : "";
    check(!error.message.includes(text) && !body.includes(text), `${show(text)} leaked`);
  }
}

/** Run `fn`; when `expect.error` is set it must throw that error, else it must not throw. */
async function expectOutcome<T>(expect: Expect, fn: () => T | Promise<T>): Promise<{ threw: true } | { threw: false; value: T }> {
  let value: T;
  try {
    value = await fn();
  } catch (err) {
    if (!expect.error) throw err;
    checkError(err, expect);
    return { threw: true };
  }
  check(!expect.error, `expected a ${expect.error} error, got ${show(value)}`);
  return { threw: false, value };
}

// -- a recording proxy on 127.0.0.1 ------------------------------------------------

const BASE_PATH = "/api/odyssey-proxy/runs/r1";

interface Recorded {
  path: string;
  headers: IncomingHttpHeaders;
  json: JsonObject;
}

interface ScriptedReply {
  status?: number;
  headers?: Record<string, string>;
  json?: Json;
  body?: string;
}

/** Replies from `script` in order (the last one repeats); every request recorded. */
class RecordingProxy {
  requests: Recorded[] = [];
  script: ScriptedReply[] = [];
  url = "";
  private readonly server = http.createServer({}, (req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      const text = Buffer.concat(chunks).toString("utf8");
      this.requests.push({ path: req.url ?? "", headers: req.headers, json: (text ? JSON.parse(text) : {}) as JsonObject });
      const fallback: ScriptedReply = { json: { response: null } };
      const spec = (this.script.length > 1 ? this.script.shift() : this.script[0]) ?? fallback;
      const body = Buffer.from(spec.json !== undefined ? JSON.stringify(spec.json) : spec.body ?? "", "utf8");
      res.writeHead(spec.status ?? 200, { "Content-Type": "application/json", ...spec.headers, "Content-Length": String(body.length) });
      res.end(body);
    });
  });

  async start(): Promise<void> {
    await new Promise<void>((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    const address = this.server.address();
    if (address === null || typeof address === "string") throw new Error("no address");
    this.url = `http://127.0.0.1:${address.port}${BASE_PATH}`;
  }

  async close(): Promise<void> {
    await new Promise<void>((resolve) => {
      this.server.close(() => resolve());
      this.server.closeAllConnections?.();
    });
  }
}

/** The run token in exactly one of `Authorization: Bearer <t>` (scheme in any case) and `X-Pipelines-Run-Token: <t>`. */
function runTokenSent(headers: IncomingHttpHeaders, token: string): boolean {
  const auth = headers["authorization"];
  const tokenHeader = headers["x-pipelines-run-token"];
  if ((auth === undefined) === (tokenHeader === undefined)) return false;
  if (tokenHeader !== undefined) return tokenHeader === token;
  const [scheme = "", ...rest] = String(auth).split(" ");
  return scheme.toLowerCase() === "bearer" && rest.join(" ").trim() === token;
}

function checkRequest(recorded: Recorded, expect: Expect, token: string): void {
  if ("path_suffix" in expect) check(recorded.path === BASE_PATH + str(expect["path_suffix"]), `path ${recorded.path}`);
  if ("body_json" in expect) check(same(recorded.json, expect["body_json"]), `body ${show(recorded.json)}`);
  for (const [name, value] of Object.entries((expect["headers"] ?? {}) as JsonObject)) {
    const wanted = str(value).replace("{run_token}", token);
    check(recorded.headers[name.toLowerCase()] === wanted, `header ${name}: ${show(recorded.headers[name.toLowerCase()])}`);
  }
  for (const name of (expect["headers_absent"] ?? []) as string[]) check(!(name.toLowerCase() in recorded.headers), `header ${name} sent`);
  if (expect["run_token_sent"]) check(runTokenSent(recorded.headers, token), "the run token not in exactly one token header");
  // §3.1's Idempotency-Key is per tool call; a trace event need not carry one.
  if (recorded.path.startsWith(`${BASE_PATH}/tools/`)) {
    check(/^[0-9a-f-]{36}$/.test(String(recorded.headers["idempotency-key"] ?? "")), "no Idempotency-Key");
  }
}

// -- the suites ----------------------------------------------------------------------

interface World {
  proxy: RecordingProxy;
  client: ProxyClient;
  waits: number[];
}

type Suite = (c: Case, doc: Doc, world: World) => Promise<"skip" | void>;

const envelopeFor = (proxy: RecordingProxy, token: string): Envelope =>
  envelopeFromDispatch({ odyssey_proxy_url: proxy.url }, { "X-Pipelines-Run-Token": token });

const suites: Record<string, Suite> = {
  async envelope(c) {
    if (c["from"] !== "dispatch") return "skip"; // code mode (§5) is Python-specific
    const body = "body_text" in c ? c["body_text"] : c["body"];
    const outcome = await expectOutcome(c.expect, () => envelopeFromDispatch(body, (c["headers"] ?? {}) as HeadersInit));
    if (outcome.threw) return undefined;
    for (const [path, wanted] of Object.entries((c.expect["fields"] ?? {}) as JsonObject)) {
      const got = path.split(".").reduce<unknown>((v, part) => (v as Record<string, unknown> | null | undefined)?.[part], outcome.value);
      check(same(got, wanted), `${path}: ${show(got)} != ${show(wanted)}`);
    }
    return undefined;
  },

  async inbound(c) {
    if (c["kind"] === "ping") check(isPing(c["body"]) === c.expect["is_ping"], "is_ping");
    else {
      const ok = checkCredential((c["headers"] ?? {}) as HeadersInit, str(c["expected"]), str(c["header_name"]) || undefined);
      check(ok === c.expect["ok"], "auth");
    }
  },

  async tool_names(c) {
    await expectOutcome(c["valid"] ? {} : { error: "proxy_request" }, () => validateToolName(c["tool_name"]));
  },

  async actor_labels(c) {
    const outcome = await expectOutcome(c.expect, () => validateActorLabel(c["label"]));
    if (!outcome.threw) check(outcome.value === c.expect["label"], `label ${show(outcome.value)}`);
  },

  async proxy_replies(c, doc, { proxy, client, waits }) {
    const bytes = Buffer.from("body_json" in c ? JSON.stringify(c["body_json"]) : str(c["body_text"]), "utf8");
    const status = c["status"] as number;
    const headers = (c["headers"] ?? {}) as Record<string, string>;
    const runToken = str(doc["run_token"]);
    const toolName = str(doc["tool_name"]);
    const pure = settleReply(RETRY_POLICY, interpretReply(status, headers, bytes, { toolName, runToken }));
    const { expect } = c;
    const retryAfter = expect["retry_after_s"];
    if ("value" in expect) check(pure.kind === "value" && same(pure.value, expect["value"]), `value ${show(pure)}`);
    else if (expect["retry"]) {
      check(pure.kind === "retry", `kind ${pure.kind}`);
      const got = pure.kind === "retry" ? pure.retryAfter : null;
      if (retryAfter === null) check(got === null, `retryAfter ${got}`);
      else check(got !== null && Math.abs(got - (retryAfter as number)) < 0.01, `retryAfter ${got}`);
    } else {
      check(pure.kind === "error", `kind ${pure.kind}`);
      if (pure.kind === "error") checkError(pure.error, expect);
    }
    // The same over a socket: the case's reply, then a success.
    const spec: ScriptedReply = { status, headers, ...("body_json" in c ? { json: c["body_json"] } : { body: str(c["body_text"]) }) };
    proxy.script = [spec, { json: { response: "after-retry" } }];
    const envelope = envelopeFor(proxy, runToken);
    const succeeds = Boolean(expect["retry"]) || "value" in expect;
    const outcome = await expectOutcome(succeeds ? {} : expect, () => client.call(envelope, toolName, {}));
    const value = outcome.threw ? undefined : outcome.value;
    if (expect["retry"]) {
      check(value === "after-retry" && proxy.requests.length === 2, `${proxy.requests.length} requests, got ${show(value)}`);
      check(proxy.requests[0]?.headers["idempotency-key"] === proxy.requests[1]?.headers["idempotency-key"], "new key on retry");
      if (retryAfter !== null) check(Math.abs((waits[0] ?? -1) - (retryAfter as number)) < 0.01, `waited ${show(waits)}`);
    } else {
      check(proxy.requests.length === 1, `${proxy.requests.length} requests: terminal errors must not be retried`);
      if ("value" in expect) check(same(value, expect["value"]), `value ${show(value)}`);
    }
  },

  async proxy_requests(c, doc, { proxy, client }) {
    const token = str(doc["run_token"]);
    const envelope = envelopeFor(proxy, token);
    const actor = c["actor"] as string | null | undefined;
    const outcome = await expectOutcome(c.expect, () => client.call(envelope, c["tool_name"] as string, c["args"], { actor }));
    check(proxy.requests.length === (outcome.threw ? 0 : 1), `${proxy.requests.length} requests sent`);
    const [recorded] = proxy.requests;
    if (!outcome.threw && recorded) checkRequest(recorded, c.expect, token);
  },

  async trace_events(c, doc, { proxy, client }) {
    const token = str(doc["run_token"]);
    const envelope = envelopeFor(proxy, token);
    proxy.script = [{ json: { accepted: true, sequence: 1 } }];
    const post = (): Promise<unknown> => (c["kind"] === "trace" ? client.trace(envelope, str(c["event_type"]), c["payload"])
      : postHandoff(c["from"] as string, c["to"] as string,
        { reason: c["reason"] ?? null, payload_preview: c["payload_preview"] ?? null, envelope, client }));
    const outcome = await expectOutcome(c.expect, post);
    if (outcome.threw || c.expect["dropped"]) {
      check(proxy.requests.length === 0 && (outcome.threw || outcome.value === null), "something was sent");
      return;
    }
    check(same(outcome.value, { accepted: true, sequence: 1 }), `reply ${show(outcome.value)}`);
    check(proxy.requests.length === 1, `${proxy.requests.length} requests sent`);
    const [recorded] = proxy.requests;
    if (!recorded) return;
    checkRequest(recorded, c.expect, token);
    for (const [key, wanted] of Object.entries((c.expect["body_has"] ?? {}) as JsonObject)) check(same(recorded.json[key], wanted), `body ${key}`);
    if (c.expect["stamped"]) check(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)$/.test(str(recorded.json["__occurred_at"])), "stamp");
  },

  async build_response(c) {
    const input = c["input"] as JsonObject;
    if ("object" in input) return "skip"; // result objects with attributes are Python-specific
    const options = { messages: input["messages"] ?? null, metadata: input["metadata"] ?? null, strict: Boolean(input["strict"] ?? false) };
    const outcome = await expectOutcome(c.expect, () => buildResponse(input["value"], options));
    const hard = (body: unknown): string[] => validateResponse(body).filter((p) => !p.startsWith("warning:"));
    if (!outcome.threw) check(same(outcome.value, c.expect["body"]) && hard(outcome.value).length === 0, `body ${show(outcome.value)}`);
    return undefined;
  },

  async turn_reply(c) {
    const input = c["input"] as JsonObject;
    const options = { strict: Boolean(input["strict"] ?? false), multiTurn: Boolean(input["multi_turn"]) };
    const outcome = await expectOutcome(c.expect, () => buildResponse(input["value"], options));
    if (!outcome.threw) check(same(outcome.value, c.expect["body"]), `body ${show(outcome.value)}`);
    const value = input["value"];
    // buildTurnReply builds what a strict server sends for a turn reply of the file, and refuses what it refuses
    // (but a message that is not a string, which the builder takes as its JSON text).
    if (options.multiTurn && options.strict && value !== null && typeof value === "object" && !Array.isArray(value)
        && "message" in value && "session_done" in value && !("final_response" in value)) {
      const { message, metadata, session_done: sessionDone, ...rest } = value;
      if (Object.keys(rest).length === 0 && typeof message === "string") {
        const built = await expectOutcome(c.expect, () => buildTurnReply(message, { metadata: metadata as JsonObject | null | undefined ?? null, sessionDone: sessionDone as boolean }));
        if (!built.threw) check(same(built.value, c.expect["body"]), `buildTurnReply ${show(built.value)}`);
      }
    }
    return undefined;
  },

  async validate_response(c) {
    const problems = validateResponse(c["body"]);
    const pathOf = (p: string): string => p.replace(/^warning: /, "").split(": ")[0] ?? "";
    const errors = new Set(problems.filter((p) => !p.startsWith("warning:")).map(pathOf));
    const warnings = new Set(problems.filter((p) => p.startsWith("warning:")).map(pathOf));
    check(same(errors, new Set(c.expect["error_paths"] as string[])) && same(warnings, new Set(c.expect["warning_paths"] as string[])), show(problems));
  },
};

// -- the runner ----------------------------------------------------------------------

const world: World = {
  proxy: new RecordingProxy(),
  waits: [], // what the client asked to sleep, instead of sleeping
  // Pacing off: these cases are about the retry policy, whose waits are recorded here.
  client: new ProxyClient({ timeout: 10, ratePerMinute: 0, sleep: async (seconds) => void world.waits.push(seconds) }),
};
const stderrWrite = process.stderr.write;

before(async () => {
  await world.proxy.start();
  // The port's retry warnings would drown the report; VERBOSE=1 keeps them.
  if (!process.env["VERBOSE"]) process.stderr.write = () => true;
});

after(async () => {
  process.stderr.write = stderrWrite;
  world.client.close();
  await world.proxy.close();
});

for (const [name, run] of Object.entries(suites)) {
  test(`vectors/${name}.json`, async (t) => {
    const doc = load(name);
    check(doc.cases.length > 0, `${name}.json has no cases`);
    for (const c of doc.cases) {
      await t.test(c.name, async (sub) => {
        world.proxy.requests = [];
        world.proxy.script = [];
        world.waits.length = 0;
        if ((await run(c, doc, world)) === "skip") sub.skip("Python-specific");
      });
    }
  });
}
