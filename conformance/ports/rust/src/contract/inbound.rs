//! Inbound decisions (§2.3): routing, auth (constant time), framing, JSON,
//! ping, connectivity check, envelope. `decide_head` and `decide_body` are
//! the whole decision as pure functions; an adapter reads the body the head
//! allows, then runs the agent or probes the proxy when told to.

use super::constants::*;
use super::envelope::{validate_proxy_url, Envelope, Headers};
use super::json::{decode, json_type, short, truthy};
use super::replies::HttpReply;
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// SHA-256 of `data`, for comparing credentials in constant time whatever
/// their lengths, and for the conformance agent's echo.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares two strings in constant time whatever their lengths: both are
/// hashed, then every byte of the digests compared (§2.3 auth-constant-time).
pub fn constant_time_eq(a: &str, b: &str) -> bool {
    let (x, y) = (sha256(a.as_bytes()), sha256(b.as_bytes()));
    x.ct_eq(&y).into()
}

/// Whether the request carries the expected agent token, compared in
/// constant time. With `Authorization` the value must read `Bearer <token>`
/// (the scheme in any case, §7.1 kit-bearer-case); a custom header carries
/// the raw value (§2.1 custom-auth-header). Surrounding whitespace is
/// trimmed, an auth header sent twice never matches (§7.1 kit-hostile-input),
/// and an empty expected token never matches.
pub fn check_credential(headers: &Headers, expected: &str, header_name: &str) -> bool {
    if expected.is_empty() {
        return false;
    }
    let values: Vec<&str> = headers.get_all(header_name).collect();
    let [value] = values.as_slice() else {
        return false;
    };
    let mut received = value.trim();
    if header_name.eq_ignore_ascii_case("authorization") {
        let (scheme, rest) = received.split_once(' ').unwrap_or((received, ""));
        if !scheme.eq_ignore_ascii_case("bearer") {
            constant_time_eq("", expected); // a wrong scheme costs the time of a wrong token
            return false;
        }
        received = rest.trim();
    }
    constant_time_eq(received, expected)
}

/// Whether a decoded body is exactly `{"ping": true}`: one key, the boolean
/// `true` (§2.3 ping-exact, ping-strict).
pub fn is_ping(body: &Value) -> bool {
    matches!(body, Value::Object(map) if map.len() == 1 && map.get("ping") == Some(&Value::Bool(true)))
}

/// Whether a JSON object's text repeats a key at its top level
/// (`{"ping": false, "ping": true}`): refused rather than guessed (§7.1 kit-hostile-input).
pub fn has_duplicate_top_level_key(raw: &[u8]) -> bool {
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = bool;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut repeated = false;
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                repeated |= !seen.insert(key);
            }
            Ok(repeated)
        }
    }
    let text = String::from_utf8_lossy(raw);
    let repaired = super::json::repair_lone_surrogates(&text);
    let mut de = serde_json::Deserializer::from_str(&repaired);
    serde::Deserializer::deserialize_map(&mut de, Keys).unwrap_or(false)
}

/// How the endpoint authenticates, as read for this request (the token
/// variable is read at every request: §7.1 kit-token-env-per-request).
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// The expected agent token.
    Token(String),
    /// The token variable (named) is not set: every request gets 503 (§2.3 auth-env-unset-503).
    Unset(String),
    /// No inbound auth: an explicit choice (§2.3 auth-disable-explicit).
    Disabled,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Token(_) => f.write_str("Auth::Token([redacted])"),
            Auth::Unset(name) => write!(f, "Auth::Unset({name})"),
            Auth::Disabled => f.write_str("Auth::Disabled"),
        }
    }
}

/// The dispatch endpoint's settings (§2.3, §7.1).
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    /// The dispatch route, without a trailing `/`.
    pub path: String,
    /// `Authorization` (`Bearer <token>`) or a custom header with the raw value.
    pub auth_header: String,
    /// The request body limit in bytes (§7.1 kit-body-framing).
    pub max_body: usize,
    /// Served open on `GET /tools_schema` when set (§7.1 kit-routes).
    pub tools_schema: Option<Vec<Value>>,
}

impl Default for Endpoint {
    fn default() -> Self {
        Endpoint {
            path: DEFAULT_DISPATCH_PATH.into(),
            auth_header: "Authorization".into(),
            max_body: DEFAULT_MAX_BODY_BYTES,
            tools_schema: None,
        }
    }
}

/// What the endpoint does with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Answer this, and run nothing. `what` names it for the log line:
    /// `"ping"`, `"health"`, `"rejected"`, ...
    Reply {
        /// The answer.
        reply: HttpReply,
        /// What it is, for the log.
        what: &'static str,
    },
    /// Read exactly this many body bytes, then call [`decide_body`].
    ReadBody(usize),
    /// A connectivity check (§2.3 step 4): probe this proxy URL (§3.7).
    Probe(String),
    /// Run the agent on this envelope (§2.3 step 6).
    Run(Box<Envelope>),
}

fn refuse(reply: HttpReply) -> Decision {
    Decision::Reply {
        reply,
        what: "rejected",
    }
}

/// A request path without its trailing `/`.
pub fn route_path(path: &str) -> &str {
    let trimmed = path.trim_end_matches('/');
    if trimmed.is_empty() {
        "/"
    } else {
        trimmed
    }
}

/// §2.3 up to the body: routing (404, 405 with `Allow`), draining (503),
/// auth first (503 when the token variable is unset, 401 without echo),
/// then framing (411 for a chunked or length-less body, 413 over the limit,
/// each closing the connection).
pub fn decide_head(
    endpoint: &Endpoint,
    auth: &Auth,
    method: &str,
    path: &str,
    headers: &Headers,
    draining: bool,
) -> Decision {
    let path = route_path(path);
    let allowed = if path == endpoint.path {
        "POST"
    } else if path == "/healthz" || (path == "/tools_schema" && endpoint.tools_schema.is_some()) {
        "GET"
    } else {
        return refuse(HttpReply::refuse(
            404,
            format!(
                "no route for {}: dispatches go to POST {}",
                short(path, 100),
                endpoint.path
            ),
        ));
    };
    if method != allowed {
        return refuse(
            HttpReply::refuse(
                405,
                format!(
                    "{} is not allowed on {path}: use {allowed}",
                    short(method, 20)
                ),
            )
            .with_header("Allow", allowed),
        );
    }
    if path == "/healthz" && path != endpoint.path {
        return Decision::Reply {
            reply: HttpReply::ok(json!({"ok": true, "version": VERSION})),
            what: "health",
        };
    }
    if path == "/tools_schema" && path != endpoint.path {
        let schema = endpoint.tools_schema.clone().unwrap_or_default();
        return Decision::Reply {
            reply: HttpReply::ok(json!({ "tools_schema": schema })),
            what: "health",
        };
    }
    if draining {
        return refuse(
            HttpReply::refuse(503, "server is shutting down: retry on another instance").closing(),
        );
    }

    // Step 1: auth, before anything about the body (§2.3 auth-first).
    match auth {
        Auth::Disabled => {}
        Auth::Unset(variable) => {
            return refuse(HttpReply::refuse(
                503,
                format!(
                    "this agent's wrapper is misconfigured: auth reads environment variable {variable}, which is not set"
                ),
            ));
        }
        Auth::Token(expected) => {
            if !check_credential(headers, expected, &endpoint.auth_header) {
                let reply = HttpReply::refuse(
                    401,
                    format!(
                        "missing or invalid credential in the {} header",
                        endpoint.auth_header
                    ),
                );
                return refuse(
                    if endpoint.auth_header.eq_ignore_ascii_case("authorization") {
                        reply.with_header("WWW-Authenticate", "Bearer")
                    } else {
                        reply
                    },
                );
            }
        }
    }

    // Framing (§7.1 kit-body-framing): a length, within the limit, decided before reading.
    if headers.contains("transfer-encoding") {
        return refuse(
            HttpReply::refuse(
                411,
                "chunked request bodies are not supported: send the JSON body with a Content-Length header",
            )
            .closing(),
        );
    }
    let lengths: Vec<&str> = headers.get_all("content-length").map(str::trim).collect();
    if lengths.windows(2).any(|w| w[0] != w[1]) {
        return refuse(HttpReply::refuse(400, "conflicting Content-Length headers").closing());
    }
    let length = match lengths.first() {
        None => None,
        Some(text) if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => {
            Some(text.parse::<u128>())
        }
        Some(_) => {
            return refuse(
                HttpReply::refuse(400, "Content-Length must be one decimal number").closing(),
            )
        }
    };
    match length {
        None => refuse(
            HttpReply::refuse(
                411,
                "a Content-Length header is required: send the JSON body with its length",
            )
            .closing(),
        ),
        Some(Ok(n)) if n <= endpoint.max_body as u128 => Decision::ReadBody(n as usize),
        Some(n) => refuse(
            HttpReply::refuse(
                413,
                format!(
                    "request body of {} bytes is over this endpoint's {}-byte cap",
                    n.map_or_else(|_| "too many".to_string(), |n| n.to_string()),
                    endpoint.max_body
                ),
            )
            .closing(),
        ),
    }
}

/// §2.3 steps 2 to 5 on the body read (`expected` bytes were announced):
/// truncated → 400, not JSON → 400, ping → 200, not an object → 400,
/// connectivity check → probe, else the envelope (400 naming what is missing).
pub fn decide_body(headers: &Headers, body: &[u8], expected: usize) -> Decision {
    if body.len() < expected {
        return refuse(
            HttpReply::refuse(
                400,
                format!(
                    "request body is truncated: {} of {expected} bytes arrived",
                    body.len()
                ),
            )
            .closing(),
        );
    }
    let payload = match decode(body) {
        Ok(payload) => payload,
        Err(e) => {
            return refuse(HttpReply::refuse(
                400,
                format!("body is not valid JSON: {}", short(&e, 200)),
            ))
        }
    };
    if is_ping(&payload) {
        if has_duplicate_top_level_key(body) {
            return refuse(HttpReply::refuse(
                400,
                r#"body repeats the key "ping": send {"ping": true} once"#,
            ));
        }
        return Decision::Reply {
            reply: HttpReply::ok(json!({"ok": true})),
            what: "ping",
        };
    }
    if !payload.is_object() {
        return refuse(HttpReply::refuse(
            400,
            format!("body must be a JSON object, got {}", json_type(&payload)),
        ));
    }
    if payload.get("connectivity_check") == Some(&Value::Bool(true)) {
        return match connectivity_proxy_url(&payload, headers) {
            Ok(url) => Decision::Probe(url),
            Err(reply) => refuse(reply),
        };
    }
    match Envelope::from_dispatch(&payload, headers) {
        Ok(envelope) => Decision::Run(Box::new(envelope)),
        Err(e) => refuse(HttpReply::refuse(400, e.0)),
    }
}

/// The proxy URL a connectivity check names (§2.3 step 4, §7.1 kit-connectivity-any-body).
pub fn connectivity_proxy_url(payload: &Value, headers: &Headers) -> Result<String, HttpReply> {
    let url = [FIELD_PROXY_URL, FIELD_PROXY_URL_LEGACY]
        .iter()
        .filter_map(|field| payload.get(*field))
        .find(|v| truthy(v))
        .cloned()
        .or_else(|| {
            headers
                .get(HEADER_PROXY_URL)
                .map(|v| Value::String(v.to_string()))
        });
    let Some(url) = url else {
        return Err(HttpReply::refuse(
            400,
            format!("connectivity_check needs a proxy URL: body field '{FIELD_PROXY_URL}' or header {HEADER_PROXY_URL}"),
        ));
    };
    validate_proxy_url(&url, "the connectivity check").map_err(|e| HttpReply::refuse(400, e.0))
}

/// The result of a reachability probe (§3.7): 401, 403 or a 2xx means reachable.
pub fn probe_result(status: Option<u16>, error: Option<String>, latency_ms: f64) -> Value {
    let reachable = matches!(status, Some(401 | 403 | 200..=299));
    let error = match (reachable, status, error) {
        (true, _, _) => Value::Null,
        (false, Some(s), None) => json!(format!("unexpected HTTP {s} from the proxy")),
        (false, _, e) => json!(e.map(|e| short(&e, 200))),
    };
    json!({"reachable": reachable, "status_code": status, "latency_ms": (latency_ms * 10.0).round() / 10.0, "error": error})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_matches_the_standard() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let long = vec![b'a'; 1000];
        assert_eq!(
            hex(&sha256(&long)),
            "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3"
        );
    }

    #[test]
    fn credentials() {
        let h: Headers = [("authorization", "bearer  tok ")].into_iter().collect();
        assert!(check_credential(&h, "tok", "Authorization"));
        assert!(!check_credential(&h, "to", "Authorization"));
        let twice: Headers = [
            ("Authorization", "Bearer tok"),
            ("authorization", "Bearer tok"),
        ]
        .into_iter()
        .collect();
        assert!(!check_credential(&twice, "tok", "Authorization"));
        assert!(!check_credential(&Headers::new(), "", "Authorization"));
    }

    #[test]
    fn duplicate_keys_are_seen() {
        assert!(has_duplicate_top_level_key(
            br#"{"ping": false, "ping": true}"#
        ));
        assert!(!has_duplicate_top_level_key(
            br#"{"ping": true, "x": {"a": 1, "b": 1}}"#
        ));
    }
}
