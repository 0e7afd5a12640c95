//! The blocking proxy driver (feature `blocking`): `ureq` with rustls (the
//! ring provider) and a keep-alive pool. [`BlockingClient::send`] is the
//! twin of [`crate::aio::AsyncClient::send`], line for line: both loop over
//! [`RetryState::step`].
//!
//! The run is explicit here: every call names its [`Envelope`] (or a
//! [`RunState`] shared with a dispatch), as a thread-per-run program expects.

use crate::contract::constants::*;
use crate::contract::encoding::{
    handoff_event, tool_call_request, trace_request, Handoff, ProxyRequest,
};
use crate::contract::envelope::Envelope;
use crate::contract::errors::{ProxyError, ProxyErrorKind};
use crate::contract::json::quoted_str;
use crate::contract::reply::{interpret_reply, Pacer, RetryState, RetryStep};
use crate::transport::*;
use serde_json::Value;
use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// How the client waits between attempts; tests swap it to record waits.
pub type Sleeper = Arc<dyn Fn(Duration) + Send + Sync>;

/// Calls the per-run proxy (§3) from blocking code. Cheap to clone; share one.
#[derive(Clone)]
pub struct BlockingClient {
    agent: ureq::Agent,
    settings: ClientSettings,
    pacer: Arc<Option<Mutex<Pacer>>>,
    sleep: Sleeper,
}

impl std::fmt::Debug for BlockingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingClient")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Default for BlockingClient {
    fn default() -> Self {
        BlockingClient::new(ClientSettings::from_env())
    }
}

impl BlockingClient {
    /// A client with these settings (see [`ClientSettings::from_env`]).
    pub fn new(settings: ClientSettings) -> Self {
        BlockingClient::with_sleeper(settings, Arc::new(std::thread::sleep))
    }

    /// A client that waits with `sleep`.
    pub fn with_sleeper(settings: ClientSettings, sleep: Sleeper) -> Self {
        install_ring_provider();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(None) // the run's proxy URL is called directly
            .max_idle_connections_per_host(64)
            .max_idle_age(Duration::from_secs(90))
            .user_agent(user_agent())
            .build()
            .new_agent();
        let pacer = Arc::new(settings.pacer());
        BlockingClient {
            agent,
            settings,
            pacer,
            sleep,
        }
    }

    /// One logical call: the retry loop around single exchanges (§3.3).
    pub fn send(
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
        let timeout = timeout.unwrap_or(self.settings.timeout);
        let mut state = RetryState::new(self.settings.policy, jitter_seed());
        loop {
            if let Some(refused) = run.refused_late(name) {
                return Err(refused);
            }
            let wait = pacing_wait(&self.pacer, token);
            if !wait.is_zero() {
                log(
                    "info",
                    &format!("pacing proxy calls: waiting {:.2} s", wait.as_secs_f64()),
                );
                (self.sleep)(wait);
                if let Some(refused) = run.refused_late(name) {
                    return Err(refused);
                }
            }
            let outcome = match self.exchange(request, timeout) {
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
                        (self.sleep)(wait);
                    }
                }
            }
        }
    }

    /// One HTTP attempt, the whole reply within `timeout`.
    fn exchange(
        &self,
        request: &ProxyRequest,
        timeout: Duration,
    ) -> Result<(u16, Option<String>, Vec<u8>), ExchangeFailure> {
        let mut builder = self
            .agent
            .post(&request.url)
            .config()
            .timeout_global(Some(timeout))
            .build();
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let mut response = builder.send(&request.body[..]).map_err(transport_failure)?;
        let status = response.status().as_u16();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let retry_after = header("retry-after");
        if let Some(length) = header("content-length").and_then(|v| v.trim().parse::<u64>().ok()) {
            if length > MAX_REPLY_BYTES as u64 {
                return Err(ExchangeFailure::TooLarge {
                    status,
                    length: Some(length),
                });
            }
        }
        let mut body = Vec::new();
        let reader = response
            .body_mut()
            .with_config()
            .limit(MAX_REPLY_BYTES as u64 + 1)
            .reader();
        reader
            .take(MAX_REPLY_BYTES as u64 + 1)
            .read_to_end(&mut body)
            .map_err(|e| ExchangeFailure::Transport {
                message: e.to_string(),
                retryable: true,
                stale: false,
            })?;
        if body.len() > MAX_REPLY_BYTES {
            return Err(ExchangeFailure::TooLarge {
                status,
                length: None,
            });
        }
        Ok((status, retry_after, body))
    }

    /// Calls a tool for the run on `envelope` (§3.1, §3.2).
    pub fn call(&self, envelope: &Envelope, name: &str, args: Value) -> Result<Value, ProxyError> {
        self.call_in(
            &RunState::new(envelope.clone()),
            name,
            args,
            &CallOptions::default(),
        )
    }

    /// Calls a tool within a run's state, with options.
    pub fn call_in(
        &self,
        run: &RunState,
        name: &str,
        args: Value,
        options: &CallOptions,
    ) -> Result<Value, ProxyError> {
        let env = &run.envelope;
        let key = options.idempotency_key.clone().unwrap_or_else(new_uuid);
        let actor = options.actor.clone().map_or(Value::Null, Value::String);
        let result = tool_call_request(&env.proxy_url, env.run_token(), name, &args, &actor, &key)
            .and_then(|request| self.send(run, &request, options.timeout));
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

    /// Posts a live trace event for the run on `envelope` (§3.4).
    pub fn trace(
        &self,
        envelope: &Envelope,
        event_type: &str,
        payload: Value,
    ) -> Result<Value, ProxyError> {
        self.trace_in(
            &RunState::new(envelope.clone()),
            event_type,
            payload,
            &CallOptions::default(),
        )
    }

    /// Posts a live trace event within a run's state, with options.
    pub fn trace_in(
        &self,
        run: &RunState,
        event_type: &str,
        payload: Value,
        options: &CallOptions,
    ) -> Result<Value, ProxyError> {
        let env = &run.envelope;
        let key = options.idempotency_key.clone().unwrap_or_else(new_uuid);
        let actor = options.actor.clone().map_or(Value::Null, Value::String);
        let result = trace_request(
            &env.proxy_url,
            env.run_token(),
            event_type,
            &payload,
            &utc_now_iso(),
            &actor,
            &key,
        )
        .and_then(|request| self.send(run, &request, options.timeout));
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

    /// Posts a handoff event; a self-handoff is dropped (`Ok(Value::Null)`, nothing sent).
    pub fn handoff(&self, envelope: &Envelope, handoff: &Handoff) -> Result<Value, ProxyError> {
        match handoff_event(handoff)? {
            Some(event) => self.trace(envelope, "handoff", event),
            None => Ok(Value::Null),
        }
    }
}

fn transport_failure(error: ureq::Error) -> ExchangeFailure {
    let message = match &error {
        ureq::Error::Timeout(_) => "timed out".to_string(),
        other => other.to_string(),
    };
    let retryable = !matches!(error, ureq::Error::HostNotFound) && !not_retryable(&message);
    ExchangeFailure::Transport {
        message,
        retryable,
        stale: false,
    }
}
