//! Response envelope (§4): building it from what an agent returned, and
//! validating a body against §4 and its JSON Schema (§4.1).

use super::constants::FINAL_RESPONSE_SOFT_LIMIT;
use super::errors::ResponseError;
use super::json::{json_type, quoted, quoted_str, spaced};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::fmt;

/// The v1 response envelope (§4), for agents that prefer a typed value;
/// an agent may as well return a string or a JSON object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseEnvelope {
    /// What the judge grades: a non-empty string.
    pub final_response: String,
    /// The transcript (§4 messages-optional).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<Message>>,
    /// Metadata (§4 metadata-keys).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

/// A multi-turn per-turn reply (§4.2), as [`build_turn_reply`] builds it. In
/// a multi-turn dispatch (`Envelope::is_multi_turn`) it is sent as built; a JSON
/// object with `message` and `session_done` and no `final_response` is one too.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnReply {
    /// The agent's answer to this turn: a non-empty string.
    pub message: String,
    /// The agent's hint that the conversation is finished; the platform decides.
    pub session_done: bool,
    /// The turn's metadata (§4 metadata-keys).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
}

/// One transcript message (§4 message-shape).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// A string, an array of content parts, or `null`.
    pub content: Value,
    /// An assistant's tool calls, flat.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message's pairing id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A tool call in the flat form the platform stores (§4 tool-call-forms).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Its id, paired by a later tool message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The tool.
    pub name: String,
    /// An object or its JSON text.
    #[serde(skip_serializing_if = "Value::is_null", default)]
    pub arguments: Value,
}

/// One problem of a response body: its JSON path, what is wrong, and whether
/// it is only a warning (what the platform softens or the renderer cannot use).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The JSON path.
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// A warning rather than what the schema or the contract refuses.
    pub warning: bool,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.warning {
            write!(f, "warning: {}: {}", self.path, self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

fn hard(path: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem {
        path: path.into(),
        message: message.into(),
        warning: false,
    }
}

fn soft(path: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem {
        path: path.into(),
        message: message.into(),
        warning: true,
    }
}

const MESSAGE_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// A final response as a string; a structured value becomes its JSON text
/// with Python's separators, except a non-string `final_response` in strict mode.
fn final_text(value: &Value, key: &str, strict: bool) -> Result<Option<String>, ResponseError> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        other if key == "final_response" && strict => Err(ResponseError {
            problems: vec![format!(
                "final_response must be a string, got {}",
                json_type(other)
            )],
        }),
        other => Ok(Some(spaced(other))),
    }
}

/// What an agent returned, unpacked (§7.7 kit-result-shapes): a string, an
/// object with `final_response` (its extra keys kept), or a framework's
/// result with `final_output` / `output` / `message` (its text alone).
fn unpack(value: &Value, strict: bool) -> Result<Map<String, Value>, ResponseError> {
    let mut body = Map::new();
    match value {
        Value::String(s) => {
            body.insert("final_response".into(), Value::String(s.clone()));
        }
        Value::Null => {
            body.insert("final_response".into(), Value::Null);
        }
        Value::Object(object) if object.contains_key("final_response") => {
            for (key, item) in object {
                if key != "final_response" {
                    body.insert(key.clone(), item.clone());
                }
            }
            let text = final_text(&object["final_response"], "final_response", strict)?;
            body.insert("final_response".into(), text.map_or(Value::Null, Value::String));
        }
        Value::Object(object) => {
            let found = ["final_output", "output", "message"]
                .iter()
                .find_map(|key| object.get(*key).filter(|v| !v.is_null()).map(|v| (*key, v)));
            let text = match found {
                Some((key, item)) => final_text(item, key, strict)?,
                None => None,
            };
            body.insert("final_response".into(), text.map_or(Value::Null, Value::String));
        }
        other => {
            return Err(ResponseError {
                problems: vec![format!(
                    "cannot build a response from {}: return a string, an object with 'final_response', \
                     or an object with final_output / output / message",
                    json_type(other)
                )],
            })
        }
    }
    Ok(body)
}

/// A tool call's resolvable name (flat `name` or nested `function.name`).
fn tool_call_name(call: &Value) -> Option<&str> {
    match call.get("name") {
        Some(Value::String(name)) if !name.is_empty() => Some(name),
        _ => call
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str),
    }
}

/// Rewrites the OpenAI nested form `{type: "function", function: {name,
/// arguments}}` flat (§7.7 kit-flat-tool-calls).
fn flat_tool_call(call: &Value) -> Value {
    let Value::Object(object) = call else {
        return call.clone();
    };
    let nested = object.get("function").and_then(Value::as_object);
    let has_name = object.contains_key("name");
    let mut flat = Map::new();
    for (key, value) in object {
        if nested.is_some() && !has_name && (key == "function" || key == "type") {
            continue;
        }
        flat.insert(key.clone(), value.clone());
    }
    if let (Some(function), false) = (nested, has_name) {
        flat.insert(
            "name".into(),
            function.get("name").cloned().unwrap_or(Value::Null),
        );
        if let Some(args) = function.get("arguments") {
            flat.insert("arguments".into(), args.clone());
        }
    }
    Value::Object(flat)
}

fn flat_messages(messages: &Value, drop_nameless: bool, notes: &mut Vec<String>) -> Value {
    let Value::Array(list) = messages else {
        return messages.clone();
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, message) in list.iter().enumerate() {
        let mut message = message.clone();
        if let Some(Value::Array(calls)) = message.get("tool_calls").cloned() {
            let mut kept = Vec::new();
            for (j, call) in calls.iter().enumerate() {
                if drop_nameless && tool_call_name(call).is_none() {
                    notes.push(format!(
                        "messages[{i}].tool_calls[{j}]: no resolvable tool name; dropped"
                    ));
                    continue;
                }
                kept.push(flat_tool_call(call));
            }
            message["tool_calls"] = Value::Array(kept);
        }
        out.push(message);
    }
    Value::Array(out)
}

/// Turns what an agent returned into the v1 response envelope (§4).
///
/// Lenient (`strict` false, §7.7 kit-lenient-response): the body the
/// platform would grade goes out; what it would drop (nameless tool calls, a
/// malformed `messages` or `metadata`) is dropped the same way, each change
/// a warning naming its JSON path. Only a missing or empty `final_response`
/// is an error. Strict (§7.7 kit-strict-mode): every problem
/// [`validate_response`] reports, warnings included (but the truncation
/// warning), is a [`ResponseError`] listing them all.
pub fn build_response(
    value: &Value,
    strict: bool,
) -> Result<(Map<String, Value>, Vec<String>), ResponseError> {
    build_reply(value, strict, false)
}

/// What a dispatch answers for what the agent returned (§4.2, §7.7
/// kit-turn-reply-detected, kit-turn-reply-single-turn): in a multi-turn
/// dispatch (`Envelope::is_multi_turn`) a turn reply (an object with
/// `message` and `session_done` and no `final_response`) as built, checked
/// as [`build_response`] checks an envelope; anything else, and a turn reply
/// in a single-turn dispatch, the response envelope (the turn reply's
/// `message` as its `final_response`, `session_done` dropped with a warning).
pub fn build_reply(
    value: &Value,
    strict: bool,
    multi_turn: bool,
) -> Result<(Map<String, Value>, Vec<String>), ResponseError> {
    let mut notes = Vec::new();
    let mut envelope = None;
    if let Some(reply) = turn_reply(value) {
        if multi_turn {
            return turn_reply_body(reply, strict);
        }
        let mut converted = Map::new();
        for (key, item) in reply {
            match key.as_str() {
                "message" => {
                    converted.insert("final_response".into(), item.clone());
                }
                "session_done" => {}
                _ => {
                    converted.insert(key.clone(), item.clone());
                }
            }
        }
        envelope = Some(Value::Object(converted));
        notes.push(
            "session_done: a single-turn dispatch has no session to end; the turn reply is sent as the \
             response envelope, its message as final_response"
                .to_string(),
        );
    }
    let mut body = unpack(envelope.as_ref().unwrap_or(value), strict)?;
    if let Some(messages) = body.get("messages").filter(|m| !m.is_null()).cloned() {
        body.insert(
            "messages".into(),
            flat_messages(&messages, !strict, &mut notes),
        );
    }
    for key in ["messages", "metadata"] {
        if body.get(key) == Some(&Value::Null) {
            body.remove(key);
        }
    }
    if !strict {
        let mut ignored = Vec::new();
        let problems = message_problems(body.get("messages").unwrap_or(&Value::Null), &mut ignored);
        if let Some(first) = problems.first() {
            let more = if problems.len() > 1 {
                format!(" (and {} more)", problems.len() - 1)
            } else {
                String::new()
            };
            notes.push(format!(
                "{first}{more}; messages dropped, as the platform drops a malformed transcript"
            ));
            body.remove("messages");
        }
        if let Some(first) = metadata_problems(body.get("metadata").unwrap_or(&Value::Null)).first()
        {
            notes.push(format!(
                "{first}; metadata dropped, as the platform drops it"
            ));
            body.remove("metadata");
        }
    }
    let problems = validate_response(&Value::Object(body.clone()));
    checked(body, problems, notes, strict)
}

/// `body` with its warnings (`notes`, then the soft problems); a
/// [`ResponseError`] for the hard problems, in strict mode for the soft ones
/// too but the truncation warning (§7.7 kit-strict-mode).
fn checked(
    body: Map<String, Value>,
    problems: Vec<Problem>,
    mut notes: Vec<String>,
    strict: bool,
) -> Result<(Map<String, Value>, Vec<String>), ResponseError> {
    let (mut errors, mut warnings) = (Vec::new(), Vec::new());
    for problem in problems {
        let truncation = problem.path == "final_response" && problem.message.contains("truncates");
        if !problem.warning {
            errors.push(problem.to_string());
        } else if strict && !truncation {
            errors.push(format!("{}: {}", problem.path, problem.message));
        } else {
            warnings.push(format!("{}: {}", problem.path, problem.message));
        }
    }
    if !errors.is_empty() {
        return Err(ResponseError { problems: errors });
    }
    notes.extend(warnings);
    Ok((body, notes))
}

/// `value` as a turn reply's object, when it is one (§4.2).
fn turn_reply(value: &Value) -> Option<&Map<String, Value>> {
    value.as_object().filter(|object| {
        object.contains_key("message")
            && object.contains_key("session_done")
            && !object.contains_key("final_response")
    })
}

/// A turn reply as it goes out, its keys as built (§7.7 kit-turn-reply-checked).
/// Lenient: a `message` that is not a string becomes its JSON text, a
/// `session_done` that is not a boolean is sent as `false` (no hint), and a
/// malformed `messages` or `metadata` is dropped, each change a warning; only a
/// missing or empty `message` is an error. Strict: every problem is a
/// [`ResponseError`], the soft ones too.
fn turn_reply_body(
    reply: &Map<String, Value>,
    strict: bool,
) -> Result<(Map<String, Value>, Vec<String>), ResponseError> {
    let mut body = reply.clone();
    let mut notes = Vec::new();
    if !strict {
        if let Some(message) = body
            .get("message")
            .filter(|m| !m.is_null() && !m.is_string())
        {
            let text = spaced(message);
            body.insert("message".into(), Value::String(text));
        }
        if !body["session_done"].is_boolean() {
            notes.push(format!(
                "session_done: must be a boolean, got {}; sent as false (no hint)",
                json_type(&body["session_done"])
            ));
            body.insert("session_done".into(), Value::Bool(false));
        }
        if let Some(messages) = body.get("messages").filter(|m| !m.is_null()).cloned() {
            body.insert(
                "messages".into(),
                flat_messages(&messages, true, &mut notes),
            );
        }
        let mut ignored = Vec::new();
        if let Some(first) =
            message_problems(body.get("messages").unwrap_or(&Value::Null), &mut ignored).first()
        {
            notes.push(format!(
                "{first}; messages dropped, as the platform drops a malformed transcript"
            ));
            body.remove("messages");
        }
        if let Some(first) = metadata_problems(body.get("metadata").unwrap_or(&Value::Null)).first()
        {
            notes.push(format!(
                "{first}; metadata dropped, as the platform drops it"
            ));
            body.remove("metadata");
        }
    }
    let problems = turn_reply_problems(&body);
    checked(body, problems, notes, strict)
}

/// Every problem of a turn reply, worded as [`validate_response`] words an envelope's.
fn turn_reply_problems(body: &Map<String, Value>) -> Vec<Problem> {
    let (mut problems, mut warnings) = (Vec::new(), Vec::new());
    match body.get("message") {
        None | Some(Value::Null) => problems.push(hard(
            "message",
            "required, a non-empty string (the user answers it)",
        )),
        Some(Value::String(text)) if text.is_empty() => problems.push(hard(
            "message",
            "required, a non-empty string (the user answers it)",
        )),
        Some(Value::String(text)) if text.trim().is_empty() => warnings.push(soft(
            "message",
            "blank (only whitespace): the user has nothing to answer",
        )),
        Some(Value::String(_)) => {}
        Some(other) => problems.push(hard(
            "message",
            format!("must be a string, got {}", json_type(other)),
        )),
    }
    if let Some(done) = body.get("session_done").filter(|d| !d.is_boolean()) {
        problems.push(hard(
            "session_done",
            format!("must be a boolean, got {}", json_type(done)),
        ));
    }
    problems.extend(shared_problems(body, &mut warnings));
    problems.extend(warnings);
    problems
}

/// Builds a multi-turn per-turn reply (§4.2) and checks it as a strict server
/// does: a blank message or metadata the platform cannot use is a
/// [`ResponseError`] (§7.7 kit-turn-reply-checked). `session_done` is a hint:
/// the platform owns termination.
pub fn build_turn_reply(
    message: &str,
    metadata: Option<Map<String, Value>>,
    session_done: bool,
) -> Result<TurnReply, ResponseError> {
    let reply = TurnReply {
        message: message.to_string(),
        session_done,
        metadata,
    };
    let Ok(Value::Object(object)) = serde_json::to_value(&reply) else {
        unreachable!("a TurnReply serialises to a JSON object")
    };
    turn_reply_body(&object, true)?;
    Ok(reply)
}

fn metadata_problems(metadata: &Value) -> Vec<Problem> {
    match metadata {
        Value::Null | Value::Object(_) => Vec::new(),
        other => vec![hard(
            "metadata",
            format!(
                "must be an object or null, got {} (the platform drops it)",
                json_type(other)
            ),
        )],
    }
}

/// Mistyped first-class metadata, which the schema allows and the renderer cannot use (§7.7 kit-metadata-types).
fn metadata_warnings(metadata: &Value) -> Vec<Problem> {
    let Value::Object(object) = metadata else {
        return Vec::new();
    };
    let mut warnings = Vec::new();
    for key in ["model", "system_prompt_id"] {
        if let Some(value) = object.get(key).filter(|v| !v.is_null() && !v.is_string()) {
            warnings.push(soft(
                format!("metadata.{key}"),
                format!("should be a string, got {}", json_type(value)),
            ));
        }
    }
    for key in ["total_input_tokens", "total_output_tokens"] {
        if let Some(value) = object.get(key).filter(|v| !v.is_null()) {
            let ok = value.as_u64().is_some()
                || value.as_f64().is_some_and(|f| {
                    f >= 0.0 && f.fract() == 0.0 && !value.to_string().contains(['.', 'e', 'E'])
                });
            if !ok {
                warnings.push(soft(
                    format!("metadata.{key}"),
                    format!(
                        "should be a non-negative integer, got {}",
                        quoted(value, 40)
                    ),
                ));
            }
        }
    }
    if let Some(value) = object.get("agent_runtime_ms").filter(|v| !v.is_null()) {
        if !value.as_f64().is_some_and(|f| f >= 0.0) {
            warnings.push(soft(
                "metadata.agent_runtime_ms",
                format!("should be a non-negative number, got {}", quoted(value, 40)),
            ));
        }
    }
    warnings
}

/// A tool call against the schema's oneOf: exactly one of the flat and the nested shape.
fn tool_call_problems(
    call: &Value,
    at: &str,
    seen: &mut HashSet<String>,
    warnings: &mut Vec<Problem>,
) -> Vec<Problem> {
    let Value::Object(object) = call else {
        return vec![hard(
            at,
            format!("must be an object, got {}", json_type(call)),
        )];
    };
    let function = object.get("function").and_then(Value::as_object);
    let flat = object.get("name").is_some_and(Value::is_string);
    let typ = object.get("type");
    let function_name = function.is_some_and(|f| f.get("name").is_some_and(Value::is_string));
    let nested = function_name && typ.is_none_or(|t| t == "function");
    if flat && nested {
        return vec![hard(
            at,
            "has both 'name' and 'function': send one of the flat and the nested form",
        )];
    }
    if !flat && !nested {
        if let (Some(t), Some(_)) = (typ, function) {
            if t != "function" {
                return vec![hard(
                    format!("{at}.type"),
                    format!(
                        "must be \"function\" in the nested form, got {}",
                        quoted(t, 40)
                    ),
                )];
            }
        }
        return vec![hard(
            format!("{at}.name"),
            "no resolvable tool name (neither 'name' nor 'function.name'); the platform drops it",
        )];
    }
    let mut problems = Vec::new();
    match object.get("id") {
        Some(Value::String(id)) => {
            seen.insert(id.clone());
        }
        Some(other) => problems.push(hard(
            format!("{at}.id"),
            format!("must be a string, got {}", json_type(other)),
        )),
        None => {}
    }
    let args = if flat {
        object.get("arguments")
    } else {
        function.and_then(|f| f.get("arguments"))
    };
    if let Some(args) = args.filter(|a| !a.is_null() && !a.is_object() && !a.is_string()) {
        warnings.push(soft(
            format!("{at}.arguments"),
            format!(
                "should be an object or a JSON-encoded string, got {}",
                json_type(args)
            ),
        ));
    }
    problems
}

/// `messages` against the schema and the pairing rule; soft problems go to `warnings`.
fn message_problems(messages: &Value, warnings: &mut Vec<Problem>) -> Vec<Problem> {
    let list = match messages {
        Value::Null => return Vec::new(),
        Value::Array(list) => list,
        other => {
            return vec![hard(
                "messages",
                format!(
                    "must be an array or null, got {} (the platform drops it)",
                    json_type(other)
                ),
            )]
        }
    };
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    for (i, message) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(object) = message else {
            problems.push(hard(
                &at,
                format!("must be an object, got {}", json_type(message)),
            ));
            continue;
        };
        let role = object
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let role_value = object.get("role").unwrap_or(&Value::Null);
        if !MESSAGE_ROLES.contains(&role) {
            problems.push(hard(
                format!("{at}.role"),
                format!(
                    "must be one of {}, got {}",
                    MESSAGE_ROLES.join(", "),
                    quoted(role_value, 40)
                ),
            ));
        }
        if let Some(content) = object
            .get("content")
            .filter(|c| !c.is_null() && !c.is_string() && !c.is_array())
        {
            problems.push(hard(
                format!("{at}.content"),
                format!(
                    "must be a string, an array of parts or null, got {}",
                    json_type(content)
                ),
            ));
        }
        match object.get("tool_calls") {
            None => {}
            Some(Value::Array(calls)) => {
                if role != "assistant" && !calls.is_empty() {
                    warnings.push(soft(
                        format!("{at}.tool_calls"),
                        format!(
                            "only assistant messages carry tool calls, this one is {}",
                            quoted(role_value, 40)
                        ),
                    ));
                }
                for (j, call) in calls.iter().enumerate() {
                    problems.extend(tool_call_problems(
                        call,
                        &format!("{at}.tool_calls[{j}]"),
                        &mut seen,
                        warnings,
                    ));
                }
            }
            Some(other) => problems.push(hard(
                format!("{at}.tool_calls"),
                format!("must be an array, got {}", json_type(other)),
            )),
        }
        match object.get("thinking") {
            None => {}
            Some(Value::Array(blocks)) => {
                for (j, block) in blocks.iter().enumerate() {
                    if !block.is_object() {
                        problems.push(hard(
                            format!("{at}.thinking[{j}]"),
                            format!("must be an object, got {}", json_type(block)),
                        ));
                    }
                }
            }
            Some(other) => problems.push(hard(
                format!("{at}.thinking"),
                format!("must be an array of objects, got {}", json_type(other)),
            )),
        }
        match (object.get("tool_call_id"), role) {
            (Some(id), _) if !id.is_string() => problems.push(hard(
                format!("{at}.tool_call_id"),
                format!("must be a string, got {}", json_type(id)),
            )),
            (id, "tool") => {
                let text = id.and_then(Value::as_str).unwrap_or_default();
                if text.is_empty() {
                    problems.push(hard(
                        format!("{at}.tool_call_id"),
                        "required on role 'tool'",
                    ));
                } else if !seen.contains(text) {
                    problems.push(hard(
                        format!("{at}.tool_call_id"),
                        format!(
                            "{} does not match the id of an earlier assistant tool_calls entry",
                            quoted_str(text, 60)
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    problems
}

/// Every problem of a response body against §4 and its JSON Schema (§4.1),
/// each with its JSON path (§7.7 kit-strict-transcript). Hard problems: what
/// the schema rejects and the contract's rules (a non-empty
/// `final_response`, `tool_call_id` pairing). Warnings: a truncated or blank
/// final response, mistyped first-class metadata, odd tool arguments, tool
/// calls on a message that is not the assistant's. Empty: accepted as sent.
pub fn validate_response(body: &Value) -> Vec<Problem> {
    let Value::Object(object) = body else {
        return vec![hard(
            "body",
            format!("must be a JSON object, got {}", json_type(body)),
        )];
    };
    let (mut problems, mut warnings) = (Vec::new(), Vec::new());
    match object.get("final_response") {
        None | Some(Value::Null) => problems.push(hard(
            "final_response",
            "required, a non-empty string (the judge grades it)",
        )),
        Some(Value::String(text)) if text.is_empty() => problems.push(hard(
            "final_response",
            "must not be empty (the judge has nothing to grade)",
        )),
        Some(Value::String(text)) if text.trim().is_empty() => warnings.push(soft(
            "final_response",
            "blank (only whitespace): the judge has nothing to grade",
        )),
        Some(Value::String(text)) => {
            let length = text.chars().count();
            if length > FINAL_RESPONSE_SOFT_LIMIT {
                warnings.push(soft(
                    "final_response",
                    format!(
                        "{length} characters; the platform truncates it at ~{FINAL_RESPONSE_SOFT_LIMIT} with a soft warning"
                    ),
                ));
            }
        }
        Some(other) => problems.push(hard(
            "final_response",
            format!("must be a string, got {}", json_type(other)),
        )),
    }
    problems.extend(shared_problems(object, &mut warnings));
    problems.extend(warnings);
    problems
}

/// The problems of what a turn reply shares with the envelope (`messages`,
/// `metadata`); soft ones go to `warnings`.
fn shared_problems(object: &Map<String, Value>, warnings: &mut Vec<Problem>) -> Vec<Problem> {
    let mut problems = message_problems(object.get("messages").unwrap_or(&Value::Null), warnings);
    problems.extend(metadata_problems(
        object.get("metadata").unwrap_or(&Value::Null),
    ));
    warnings.extend(metadata_warnings(
        object.get("metadata").unwrap_or(&Value::Null),
    ));
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strings_and_envelopes_build() {
        let (body, _) = build_response(&json!("done"), true).unwrap();
        assert_eq!(Value::Object(body), json!({"final_response": "done"}));
        let (body, _) =
            build_response(&json!({"final_response": {"b": 1, "a": [1, 2]}}), false).unwrap();
        assert_eq!(body["final_response"], json!(r#"{"a": [1, 2], "b": 1}"#));
        assert!(build_response(&json!(""), false).is_err());
        assert!(build_response(&json!({"final_response": 1}), true).is_err());
    }

    #[test]
    fn nested_tool_calls_are_flattened() {
        let value = json!({"final_response": "x", "messages": [
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]});
        let (body, warnings) = build_response(&value, true).unwrap();
        assert_eq!(
            body["messages"][0]["tool_calls"][0],
            json!({"id": "c", "name": "t", "arguments": "{}"})
        );
        assert!(warnings.is_empty());
    }

    #[test]
    fn a_typed_envelope_serialises_to_a_valid_body() {
        let typed = ResponseEnvelope {
            final_response: "ok".into(),
            messages: Some(vec![Message {
                role: "user".into(),
                content: json!("hi"),
                ..Default::default()
            }]),
            metadata: None,
        };
        let value = serde_json::to_value(&typed).unwrap();
        assert!(validate_response(&value).is_empty());
    }
}
