//! The async proxy driver (feature `async`): `reqwest` on tokio, rustls with
//! the ring provider, keep-alive connections. [`AsyncClient::send`] is the
//! asyncio twin of [`crate::blocking::BlockingClient::send`], line for line:
//! both loop over [`RetryState::step`].
//!
//! A run is reached through a [`Run`]: the agent gets one explicitly, and
//! [`Run::scope`] also binds it to a tokio task-local for the code the agent
//! awaits, so a tool deep in a call stack finds it with [`current_run`]. A
//! task-local does not follow `tokio::spawn`: move a clone of the `Run` into
//! the task (or wrap the spawned future in `run.clone().scope(...)`).

use crate::contract::constants::*;
use crate::contract::encoding::{
    handoff_event, tool_call_request, trace_request, Handoff, ProxyRequest,
};
use crate::contract::envelope::Envelope;
use crate::contract::errors::{ProxyError, ProxyErrorKind};
use crate::contract::inbound::probe_result;
use crate::contract::json::quoted_str;
use crate::contract::reply::{interpret_reply, Pacer, RetryState, RetryStep};
use crate::transport::*;
use serde_json::Value;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How the client waits between attempts; tests swap it to record waits.
pub type Sleeper = Arc<dyn Fn(Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

struct Inner {
    http: reqwest::Client,
    settings: ClientSettings,
    pacer: Option<Mutex<Pacer>>,
    sleep: Sleeper,
}

/// Calls the per-run proxy (§3): validation, keep-alive connections, pacing,
/// retries. Cheap to clone; one client serves any number of concurrent runs.
#[derive(Clone)]
pub struct AsyncClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AsyncClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncClient")
            .field("settings", &self.inner.settings)
            .finish_non_exhaustive()
    }
}

impl Default for AsyncClient {
    fn default() -> Self {
        AsyncClient::new(ClientSettings::from_env())
    }
}

impl AsyncClient {
    /// A client with these settings (see [`ClientSettings::from_env`]).
    pub fn new(settings: ClientSettings) -> Self {
        AsyncClient::with_sleeper(settings, Arc::new(|d| Box::pin(tokio::time::sleep(d))))
    }

    /// A client that waits with `sleep` (tests record the waits instead).
    pub fn with_sleeper(settings: ClientSettings, sleep: Sleeper) -> Self {
        install_ring_provider();
        let http = reqwest::Client::builder()
            .no_proxy() // the run's proxy URL is called directly
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(64)
            .pool_idle_timeout(Duration::from_secs(90))
            .connect_timeout(Duration::from_secs(30))
            .build()
            .expect("a reqwest client with rustls builds");
        let pacer = settings.pacer();
        AsyncClient {
            inner: Arc::new(Inner {
                http,
                settings,
                pacer,
                sleep,
            }),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &ClientSettings {
        &self.inner.settings
    }

    /// One logical call: the retry loop around single exchanges (§3.3). The
    /// same request, its Idempotency-Key included, is sent on every attempt.
    pub async fn send(
        &self,
        run: &RunState,
        request: &ProxyRequest,
        timeout: Option<Duration>,
    ) -> Result<Value, ProxyError> {
        let name = request.name.as_str();
        let token = run.envelope.run_token();
        if let Some(refused) = run.refused_late(name) {
            return Err(refused);
        }
        run.count_call();
        let timeout = timeout.unwrap_or(self.inner.settings.timeout);
        let mut state = RetryState::new(self.inner.settings.policy, jitter_seed());
        loop {
            if let Some(refused) = run.refused_late(name) {
                return Err(refused);
            }
            let wait = pacing_wait(&self.inner.pacer, token);
            if !wait.is_zero() {
                log(
                    "info",
                    &format!("pacing proxy calls: waiting {:.2} s", wait.as_secs_f64()),
                );
                (self.inner.sleep)(wait).await;
                if let Some(refused) = run.refused_late(name) {
                    return Err(refused);
                }
            }
            let outcome = match self.exchange(request, timeout).await {
                Ok((status, retry_after, body)) => interpret_reply(
                    status,
                    retry_after.as_deref(),
                    &body,
                    name,
                    token,
                    SystemTime::now(),
                ),
                Err(failure) => failure_outcome(failure, name, token),
            };
            let step = state.step(outcome);
            match step {
                RetryStep::Return(value) => return Ok(value),
                RetryStep::Raise(error) => return Err(error),
                RetryStep::Retry { wait, .. } => {
                    log_retry(&step, state.attempts);
                    if let Some(wait) = wait {
                        (self.inner.sleep)(wait).await;
                    }
                }
            }
        }
    }

    /// One HTTP attempt: status, `Retry-After`, body within the 1 MiB cap,
    /// the whole reply within `timeout` (§7.4 kit-whole-reply-timeout).
    async fn exchange(
        &self,
        request: &ProxyRequest,
        timeout: Duration,
    ) -> Result<(u16, Option<String>, Vec<u8>), ExchangeFailure> {
        let attempt = async {
            let mut builder = self
                .inner
                .http
                .post(&request.url)
                .body(request.body.clone());
            for (name, value) in &request.headers {
                builder = builder.header(name, value);
            }
            let mut response = builder.send().await.map_err(transport_failure)?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            if let Some(length) = response
                .content_length()
                .filter(|n| *n > MAX_REPLY_BYTES as u64)
            {
                return Err(ExchangeFailure::TooLarge {
                    status,
                    length: Some(length),
                });
            }
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(transport_failure)? {
                body.extend_from_slice(&chunk);
                if body.len() > MAX_REPLY_BYTES {
                    return Err(ExchangeFailure::TooLarge {
                        status,
                        length: None,
                    });
                }
            }
            Ok((status, retry_after, body))
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(ExchangeFailure::Transport {
                message: "timed out".into(),
                retryable: true,
                stale: false,
            }),
        }
    }

    /// Tests egress to a proxy (§3.7): `POST {proxy_url}/tools/__reachability_probe__`
    /// with a fake bearer, never the run token. `{"reachable", "status_code", "latency_ms", "error"}`.
    pub async fn probe(&self, proxy_url: &str, timeout: Duration) -> Value {
        let started = Instant::now();
        let sent = self
            .inner
            .http
            .post(format!("{proxy_url}/tools/{PROBE_TOOL}"))
            .header("Content-Type", "application/json")
            .header("Authorization", "Bearer fake-token")
            .header("User-Agent", user_agent())
            .body("{}")
            .timeout(timeout)
            .send()
            .await;
        let latency = started.elapsed().as_secs_f64() * 1000.0;
        match sent {
            Ok(response) => probe_result(Some(response.status().as_u16()), None, latency),
            Err(e) => probe_result(None, Some(describe(&e)), latency),
        }
    }
}

fn describe(error: &reqwest::Error) -> String {
    let mut text = if error.is_timeout() {
        "timed out".to_string()
    } else {
        String::new()
    };
    let mut source: Option<&dyn std::error::Error> = Some(error);
    while let Some(cause) = source {
        if text.is_empty() || !text.contains(&cause.to_string()) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause.to_string());
        }
        source = cause.source();
    }
    text
}

fn transport_failure(error: reqwest::Error) -> ExchangeFailure {
    let error = error.without_url();
    let message = describe(&error);
    let stale = message.contains("connection closed before message completed");
    ExchangeFailure::Transport {
        retryable: !not_retryable(&message),
        stale,
        message,
    }
}

tokio::task_local! {
    static CURRENT: Run;
}

/// The run bound to the current task by [`Run::scope`], if any (§2.3 per-request-binding).
pub fn current_run() -> Option<Run> {
    CURRENT.try_with(Run::clone).ok()
}

/// One dispatch, as its agent reaches the proxy: the envelope, the client,
/// and the sub-agent label its calls carry. Cheap to clone; concurrent
/// dispatches each have their own, so none sees another's run token.
#[derive(Clone, Debug)]
pub struct Run {
    state: Arc<RunState>,
    client: AsyncClient,
    actor: Option<String>,
}

impl Run {
    /// A run on this envelope, calling through `client`.
    pub fn new(envelope: Envelope, client: AsyncClient) -> Self {
        Run {
            state: Arc::new(RunState::new(envelope)),
            client,
            actor: None,
        }
    }

    /// A run sharing `state` (the dispatch app keeps it to refuse late calls).
    pub fn from_state(state: Arc<RunState>, client: AsyncClient) -> Self {
        Run {
            state,
            client,
            actor: None,
        }
    }

    /// The run's envelope.
    pub fn envelope(&self) -> &Envelope {
        &self.state.envelope
    }

    /// The run's state (proxy call count, cancellation).
    pub fn state(&self) -> &Arc<RunState> {
        &self.state
    }

    /// The same run, its calls attributed to the sub-agent `label` (§3.5); `""` means none.
    pub fn with_actor(&self, label: impl Into<String>) -> Run {
        Run {
            actor: Some(label.into()),
            ..self.clone()
        }
    }

    /// Runs `future` with this run bound to the task (see [`current_run`]).
    pub async fn scope<F: Future>(self, future: F) -> F::Output {
        CURRENT.scope(self, future).await
    }

    fn actor_of(&self, options: &CallOptions) -> Value {
        options
            .actor
            .clone()
            .or_else(|| self.actor.clone())
            .map_or(Value::Null, Value::String)
    }

    /// Calls a tool: `POST {proxy_url}/tools/{name}` with `args` (a JSON
    /// object; `null` is `{}`), returning the unwrapped `response` (§3.1, §3.2).
    pub async fn call(&self, name: &str, args: Value) -> Result<Value, ProxyError> {
        self.call_with(name, args, &CallOptions::default()).await
    }

    /// [`Run::call`] with options.
    pub async fn call_with(
        &self,
        name: &str,
        args: Value,
        options: &CallOptions,
    ) -> Result<Value, ProxyError> {
        let env = self.envelope();
        let key = options.idempotency_key.clone().unwrap_or_else(new_uuid);
        let result = match tool_call_request(
            &env.proxy_url,
            env.run_token(),
            name,
            &args,
            &self.actor_of(options),
            &key,
        ) {
            Ok(request) => {
                warn_if_undeclared(env, request.header(HEADER_ACTOR_ID));
                self.client
                    .send(&self.state, &request, options.timeout)
                    .await
            }
            Err(refused) => Err(refused),
        };
        match result {
            Err(e) if options.errors_as_values && e.kind != ProxyErrorKind::StaleRunToken => {
                log(
                    "info",
                    &format!(
                        "tool {} failed, returning the error to the agent: {e}",
                        quoted_str(name, 80)
                    ),
                );
                Ok(e.to_value())
            }
            other => other,
        }
    }

    /// Posts a live trace event (§3.4); the proxy's reply (`{"accepted": true, "sequence": N}`, `null` when empty).
    pub async fn trace(&self, event_type: &str, payload: Value) -> Result<Value, ProxyError> {
        self.trace_with(event_type, payload, &CallOptions::default())
            .await
    }

    /// [`Run::trace`] with options (`best_effort` turns a failure into a log line and `null`).
    pub async fn trace_with(
        &self,
        event_type: &str,
        payload: Value,
        options: &CallOptions,
    ) -> Result<Value, ProxyError> {
        let env = self.envelope();
        let key = options.idempotency_key.clone().unwrap_or_else(new_uuid);
        let request = trace_request(
            &env.proxy_url,
            env.run_token(),
            event_type,
            &payload,
            &utc_now_iso(),
            &self.actor_of(options),
            &key,
        );
        let result = match request {
            Ok(request) => {
                self.client
                    .send(&self.state, &request, options.timeout)
                    .await
            }
            Err(refused) => Err(refused),
        };
        match result {
            Err(e) if options.best_effort => {
                log(
                    "warning",
                    &format!(
                        "trace event {} not recorded: {e}",
                        quoted_str(event_type, 60)
                    ),
                );
                Ok(Value::Null)
            }
            Ok(reply) if !reply.is_object() => Ok(Value::Null),
            other => other,
        }
    }

    /// Posts a handoff event (§3.4 handoff-shape); a self-handoff is dropped
    /// (`Ok(Value::Null)`, nothing sent: §3.4 self-handoff-dropped).
    pub async fn handoff(&self, handoff: &Handoff) -> Result<Value, ProxyError> {
        match handoff_event(handoff)? {
            Some(event) => self.trace("handoff", event).await,
            None => {
                log("info", "dropping a self-handoff");
                Ok(Value::Null)
            }
        }
    }
}

/// Logs, once per run and label, a label outside the run's `sub_agents`
/// catalog: it is sent all the same (§3.5 actor-undeclared-allowed).
pub(crate) fn warn_if_undeclared(env: &Envelope, label: Option<&str>) {
    let Some(label) = label else { return };
    if env.sub_agents.is_empty() {
        return;
    }
    let last = label.rsplit('/').next().unwrap_or(label);
    if env.sub_agents.iter().any(|d| d == label || d == last) {
        return;
    }
    log(
        "warning",
        &format!(
            "actor label {} is not in this run's declared sub_agents; the platform will show it as undeclared",
            quoted_str(label, 80)
        ),
    );
}
