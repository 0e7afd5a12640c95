// turn_reply.test.ts: multi-turn runs (§4.2): a turn reply leaves every server of this port as the agent built it,
// over 127.0.0.1: startServer, nodeHandler under node:http, fetchHandler behind a node:http bridge; then 120
// concurrent multi-turn dispatches, each with its own run token and session.
//
//   npm test            (node --test dist/, after npm run build)
import { strict as assert } from "node:assert";
import http from "node:http";
import { test } from "node:test";
import { buildTurnReply, fetchHandler, nodeHandler, proxyCall, startServer } from "./pipelines_port.js";
const AGENT_TOKEN = "agent-token-turns-ts";
const REPLY = { message: "Which order do you mean?", session_done: true, metadata: { model: "m-1", total_input_tokens: 12 } };
/** A proxy on 127.0.0.1 answering every tool call `{"response": {"bearer", "args"}}`; `seen` holds each [bearer, args]. */
async function proxy() {
    const seen = [];
    const server = http.createServer((req, res) => {
        const chunks = [];
        req.on("data", (chunk) => chunks.push(chunk));
        req.on("end", () => {
            const bearer = String(req.headers["authorization"] ?? "").replace(/^Bearer /, "");
            const args = JSON.parse(Buffer.concat(chunks).toString("utf8"));
            seen.push([bearer, args]);
            setTimeout(() => {
                res.writeHead(200, { "Content-Type": "application/json" });
                res.end(JSON.stringify({ response: { bearer, args } }));
            }, 50);
        });
    });
    return { ...(await listen(server, "/api/odyssey-proxy/runs/r1")), seen };
}
async function listen(server, path = "") {
    await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
    const address = server.address();
    if (address === null || typeof address === "string")
        throw new Error("no address");
    return {
        url: `http://127.0.0.1:${address.port}${path}`,
        close: () => new Promise((resolve) => {
            server.close(() => resolve());
            server.closeAllConnections?.();
        }),
    };
}
/** What the test agent returns for an instruction: "reply", "string", or the JSON value it holds. */
async function agent(envelope) {
    await proxyCall("get_order", { order_id: "4521", session: envelope.session_id });
    if (envelope.user_instruction === "reply")
        return buildTurnReply(REPLY.message, { metadata: REPLY.metadata, sessionDone: true });
    if (envelope.user_instruction === "string")
        return "Which order?";
    return JSON.parse(envelope.user_instruction);
}
/** Each server of the port, serving `agent` with `options` on 127.0.0.1: its dispatch URL and a closer. */
const SERVERS = {
    async startServer(served, options) {
        const running = await startServer(served, { ...options, host: "127.0.0.1", port: 0 });
        return { url: running.url, close: () => running.close(2) };
    },
    async nodeHandler(served, options) {
        const handler = nodeHandler(served, options);
        const { url, close } = await listen(http.createServer((req, res) => void handler(req, res)));
        return { url: `${url}/dispatch`, close };
    },
    async fetchHandler(served, options) {
        const handler = fetchHandler(served, options);
        const { url, close } = await listen(http.createServer((req, res) => {
            const chunks = [];
            req.on("data", (chunk) => chunks.push(chunk));
            req.on("end", async () => {
                const headers = Object.entries(req.headers).flatMap(([k, v]) => (typeof v === "string" ? [[k, v]] : []));
                const response = await handler(new Request(`http://127.0.0.1${req.url ?? "/"}`, { method: req.method ?? "POST", headers, body: Buffer.concat(chunks) }));
                res.writeHead(response.status, Object.fromEntries(response.headers));
                res.end(Buffer.from(await response.arrayBuffer()));
            });
        }));
        return { url: `${url}/dispatch`, close };
    },
};
function dispatch(url, proxyUrl, instruction, { runToken = "run-token-turns-1", multiTurn = true, session = "sess-1" } = {}) {
    const input = { user_instruction: instruction, input: {} };
    if (multiTurn)
        Object.assign(input, { latest_user_prompt: "Cancel my order", session_id: session, turn_id: `${session}-t0`, messages: [] });
    return fetch(url, {
        method: "POST",
        headers: { authorization: `Bearer ${AGENT_TOKEN}`, "content-type": "application/json", "x-pipelines-run-token": runToken },
        body: JSON.stringify({ odyssey_proxy_url: proxyUrl, run_id: 17, input }),
    }).then(async (response) => [response.status, await response.json()]);
}
for (const [name, start] of Object.entries(SERVERS)) {
    test(`${name}: a turn reply leaves as built; single-turn, a string, lenient and strict as for an envelope`, async () => {
        const tools = await proxy();
        const lenient = await start(agent, { token: AGENT_TOKEN, strict: false });
        const strict = await start(agent, { token: AGENT_TOKEN, strict: true });
        const stderr = process.stderr.write;
        process.stderr.write = () => true; // the lenient warnings
        try {
            assert.deepEqual(await dispatch(lenient.url, tools.url, "reply"), [200, REPLY]);
            assert.deepEqual(await dispatch(lenient.url, tools.url, "reply", { multiTurn: false }), [200, { final_response: REPLY.message, metadata: REPLY.metadata }]);
            assert.deepEqual(await dispatch(lenient.url, tools.url, "string"), [200, { final_response: "Which order?" }]);
            const handBuilt = JSON.stringify({ message: "ok", session_done: false, trace: { step: 2 } });
            assert.deepEqual(await dispatch(strict.url, tools.url, handBuilt), [200, JSON.parse(handBuilt)]);
            const malformed = JSON.stringify({ message: "ok", session_done: "yes", metadata: [1] });
            assert.deepEqual(await dispatch(lenient.url, tools.url, malformed), [200, { message: "ok", session_done: false }]);
            const [status, body] = await dispatch(strict.url, tools.url, malformed);
            assert.equal(status, 500);
            assert.match(String(body.detail), /session_done: must be a boolean.*metadata/);
            const [emptyStatus] = await dispatch(lenient.url, tools.url, JSON.stringify({ message: "", session_done: true }));
            assert.equal(emptyStatus, 500);
            const leaky = JSON.stringify({ message: "token run-token-turns-1", session_done: false });
            assert.deepEqual(await dispatch(lenient.url, tools.url, leaky), [200, { message: "token [redacted]", session_done: false }]);
            assert.ok(tools.seen.every(([bearer]) => bearer === "run-token-turns-1"));
        }
        finally {
            process.stderr.write = stderr;
            await lenient.close();
            await strict.close();
            await tools.close();
        }
    });
}
test("buildTurnReply builds the reply and refuses what a strict server refuses", () => {
    assert.deepEqual(buildTurnReply("Which order?"), { message: "Which order?", session_done: false });
    assert.deepEqual(buildTurnReply({ order: 1 }, { sessionDone: true }), { message: '{"order": 1}', session_done: true });
    for (const bad of ["", "  ", null])
        assert.throws(() => buildTurnReply(bad), /message/);
    assert.throws(() => buildTurnReply("x", { sessionDone: "yes" }), /session_done/);
    assert.throws(() => buildTurnReply("x", { metadata: { total_input_tokens: "many" } }), /metadata\.total_input_tokens/);
});
test("120 concurrent multi-turn dispatches through startServer each get their own turn reply", async () => {
    const tools = await proxy();
    const running = await startServer(async (envelope) => {
        const seen = await proxyCall("whoami", { run_id: envelope.run_id, session: envelope.session_id });
        return buildTurnReply(`${String(envelope.session_id)}: run ${seen.args.run_id}`, {
            metadata: { model: "m-1", turn_id: envelope.turn_id }, sessionDone: Number(envelope.run_id) % 2 === 0,
        });
    }, { token: AGENT_TOKEN, host: "127.0.0.1", port: 0 });
    try {
        const replies = await Promise.all(Array.from({ length: 120 }, (_, i) => fetch(running.url, {
            method: "POST",
            headers: { authorization: `Bearer ${AGENT_TOKEN}`, "content-type": "application/json", "x-pipelines-run-token": `run-token-turns-${i}` },
            body: JSON.stringify({ odyssey_proxy_url: tools.url, run_id: i, input: {
                    user_instruction: "x", latest_user_prompt: "x", session_id: `sess-${i}`, turn_id: `sess-${i}-t0`, messages: []
                } }),
        }).then(async (response) => [response.status, await response.json()])));
        replies.forEach((reply, i) => assert.deepEqual(reply, [200, {
                message: `sess-${i}: run ${i}`, session_done: i % 2 === 0, metadata: { model: "m-1", turn_id: `sess-${i}-t0` }
            }]));
        assert.equal(tools.seen.length, 120);
        for (const [bearer, args] of tools.seen) {
            assert.equal(bearer, `run-token-turns-${String(args["run_id"])}`);
            assert.equal(args["session"], `sess-${String(args["run_id"])}`);
        }
    }
    finally {
        await running.close(2);
        await tools.close();
    }
});
