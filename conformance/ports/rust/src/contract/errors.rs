//! Errors. Each refusal carries the HTTP status a dispatch endpoint answers
//! with (§7.1 kit-error-statuses); proxy failures carry their kind (§3.3).

use serde_json::{json, Map, Value};
use std::fmt;
use std::time::Duration;

/// A dispatch envelope is missing or malformed (§2.2, §2.3 step 5): 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvelopeError(pub String);

impl fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EnvelopeError {}

/// What kind of proxy failure (§3.3): the names the conformance agent reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyErrorKind {
    /// A terminal reply (after the retry policy, if it retried).
    Proxy,
    /// 401 with a stale-token class: the run is over (§3.3 stale-token-distinct).
    StaleRunToken,
    /// No usable reply: timeout, refused or reset connection, TLS, DNS.
    Transport,
    /// Refused locally, nothing sent (§7.5).
    Request,
}

impl ProxyErrorKind {
    /// `"proxy"`, `"stale_run_token"`, `"transport"` or `"request"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyErrorKind::Proxy => "proxy",
            ProxyErrorKind::StaleRunToken => "stale_run_token",
            ProxyErrorKind::Transport => "transport",
            ProxyErrorKind::Request => "request",
        }
    }
}

/// A failed tool call or trace post (§3.3). The message and the kept body
/// never contain the run token.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyError {
    /// What kind of failure.
    pub kind: ProxyErrorKind,
    /// One readable sentence.
    pub message: String,
    /// The HTTP status, `None` when no reply arrived or nothing was sent.
    pub status_code: Option<u16>,
    /// The platform's machine-readable class.
    pub error_class: Option<String>,
    /// The reply body as parsed (its first 200 characters when not JSON), scrubbed of the run token.
    pub body: Box<Value>,
    /// The tool (or trace event type) called.
    pub tool_name: String,
    /// The reply's `Retry-After`, when it had one.
    pub retry_after: Option<Duration>,
}

impl ProxyError {
    /// A failure with no reply fields.
    pub fn new(
        kind: ProxyErrorKind,
        message: impl Into<String>,
        tool_name: impl Into<String>,
    ) -> Self {
        ProxyError {
            kind,
            message: message.into(),
            status_code: None,
            error_class: None,
            body: Box::default(),
            tool_name: tool_name.into(),
            retry_after: None,
        }
    }

    /// A local refusal (kind `request`).
    pub fn request(message: impl Into<String>, tool_name: impl Into<String>) -> Self {
        Self::new(ProxyErrorKind::Request, message, tool_name)
    }

    /// The failure as an `{"error": ...}` tool result a model can read (§7.4 kit-errors-return).
    pub fn to_value(&self) -> Value {
        let mut value = Map::new();
        value.insert("error".into(), json!(self.message));
        if let Some(class) = &self.error_class {
            value.insert("error_class".into(), json!(class));
        }
        if let Some(status) = self.status_code {
            value.insert("status_code".into(), json!(status));
        }
        Value::Object(value)
    }
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ProxyError {}

/// What an agent returned cannot become a response envelope (§4): 500.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseError {
    /// Each problem, with its JSON path.
    pub problems: Vec<String>,
}

impl fmt::Display for ResponseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.problems.join("; "))
    }
}

impl std::error::Error for ResponseError {}

/// The agent overran its run timeout (§2.3 step 7, §7.3 kit-run-timeout-504): 504.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunTimeoutError {
    /// The run timeout.
    pub limit: Duration,
}

impl fmt::Display for RunTimeoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "agent did not finish within run_timeout_s={} s",
            format_seconds(self.limit)
        )
    }
}

impl std::error::Error for RunTimeoutError {}

/// Seconds as Python prints them: `300`, `0.5`.
pub fn format_seconds(d: Duration) -> String {
    let text = format!("{:.3}", d.as_secs_f64());
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// An agent's failure: `?` turns any error into one, keeping its type's
/// name for the 500 `detail` (`"ProxyError: ..."`, §2.3 agent-error-detail).
///
/// Like `anyhow::Error`, it does not implement `std::error::Error` itself, so
/// that `From<E: Error>` covers every error type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentError {
    /// The type name shown before the message (`Error` for a plain message).
    pub type_name: String,
    /// The message.
    pub message: String,
}

impl AgentError {
    /// An error of type `Error` with this message (`{"raise": MESSAGE}`).
    pub fn msg(message: impl Into<String>) -> Self {
        AgentError {
            type_name: "Error".into(),
            message: message.into(),
        }
    }

    /// `"TypeName: message"`, or the bare type name when the message is empty.
    pub fn describe(&self) -> String {
        if self.message.is_empty() {
            self.type_name.clone()
        } else {
            format!("{}: {}", self.type_name, self.message)
        }
    }
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl<E: std::error::Error + 'static> From<E> for AgentError {
    fn from(error: E) -> Self {
        let full = std::any::type_name::<E>();
        let base = full.split('<').next().unwrap_or(full);
        let name = base.rsplit("::").next().unwrap_or(base);
        AgentError {
            type_name: name.to_string(),
            message: error.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_errors_keep_their_type_name() {
        let e: AgentError = EnvelopeError("no".into()).into();
        assert_eq!(e.describe(), "EnvelopeError: no");
        let e: AgentError = std::io::Error::other("disk").into();
        assert_eq!(e.describe(), "Error: disk");
        assert_eq!(AgentError::msg("").describe(), "Error");
    }

    #[test]
    fn seconds_print_like_python() {
        assert_eq!(format_seconds(Duration::from_secs(300)), "300");
        assert_eq!(format_seconds(Duration::from_millis(500)), "0.5");
    }
}
