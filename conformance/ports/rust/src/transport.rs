//! What both proxy drivers share (PART 2 of `pipelines_port.py`, "Transport"):
//! call options, the client's settings from the environment, the per-run
//! state, Idempotency-Keys and timestamps, and the failures of one exchange.

use crate::contract::constants::*;
use crate::contract::envelope::Envelope;
use crate::contract::errors::{ProxyError, ProxyErrorKind};
use crate::contract::json::{quoted_str, short};
use crate::contract::replies::redact_str;
use crate::contract::reply::{Pacer, ProxyOutcome, RetryPolicy, RetryStep};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Adjusts one tool call, trace post or handoff.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// The sub-agent label (§3.5), winning over the run's; `Some("")` sends no header.
    pub actor: Option<String>,
    /// This call's per-attempt timeout.
    pub timeout: Option<Duration>,
    /// The call's Idempotency-Key instead of a fresh UUID.
    pub idempotency_key: Option<String>,
    /// A failed tool call becomes `{"error": ...}` for the model, a stale token excepted (§7.4 kit-errors-return).
    pub errors_as_values: bool,
    /// A failed trace post becomes a log line and `null` (§3.4 trace-best-effort).
    pub best_effort: bool,
}

/// The client's settings (§3.1, §7.4).
#[derive(Debug, Clone, PartialEq)]
pub struct ClientSettings {
    /// Per attempt, the whole reply included (§7.4 kit-whole-reply-timeout).
    pub timeout: Duration,
    /// The retry policy.
    pub policy: RetryPolicy,
    /// Requests per minute per run token; `None` turns pacing off.
    pub rate_per_minute: Option<usize>,
}

impl Default for ClientSettings {
    fn default() -> Self {
        ClientSettings {
            timeout: DEFAULT_PROXY_TIMEOUT,
            policy: RetryPolicy::default(),
            rate_per_minute: Some(RATE_LIMIT_PER_MINUTE),
        }
    }
}

impl ClientSettings {
    /// The defaults, with `PIPELINES_PROXY_TIMEOUT_S` (§3.1 timeout-env) and
    /// `PIPELINES_PROXY_RATE_PER_MINUTE` (0 turns pacing off) applied.
    pub fn from_env() -> Self {
        let mut settings = ClientSettings::default();
        if let Ok(text) = std::env::var("PIPELINES_PROXY_TIMEOUT_S") {
            match text.trim().parse::<f64>() {
                Ok(s) if s > 0.0 && s.is_finite() => settings.timeout = Duration::from_secs_f64(s),
                _ => log(
                    "warning",
                    &format!(
                        "PIPELINES_PROXY_TIMEOUT_S must be a positive number of seconds, got {}; using 120",
                        quoted_str(&text, 40)
                    ),
                ),
            }
        }
        if let Ok(text) = std::env::var("PIPELINES_PROXY_RATE_PER_MINUTE") {
            match text.trim().parse::<f64>() {
                Ok(r) if (0.0..1e6).contains(&r) => {
                    settings.rate_per_minute = (r >= 1.0).then_some(r as usize);
                }
                _ => log(
                    "warning",
                    &format!(
                        "PIPELINES_PROXY_RATE_PER_MINUTE must be a non-negative number, got {}; using 60",
                        quoted_str(&text, 40)
                    ),
                ),
            }
        }
        settings
    }

    pub(crate) fn pacer(&self) -> Option<Mutex<Pacer>> {
        self.rate_per_minute
            .map(|limit| Mutex::new(Pacer::new(limit, Duration::from_secs(60))))
    }
}

/// One dispatch's state: its envelope, whether it overran its run timeout
/// (its later proxy calls are then refused), and its proxy call count.
#[derive(Debug)]
pub struct RunState {
    /// The run's envelope.
    pub envelope: Envelope,
    cancelled: AtomicBool,
    proxy_calls: AtomicU64,
}

impl RunState {
    /// The state of a run that starts now.
    pub fn new(envelope: Envelope) -> Self {
        RunState {
            envelope,
            cancelled: AtomicBool::new(false),
            proxy_calls: AtomicU64::new(0),
        }
    }

    /// Refuse every later proxy call of this run (§7.3 kit-run-timeout-504).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    /// Whether the run was answered already.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Proxy calls made so far.
    pub fn proxy_calls(&self) -> u64 {
        self.proxy_calls.load(Ordering::SeqCst)
    }

    pub(crate) fn count_call(&self) {
        self.proxy_calls.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn refused_late(&self, name: &str) -> Option<ProxyError> {
        self.is_cancelled().then(|| {
            ProxyError::new(
                ProxyErrorKind::Proxy,
                format!(
                    "proxy call {} refused: this dispatch overran its run timeout and was answered already",
                    quoted_str(name, 80)
                ),
                name,
            )
        })
    }
}

/// A random (version 4) UUID: one Idempotency-Key per logical call (§3.1 idempotency-key-per-call).
pub fn new_uuid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// A seed for a call's jitter, from the operating system's random source.
pub fn jitter_seed() -> u64 {
    // should the source fail, the clock still spreads concurrent callers' retries
    getrandom::u64().unwrap_or_else(|_| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    })
}

/// Now as ISO-8601 UTC with milliseconds: `2026-01-02T03:04:05.678Z` (§3.4 trace-occurred-at).
pub fn utc_now_iso() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// One line on stderr: `2026-...Z LEVEL pipelines_port: message`; line breaks folded. Callers never pass a secret.
pub fn log(level: &str, message: &str) {
    let message = message.replace('\r', " ").replace('\n', " | ");
    eprintln!(
        "{} {} pipelines_port: {message}",
        utc_now_iso(),
        level.to_ascii_uppercase()
    );
}

/// Why one exchange brought no usable reply.
#[derive(Debug)]
pub(crate) enum ExchangeFailure {
    /// A reply over the 1 MiB cap (§7.5 kit-reply-cap): a failed call carrying its status.
    TooLarge { status: u16, length: Option<u64> },
    /// No reply: `retryable` for timeouts and refused or reset connections,
    /// `stale` for a pooled connection the server had closed.
    Transport {
        message: String,
        retryable: bool,
        stale: bool,
    },
}

/// The outcome of an exchange that failed, for [`crate::contract::reply::RetryState::step`].
pub(crate) fn failure_outcome(
    failure: ExchangeFailure,
    name: &str,
    run_token: &str,
) -> ProxyOutcome {
    match failure {
        ExchangeFailure::TooLarge { status, length } => {
            let size = match length {
                Some(n) => format!("is {n} bytes, over the {MAX_REPLY_BYTES}-byte cap"),
                None => format!("exceeds the {MAX_REPLY_BYTES}-byte cap"),
            };
            let mut error = ProxyError::new(
                ProxyErrorKind::Proxy,
                format!("proxy reply to {} {size}", quoted_str(name, 80)),
                name,
            );
            error.status_code = Some(status);
            ProxyOutcome::Error(error)
        }
        ExchangeFailure::Transport {
            message,
            retryable,
            stale,
        } => {
            let error = ProxyError::new(
                ProxyErrorKind::Transport,
                format!(
                    "proxy call {} failed before a reply arrived: {}",
                    quoted_str(name, 80),
                    short(&redact_str(&message, &[run_token]), 200)
                ),
                name,
            );
            if retryable {
                ProxyOutcome::Transport { error, stale }
            } else {
                ProxyOutcome::Error(error)
            }
        }
    }
}

/// Whether a transport failure's text says it is not worth retrying (DNS, certificates).
pub(crate) fn not_retryable(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    [
        "dns",
        "resolve",
        "certificate",
        "tls",
        "host not found",
        "invalidcertificate",
        "unknownissuer",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// The log line of a retry.
pub(crate) fn log_retry(step: &RetryStep, attempts: u32) {
    if let RetryStep::Retry { wait, error } = step {
        let wait = wait.unwrap_or_default().as_secs_f64();
        if error.kind == ProxyErrorKind::Transport {
            log(
                "warning",
                &format!("{}; retrying in {wait:.2} s", error.message),
            );
        } else {
            log(
                "warning",
                &format!("{}; retry {attempts} in {wait:.2} s", error.message),
            );
        }
    }
}

/// How long a call waits for its pacing slot (every attempt takes one).
pub(crate) fn pacing_wait(pacer: &Option<Mutex<Pacer>>, run_token: &str) -> Duration {
    match pacer {
        Some(pacer) => pacer
            .lock()
            .map(|mut p| p.reserve(run_token, Instant::now()))
            .unwrap_or_default(),
        None => Duration::ZERO,
    }
}

/// Installs rustls' ring provider as the process default (once; a provider
/// installed by the application first is kept).
pub(crate) fn install_ring_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_version_4_and_differ() {
        let (a, b) = (new_uuid(), new_uuid());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!("89ab".contains(&a[19..20]));
    }

    #[test]
    fn timestamps_are_iso_utc() {
        let now = utc_now_iso();
        assert_eq!(now.len(), 24);
        assert!(now.ends_with('Z') && now.starts_with("20"));
    }
}
