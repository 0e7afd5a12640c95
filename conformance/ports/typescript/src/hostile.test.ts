// No run lost (issue 24, kit-json-safe-response): whatever an agent returns, the server answers JSON over a real
// socket on 127.0.0.1, valid UTF-8 (a lone surrogate sent as U+FFFD, never as an escape), and a JSON 500 when
// building the reply fails anyway: never a dropped connection or a text page.

import { strict as assert } from "node:assert";
import http from "node:http";
import { test } from "node:test";

import { DispatchApp, startServer } from "./pipelines_port.js";
import type { AgentResult, Envelope } from "./pipelines_port.js";

const AGENT_TOKEN = "agent-token-hostile-ts";
const RUN_TOKEN = "run-token-hostile-ts";

const cyclic: Record<string, unknown> = { name: "loop" };
cyclic["self"] = cyclic;
const throwingGetter = Object.defineProperty({}, "boom", { enumerable: true, get: () => { throw new Error("getter"); } });
const throwingKeys = new Proxy({}, { ownKeys: () => { throw new Error("ownKeys"); } });

// [the agent's return value, the status the lenient server answers]
const HOSTILE: Record<string, [() => unknown, number]> = {
  "lone surrogate in final_response": [() => ({ final_response: "cut \ud83d" }), 200],
  "lone surrogates in metadata keys and values": [() => ({ final_response: "done", metadata: { "k\udc00": "v\ud800" } }), 200],
  "lone surrogate in a message": [() => ({ final_response: "done", messages: [{ role: "user", content: "x\ud83d" }] }), 200],
  "a plain string with a lone surrogate": [() => "ends \udbff", 200],
  "NaN and infinities": [() => ({ final_response: "done", metadata: { n: NaN, i: Infinity } }), 200],
  "bigint": [() => ({ final_response: "done", metadata: { big: 10n ** 5000n } }), 200],
  "Map, Set, Date, function, symbol": [() => ({ final_response: "done", metadata: {
    m: new Map([[1, 2]]), s: new Set([1]), d: new Date(0), f: () => 1, y: Symbol("y") } }), 200],
  "a cycle": [() => ({ final_response: "done", metadata: cyclic }), 500],
  "a toJSON that throws": [() => ({ final_response: "done", metadata: { t: { toJSON: () => { throw new Error("toJSON"); } } } }), 500],
  "a getter that throws": [() => ({ final_response: "done", metadata: throwingGetter }), 500],
  "a Proxy whose ownKeys throws": [() => ({ final_response: "done", metadata: throwingKeys }), 500],
};

function post(url: string, instruction: string): Promise<{ status: number; type: string; raw: Buffer }> {
  const body = Buffer.from(JSON.stringify({ odyssey_proxy_url: "http://127.0.0.1:9/api/odyssey-proxy/runs/r", run_id: 1,
    input: { user_instruction: instruction } }), "utf8");
  return new Promise((resolve, reject) => {
    const req = http.request(url, { method: "POST", headers: { authorization: `Bearer ${AGENT_TOKEN}`,
      "x-pipelines-run-token": RUN_TOKEN, "content-type": "application/json", "content-length": String(body.length) } },
    (res) => {
      const chunks: Buffer[] = [];
      res.on("data", (c: Buffer) => chunks.push(c));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, type: String(res.headers["content-type"]), raw: Buffer.concat(chunks) }));
    });
    req.on("error", reject);
    req.end(body);
  });
}

function assertJsonReply(reply: { status: number; type: string; raw: Buffer }, status: number, what: string): Record<string, unknown> {
  assert.equal(reply.type, "application/json", what);
  const text = new TextDecoder("utf-8", { fatal: true }).decode(reply.raw); // valid UTF-8, or this throws
  assert.ok(!/\\u[dD][89a-fA-F][0-9a-fA-F]{2}/.test(text), `${what}: an escaped surrogate in ${text.slice(0, 200)}`);
  assert.ok(!text.includes(RUN_TOKEN), what);
  const body = JSON.parse(text) as Record<string, unknown>;
  assert.equal(reply.status, status, `${what}: ${text.slice(0, 200)}`);
  if (status === 500) assert.ok(typeof body["detail"] === "string" && body["detail"] !== "", what);
  else assert.ok(typeof body["final_response"] === "string" && body["final_response"] !== "", what);
  return body;
}

test("every hostile value gets a JSON reply over a real socket", async () => {
  const running = await startServer((envelope: Envelope) => {
    const entry = HOSTILE[envelope.user_instruction];
    if (entry === undefined) throw new Error("no such case");
    return entry[0]() as AgentResult;
  }, { token: AGENT_TOKEN });
  try {
    for (const [name, [, status]] of Object.entries(HOSTILE)) {
      const body = assertJsonReply(await post(running.url, name), status, name);
      if (name === "lone surrogate in final_response") assert.equal(body["final_response"], "cut \ufffd");
    }
  } finally {
    await running.close(2);
  }
});

test("when building the reply fails anyway, the server still answers a JSON 500", async () => {
  const app = new DispatchApp(() => "fine", { token: AGENT_TOKEN });
  app.handle = () => { throw new TypeError("Do not know how to serialize a BigInt"); };
  const running = await startServer(app);
  try {
    const body = assertJsonReply(await post(running.url, "x"), 500, "a failing handle()");
    assert.match(String(body["detail"]), /TypeError/);
  } finally {
    await running.close(2);
  }
});
