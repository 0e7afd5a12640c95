//! Request encoding (§3.1, §3.4, §3.5, §7.5): what goes on the wire to the
//! proxy, checked before anything is sent.

use super::constants::*;
use super::errors::{ProxyError, ProxyErrorKind};
use super::json::{compact, json_type, quoted, quoted_str};
use serde_json::{Map, Value};

const ACTOR_MAX_SEGMENTS: usize = 8;
const ACTOR_MAX_LENGTH: usize = 256;

/// The tool name when it is a string matching `^[A-Za-z_][A-Za-z0-9_-]{0,127}$`
/// (§3.1 tool-name-pattern); anything else (a non-string included) is refused
/// with kind `request` (§7.5 kit-local-tool-name).
pub fn validate_tool_name(name: &Value) -> Result<String, ProxyError> {
    if let Value::String(text) = name {
        let mut chars = text.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if first_ok
            && text.len() <= 128
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Ok(text.clone());
        }
    }
    Err(ProxyError::request(
        format!(
            "invalid tool name {}: must match ^[A-Za-z_][A-Za-z0-9_-]{{0,127}}$",
            quoted(name, 80)
        ),
        name.as_str().unwrap_or_default(),
    ))
}

/// The normalised actor label (§3.5), `None` for none (`null` or blank). A
/// label is trimmed and has at most 8 `/`-separated segments of 1 to 64
/// characters from `[A-Za-z0-9_.:-]`, at most 256 characters in all;
/// anything else is refused with error class `actor_id_invalid`.
pub fn validate_actor_label(label: &Value) -> Result<Option<String>, ProxyError> {
    let invalid = |problem: String| {
        let mut e = ProxyError::request(problem, "");
        e.error_class = Some("actor_id_invalid".into());
        e
    };
    let text = match label {
        Value::Null => return Ok(None),
        Value::String(text) => text.trim(),
        other => {
            return Err(invalid(format!(
                "actor label must be a string, got {}",
                json_type(other)
            )))
        }
    };
    if text.is_empty() {
        return Ok(None);
    }
    let segments: Vec<&str> = text.split('/').collect();
    let length = text.chars().count();
    let problem = if length > ACTOR_MAX_LENGTH {
        Some(format!(
            "is {length} characters long (at most {ACTOR_MAX_LENGTH})"
        ))
    } else if segments.len() > ACTOR_MAX_SEGMENTS {
        Some(format!(
            "has {} segments (at most {ACTOR_MAX_SEGMENTS})",
            segments.len()
        ))
    } else {
        segments
            .iter()
            .find(|s| {
                s.is_empty()
                    || s.len() > 64
                    || !s
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.:-".contains(c))
            })
            .map(|s| {
                format!(
                    "has segment {}: each segment is 1-64 characters from [A-Za-z0-9_.:-]",
                    quoted_str(s, 80)
                )
            })
    };
    match problem {
        Some(problem) => Err(invalid(format!(
            "invalid actor label {}: {problem}",
            quoted_str(text, 80)
        ))),
        None => Ok(Some(text.to_string())),
    }
}

/// The compact JSON of a request body: a JSON object within the 1 MiB cap
/// (§3.1 args-object-body, size-caps; §7.5 kit-local-args-object,
/// kit-local-size-cap); `null` is sent as `{}`.
pub fn encode_args(name: &str, args: &Value, what: &str) -> Result<Vec<u8>, ProxyError> {
    let text = match args {
        Value::Null => "{}".to_string(),
        Value::Object(_) => compact(args),
        other => {
            return Err(ProxyError::request(
                format!(
                    "{what} for {} must be a JSON object, got {}",
                    quoted_str(name, 80),
                    json_type(other)
                ),
                name,
            ))
        }
    };
    if text.len() > MAX_REQUEST_BYTES {
        return Err(ProxyError::request(
            format!(
                "{what} for {} are {} bytes as JSON, over the {MAX_REQUEST_BYTES}-byte cap",
                quoted_str(name, 80),
                text.len()
            ),
            name,
        ));
    }
    Ok(text.into_bytes())
}

/// Which proxy route a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// `POST {proxy_url}/tools/{name}` (§3.1).
    Tool,
    /// `POST {proxy_url}/traces/{event_type}` (§3.4).
    Trace,
}

impl RequestKind {
    /// The path segment: `tools` or `traces`.
    pub fn segment(self) -> &'static str {
        match self {
            RequestKind::Tool => "tools",
            RequestKind::Trace => "traces",
        }
    }
}

/// One proxy request as it goes on the wire; every retry of the logical call
/// sends it unchanged, its `Idempotency-Key` included (§3.1 idempotency-key-reuse).
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyRequest {
    /// Tool call or trace event.
    pub kind: RequestKind,
    /// The tool, or the trace event type.
    pub name: String,
    /// The whole URL.
    pub url: String,
    /// Header (name, value) pairs, the bearer included.
    pub headers: Vec<(String, String)>,
    /// The JSON body.
    pub body: Vec<u8>,
}

impl std::fmt::Debug for ProxyRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<(&str, &str)> = self
            .headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str(),
                    if n == "Authorization" {
                        REDACTED
                    } else {
                        v.as_str()
                    },
                )
            })
            .collect();
        f.debug_struct("ProxyRequest")
            .field("kind", &self.kind)
            .field("url", &self.url)
            .field("headers", &headers)
            .finish_non_exhaustive()
    }
}

impl ProxyRequest {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Percent-encodes everything outside RFC 3986's unreserved characters, so no
/// name can move the request to another path (§3.1 tool-name-path-safe).
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `POST {proxy_url}/{kind}/{name}` with the run token as bearer only (§7.4
/// kit-bearer-only) and one `Idempotency-Key` (§3.1); `actor` (validated)
/// goes in `X-Pipelines-Actor-Id`, and no header at all without one (§3.5
/// actor-absent-no-header).
pub fn proxy_request(
    proxy_url: &str,
    run_token: &str,
    kind: RequestKind,
    name: &str,
    body: Vec<u8>,
    actor: Option<&str>,
    idempotency_key: &str,
) -> Result<ProxyRequest, ProxyError> {
    let mut headers = vec![
        ("Content-Type".to_string(), "application/json".to_string()),
        ("Accept".to_string(), "application/json".to_string()),
        ("Authorization".to_string(), format!("Bearer {run_token}")),
        ("Idempotency-Key".to_string(), idempotency_key.to_string()),
        ("User-Agent".to_string(), user_agent()),
    ];
    if let Some(label) = actor.filter(|l| !l.is_empty()) {
        headers.push((HEADER_ACTOR_ID.to_string(), label.to_string()));
    }
    // §7.5 kit-header-values: a line break in a header value is refused, naming the header, never the value.
    if let Some((header, _)) = headers
        .iter()
        .find(|(_, v)| v.chars().any(|c| (c < ' ' && c != '\t') || c == '\x7f'))
    {
        return Err(ProxyError::request(
            format!("header {header} contains a line break or control character; nothing was sent"),
            name,
        ));
    }
    Ok(ProxyRequest {
        kind,
        name: name.to_string(),
        url: format!(
            "{}/{}/{}",
            proxy_url.trim_end_matches('/'),
            kind.segment(),
            percent_encode(name)
        ),
        headers,
        body,
    })
}

/// A tool call, checked before anything is sent: the name pattern, the actor
/// label, a JSON object of arguments under the 1 MiB cap (§3.1, §3.5, §7.5).
pub fn tool_call_request(
    proxy_url: &str,
    run_token: &str,
    name: &str,
    args: &Value,
    actor: &Value,
    idempotency_key: &str,
) -> Result<ProxyRequest, ProxyError> {
    let name = validate_tool_name(&Value::String(name.to_string()))?;
    let label = validate_actor_label(actor)?;
    let body = encode_args(&name, args, "tool arguments")?;
    proxy_request(
        proxy_url,
        run_token,
        RequestKind::Tool,
        &name,
        body,
        label.as_deref(),
        idempotency_key,
    )
}

/// A live trace event (§3.4): a reserved event type, a JSON object payload,
/// `__occurred_at` stamped once (given by the caller, so every retry keeps
/// it; §3.4 trace-occurred-at) unless the payload carries one.
pub fn trace_request(
    proxy_url: &str,
    run_token: &str,
    event_type: &str,
    payload: &Value,
    occurred_at: &str,
    actor: &Value,
    idempotency_key: &str,
) -> Result<ProxyRequest, ProxyError> {
    if !TRACE_EVENT_TYPES.contains(&event_type) {
        let mut known = TRACE_EVENT_TYPES.to_vec();
        known.sort_unstable();
        return Err(ProxyError::request(
            format!(
                "unknown trace event type {}: expected one of {}",
                quoted_str(event_type, 60),
                known.join(", ")
            ),
            event_type,
        ));
    }
    let label = validate_actor_label(actor)?;
    let mut event = match payload {
        Value::Null => Map::new(),
        Value::Object(map) => map.clone(),
        other => {
            return Err(ProxyError::request(
                format!(
                    "trace payload must be a JSON object, got {}",
                    json_type(other)
                ),
                event_type,
            ))
        }
    };
    event
        .entry("__occurred_at")
        .or_insert_with(|| Value::String(occurred_at.to_string()));
    let body = encode_args(event_type, &Value::Object(event), "trace payload")?;
    proxy_request(
        proxy_url,
        run_token,
        RequestKind::Trace,
        event_type,
        body,
        label.as_deref(),
        idempotency_key,
    )
}

/// A handoff between sub-agents (§3.4 handoff-shape).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Handoff {
    /// The sub-agent giving control.
    pub from: String,
    /// The sub-agent taking it.
    pub to: String,
    /// Why (optional).
    pub reason: Option<Value>,
    /// A preview of what is handed over (optional).
    pub payload_preview: Option<Value>,
}

/// The payload of a `handoff` event: `{"from_sub_agent", "to_sub_agent",
/// "reason"?, "payload_preview"?}`, both labels validated; `Ok(None)` for a
/// self-handoff, which is dropped, not sent (§3.4 self-handoff-dropped).
pub fn handoff_event(handoff: &Handoff) -> Result<Option<Value>, ProxyError> {
    let source = validate_actor_label(&Value::String(handoff.from.clone()))?;
    let target = validate_actor_label(&Value::String(handoff.to.clone()))?;
    let (Some(source), Some(target)) = (source, target) else {
        let mut e = ProxyError::request("a handoff needs non-empty from and to labels", "handoff");
        e.error_class = Some("actor_id_invalid".into());
        return Err(e);
    };
    if source == target {
        return Ok(None);
    }
    let mut event = Map::new();
    event.insert("from_sub_agent".into(), Value::String(source));
    event.insert("to_sub_agent".into(), Value::String(target));
    if let Some(reason) = handoff.reason.clone().filter(|v| !v.is_null()) {
        event.insert("reason".into(), reason);
    }
    if let Some(preview) = handoff.payload_preview.clone().filter(|v| !v.is_null()) {
        event.insert("payload_preview".into(), preview);
    }
    Ok(Some(Value::Object(event)))
}

/// Whether a proxy error is a local refusal.
pub fn is_request_error(error: &ProxyError) -> bool {
    error.kind == ProxyErrorKind::Request
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_names_follow_the_pattern() {
        assert!(validate_tool_name(&json!("get_order-2")).is_ok());
        for bad in [
            json!("../admin"),
            json!("9x"),
            json!(""),
            json!(7),
            json!("a".repeat(129)),
        ] {
            assert_eq!(
                validate_tool_name(&bad).unwrap_err().kind,
                ProxyErrorKind::Request
            );
        }
    }

    #[test]
    fn requests_carry_one_bearer_and_the_key() {
        let r = tool_call_request(
            "http://p/x/",
            "tok",
            "t",
            &Value::Null,
            &json!(" a/b "),
            "k-1",
        )
        .unwrap();
        assert_eq!(r.url, "http://p/x/tools/t");
        assert_eq!(r.body, b"{}");
        assert_eq!(r.header("authorization"), Some("Bearer tok"));
        assert_eq!(r.header("x-pipelines-actor-id"), Some("a/b"));
        assert!(!format!("{r:?}").contains("tok\""));
        let r = tool_call_request("http://p", "tok", "t", &json!({}), &json!(""), "k").unwrap();
        assert_eq!(r.header(HEADER_ACTOR_ID), None);
        assert!(
            tool_call_request("http://p", "tok\n", "t", &json!({}), &Value::Null, "k").is_err()
        );
    }

    #[test]
    fn self_handoffs_are_dropped() {
        let h = Handoff {
            from: "a".into(),
            to: " a ".into(),
            ..Default::default()
        };
        assert_eq!(handoff_event(&h).unwrap(), None);
    }
}
