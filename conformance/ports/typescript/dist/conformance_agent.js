// conformance_agent.ts: the conformance agent of conformance/README.md, on top of this port.
//
// An ordinary agent function: it reads the envelope, calls tools through the
// port's proxy shim, and returns through the port's response builder.  Nothing
// here talks HTTP itself.
//
//   echo mode:   final_response = {"envelope": E}, the envelope as the port parsed it
//   script mode: user_instruction is {"steps": [...]}; each step gives one result
import { createHash } from "node:crypto";
import { ProxyError, ProxyRequestError, ProxyTransportError, StaleRunTokenError, buildTurnReply, postHandoff, postTrace, proxyCall, } from "./pipelines_port.js";
const STEP_KINDS = ["call", "parallel", "trace", "handoff", "sleep_ms", "raise", "return", "turn_reply"];
/** The agent: echo mode, or script mode when user_instruction is a JSON object with a `steps` array. */
export async function conformanceAgent(envelope) {
    const script = parseScript(envelope.user_instruction);
    return script ? runScript(envelope, script) : echo(envelope);
}
function parseScript(text) {
    try {
        const value = JSON.parse(text);
        return isObject(value) && Array.isArray(value["steps"]) ? value["steps"] : null;
    }
    catch {
        return null;
    }
}
// -- echo mode ------------------------------------------------------------------
const ECHOED = [
    "proxy_url", "run_id", "task_id", "agent_id", "run_token_jti", "user_instruction", "task_input",
    "latest_user_prompt", "session_id", "turn_id", "messages", "scenario_state", "workspace",
    "tools_schema", "sub_agents", "api_url", "raw",
];
function echo(envelope) {
    const echoed = Object.fromEntries(ECHOED.map((name) => [name, envelope[name]]));
    echoed["run_token_sha256"] = createHash("sha256").update(envelope.run_token, "utf8").digest("hex");
    return { final_response: JSON.stringify({ envelope: echoed }) };
}
// -- script mode ----------------------------------------------------------------
/** Error naming the malformed step; the port answers 500 with it. */
class ScriptError extends Error {
    constructor(message) {
        super(message);
        this.name = "ScriptError";
    }
}
function isObject(value) {
    return value !== null && typeof value === "object" && !Array.isArray(value);
}
/** The step's kind; throws ScriptError for an unknown or malformed step. */
function stepKind(step, where) {
    const kinds = isObject(step) ? STEP_KINDS.filter((kind) => kind in step) : [];
    const [kind] = kinds;
    if (kinds.length !== 1 || kind === undefined || !isObject(step)) {
        throw new ScriptError(`${where}: a step is an object with exactly one of ${STEP_KINDS.join(", ")}, ` +
            `got ${JSON.stringify(step)?.slice(0, 200)}`);
    }
    // Fields marked "?" in the README's step table are optional; the others are required.
    const required = kind === "call" ? ["args"] : kind === "trace" ? ["payload"] : [];
    const missing = required.filter((field) => !(field in step));
    if (missing.length)
        throw new ScriptError(`${where}: a ${kind} step needs ${missing.map((f) => `"${f}"`).join(", ")}`);
    const parallel = step["parallel"];
    if (kind === "parallel") {
        if (!Array.isArray(parallel))
            throw new ScriptError(`${where}.parallel: must be an array of call steps`);
        parallel.forEach((call, i) => {
            if (stepKind(call, `${where}.parallel[${i}]`) !== "call")
                throw new ScriptError(`${where}.parallel[${i}]: not a call step`);
        });
    }
    const handoff = step["handoff"];
    if (kind === "handoff" && !(isObject(handoff) && "from" in handoff && "to" in handoff)) {
        throw new ScriptError(`${where}.handoff: must be an object with "from" and "to"`);
    }
    const sleep = step["sleep_ms"];
    if (kind === "sleep_ms" && !(typeof sleep === "number" && sleep >= 0)) {
        throw new ScriptError(`${where}.sleep_ms: must be a non-negative number`);
    }
    if (kind === "raise" && typeof step["raise"] !== "string")
        throw new ScriptError(`${where}.raise: must be a string`);
    const turnReply = step["turn_reply"];
    if (kind === "turn_reply" && !(isObject(turnReply) && "message" in turnReply)) {
        throw new ScriptError(`${where}.turn_reply: must be an object with "message"`);
    }
    return kind;
}
/** The outcome of one proxy operation: its value, or the error's kind, status and class. */
async function outcome(operation) {
    try {
        return { ok: true, value: ((await operation()) ?? null) };
    }
    catch (err) {
        if (!(err instanceof ProxyError))
            throw err;
        const kind = err instanceof StaleRunTokenError ? "stale_run_token"
            : err instanceof ProxyTransportError ? "transport"
                : err instanceof ProxyRequestError ? "request" : "proxy";
        return { ok: false, error: { kind, status_code: err.statusCode, error_class: err.errorClass } };
    }
}
/** The arguments as a transcript may show them (§4): an object, or the JSON text of anything else. */
const shownArguments = (args) => (isObject(args) ? args : JSON.stringify(args) ?? "null");
async function runScript(envelope, steps) {
    const started = Date.now();
    // Check the whole script first: a malformed one fails before anything is sent.
    const kinds = steps.map((step, i) => stepKind(step, `steps[${i}]`));
    const results = [];
    const transcript = [{ role: "user", content: envelope.user_instruction }];
    let calls = 0;
    const call = async (step) => {
        const id = `call_${++calls}`;
        const name = step["call"];
        const actor = step["actor"];
        // A non-string name or actor goes to the port as it is: the port must refuse it (kind "request").
        const send = () => proxyCall(name, step["args"], { actor: actor ?? null });
        // "raise_on_error": the call's error leaves the agent as it is (the port answers 500 with its text).
        const result = step["raise_on_error"] === true ? { ok: true, value: await send() } : await outcome(send);
        const shownName = typeof name === "string" && name ? name : JSON.stringify(name) ?? "null";
        return [result, [
                { role: "assistant", content: null, tool_calls: [{ id, name: shownName, arguments: shownArguments(step["args"]) }] },
                { role: "tool", tool_call_id: id, content: JSON.stringify(result) },
            ]];
    };
    for (const [i, step] of steps.entries()) {
        switch (kinds[i]) {
            case "call": {
                const [result, messages] = await call(step);
                results.push(result);
                transcript.push(...messages);
                break;
            }
            case "parallel": {
                const done = await Promise.all(step["parallel"].map(call)); // started together, ids in listed order
                results.push({ parallel: done.map(([result]) => result) });
                done.forEach(([, messages]) => transcript.push(...messages));
                break;
            }
            case "trace":
                results.push(await outcome(() => postTrace(step["trace"], step["payload"], { actor: step["actor"] ?? null })));
                break;
            case "handoff": {
                const handoff = step["handoff"];
                const reason = handoff["reason"] ?? null;
                const preview = handoff["payload_preview"] ?? null;
                results.push(await outcome(() => postHandoff(handoff["from"], handoff["to"], { reason, payload_preview: preview })));
                break;
            }
            case "sleep_ms":
                await new Promise((resolve) => setTimeout(resolve, step["sleep_ms"]));
                results.push({ ok: true, value: null });
                break;
            case "raise":
                throw new Error(step["raise"]);
            case "return":
                return step["return"];
            case "turn_reply": { // what the port's turn-reply builder builds (§4.2)
                const spec = step["turn_reply"];
                return buildTurnReply(spec["message"], {
                    metadata: (spec["metadata"] ?? null), sessionDone: (spec["session_done"] ?? false),
                });
            }
        }
    }
    const final_response = JSON.stringify({ results });
    transcript.push({ role: "assistant", content: final_response });
    return {
        final_response,
        messages: transcript,
        metadata: { model: "conformance-agent", agent_runtime_ms: Date.now() - started },
    };
}
