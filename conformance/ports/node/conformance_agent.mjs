// conformance_agent.mjs: the conformance agent of conformance/README.md, on top of this port.
//
// An ordinary agent function: it reads the envelope, calls tools through the
// port's proxy shim, and returns through the port's response builder.  Nothing
// here talks HTTP itself.
//
//   echo mode:   final_response = {"envelope": E}, the envelope as the port parsed it
//   script mode: user_instruction is {"steps": [...]}; each step gives one result

import { createHash } from "node:crypto";

import {
  ProxyError, ProxyRequestError, ProxyTransportError, StaleRunTokenError,
  postHandoff, postTrace, proxyCall,
} from "./pipelines_port.mjs";

const STEP_KINDS = ["call", "parallel", "trace", "handoff", "sleep_ms", "raise", "return"];

/** The agent: echo mode, or script mode when user_instruction is a JSON object with a `steps` array. */
export async function conformanceAgent(envelope) {
  const script = parseScript(envelope.user_instruction);
  return script ? runScript(envelope, script) : echo(envelope);
}

function parseScript(text) {
  try {
    const value = JSON.parse(text);
    return value !== null && typeof value === "object" && Array.isArray(value.steps) ? value : null;
  } catch {
    return null;
  }
}

// -- echo mode ------------------------------------------------------------------

function echo(envelope) {
  const fields = [
    "proxy_url", "run_id", "task_id", "agent_id", "run_token_jti", "user_instruction", "task_input",
    "latest_user_prompt", "session_id", "turn_id", "messages", "scenario_state", "workspace",
    "tools_schema", "sub_agents", "api_url", "raw",
  ];
  const echoed = Object.fromEntries(fields.map((name) => [name, envelope[name]]));
  echoed.run_token_sha256 = createHash("sha256").update(envelope.run_token, "utf8").digest("hex");
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

const isObject = (value) => value !== null && typeof value === "object" && !Array.isArray(value);

/** The step's kind; throws ScriptError for an unknown or malformed step. */
function stepKind(step, where) {
  const kinds = isObject(step) ? STEP_KINDS.filter((kind) => kind in step) : [];
  if (kinds.length !== 1) {
    throw new ScriptError(`${where}: a step is an object with exactly one of ${STEP_KINDS.join(", ")}, ` +
      `got ${JSON.stringify(step)?.slice(0, 200)}`);
  }
  const [kind] = kinds;
  // Fields marked "?" in the README's step table are optional; the others are required.
  const required = { call: ["args"], trace: ["payload"] }[kind] ?? [];
  const missing = required.filter((field) => !(field in step));
  if (missing.length) throw new ScriptError(`${where}: a ${kind} step needs ${missing.map((f) => `"${f}"`).join(", ")}`);
  if (kind === "parallel") {
    if (!Array.isArray(step.parallel)) throw new ScriptError(`${where}.parallel: must be an array of call steps`);
    step.parallel.forEach((call, i) => {
      if (stepKind(call, `${where}.parallel[${i}]`) !== "call") throw new ScriptError(`${where}.parallel[${i}]: not a call step`);
    });
  }
  if (kind === "handoff" && !(isObject(step.handoff) && "from" in step.handoff && "to" in step.handoff)) {
    throw new ScriptError(`${where}.handoff: must be an object with "from" and "to"`);
  }
  if (kind === "sleep_ms" && !(typeof step.sleep_ms === "number" && step.sleep_ms >= 0)) {
    throw new ScriptError(`${where}.sleep_ms: must be a non-negative number`);
  }
  if (kind === "raise" && typeof step.raise !== "string") throw new ScriptError(`${where}.raise: must be a string`);
  return kind;
}

/** `{ok: true, value}` or `{ok: false, error: {kind, status_code, error_class}}` of one proxy operation. */
async function outcome(operation) {
  try {
    return { ok: true, value: (await operation()) ?? null };
  } catch (err) {
    if (!(err instanceof ProxyError)) throw err;
    const kind = err instanceof StaleRunTokenError ? "stale_run_token"
      : err instanceof ProxyTransportError ? "transport"
        : err instanceof ProxyRequestError ? "request" : "proxy";
    return { ok: false, error: { kind, status_code: err.statusCode, error_class: err.errorClass } };
  }
}

/** The arguments as a transcript may show them (§4): an object, or the JSON text of anything else. */
const shownArguments = (args) => (isObject(args) ? args : JSON.stringify(args));

async function runScript(envelope, script) {
  const started = Date.now();
  // Check the whole script first: a malformed one fails before anything is sent.
  const kinds = script.steps.map((step, i) => stepKind(step, `steps[${i}]`));
  const results = [];
  const transcript = [{ role: "user", content: envelope.user_instruction }];
  let calls = 0;

  const call = async (step) => {
    const id = `call_${++calls}`;
    const result = await outcome(() => proxyCall(step.call, step.args, { actor: step.actor ?? null }));
    const name = typeof step.call === "string" && step.call ? step.call : JSON.stringify(step.call) ?? "null";
    return [result, [
      { role: "assistant", content: null, tool_calls: [{ id, name, arguments: shownArguments(step.args) }] },
      { role: "tool", tool_call_id: id, content: JSON.stringify(result) },
    ]];
  };

  for (const [i, step] of script.steps.entries()) {
    switch (kinds[i]) {
      case "call": {
        const [result, messages] = await call(step);
        results.push(result);
        transcript.push(...messages);
        break;
      }
      case "parallel": {
        const done = await Promise.all(step.parallel.map(call)); // started together, ids in listed order
        results.push({ parallel: done.map(([result]) => result) });
        done.forEach(([, messages]) => transcript.push(...messages));
        break;
      }
      case "trace":
        results.push(await outcome(() => postTrace(step.trace, step.payload, { actor: step.actor ?? null })));
        break;
      case "handoff": {
        const { from, to, reason = null, payload_preview = null } = step.handoff;
        results.push(await outcome(() => postHandoff(from, to, { reason, payload_preview })));
        break;
      }
      case "sleep_ms":
        await new Promise((resolve) => setTimeout(resolve, step.sleep_ms));
        results.push({ ok: true, value: null });
        break;
      case "raise":
        throw new Error(step.raise);
      case "return":
        return step.return;
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
