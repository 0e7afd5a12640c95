//! The dispatch app (§2) and its axum adapter (feature `axum`): `decide`,
//! then answer, probe the proxy or run the agent; graceful shutdown.
//!
//! ```no_run
//! use pipelines_port::{AgentError, DispatchApp, Options, Run};
//! use serde_json::json;
//!
//! async fn agent(run: Run) -> Result<String, AgentError> {
//!     let order = run.call("get_order", json!({"order_id": run.envelope().task_input["order_id"]})).await?;
//!     Ok(format!("Order: {order}"))
//! }
//!
//! # async fn main_() -> std::io::Result<()> {
//! let app = DispatchApp::new(agent, Options::default()).expect("valid options");
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! pipelines_port::server::serve(listener, app, async { let _ = tokio::signal::ctrl_c().await; },
//!     std::time::Duration::from_secs(30)).await?;
//! # Ok(()) }
//! ```
//!
//! Request heads are parsed by hyper, whose parser (httparse) refuses every
//! head CONTRACT §2.3 no-request-smuggling lists with a 400 and a closed
//! connection: whitespace before a colon, a field line without a colon, a
//! bare CR, obs-fold, conflicting `Content-Length`s. hyper accepts
//! `Transfer-Encoding: chunked` together with `Content-Length` (RFC 9112
//! §6.1 allows a server to); the app answers any `Transfer-Encoding` with 411
//! and `Connection: close` before reading a byte of the body, so nothing
//! after the head is ever read as a request.

use crate::aio::{AsyncClient, Run};
use crate::contract::constants::*;
use crate::contract::envelope::Headers;
use crate::contract::errors::{format_seconds, AgentError, RunTimeoutError};
use crate::contract::inbound::{decide_body, decide_head, route_path, Auth, Decision, Endpoint};
use crate::contract::json::{quoted_str, short};
use crate::contract::replies::{
    agent_error_detail, contains_secret, one_line, redact_value, HttpReply,
};
use crate::contract::response::build_reply;
use crate::transport::log;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::Serialize;
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

type AgentOutput = Result<Result<Value, serde_json::Error>, AgentError>;
type AgentFn = Arc<dyn Fn(Run) -> Pin<Box<dyn Future<Output = AgentOutput> + Send>> + Send + Sync>;

/// The dispatch endpoint's options; `Options::default()` is the kit's defaults.
#[derive(Clone, Debug)]
pub struct Options {
    /// The dispatch route (`/dispatch`).
    pub path: String,
    /// A fixed agent token; wins over `token_env`.
    pub token: Option<String>,
    /// The variable holding the agent token, read at every request (`AGENT_TOKEN`).
    pub token_env: String,
    /// `Authorization` (`Bearer <token>`) or a custom header with the raw value.
    pub auth_header: String,
    /// Run without inbound auth: an explicit choice, logged loudly.
    pub no_auth: bool,
    /// Refuse (500) what the platform would only soften; also `PIPELINES_PORT_STRICT=1`.
    pub strict: bool,
    /// Request body limit (8 MiB).
    pub max_body: usize,
    /// The run timeout (300 s, at most 1800 s); an overrun is answered 504.
    pub run_timeout: Duration,
    /// The request body must arrive within this (30 s).
    pub read_timeout: Duration,
    /// Served open on `GET /tools_schema` when set.
    pub tools_schema: Option<Vec<Value>>,
    /// The proxy client the agent's calls use (one per app by default).
    pub client: Option<AsyncClient>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            path: DEFAULT_DISPATCH_PATH.into(),
            token: None,
            token_env: DEFAULT_TOKEN_ENV.into(),
            auth_header: "Authorization".into(),
            no_auth: false,
            strict: false,
            max_body: DEFAULT_MAX_BODY_BYTES,
            run_timeout: DEFAULT_RUN_TIMEOUT,
            read_timeout: Duration::from_secs(30),
            tools_schema: None,
            client: None,
        }
    }
}

struct Inner {
    agent: AgentFn,
    options: Options,
    endpoint: Endpoint,
    client: AsyncClient,
    draining: AtomicBool,
    cut: watch::Sender<bool>,
}

/// Serves one agent over HTTP (§2.3). Cheap to clone; [`DispatchApp::router`]
/// is an ordinary axum `Router` to mount or serve.
#[derive(Clone)]
pub struct DispatchApp {
    inner: Arc<Inner>,
}

/// Whether a strict-mode variable is on (`1`, `true`, `yes`, `on`).
pub fn strict_from_env() -> bool {
    std::env::var("PIPELINES_PORT_STRICT")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

impl DispatchApp {
    /// Checks the options and makes the app. The agent gets the run's
    /// [`Run`] (the envelope and the proxy client) and returns anything that
    /// serialises to what [`crate::contract::response::build_response`] accepts: a `String`, a
    /// [`crate::ResponseEnvelope`], a JSON object with `final_response`; in a
    /// multi-turn dispatch a [`crate::TurnReply`] is sent as built ([`build_reply`]).
    pub fn new<F, Fut, T>(agent: F, options: Options) -> Result<DispatchApp, String>
    where
        F: Fn(Run) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, AgentError>> + Send + 'static,
        T: Serialize + Send + 'static,
    {
        if !options.path.starts_with('/') {
            return Err(format!(
                "path must start with '/', got {}",
                quoted_str(&options.path, 80)
            ));
        }
        let header_ok = !options.auth_header.is_empty()
            && options
                .auth_header
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !header_ok {
            return Err(format!(
                "auth header must be an HTTP header name, got {}",
                quoted_str(&options.auth_header, 80)
            ));
        }
        if options.no_auth && options.token.is_some() {
            return Err("no-auth and a token contradict each other: choose one".into());
        }
        if options.run_timeout.is_zero() || options.run_timeout > MAX_RUN_TIMEOUT {
            return Err(format!(
                "run timeout must be in (0, {}] seconds, got {}",
                format_seconds(MAX_RUN_TIMEOUT),
                format_seconds(options.run_timeout)
            ));
        }
        if options.max_body == 0 {
            return Err("max body must be a positive number of bytes".into());
        }
        let agent: AgentFn = Arc::new(move |run| {
            let future = agent(run);
            Box::pin(async move { future.await.map(serde_json::to_value) })
        });
        let endpoint = Endpoint {
            path: route_path(&options.path).to_string(),
            auth_header: options.auth_header.clone(),
            max_body: options.max_body,
            tools_schema: options.tools_schema.clone(),
        };
        let client = options.client.clone().unwrap_or_default();
        let (cut, _) = watch::channel(false);
        Ok(DispatchApp {
            inner: Arc::new(Inner {
                agent,
                options,
                endpoint,
                client,
                draining: AtomicBool::new(false),
                cut,
            }),
        })
    }

    /// The dispatch route.
    pub fn path(&self) -> &str {
        &self.inner.endpoint.path
    }

    /// How auth is configured, for a start-up line (never the token).
    pub fn describe_auth(&self) -> String {
        let o = &self.inner.options;
        if o.no_auth {
            return "DISABLED (--no-auth): anyone who can reach this endpoint can dispatch".into();
        }
        let value = if o.auth_header.eq_ignore_ascii_case("authorization") {
            "Bearer <token>"
        } else {
            "<token>"
        };
        let source = if o.token.is_some() {
            "the configured token".to_string()
        } else {
            format!("${}", o.token_env)
        };
        let mut line = format!("{}: {value} (token from {source})", o.auth_header);
        if matches!(self.auth(), Auth::Unset(_)) {
            line += &format!(
                "; {} is NOT set: every request gets 503 until it is",
                o.token_env
            );
        }
        line
    }

    /// The auth of this request: the token variable is read every time (§7.1 kit-token-env-per-request).
    fn auth(&self) -> Auth {
        let o = &self.inner.options;
        if o.no_auth {
            return Auth::Disabled;
        }
        match (&o.token, std::env::var(&o.token_env)) {
            (Some(token), _) => Auth::Token(token.clone()),
            (None, Ok(token)) if !token.is_empty() => Auth::Token(token),
            _ => Auth::Unset(o.token_env.clone()),
        }
    }

    /// Refuse new dispatches with 503 (the server is shutting down).
    pub fn drain(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }

    /// End the grace period: every dispatch still running is answered 503 with `Connection: close`.
    pub fn cut_in_flight(&self) {
        self.inner.cut.send_replace(true);
    }

    /// The axum router: every path and method goes to [`DispatchApp::handle`],
    /// which routes as the contract says (404, 405 with `Allow`).
    pub fn router(&self) -> Router {
        Router::new().fallback(handler).with_state(self.clone())
    }

    /// Answers one request in §2.3's order and writes one log line (method,
    /// path, status, run id, task id, jti, duration, proxy calls; never a token).
    pub async fn handle(&self, request: Request) -> Response {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        let headers: Headers = parts
            .headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let auth = self.auth();
        let secret = match &auth {
            Auth::Token(token) => token.clone(),
            _ => String::new(),
        };
        let inner = &self.inner;
        let path = parts.uri.path().to_string();
        let mut decision = decide_head(
            &inner.endpoint,
            &auth,
            parts.method.as_str(),
            &path,
            &headers,
            inner.draining.load(Ordering::SeqCst),
        );
        if let Decision::ReadBody(length) = decision {
            decision = match tokio::time::timeout(
                inner.options.read_timeout,
                axum::body::to_bytes(body, length),
            )
            .await
            {
                Ok(Ok(bytes)) => decide_body(&headers, &bytes, length),
                _ => Decision::Reply {
                    reply: HttpReply::refuse(
                        400,
                        "request body is truncated: it did not arrive whole in time",
                    )
                    .closing(),
                    what: "rejected",
                },
            };
        }
        let mut ids = (
            headers.get(HEADER_RUN_ID).map(str::to_string),
            headers.get(HEADER_TASK_ID).map(str::to_string),
        );
        let mut jti = headers.get(HEADER_RUN_TOKEN_JTI).map(str::to_string);
        let mut calls = 0;
        let (reply, what) = match decision {
            Decision::Reply { reply, what } => (reply, what),
            Decision::ReadBody(_) => unreachable!("the body was read"),
            Decision::Probe(url) => {
                let outbound = inner.client.probe(&url, Duration::from_secs(10)).await;
                (
                    HttpReply::ok(serde_json::json!({"ok": true, "outbound": outbound})),
                    "connectivity check",
                )
            }
            Decision::Run(envelope) => {
                let show = |v: &Option<Value>| {
                    v.as_ref()
                        .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                };
                ids = (show(&envelope.run_id), show(&envelope.task_id));
                jti.clone_from(&envelope.run_token_jti);
                let run = Run::from_state(
                    Arc::new(crate::transport::RunState::new(*envelope)),
                    inner.client.clone(),
                );
                let reply = self.run_agent(run.clone(), &secret).await;
                calls = run.state().proxy_calls();
                (reply, "dispatch")
            }
        };
        if what != "health" {
            let note = match (what, reply.detail()) {
                ("dispatch", _) => String::new(),
                (_, Some(detail)) if reply.status >= 400 => {
                    format!(" (rejected: {})", short(detail, 200))
                }
                _ => format!(" ({what})"),
            };
            let shown =
                |v: Option<String>| v.map_or_else(|| "null".to_string(), |v| short(&v, 100));
            log(
                "info",
                &format!(
                    "{} {} status={} run_id={} task_id={} jti={} duration_ms={:.1} proxy_calls={calls}{note}",
                    parts.method,
                    short(route_path(&path), 100),
                    reply.status,
                    shown(ids.0),
                    shown(ids.1),
                    shown(jti),
                    started.elapsed().as_secs_f64() * 1000.0
                ),
            );
        }
        write_reply(reply)
    }

    /// Runs the agent with this request's run bound (step 6), within the
    /// run timeout (step 7), and answers 500 when it fails (step 8).
    async fn run_agent(&self, run: Run, agent_token: &str) -> HttpReply {
        let inner = &self.inner;
        let state = run.state().clone();
        let run_token = state.envelope.run_token().to_string();
        let secrets = [run_token.as_str(), agent_token];
        let run_id = state
            .envelope
            .run_id
            .clone()
            .map_or_else(|| "null".into(), |v| v.to_string());
        // The agent runs as a task of its own: a panic is a 500, an overrun or a cut aborts it.
        let task = tokio::spawn(run.clone().scope((inner.agent)(run)));
        let abort = task.abort_handle();
        let mut cut = inner.cut.subscribe();
        let outcome = tokio::select! {
            joined = tokio::time::timeout(inner.options.run_timeout, task) => joined,
            _ = cut.wait_for(|cut| *cut) => {
                state.cancel();
                abort.abort();
                log("warning", &format!("run {run_id}: cut by the shutdown; answering 503"));
                return HttpReply::refuse(503, "the server shut down before this dispatch finished: dispatch it again")
                    .closing();
            }
        };
        let result = match outcome {
            Err(_) => {
                state.cancel(); // its later proxy calls fail at once
                abort.abort();
                let timeout = RunTimeoutError {
                    limit: inner.options.run_timeout,
                };
                log("error", &format!("run {run_id}: {timeout}; answering 504"));
                return HttpReply::refuse(504, timeout.to_string());
            }
            Ok(Err(join)) => {
                let panic = join.try_into_panic().ok();
                let message = panic
                    .as_ref()
                    .and_then(|p| {
                        p.downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                    })
                    .unwrap_or_else(|| "the agent's task was cancelled".into());
                Err(AgentError {
                    type_name: "panic".into(),
                    message,
                })
            }
            Ok(Ok(result)) => result,
        };
        let value = match result {
            Err(error) => {
                let detail = agent_error_detail(&error.describe(), &secrets);
                log(
                    "error",
                    &format!("run {run_id}: the agent failed: {detail}"),
                );
                return HttpReply::refuse(500, detail);
            }
            Ok(Err(unserialisable)) => {
                return HttpReply::refuse(
                    500,
                    one_line(
                        &crate::contract::replies::redact_str(
                            &format!("agent returned a value that cannot become a response: {unserialisable}"),
                            &secrets,
                        ),
                        DETAIL_LIMIT,
                    ),
                );
            }
            Ok(Ok(value)) => value,
        };
        let strict = inner.options.strict || strict_from_env();
        match build_reply(&value, strict, state.envelope.is_multi_turn()) {
            Err(e) => HttpReply::refuse(
                500,
                one_line(
                    &crate::contract::replies::redact_str(
                        &format!("agent returned a value that cannot become a response: {e}"),
                        &secrets,
                    ),
                    DETAIL_LIMIT,
                ),
            ),
            Ok((body, warnings)) => {
                for warning in warnings {
                    log(
                        "warning",
                        &format!(
                            "response: {}",
                            crate::contract::replies::redact_str(&warning, &secrets)
                        ),
                    );
                }
                let mut body = Value::Object(body);
                if contains_secret(&body, &secrets) {
                    log("warning", &format!("run {run_id}: the agent's response contained a secret token; it was redacted"));
                    body = redact_value(&body, &secrets);
                }
                HttpReply::ok(body)
            }
        }
    }
}

async fn handler(State(app): State<DispatchApp>, request: Request) -> Response {
    app.handle(request).await
}

/// An [`HttpReply`] as an axum response: JSON, its headers, `Content-Length`.
pub fn write_reply(reply: HttpReply) -> Response {
    let text = reply.body.to_string();
    let mut response = (
        StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Body::from(Bytes::from(text)),
    )
        .into_response();
    let headers = response.headers_mut();
    for (name, value) in &reply.headers {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    response
}

/// Serves `app` on `listener` until `shutdown` completes (SIGTERM, say), then
/// shuts down gracefully (§7.1 kit-server-timeouts): the listener closes at
/// once (new connections are refused), idle keep-alive connections close, new
/// dispatches on busy ones get 503, and running dispatches have `grace` to
/// finish; each still running then is answered 503 with `Connection: close`.
/// `Ok(true)` when every dispatch finished in time.
///
/// Each connection is served by hyper's HTTP/1.1 server with a timer: a
/// request head must arrive within 30 s (`header_read_timeout`), a head is at
/// most 64 KiB and 100 fields (else 431), keep-alive is on. (`axum::serve`
/// sets no timer, so it has no head timeout; mount [`DispatchApp::router`]
/// there only behind a front end that has one.)
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: DispatchApp,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<bool> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    if app.inner.options.no_auth {
        log(
            "warning",
            "auth is DISABLED: anyone who can reach this endpoint can dispatch",
        );
    }
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .keep_alive(true)
        .max_headers(100)
        .max_buf_size(64 << 10);
    let connections = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // out of file descriptors, say: wait a moment rather than spin
                        log("warning", &format!("accept failed: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let app = app.clone();
                let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    async move { Ok::<_, std::convert::Infallible>(app.handle(request.map(Body::new)).await) }
                });
                let connection = connections.watch(http.serve_connection(TokioIo::new(stream), service));
                tokio::spawn(async move {
                    let _ = connection.await; // a peer that went away, a malformed head (hyper answered 400)
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener); // new connections are refused from now on
    log(
        "info",
        &format!(
            "shutting down: refusing new dispatches, waiting up to {} s for running ones",
            format_seconds(grace)
        ),
    );
    app.drain();
    let all_closed = connections.shutdown();
    tokio::pin!(all_closed);
    tokio::select! {
        () = &mut all_closed => Ok(true),
        () = tokio::time::sleep(grace) => {
            log("warning", &format!("grace period of {} s over: answering the dispatches still running with 503", format_seconds(grace)));
            app.cut_in_flight();
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut all_closed).await;
            Ok(false)
        }
    }
}
