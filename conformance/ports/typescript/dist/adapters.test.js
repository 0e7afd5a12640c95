// adapters.test.ts: the fetch handler and the Node handler are thin layers over DispatchApp.handle.
//
//   npm test            (node --test dist/, after npm run build)
import { strict as assert } from "node:assert";
import http from "node:http";
import { test } from "node:test";
import { DispatchApp, fetchHandler, nodeHandler, proxyCall } from "./pipelines_port.js";
const AGENT_TOKEN = "agent-token-adapters-ts";
const AUTH = { authorization: `Bearer ${AGENT_TOKEN}` };
/**
 * A proxy on 127.0.0.1 recording [bearer, arguments] of each tool call and answering `{"response": {"ok": true}}`.
 * The first `together` calls are held until all of them are in flight (a 500 after 15 s if they never are):
 * overlap shown without timing.
 */
async function recordingProxy(together = 0) {
    const seen = [];
    const held = [];
    const server = http.createServer({}, (req, res) => {
        const chunks = [];
        req.on("data", (chunk) => chunks.push(chunk));
        req.on("end", () => {
            seen.push([String(req.headers["authorization"] ?? "").replace(/^Bearer /, ""), JSON.parse(Buffer.concat(chunks).toString("utf8"))]);
            const answer = (status = 200) => {
                if (res.headersSent)
                    return;
                res.writeHead(status, { "Content-Type": "application/json" });
                res.end(status === 200 ? '{"response": {"ok": true}}' : '{"detail": {"error_class": "not_concurrent"}}');
            };
            if (seen.length > together)
                return answer();
            held.push(answer);
            if (held.length === together)
                held.forEach((release) => release());
            else
                setTimeout(() => answer(500), 15_000).unref();
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
/** An agent that calls `whoami` twice with its run id, then answers with it. */
async function whoami(envelope) {
    await proxyCall("whoami", { run_id: envelope.run_id });
    await proxyCall("whoami", { run_id: envelope.run_id });
    return `run ${envelope.run_id} done`;
}
function request(method, path, headers, body) {
    return new Request(`http://agent.example${path}`, { method, headers, ...(body === undefined ? {} : { body }) });
}
const sent = (body) => ({ ...AUTH, "content-length": String(Buffer.byteLength(body)) });
test("the fetch handler answers every refusal exactly as DispatchApp.handle decides it", async () => {
    const app = new DispatchApp(() => "never run", { token: AGENT_TOKEN, maxBody: 64 });
    const handler = fetchHandler(app);
    const ping = '{"ping": true}';
    const cases = [
        ["POST", "/dispatch", sent(ping), ping, 200],
        ["POST", "/dispatch", { ...sent(ping), authorization: "Bearer guess-1234" }, ping, 401],
        ["POST", "/dispatch", { "content-length": "14" }, ping, 401],
        ["POST", "/dispatch", { ...AUTH, "content-length": "65" }, "x".repeat(65), 413],
        ["POST", "/dispatch", sent("{oops"), "{oops", 400],
        ["POST", "/dispatch", sent("[1, 2]"), "[1, 2]", 400],
        ["GET", "/dispatch", { ...AUTH }, undefined, 405],
        ["POST", "/elsewhere", sent(ping), ping, 404],
        ["GET", "/healthz", {}, undefined, 200],
        ["POST", "/dispatch?x=1", sent(ping), ping, 200],
    ];
    for (const [method, path, headers, body, status] of cases) {
        const response = await handler(request(method, path, headers, body));
        const direct = await app.handle(method, path, headers, Buffer.from(body ?? "", "utf8"));
        const what = `${method} ${path} ${JSON.stringify(headers)}`;
        assert.equal(response.status, status, what);
        assert.equal(direct.status, status, what);
        assert.equal(await response.text(), direct.body.toString("utf8"), what);
        const headerPairs = [];
        response.headers.forEach((value, name) => void headerPairs.push([name, value]));
        assert.deepEqual(headerPairs.sort(), direct.headers.map(([k, v]) => [k.toLowerCase(), v]).sort(), what);
    }
});
/** `text` as a stream of `size`-byte chunks, then as many more chunks of spaces as `extra` says (Infinity: endless). */
function streamed(text, size, extra = 0) {
    const bytes = Buffer.from(text, "utf8");
    let pulled = 0;
    let cancelled = false;
    const body = new ReadableStream({
        pull(controller) {
            const start = pulled * size;
            pulled += 1;
            if (start < bytes.length)
                controller.enqueue(Uint8Array.from(bytes.subarray(start, start + size)));
            else if (pulled - Math.ceil(bytes.length / size) <= extra)
                controller.enqueue(new Uint8Array(size).fill(0x20));
            else
                controller.close();
        },
        cancel() {
            cancelled = true;
        },
    });
    return { body, pulls: () => pulled, cancelled: () => cancelled };
}
const streamRequest = (headers, body) => new Request("http://agent.example/dispatch", { method: "POST", headers, body, duplex: "half" });
test("the fetch handler reads a body as its host framed it: no Content-Length needed, a stream read whole", async () => {
    const app = new DispatchApp(() => "never run", { token: AGENT_TOKEN });
    const handler = fetchHandler(app);
    const ping = '{"ping": true}';
    // A Request made in code (Hono's app.request(), a test) carries no Content-Length.
    const made = await handler(request("POST", "/dispatch", { ...AUTH }, ping));
    assert.deepEqual([made.status, await made.json()], [200, { ok: true }]);
    // A body streamed (or re-chunked by a proxy) in 3-byte pieces, Transfer-Encoding left as the host saw it.
    const stream = streamed(ping, 3);
    const reply = await handler(streamRequest({ ...AUTH, "transfer-encoding": "chunked" }, stream.body));
    assert.deepEqual([reply.status, await reply.json(), stream.pulls()], [200, { ok: true }, 6]); // 5 chunks, then the end
    // No body at all is an empty one: not JSON.
    const empty = await handler(request("POST", "/dispatch", { ...AUTH }));
    assert.equal(empty.status, 400);
    assert.match(String((await empty.json()).detail), /not valid JSON/);
});
test("a streamed body past maxBody is a 413, and reading stops there: the stream is cancelled", async () => {
    const handler = fetchHandler(() => "never run", { token: AGENT_TOKEN, maxBody: 1024 });
    const endless = streamed("", 100, Infinity);
    const response = await handler(streamRequest(AUTH, endless.body));
    assert.equal(response.status, 413);
    assert.match(String((await response.json()).detail), /1024-byte cap/);
    assert.ok(endless.cancelled(), "the stream was not cancelled");
    assert.ok(endless.pulls() <= 12 + 2, `${endless.pulls()} chunks of 100 bytes pulled for a 1024-byte cap`); // the stream's own read-ahead at most
});
test("auth and a declared Content-Length over maxBody refuse before the body is read", async () => {
    const handler = fetchHandler(() => "never run", { token: AGENT_TOKEN, maxBody: 64 });
    for (const [headers, status] of [[{ authorization: "Bearer guess-1234" }, 401], [{ ...AUTH, "content-length": "65" }, 413]]) {
        const body = streamed("", 1, Infinity);
        const response = await handler(streamRequest(headers, body.body));
        assert.equal(response.status, status);
        assert.ok(body.pulls() <= 1, `${body.pulls()} chunks pulled before a ${status}`); // at most the stream's own first pull
    }
});
test("a declared Content-Length the body disagrees with is a 400 naming both", async () => {
    const handler = fetchHandler(() => "never run", { token: AGENT_TOKEN });
    const ping = '{"ping": true}';
    for (const [declared, pattern] of [["100", /is 14 bytes but its Content-Length says "100": truncated/], ["5", /is 14 bytes but its Content-Length says "5"$/],
        ["abc", /Content-Length says "abc"/], ["14, 14", /Content-Length says "14, 14"/]]) {
        const response = await handler(request("POST", "/dispatch", { ...AUTH, "content-length": declared }, ping));
        assert.equal(response.status, 400, declared);
        assert.match(String((await response.json()).detail), pattern);
    }
    const exact = await handler(request("POST", "/dispatch", sent(ping), ping));
    assert.equal(exact.status, 200);
});
test("a fetch handler's body is read no further than maxBody, whatever Content-Length claims", async () => {
    const handler = fetchHandler(() => "never run", { token: AGENT_TOKEN, maxBody: 16 });
    const response = await handler(request("POST", "/dispatch", { ...AUTH, "content-length": "14" }, `{"ping": true}${" ".repeat(4096)}`));
    assert.equal(response.status, 413);
    assert.match(String((await response.json()).detail), /16-byte cap/);
});
test("a body read before the fetch handler is a 500 naming the mistake, and the agent does not run", async () => {
    let ran = false;
    const handler = fetchHandler(() => { ran = true; return "ran"; }, { token: AGENT_TOKEN });
    const body = JSON.stringify({ odyssey_proxy_url: "http://127.0.0.1:9/p", input: { user_instruction: "x" } });
    const read = request("POST", "/dispatch", { ...sent(body), "x-pipelines-run-token": "run-token-read-1" }, body);
    await read.text(); // what a framework's JSON body parser does
    const response = await handler(read);
    const detail = String((await response.json()).detail);
    assert.equal(response.status, 500);
    assert.match(detail, /body parser/);
    assert.ok(!ran && !detail.includes("run-token-read-1"));
});
test("120 concurrent dispatches through the fetch handler each call the proxy with their own run token", async () => {
    const proxy = await recordingProxy(60); // the first 60 calls answered only once all are in flight
    const handler = fetchHandler(whoami, { token: AGENT_TOKEN, path: "/api/dispatch" });
    try {
        const replies = await Promise.all(Array.from({ length: 120 }, async (_, i) => {
            const body = JSON.stringify({ odyssey_proxy_url: proxy.url, run_id: i, input: { user_instruction: "x" } });
            const response = await handler(request("POST", "/api/dispatch", { ...sent(body), "x-pipelines-run-token": `run-token-fetch-${i}` }, body));
            return [response.status, await response.json()];
        }));
        replies.forEach(([status, body], i) => assert.deepEqual([status, body], [200, { final_response: `run ${i} done` }]));
        assert.equal(proxy.seen.length, 240);
        for (const [bearer, args] of proxy.seen)
            assert.equal(bearer, `run-token-fetch-${args.run_id}`);
    }
    finally {
        await proxy.close();
    }
});
/** `listener` on 127.0.0.1; the base URL and a closer. */
async function serve(listener) {
    const server = http.createServer(listener);
    await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
    const address = server.address();
    if (address === null || typeof address === "string")
        throw new Error("no address");
    return {
        base: `http://127.0.0.1:${address.port}`,
        close: () => new Promise((resolve) => {
            server.close(() => resolve());
            server.closeAllConnections?.();
        }),
    };
}
test("the Node handler serves a dispatch under a plain node:http server, and refuses a body read before it", async () => {
    const proxy = await recordingProxy();
    const handler = nodeHandler(whoami, { token: AGENT_TOKEN });
    const plain = await serve((req, res) => void handler(req, res));
    const parsed = await serve((req, res) => {
        const chunks = [];
        req.on("data", (chunk) => chunks.push(chunk));
        req.on("end", () => void handler(req, res));
    });
    try {
        const body = JSON.stringify({ odyssey_proxy_url: proxy.url, run_id: 7, input: { user_instruction: "x" } });
        const headers = { ...AUTH, "content-type": "application/json", "x-pipelines-run-token": "run-token-node-7" };
        const ok = await fetch(`${plain.base}/dispatch`, { method: "POST", headers, body });
        assert.deepEqual([ok.status, await ok.json()], [200, { final_response: "run 7 done" }]);
        assert.deepEqual(proxy.seen.map(([bearer]) => bearer), ["run-token-node-7", "run-token-node-7"]);
        const refused = await fetch(`${parsed.base}/dispatch`, { method: "POST", headers, body });
        assert.equal(refused.status, 500);
        assert.match(String((await refused.json()).detail), /express\.json\(\)/);
        assert.equal(proxy.seen.length, 2);
    }
    finally {
        await plain.close();
        await parsed.close();
        await proxy.close();
    }
});
