#!/usr/bin/env node
// vectors.mjs: run the language-neutral JSON vectors of conformance/vectors/ against this port.
//
//   node conformance/ports/node/vectors.mjs [--verbose]
//
// Pure cases call the port's functions directly; request, reply and trace
// cases go over a socket to a small recording proxy on 127.0.0.1 (the Python
// suite uses conformance/mock_proxy.py the same way).  Code-mode cases
// (`from: run|env`) and build_response's `object` cases are Python-specific
// and skipped.  Exit status 0 when every case passes.

import { readFileSync } from "node:fs";
import http from "node:http";
import { isDeepStrictEqual } from "node:util";

import {
  EnvelopeError, ProxyClient, ProxyError, ProxyRequestError, ProxyTransportError, ResponseError, StaleRunTokenError,
  buildResponse, checkCredential, envelopeFromDispatch, interpretReply, isPing, postHandoff,
  validateActorLabel, validateResponse, validateToolName,
} from "./pipelines_port.mjs";

const VECTORS = new URL("../../vectors/", import.meta.url);
const verbose = process.argv.includes("--verbose");

/** A vector file with every {"$repeat": s, "count": n} expanded. */
function load(name) {
  const expand = (v) => {
    if (Array.isArray(v)) return v.map(expand);
    if (v === null || typeof v !== "object") return v;
    const keys = Object.keys(v);
    if (keys.length === 2 && "$repeat" in v && "count" in v) return v.$repeat.repeat(v.count);
    return Object.fromEntries(keys.map((k) => [k, expand(v[k])]));
  };
  return expand(JSON.parse(readFileSync(new URL(`${name}.json`, VECTORS), "utf8")));
}

class Failure extends Error {}

function check(condition, message) {
  if (!condition) throw new Failure(message);
}

const same = (got, wanted) => isDeepStrictEqual(got, wanted);
const show = (v) => JSON.stringify(v)?.slice(0, 200);

const ERROR_KINDS = {
  envelope: EnvelopeError,
  proxy: ProxyError,
  proxy_request: ProxyRequestError,
  stale_run_token: StaleRunTokenError,
  response: ResponseError,
};

function checkError(err, expect) {
  if (err instanceof Failure) throw err;
  const kind = ERROR_KINDS[expect.error];
  check(err instanceof kind, `expected ${kind.name}, got ${err?.name}: ${err?.message}`);
  if (expect.error === "proxy") {
    check(!(err instanceof StaleRunTokenError || err instanceof ProxyRequestError || err instanceof ProxyTransportError),
      `expected a plain ProxyError, got ${err.name}`);
  }
  if ("status_code" in expect) check(err.statusCode === expect.status_code, `status_code ${err.statusCode} != ${expect.status_code}`);
  if ("error_class" in expect) check(err.errorClass === expect.error_class, `error_class ${err.errorClass} != ${expect.error_class}`);
  for (const text of expect.mentions ?? []) check(err.message.includes(text), `${show(text)} not in ${show(err.message)}`);
  for (const text of expect.never_mentions ?? []) {
    check(!err.message.includes(text) && !(JSON.stringify(err.body ?? null) ?? "").includes(text), `${show(text)} leaked`);
  }
}

/** Run `fn`; when `expect.error` is set it must throw that error, else it must not throw. */
async function expectOutcome(expect, fn) {
  let value;
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

/** Replies from `script` in order (the last one repeats); every request recorded. */
async function startProxy() {
  const proxy = { requests: [], script: [] };
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on("data", (c) => chunks.push(c));
    req.on("end", () => {
      const text = Buffer.concat(chunks).toString("utf8");
      proxy.requests.push({ path: req.url, headers: req.headers, json: text ? JSON.parse(text) : null });
      const spec = proxy.script.length > 1 ? proxy.script.shift() : proxy.script[0] ?? { json: { response: null } };
      const body = Buffer.from("json" in spec ? JSON.stringify(spec.json) : spec.body ?? "", "utf8");
      res.writeHead(spec.status ?? 200, { "Content-Type": "application/json", ...spec.headers, "Content-Length": body.length });
      res.end(body);
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  proxy.url = `http://127.0.0.1:${server.address().port}${BASE_PATH}`;
  proxy.close = () => new Promise((resolve) => {
    server.close(resolve);
    server.closeAllConnections?.();
  });
  return proxy;
}

/** The run token in exactly one of `Authorization: Bearer <t>` (scheme in any case) and `X-Pipelines-Run-Token: <t>`. */
function runTokenSent(headers, token) {
  const auth = headers.authorization;
  const header = headers["x-pipelines-run-token"];
  if ((auth === undefined) === (header === undefined)) return false;
  if (header !== undefined) return header === token;
  const [scheme, ...rest] = auth.split(" ");
  return scheme.toLowerCase() === "bearer" && rest.join(" ").trim() === token;
}

function checkRequest(recorded, expect, token) {
  if ("path_suffix" in expect) check(recorded.path === BASE_PATH + expect.path_suffix, `path ${recorded.path}`);
  if ("body_json" in expect) check(same(recorded.json, expect.body_json), `body ${show(recorded.json)}`);
  for (const [name, value] of Object.entries(expect.headers ?? {})) {
    const wanted = value.replace("{run_token}", token);
    check(recorded.headers[name.toLowerCase()] === wanted, `header ${name}: ${show(recorded.headers[name.toLowerCase()])}`);
  }
  for (const name of expect.headers_absent ?? []) check(!(name.toLowerCase() in recorded.headers), `header ${name} sent`);
  if (expect.run_token_sent) check(runTokenSent(recorded.headers, token), "the run token not in exactly one token header");
  // §3.1's Idempotency-Key is per tool call; a trace event need not carry one.
  if (recorded.path.startsWith(`${BASE_PATH}/tools/`)) {
    check(/^[0-9a-f-]{36}$/.test(recorded.headers["idempotency-key"] ?? ""), "no Idempotency-Key");
  }
}

// -- the suites ----------------------------------------------------------------------

const suites = {
  async envelope(c) {
    if (c.from !== "dispatch") return "skip"; // code mode (§5) is Python-specific
    const body = "body_text" in c ? c.body_text : c.body;
    const { threw, value: envelope } = await expectOutcome(c.expect, () => envelopeFromDispatch(body, c.headers ?? {}));
    if (threw) return;
    for (const [path, wanted] of Object.entries(c.expect.fields)) {
      const got = path.split(".").reduce((v, part) => v?.[part], envelope);
      check(same(got, wanted), `${path}: ${show(got)} != ${show(wanted)}`);
    }
  },

  async inbound(c) {
    if (c.kind === "ping") check(isPing(c.body) === c.expect.is_ping, "is_ping");
    else check(checkCredential(c.headers, c.expected, c.header_name) === c.expect.ok, "auth");
  },

  async tool_names(c) {
    await expectOutcome(c.valid ? {} : { error: "proxy_request" }, () => validateToolName(c.tool_name));
  },

  async actor_labels(c) {
    const { threw, value } = await expectOutcome(c.expect, () => validateActorLabel(c.label));
    if (!threw) check(value === c.expect.label, `label ${show(value)}`);
  },

  async proxy_replies(c, doc, { proxy, client, waits }) {
    const bytes = Buffer.from("body_json" in c ? JSON.stringify(c.body_json) : c.body_text ?? "", "utf8");
    const pure = interpretReply(c.status, c.headers, bytes, { toolName: doc.tool_name, runToken: doc.run_token });
    const { expect } = c;
    if ("value" in expect) check(pure.kind === "value" && same(pure.value, expect.value), `value ${show(pure.value)}`);
    else if (expect.retry) {
      check(pure.kind === "retry", `kind ${pure.kind}`);
      if (expect.retry_after_s === null) check(pure.retryAfter === null, `retryAfter ${pure.retryAfter}`);
      else check(Math.abs(pure.retryAfter - expect.retry_after_s) < 0.01, `retryAfter ${pure.retryAfter}`);
    } else {
      check(pure.kind === "error", `kind ${pure.kind}`);
      checkError(pure.error, expect);
    }
    // The same over a socket: the case's reply, then a success.
    const spec = { status: c.status, headers: c.headers, ...("body_json" in c ? { json: c.body_json } : { body: c.body_text ?? "" }) };
    proxy.script = [spec, { json: { response: "after-retry" } }];
    const envelope = envelopeFromDispatch({ odyssey_proxy_url: proxy.url }, { "X-Pipelines-Run-Token": doc.run_token });
    const { value } = await expectOutcome(expect.retry || "value" in expect ? {} : expect, () => client.call(envelope, doc.tool_name, {}));
    if (expect.retry) {
      check(value === "after-retry" && proxy.requests.length === 2, `${proxy.requests.length} requests, got ${show(value)}`);
      check(proxy.requests[0].headers["idempotency-key"] === proxy.requests[1].headers["idempotency-key"], "new key on retry");
      if (expect.retry_after_s !== null) check(Math.abs(waits[0] - expect.retry_after_s) < 0.01, `waited ${waits}`);
    } else {
      check(proxy.requests.length === 1, `${proxy.requests.length} requests: terminal errors must not be retried`);
      if ("value" in expect) check(same(value, expect.value), `value ${show(value)}`);
    }
  },

  async proxy_requests(c, doc, { proxy, client }) {
    const envelope = envelopeFromDispatch({ odyssey_proxy_url: proxy.url }, { "X-Pipelines-Run-Token": doc.run_token });
    const { threw } = await expectOutcome(c.expect, () => client.call(envelope, c.tool_name, c.args, { actor: c.actor }));
    check(proxy.requests.length === (threw ? 0 : 1), `${proxy.requests.length} requests sent`);
    if (!threw) checkRequest(proxy.requests[0], c.expect, doc.run_token);
  },

  async trace_events(c, doc, { proxy, client }) {
    const envelope = envelopeFromDispatch({ odyssey_proxy_url: proxy.url }, { "X-Pipelines-Run-Token": doc.run_token });
    proxy.script = [{ json: { accepted: true, sequence: 1 } }];
    const post = () => (c.kind === "trace" ? client.trace(envelope, c.event_type, c.payload)
      : postHandoff(c.from, c.to, { reason: c.reason ?? null, payload_preview: c.payload_preview ?? null, envelope, client }));
    const { threw, value } = await expectOutcome(c.expect, post);
    if (threw || c.expect.dropped) {
      check(proxy.requests.length === 0 && (threw || value === null), "something was sent");
      return;
    }
    check(same(value, { accepted: true, sequence: 1 }), `reply ${show(value)}`);
    check(proxy.requests.length === 1, `${proxy.requests.length} requests sent`);
    const [recorded] = proxy.requests;
    checkRequest(recorded, c.expect, doc.run_token);
    for (const [key, wanted] of Object.entries(c.expect.body_has ?? {})) check(same(recorded.json[key], wanted), `body ${key}`);
    if (c.expect.stamped) check(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)$/.test(recorded.json.__occurred_at), "stamp");
  },

  async build_response(c) {
    if ("object" in c.input) return "skip"; // result objects with attributes are Python-specific
    const options = { messages: c.input.messages ?? null, metadata: c.input.metadata ?? null, strict: c.input.strict ?? false };
    const { threw, value } = await expectOutcome(c.expect, () => buildResponse(c.input.value, options));
    const hard = (body) => validateResponse(body).filter((p) => !p.startsWith("warning:"));
    if (!threw) check(same(value, c.expect.body) && hard(value).length === 0, `body ${show(value)}`);
  },

  async validate_response(c) {
    const problems = validateResponse(c.body);
    const pathOf = (p) => p.replace(/^warning: /, "").split(": ")[0];
    const errors = new Set(problems.filter((p) => !p.startsWith("warning:")).map(pathOf));
    const warnings = new Set(problems.filter((p) => p.startsWith("warning:")).map(pathOf));
    check(same(errors, new Set(c.expect.error_paths)) && same(warnings, new Set(c.expect.warning_paths)), show(problems));
  },
};

async function main() {
  const counts = { passed: 0, failed: 0, skipped: 0 };
  const proxy = await startProxy();
  const waits = []; // what the client asked to sleep, instead of sleeping
  const client = new ProxyClient({ timeout: 10, sleep: async (seconds) => waits.push(seconds) });
  const quiet = process.stderr.write.bind(process.stderr);
  process.stderr.write = verbose ? quiet : () => true; // the port's retry warnings would drown the report
  try {
    for (const [name, run] of Object.entries(suites)) {
      const doc = load(name);
      for (const c of doc.cases) {
        proxy.requests = [];
        proxy.script = [];
        waits.length = 0;
        let outcome;
        try {
          outcome = (await run(c, doc, { proxy, client, waits })) === "skip" ? "skipped" : "passed";
        } catch (err) {
          outcome = "failed";
          quiet(`FAIL ${name}: ${c.name}: ${err instanceof Failure ? err.message : err?.stack ?? err}\n`);
        }
        counts[outcome] += 1;
        if (verbose && outcome !== "failed") quiet(`${outcome === "passed" ? "ok  " : "skip"} ${name}: ${c.name}\n`);
      }
    }
  } finally {
    process.stderr.write = quiet;
    client.close();
    await proxy.close();
  }
  process.stdout.write(`${counts.passed} passed, ${counts.failed} failed, ${counts.skipped} skipped\n`);
  return counts.failed ? 1 : 0;
}

process.exit(await main());
