//! HTTP replies of a dispatch endpoint (JSON bodies, one error path) and
//! redaction of the secrets (§2.1 run-token-secret, §7.3, §7.6).

use super::constants::*;
use super::json::short;
use serde_json::{json, Map, Value};

/// One answer of the dispatch endpoint: a status, a JSON body, extra headers.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpReply {
    /// The HTTP status.
    pub status: u16,
    /// The JSON body.
    pub body: Value,
    /// Extra headers (`Allow`, `WWW-Authenticate`, `Connection`).
    pub headers: Vec<(String, String)>,
}

impl HttpReply {
    /// A 200 with this body.
    pub fn ok(body: Value) -> Self {
        HttpReply {
            status: 200,
            body,
            headers: Vec::new(),
        }
    }

    /// A refusal: `{"detail": detail}` (§7.1 kit-error-statuses).
    pub fn refuse(status: u16, detail: impl Into<String>) -> Self {
        HttpReply {
            status,
            body: json!({ "detail": detail.into() }),
            headers: Vec::new(),
        }
    }

    /// The same reply with one more header.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// The same reply, closing the connection after it.
    pub fn closing(self) -> Self {
        self.with_header("Connection", "close")
    }

    /// Whether the connection closes after this reply.
    pub fn closes(&self) -> bool {
        self.headers
            .iter()
            .any(|(n, v)| n.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case("close"))
    }

    /// The `detail` of a refusal.
    pub fn detail(&self) -> Option<&str> {
        self.body.get("detail").and_then(Value::as_str)
    }
}

/// `text` with every non-empty secret replaced by `[redacted]`.
pub fn redact_str(text: &str, secrets: &[&str]) -> String {
    let mut out = text.to_string();
    for secret in secrets.iter().filter(|s| !s.is_empty()) {
        if out.contains(secret) {
            out = out.replace(secret, REDACTED);
        }
    }
    out
}

/// A JSON value with the secrets replaced in every string, keys included.
pub fn redact_value(value: &Value, secrets: &[&str]) -> Value {
    match value {
        Value::String(s) => Value::String(redact_str(s, secrets)),
        Value::Array(items) => {
            Value::Array(items.iter().map(|v| redact_value(v, secrets)).collect())
        }
        Value::Object(map) => {
            let mut out = Map::new();
            for (k, v) in map {
                out.insert(redact_str(k, secrets), redact_value(v, secrets));
            }
            Value::Object(out)
        }
        other => other.clone(),
    }
}

/// Whether any string of a JSON value (keys included) contains a secret.
pub fn contains_secret(value: &Value, secrets: &[&str]) -> bool {
    let secrets: Vec<&str> = secrets.iter().copied().filter(|s| !s.is_empty()).collect();
    !secrets.is_empty() && {
        let text = value.to_string();
        secrets.iter().any(|s| {
            let escaped = Value::String(s.to_string()).to_string(); // the secret as it appears inside JSON text
            text.contains(s) || text.contains(&escaped[1..escaped.len() - 1])
        })
    }
}

/// Folds line breaks and runs of whitespace to one space and cuts the text to
/// at most `limit` characters (§7.3 kit-error-detail-shape).
pub fn one_line(text: &str, limit: usize) -> String {
    short(
        &text.split_whitespace().collect::<Vec<_>>().join(" "),
        limit.saturating_sub(1),
    )
}

/// The 500 `detail` of a failing agent: `"Type: message"` on one line, at
/// most 500 characters, secrets redacted *before* the cut, so no token can
/// be half-shown (§2.3 agent-error-detail, §7.3, §7.6 kit-error-redaction).
pub fn agent_error_detail(described: &str, secrets: &[&str]) -> String {
    one_line(&redact_str(described, secrets), DETAIL_LIMIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_redacted_everywhere() {
        let v = json!({"a tok": ["x tok y", 1]});
        assert_eq!(
            redact_value(&v, &["tok", ""]),
            json!({"a [redacted]": ["x [redacted] y", 1]})
        );
        assert!(contains_secret(&v, &["tok"]));
        assert!(!contains_secret(&v, &[""]));
    }

    #[test]
    fn details_are_one_line() {
        assert_eq!(
            agent_error_detail("Error: a\n  b tok", &["tok"]),
            "Error: a b [redacted]"
        );
        assert_eq!(one_line(&"x".repeat(900), 500).chars().count(), 500);
    }
}
