//! Envelope (§2.2): the dispatch as the agent sees it, parsed from the body
//! and the request headers (body fields first, header fallbacks, legacy names,
//! native id types, unknown fields kept).

use super::constants::*;
use super::encoding::validate_actor_label;
use super::errors::EnvelopeError;
use super::json::{quoted_str, short};
use serde_json::{Map, Value};
use std::fmt;

/// Request headers: names matched case-insensitively (§2.1
/// headers-case-insensitive), every value kept in arrival order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// No headers.
    pub fn new() -> Self {
        Headers(Vec::new())
    }

    /// Adds one value.
    pub fn append(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.0.push((name.into(), value.into()));
    }

    /// Every value of `name`, in order.
    pub fn get_all<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a str> + 'a {
        let name = name.to_ascii_lowercase();
        self.0
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(&name))
            .map(|(_, v)| v.as_str())
    }

    /// The first value, trimmed; `None` when absent or blank (§7.2 kit-repeated-header).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_all(name)
            .next()
            .map(str::trim)
            .filter(|v| !v.is_empty())
    }

    /// Whether `name` is present at all.
    pub fn contains(&self, name: &str) -> bool {
        self.get_all(name).next().is_some()
    }

    /// Every (name, value) pair.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

impl<N: Into<String>, V: Into<String>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        Headers(
            iter.into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
        )
    }
}

/// One run's dispatch (§2.2). Ids keep their JSON type (a number or a string;
/// ids read from headers are strings), `None` when absent. The run token is a
/// secret: private, read with [`Envelope::run_token`], never in `Debug`.
#[derive(Clone, PartialEq)]
pub struct Envelope {
    /// The proxy base URL, without a trailing `/`.
    pub proxy_url: String,
    run_token: String,
    /// `run_id`: body, else the `X-Pipelines-Run-Id` header.
    pub run_id: Option<Value>,
    /// `task_id`: body, `input.task_id`, else the header (§7.2 kit-task-id-fallback).
    pub task_id: Option<Value>,
    /// `agent_id` from the body.
    pub agent_id: Option<Value>,
    /// The token's correlation id (not the token).
    pub run_token_jti: Option<String>,
    /// `body.input.user_instruction`, `""` when absent (§2.2 prompt-field).
    pub user_instruction: String,
    /// `body.input.input`, `{}` when absent (§2.2 task-input-nesting).
    pub task_input: Map<String, Value>,
    /// Multi-turn fields (§2.2 multi-turn-fields).
    pub latest_user_prompt: Option<String>,
    /// An integer or a non-blank string (§7.2 kit-native-session-id).
    pub session_id: Option<Value>,
    /// Any JSON type (§7.2 kit-turn-id-any).
    pub turn_id: Option<Value>,
    /// Earlier turns.
    pub messages: Option<Vec<Value>>,
    /// Scenario state.
    pub scenario_state: Option<Map<String, Value>>,
    /// Coding runs: cwd, setup_mode, setup_instructions (§2.2 workspace-field).
    pub workspace: Option<Map<String, Value>>,
    /// The inlined tool list (§2.2 tools-schema-inline).
    pub tools_schema: Option<Vec<Value>>,
    /// Declared sub-agent labels (§7.2 kit-sub-agents-catalog).
    pub sub_agents: Vec<String>,
    /// The proxy URL's origin.
    pub api_url: String,
    /// The whole body, unknown fields included (§2.2 unknown-fields-available).
    pub raw: Map<String, Value>,
}

impl fmt::Debug for Envelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Envelope")
            .field("proxy_url", &self.proxy_url)
            .field("run_token", &REDACTED)
            .field("run_id", &self.run_id)
            .field("task_id", &self.task_id)
            .field("run_token_jti", &self.run_token_jti)
            .finish_non_exhaustive()
    }
}

impl Envelope {
    /// The run's bearer for the proxy: a secret (§2.1 run-token-secret).
    pub fn run_token(&self) -> &str {
        &self.run_token
    }

    /// A turn of a multi-turn run: the input carries `session_id` or
    /// `turn_id` (§2.2 multi-turn-fields); its turn reply is sent as built.
    pub fn is_multi_turn(&self) -> bool {
        self.session_id.is_some() || self.turn_id.is_some()
    }

    /// A minimal envelope for a run (tests, or a caller driving the client by hand).
    pub fn for_run(proxy_url: &str, run_token: &str) -> Result<Envelope, EnvelopeError> {
        let mut headers = Headers::new();
        headers.append(HEADER_RUN_TOKEN, run_token);
        let mut body = Map::new();
        body.insert(FIELD_PROXY_URL.into(), Value::String(proxy_url.into()));
        Envelope::from_dispatch(&Value::Object(body), &headers)
    }

    /// Parses an HTTP dispatch (§2.2): the JSON body plus the request headers.
    /// Body fields win; the ids, the jti and the proxy URL fall back to the
    /// `X-Pipelines-*` headers and the legacy `pwsa` names; the run token
    /// comes from `X-Pipelines-Run-Token`. The error names what is missing
    /// and where it was looked for, and never shows the run token.
    pub fn from_dispatch(body: &Value, headers: &Headers) -> Result<Envelope, EnvelopeError> {
        let Value::Object(object) = body else {
            return Err(EnvelopeError(format!(
                "dispatch body must be a JSON object, got {}",
                super::json::json_type(body)
            )));
        };
        let mut url: Option<(String, String)> = None;
        for field in [FIELD_PROXY_URL, FIELD_PROXY_URL_LEGACY] {
            if let (None, Some(Value::String(text))) = (&url, object.get(field)) {
                if !text.trim().is_empty() {
                    url = Some((text.clone(), format!("body field '{field}'")));
                }
            }
        }
        for name in [HEADER_PROXY_URL, HEADER_PROXY_URL_LEGACY] {
            if let (None, Some(value)) = (&url, headers.get(name)) {
                url = Some((value.to_string(), format!("header {name}")));
            }
        }
        let token = headers.get(HEADER_RUN_TOKEN);
        let mut missing = Vec::new();
        if url.is_none() {
            missing.push(format!(
                "proxy URL (looked for body field '{FIELD_PROXY_URL}', legacy '{FIELD_PROXY_URL_LEGACY}', \
                 and headers {HEADER_PROXY_URL}, legacy {HEADER_PROXY_URL_LEGACY})"
            ));
        }
        if token.is_none() {
            missing.push(format!("run token (looked for header {HEADER_RUN_TOKEN})"));
        }
        let (Some((url, where_)), Some(token)) = (url, token) else {
            return Err(EnvelopeError(format!(
                "dispatch is missing {}",
                missing.join(" and ")
            )));
        };
        let proxy_url = validate_proxy_url(&Value::String(url), &where_)?;
        let run_token = check_run_token(token, &format!("header {HEADER_RUN_TOKEN}"))?;

        let empty = Map::new();
        let task = match object.get("input") {
            Some(Value::Object(task)) => task,
            _ => &empty,
        };
        let header_id = |name: &str| headers.get(name).map(|v| Value::String(v.to_string()));
        let jti = match object.get("run_token_jti") {
            Some(Value::String(text)) if !text.trim().is_empty() => Some(text.trim().to_string()),
            _ => headers.get(HEADER_RUN_TOKEN_JTI).map(str::to_string),
        };
        let string_of = |key: &str| match task.get(key) {
            Some(Value::String(text)) => Some(text.clone()),
            _ => None,
        };
        let object_of = |key: &str| match task.get(key) {
            Some(Value::Object(map)) => Some(map.clone()),
            _ => None,
        };
        Ok(Envelope {
            api_url: origin(&proxy_url),
            proxy_url,
            run_token,
            run_id: first_id([object.get("run_id").cloned(), header_id(HEADER_RUN_ID)]),
            task_id: first_id([
                object.get("task_id").cloned(),
                task.get("task_id").cloned(),
                header_id(HEADER_TASK_ID),
            ]),
            agent_id: first_id([object.get("agent_id").cloned()]),
            run_token_jti: jti,
            user_instruction: string_of("user_instruction").unwrap_or_default(),
            task_input: object_of("input").unwrap_or_default(),
            latest_user_prompt: string_of("latest_user_prompt"),
            session_id: task.get("session_id").and_then(native_id),
            turn_id: task.get("turn_id").filter(|v| !v.is_null()).cloned(),
            messages: match task.get("messages") {
                Some(Value::Array(list)) => Some(list.clone()),
                _ => None,
            },
            scenario_state: object_of("scenario_state"),
            workspace: object_of("workspace"),
            tools_schema: match object.get("tools_schema") {
                Some(Value::Array(list)) => Some(list.clone()),
                _ => None,
            },
            sub_agents: sub_agent_catalog(object.get("sub_agents")),
            raw: object.clone(),
        })
    }

    /// Parses a dispatch from its raw body bytes.
    pub fn from_dispatch_bytes(body: &[u8], headers: &Headers) -> Result<Envelope, EnvelopeError> {
        let value = super::json::decode(body).map_err(|e| {
            EnvelopeError(format!(
                "dispatch body is not valid JSON: {}",
                short(&e, 200)
            ))
        })?;
        Envelope::from_dispatch(&value, headers)
    }
}

/// `scheme://authority` of a URL.
fn origin(url: &str) -> String {
    match url.find("://") {
        Some(at) => {
            let rest = &url[at + 3..];
            let end = rest.find('/').unwrap_or(rest.len());
            format!("{}{}", &url[..at + 3], &rest[..end])
        }
        None => String::new(),
    }
}

/// The proxy base URL without its trailing `/`: `http://` or `https://` with a
/// host, no query or fragment, no whitespace or control characters (§2.2
/// proxy-url-source, §7.2 kit-proxy-url-checked). `where_` names the source.
pub fn validate_proxy_url(url: &Value, where_: &str) -> Result<String, EnvelopeError> {
    let text = match url {
        Value::String(text) if !text.trim().is_empty() => {
            text.trim().trim_end_matches('/').to_string()
        }
        _ => {
            return Err(EnvelopeError(format!(
                "proxy URL from {where_} must be a non-empty string"
            )));
        }
    };
    let shown = quoted_str(&text, 200);
    let bad_host = || {
        EnvelopeError(format!(
            "proxy URL {shown} from {where_} must be an http:// or https:// URL with a host"
        ))
    };
    let (scheme, rest) = text.split_once("://").ok_or_else(bad_host)?;
    let scheme_ok = scheme
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c));
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = match host_port.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => (host, port),
        _ => (host_port, ""),
    };
    let scheme = scheme.to_ascii_lowercase();
    if !scheme_ok || (scheme != "http" && scheme != "https") || host.is_empty() {
        return Err(bad_host());
    }
    if !port.is_empty() && port.parse::<u32>().map_or(true, |p| p > 65535) {
        return Err(EnvelopeError(format!(
            "proxy URL {shown} from {where_} is not a valid URL: port out of range"
        )));
    }
    if rest[authority_end..].contains(['?', '#']) {
        return Err(EnvelopeError(format!(
            "proxy URL {shown} from {where_} must not carry a query or fragment"
        )));
    }
    if text.chars().any(|c| c <= ' ' || c == '\x7f') {
        return Err(EnvelopeError(format!(
            "proxy URL from {where_} contains whitespace or control characters"
        )));
    }
    Ok(text)
}

/// The run token, trimmed; one with control characters is refused without showing it (§7.2 kit-run-token-checked).
fn check_run_token(token: &str, where_: &str) -> Result<String, EnvelopeError> {
    let token = token.trim();
    if token.is_empty() {
        return Err(EnvelopeError(format!(
            "run token from {where_} must be a non-empty string"
        )));
    }
    if token.chars().any(|c| c < ' ' || c == '\x7f') {
        return Err(EnvelopeError(format!(
            "run token from {where_} contains control characters"
        )));
    }
    Ok(token.to_string())
}

/// An id as the body types it: an integer or a non-blank string (trimmed);
/// anything else (a float, a boolean) is absent (§7.2 kit-float-ids-absent).
pub fn native_id(value: &Value) -> Option<Value> {
    match value {
        Value::Number(n) if n.is_i64() || n.is_u64() => Some(value.clone()),
        Value::String(s) if !s.trim().is_empty() => Some(Value::String(s.trim().to_string())),
        _ => None,
    }
}

fn first_id<const N: usize>(candidates: [Option<Value>; N]) -> Option<Value> {
    candidates.into_iter().flatten().find_map(|v| native_id(&v))
}

/// §2.2 `sub_agents`: label strings or `{"actor_id": label}`; malformed
/// entries and repeats skipped (§7.2 kit-sub-agents-normalised).
fn sub_agent_catalog(value: Option<&Value>) -> Vec<String> {
    let mut labels: Vec<String> = Vec::new();
    let Some(Value::Array(entries)) = value else {
        return labels;
    };
    for entry in entries {
        let raw = match entry {
            Value::Object(object) => object.get("actor_id").unwrap_or(&Value::Null),
            other => other,
        };
        if !raw.is_string() {
            continue;
        }
        if let Ok(Some(label)) = validate_actor_label(raw) {
            if !labels.contains(&label) {
                labels.push(label);
            }
        }
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn debug_never_shows_the_run_token() {
        let env = Envelope::for_run("http://127.0.0.1:9/p/", "tok-secret-1").unwrap();
        assert_eq!(env.proxy_url, "http://127.0.0.1:9/p");
        assert!(!format!("{env:?}").contains("tok-secret-1"));
        assert_eq!(env.run_token(), "tok-secret-1");
    }

    #[test]
    fn ids_keep_their_type_and_fall_back_to_headers() {
        let headers: Headers = [
            ("x-pipelines-run-token", "t"),
            ("X-Pipelines-Run-Id", " 17 "),
            ("x-pipelines-task-id", "9"),
        ]
        .into_iter()
        .collect();
        let body =
            json!({"odyssey_proxy_url": "https://p.example/x", "task_id": 4.5, "agent_id": "a"});
        let env = Envelope::from_dispatch(&body, &headers).unwrap();
        assert_eq!(env.run_id, Some(json!("17")));
        assert_eq!(env.task_id, Some(json!("9")));
        assert_eq!(env.agent_id, Some(json!("a")));
        assert_eq!(env.api_url, "https://p.example");
    }

    #[test]
    fn proxy_urls_are_checked() {
        for bad in [
            "ftp://x",
            "http://",
            "http://x?q=1",
            "http://x:99999",
            "http://a b",
        ] {
            assert!(validate_proxy_url(&json!(bad), "t").is_err(), "{bad}");
        }
        assert_eq!(
            validate_proxy_url(&json!(" http://[::1]:80/a// "), "t").unwrap(),
            "http://[::1]:80/a"
        );
    }
}
