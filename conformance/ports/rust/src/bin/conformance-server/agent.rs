//! The conformance agent of `conformance/README.md` ("The conformance agent"),
//! built only on the port's public API: it reads the envelope, calls tools
//! through the port's proxy client, and returns through the port's response
//! builder. Nothing here talks HTTP itself.
//!
//! - echo mode: `final_response` = `{"envelope": E}`, the envelope as the port parsed it;
//! - script mode: `user_instruction` is `{"steps": [...]}`; each step gives one result.

use pipelines_port::contract::encoding::{validate_actor_label, validate_tool_name};
use pipelines_port::contract::inbound::{hex, sha256};
use pipelines_port::contract::json::{compact, decode};
use pipelines_port::contract::response::build_turn_reply;
use pipelines_port::transport::CallOptions;
use pipelines_port::{AgentError, Envelope, Handoff, ProxyError, Run};
use serde_json::{json, Map, Value};
use std::fmt;
use std::time::{Duration, Instant};

const STEP_KINDS: [&str; 8] = [
    "call",
    "parallel",
    "trace",
    "handoff",
    "sleep_ms",
    "raise",
    "return",
    "turn_reply",
];

/// Echo mode, or script mode when `user_instruction` is a JSON object with a `steps` array.
pub async fn conformance_agent(run: Run) -> Result<Value, AgentError> {
    let script = decode(run.envelope().user_instruction.as_bytes()).ok();
    match script
        .as_ref()
        .and_then(|s| s.get("steps"))
        .and_then(Value::as_array)
    {
        Some(steps) => run_script(&run, steps).await,
        None => Ok(echo(run.envelope())),
    }
}

fn echo(env: &Envelope) -> Value {
    let or_null = |v: &Option<Value>| v.clone().unwrap_or(Value::Null);
    let echoed = json!({
        "proxy_url": env.proxy_url,
        "run_token_sha256": hex(&sha256(env.run_token().as_bytes())),
        "run_id": or_null(&env.run_id),
        "task_id": or_null(&env.task_id),
        "agent_id": or_null(&env.agent_id),
        "run_token_jti": env.run_token_jti,
        "user_instruction": env.user_instruction,
        "task_input": env.task_input,
        "latest_user_prompt": env.latest_user_prompt,
        "session_id": or_null(&env.session_id),
        "turn_id": or_null(&env.turn_id),
        "messages": env.messages,
        "scenario_state": env.scenario_state,
        "workspace": env.workspace,
        "tools_schema": env.tools_schema,
        "sub_agents": env.sub_agents,
        "api_url": env.api_url,
        "raw": env.raw,
    });
    json!({ "final_response": compact(&json!({ "envelope": echoed })) })
}

/// A malformed script: the port answers 500 `"ScriptError: ..."`.
#[derive(Debug)]
struct ScriptError(String);

impl fmt::Display for ScriptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ScriptError {}

fn script_error(message: String) -> AgentError {
    ScriptError(message).into()
}

/// The step's kind; a `ScriptError` for an unknown or malformed step.
fn step_kind(step: &Value, at: &str) -> Result<&'static str, AgentError> {
    let empty = Map::new();
    let object = step.as_object().unwrap_or(&empty);
    let kinds: Vec<&'static str> = STEP_KINDS
        .iter()
        .copied()
        .filter(|k| object.contains_key(*k))
        .collect();
    let [kind] = kinds.as_slice() else {
        let text: String = compact(step).chars().take(200).collect();
        return Err(script_error(format!(
            "{at}: a step is an object with exactly one of {}, got {text}",
            STEP_KINDS.join(", ")
        )));
    };
    let required = match *kind {
        "call" => Some("args"),
        "trace" => Some("payload"),
        _ => None,
    };
    if let Some(field) = required.filter(|f| !object.contains_key(*f)) {
        return Err(script_error(format!(
            "{at}: a {kind} step needs \"{field}\""
        )));
    }
    match *kind {
        "parallel" => {
            let Some(calls) = object["parallel"].as_array() else {
                return Err(script_error(format!(
                    "{at}.parallel: must be an array of call steps"
                )));
            };
            for (i, call) in calls.iter().enumerate() {
                let inner = format!("{at}.parallel[{i}]");
                if step_kind(call, &inner)? != "call" {
                    return Err(script_error(format!("{inner}: not a call step")));
                }
            }
        }
        "handoff" => {
            let h = &object["handoff"];
            if !(h.is_object() && h.get("from").is_some() && h.get("to").is_some()) {
                return Err(script_error(format!(
                    "{at}.handoff: must be an object with \"from\" and \"to\""
                )));
            }
        }
        "sleep_ms" if !object["sleep_ms"].as_f64().is_some_and(|ms| ms >= 0.0) => {
            return Err(script_error(format!(
                "{at}.sleep_ms: must be a non-negative number"
            )));
        }
        "raise" if !object["raise"].is_string() => {
            return Err(script_error(format!("{at}.raise: must be a string")));
        }
        "turn_reply" => {
            let spec = &object["turn_reply"];
            let metadata_ok = spec
                .get("metadata")
                .is_none_or(|m| m.is_null() || m.is_object());
            let done_ok = spec.get("session_done").is_none_or(Value::is_boolean);
            if !(spec.get("message").is_some_and(Value::is_string) && metadata_ok && done_ok) {
                return Err(script_error(format!(
                    "{at}.turn_reply: must be an object with a string \"message\", an object \"metadata\" \
                     and a boolean \"session_done\""
                )));
            }
        }
        _ => {}
    }
    Ok(kind)
}

/// `{"ok": true, "value": V}` or `{"ok": false, "error": {"kind", "status_code", "error_class"}}`.
fn outcome(result: Result<Value, ProxyError>) -> Value {
    match result {
        Ok(value) => json!({"ok": true, "value": value}),
        Err(e) => json!({"ok": false, "error": {
            "kind": e.kind.as_str(), "status_code": e.status_code, "error_class": e.error_class}}),
    }
}

/// The call options of a step's `actor`: none when absent or null; a non-string is refused by the port.
fn actor_options(step: &Value) -> Result<CallOptions, ProxyError> {
    match step.get("actor") {
        None | Some(Value::Null) => Ok(CallOptions::default()),
        Some(Value::String(label)) => Ok(CallOptions {
            actor: Some(label.clone()),
            ..Default::default()
        }),
        Some(other) => validate_actor_label(other).map(|_| CallOptions::default()),
    }
}

/// A handoff label; a non-string is refused by the port.
fn label(value: &Value) -> Result<String, ProxyError> {
    match value {
        Value::String(text) => Ok(text.clone()),
        other => validate_actor_label(other).map(|l| l.unwrap_or_default()),
    }
}

/// One tool call: its outcome and its two transcript messages.
async fn call(run: &Run, step: &Value, id: String) -> Result<(Value, [Value; 2]), AgentError> {
    let args = step.get("args").cloned().unwrap_or(Value::Null);
    let result = match (actor_options(step), step.get("call")) {
        (Err(e), _) => Err(e),
        (Ok(options), Some(Value::String(name))) => {
            run.call_with(name, args.clone(), &options).await
        }
        (Ok(_), other) => validate_tool_name(other.unwrap_or(&Value::Null)).map(|_| Value::Null),
    };
    if step.get("raise_on_error") == Some(&Value::Bool(true)) {
        if let Err(e) = result {
            return Err(e.into()); // the call's error leaves the agent as it is: the port answers 500 with its text
        }
    }
    let result = outcome(result);
    let name = match step.get("call") {
        Some(Value::String(name)) if !name.is_empty() => name.clone(),
        other => compact(other.unwrap_or(&Value::Null)),
    };
    let shown = if args.is_object() {
        args
    } else {
        Value::String(compact(&args))
    };
    let messages = [
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "name": name, "arguments": shown}]}),
        json!({"role": "tool", "tool_call_id": id, "content": compact(&result)}),
    ];
    Ok((result, messages))
}

async fn run_script(run: &Run, steps: &[Value]) -> Result<Value, AgentError> {
    let started = Instant::now();
    // Check the whole script first: a malformed one fails before anything is sent.
    let kinds = steps
        .iter()
        .enumerate()
        .map(|(i, step)| step_kind(step, &format!("steps[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let instruction = run.envelope().user_instruction.clone();
    let mut results = Vec::new();
    let mut transcript = vec![json!({"role": "user", "content": instruction})];
    let mut calls = 0;
    let mut next_id = || {
        calls += 1;
        format!("call_{calls}")
    };
    for (step, kind) in steps.iter().zip(kinds) {
        match kind {
            "call" => {
                let (result, messages) = call(run, step, next_id()).await?;
                results.push(result);
                transcript.extend(messages);
            }
            "parallel" => {
                let tasks: Vec<_> = step["parallel"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|inner| {
                        let (run, inner, id) = (run.clone(), inner.clone(), next_id()); // ids in listed order
                        tokio::spawn(
                            run.clone()
                                .scope(async move { call(&run, &inner, id).await }),
                        )
                    })
                    .collect();
                let mut outcomes = Vec::new();
                for task in tasks {
                    let (result, messages) =
                        task.await.map_err(|e| AgentError::msg(e.to_string()))??;
                    outcomes.push(result);
                    transcript.extend(messages);
                }
                results.push(json!({ "parallel": outcomes }));
            }
            "trace" => {
                let result = match actor_options(step) {
                    Err(e) => Err(e),
                    Ok(options) => {
                        let event_type = match &step["trace"] {
                            Value::String(t) => t.clone(),
                            other => compact(other), // never a reserved type: the port refuses it
                        };
                        run.trace_with(&event_type, step["payload"].clone(), &options)
                            .await
                    }
                };
                results.push(outcome(result));
            }
            "handoff" => {
                let h = &step["handoff"];
                let result = match (label(&h["from"]), label(&h["to"])) {
                    (Ok(from), Ok(to)) => {
                        let handoff = Handoff {
                            from,
                            to,
                            reason: h.get("reason").cloned(),
                            payload_preview: h.get("payload_preview").cloned(),
                        };
                        run.handoff(&handoff).await
                    }
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
                results.push(outcome(result));
            }
            "sleep_ms" => {
                let ms = step["sleep_ms"].as_f64().unwrap_or_default();
                tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
                results.push(json!({"ok": true, "value": null}));
            }
            "raise" => return Err(AgentError::msg(step["raise"].as_str().unwrap_or_default())),
            "turn_reply" => {
                // what the port's turn-reply builder builds (§4.2)
                let spec = &step["turn_reply"];
                let reply = build_turn_reply(
                    spec["message"].as_str().unwrap_or_default(),
                    spec.get("metadata").and_then(Value::as_object).cloned(),
                    spec.get("session_done")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                )?;
                return Ok(serde_json::to_value(reply).unwrap_or(Value::Null));
            }
            _ => return Ok(step["return"].clone()),
        }
    }
    let final_response = compact(&json!({ "results": results }));
    transcript.push(json!({"role": "assistant", "content": final_response}));
    Ok(json!({
        "final_response": final_response,
        "messages": transcript,
        "metadata": {"model": "conformance-agent", "agent_runtime_ms": started.elapsed().as_millis() as u64},
    }))
}
