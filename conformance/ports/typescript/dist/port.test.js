// port.test.ts: what the vectors cannot show: pacing, per-dispatch context, typed errors, a dispatch end to end.
//
//   npm test            (node --test dist/, after npm run build)
import { strict as assert } from "node:assert";
import http from "node:http";
import { test } from "node:test";
import { DispatchApp, EnvelopeError, Pacer, PipelinesError, ProxyClient, ProxyError, ProxyRequestError, StaleRunTokenError, bindEnvelope, currentEnvelope, envelopeFromDispatch, proxyCall, } from "./pipelines_port.js";
/** A proxy on 127.0.0.1 answering every tool call with the bearer it saw, after `delayMs`. */
async function echoProxy(delayMs = 0) {
    const seen = [];
    const server = http.createServer({}, (req, res) => {
        req.on("data", () => undefined);
        req.on("end", () => {
            const bearer = String(req.headers["authorization"] ?? "").replace(/^Bearer /, "");
            seen.push(bearer);
            setTimeout(() => {
                const body = Buffer.from(JSON.stringify({ response: { bearer } }), "utf8");
                res.writeHead(200, { "Content-Type": "application/json", "Content-Length": String(body.length) });
                res.end(body);
            }, delayMs);
        });
    });
    await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
    const address = server.address();
    if (address === null || typeof address === "string")
        throw new Error("no address");
    return {
        url: `http://127.0.0.1:${address.port}/api/odyssey-proxy/runs/r1`,
        seen,
        close: () => new Promise((resolve) => {
            server.close(() => resolve());
            server.closeAllConnections?.();
        }),
    };
}
const envelopeFor = (url, token) => envelopeFromDispatch({ odyssey_proxy_url: url, run_id: token }, { "X-Pipelines-Run-Token": token });
test("the pacer spreads a burst over the window, per run token", () => {
    const pacer = new Pacer(2, 60);
    assert.equal(pacer.reserve("a", 100), 0);
    assert.equal(pacer.reserve("a", 100), 0);
    assert.equal(pacer.reserve("a", 100), 60); // the third waits for the first slot to leave the window
    assert.equal(pacer.reserve("a", 130), 30); // the fourth: the second slot (at 100) leaves the window at 160
    assert.equal(pacer.reserve("b", 100), 0); // another run has its own budget
    assert.throws(() => new Pacer(0), RangeError);
});
test("the client paces every attempt under ratePerMinute and never for another token", async () => {
    const proxy = await echoProxy();
    const waits = [];
    const client = new ProxyClient({ timeout: 5, ratePerMinute: 3, sleep: async (s) => void waits.push(s) });
    try {
        const run = envelopeFor(proxy.url, "run-token-pace-1");
        for (let i = 0; i < 4; i++)
            await client.call(run, "get_order", {});
        assert.equal(waits.length, 1);
        assert.ok((waits[0] ?? 0) > 59 && (waits[0] ?? 0) <= 60, `waited ${waits[0]}`);
        await client.call(envelopeFor(proxy.url, "run-token-pace-2"), "get_order", {});
        assert.equal(waits.length, 1);
        assert.equal(proxy.seen.length, 5);
    }
    finally {
        client.close();
        await proxy.close();
    }
});
test("concurrent bound contexts never see each other's envelope", async () => {
    const proxy = await echoProxy(20);
    const client = new ProxyClient({ timeout: 5, ratePerMinute: 0 });
    try {
        const runs = Array.from({ length: 12 }, (_, i) => envelopeFor(proxy.url, `run-token-ctx-${i}`));
        const seen = await Promise.all(runs.map((run) => bindEnvelope(run, async () => {
            const first = await proxyCall("whoami", {}, { client });
            await new Promise((resolve) => setTimeout(resolve, 5));
            const second = await proxyCall("whoami", {}, { client });
            return [first, second, currentEnvelope().run_token];
        })));
        seen.forEach(([first, second, token], i) => {
            const want = `run-token-ctx-${i}`;
            assert.deepEqual([first, second, token], [{ bearer: want }, { bearer: want }, want]);
        });
        assert.throws(() => currentEnvelope(), EnvelopeError); // nothing leaks outside the contexts
    }
    finally {
        client.close();
        await proxy.close();
    }
});
test("errors are typed: one hierarchy, each with its fields", async () => {
    const client = new ProxyClient({ timeout: 5, ratePerMinute: 0 });
    const run = envelopeFor("http://127.0.0.1:9/api/odyssey-proxy/runs/r1", "run-token-errors");
    await assert.rejects(client.call(run, "bad name", {}), (err) => err instanceof ProxyRequestError && err instanceof ProxyError && err instanceof PipelinesError && err.statusCode === null);
    await assert.rejects(client.call(run, "get_order", [1, 2]), ProxyRequestError);
    assert.ok(new StaleRunTokenError("gone", { statusCode: 401, errorClass: "run_token_expired" }) instanceof ProxyError);
    assert.throws(() => envelopeFromDispatch({}, {}), (err) => err instanceof EnvelopeError && /proxy URL/.test(err.message) && /run token/.test(err.message));
    client.close();
});
test("a dispatch end to end through DispatchApp.handle: auth, envelope, agent, response", async () => {
    const proxy = await echoProxy();
    const app = new DispatchApp(async (envelope) => `hello ${envelope.task_id}`, { token: "agent-token-e2e" });
    const body = Buffer.from(JSON.stringify({ odyssey_proxy_url: proxy.url, task_id: 7 }), "utf8");
    const headers = { authorization: "Bearer agent-token-e2e", "x-pipelines-run-token": "run-token-e2e", "content-length": String(body.length) };
    try {
        const reply = await app.handle("POST", "/dispatch", headers, body);
        assert.equal(reply.status, 200);
        assert.deepEqual(JSON.parse(reply.body.toString("utf8")), { final_response: "hello 7" });
        const denied = await app.handle("POST", "/dispatch", { ...headers, authorization: "Bearer agent-token-e2" }, body);
        assert.equal(denied.status, 401);
        assert.ok(!denied.body.toString("utf8").includes("agent-token"));
    }
    finally {
        await proxy.close();
    }
});
