//! Reply interpretation (§3.2, §3.3) and the retry policy as a step function
//! (`RetryState::step`) that both drivers loop over, plus client-side pacing
//! (§7.4 kit-pacing). No I/O: time and randomness come in as arguments.

use super::constants::*;
use super::errors::{ProxyError, ProxyErrorKind};
use super::json::{compact, decode, quoted_str, short, truthy};
use super::replies::redact_value;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

/// Finds `error_class` and the message in the three error body shapes of
/// §3.3: `{"detail": {"error_class", "message"}}`, `{"detail": "text"}` and
/// `{"error_class", "message"}` at the top level (§3.3 error-body-shapes).
pub fn error_fields(body: &Value) -> (Option<String>, Option<String>) {
    let Value::Object(object) = body else {
        return (None, None);
    };
    let string = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    if let Some(Value::Object(inner)) = object.get("detail") {
        let text = inner
            .get("message")
            .filter(|v| truthy(v))
            .or_else(|| inner.get("detail"));
        return (string(inner.get("error_class")), string(text));
    }
    let class = string(object.get("error_class"));
    if let Some(Value::String(text)) = object.get("detail") {
        return (class, Some(text.clone()));
    }
    let mut text = object
        .get("message")
        .filter(|v| truthy(v))
        .or_else(|| object.get("error"))
        .cloned();
    if let Some(detail) = object.get("detail").filter(|d| !d.is_null()) {
        if text.as_ref().is_none_or(Value::is_null) {
            text = Some(Value::String(compact(detail).chars().take(200).collect()));
        }
    }
    (
        class,
        text.as_ref().and_then(Value::as_str).map(str::to_string),
    )
}

/// A `Retry-After` value: delta-seconds or an HTTP date (RFC 9110 §10.2.3;
/// one in the past waits 0); `None` when absent or unreadable (§7.4
/// kit-retry-after-cap).
pub fn parse_retry_after(value: Option<&str>, now: SystemTime) -> Option<Duration> {
    let value = value?.trim();
    if value.is_empty() {
        return None;
    }
    let numeric = value
        .chars()
        .all(|c| c.is_ascii_digit() || "+-.eE".contains(c));
    let seconds = if numeric {
        value.parse::<f64>().ok()?
    } else {
        let when = httpdate::parse_http_date(value).ok()?;
        when.duration_since(now)
            .map_or(0.0, |wait| wait.as_secs_f64())
    };
    if seconds.is_nan() {
        return None;
    }
    Some(Duration::from_secs_f64(seconds.clamp(0.0, 1e6)))
}

/// §3.3 the retry decision for a non-2xx reply, from the table: `Retry` for
/// 429 and the transient 503 classes, `Stale` for a 401 with a stale-token
/// class, `Fail` for everything else (§7.4 kit-other-statuses-terminal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Retry with backoff (§3.3 retry-transient).
    Retry,
    /// The run is over (§3.3 stale-token-distinct).
    Stale,
    /// Terminal (§3.3 terminal-no-retry).
    Fail,
}

/// The table of §3.3.
pub fn retry_decision(status: u16, error_class: Option<&str>) -> RetryDecision {
    let class = error_class.unwrap_or_default();
    match status {
        429 => RetryDecision::Retry,
        503 if TRANSIENT_503_CLASSES.contains(&class) => RetryDecision::Retry,
        401 if STALE_TOKEN_CLASSES.contains(&class) => RetryDecision::Stale,
        _ => RetryDecision::Fail,
    }
}

/// What one attempt came to (§3.2, §3.3).
#[derive(Debug, Clone, PartialEq)]
pub enum ProxyOutcome {
    /// A success: what the call returns.
    Value(Value),
    /// A terminal failure (a reply, or a transport failure not worth retrying).
    Error(ProxyError),
    /// 429 or a transient 503: retry after `Retry-After`, else a backoff.
    Retry(ProxyError),
    /// No usable reply, worth retrying with the same Idempotency-Key; `stale`
    /// marks a pooled keep-alive connection the server had closed (re-sent at once).
    Transport {
        /// The error the call fails with if it is not retried.
        error: ProxyError,
        /// A stale pooled connection.
        stale: bool,
    },
}

/// Reads one proxy reply, with no I/O (§3.2, §3.3). A 2xx gives the unwrapped
/// `response` (a legacy body without it whole, non-JSON text as the string,
/// an empty body `null`, never decoded twice). The run token is scrubbed from
/// the error's message and kept body (§2.1 run-token-secret).
pub fn interpret_reply(
    status: u16,
    retry_after_header: Option<&str>,
    body: &[u8],
    tool_name: &str,
    run_token: &str,
    now: SystemTime,
) -> ProxyOutcome {
    let (value, is_json) = if body.is_empty() {
        (Value::Null, false)
    } else {
        match decode(body) {
            Ok(v) => (v, true),
            Err(_) => (
                Value::String(String::from_utf8_lossy(body).into_owned()),
                false,
            ),
        }
    };
    if (200..300).contains(&status) {
        if let (true, Value::Object(mut object)) = (is_json, value.clone()) {
            if let Some(response) = object.remove("response") {
                return ProxyOutcome::Value(response);
            }
        }
        return ProxyOutcome::Value(value);
    }
    let value = redact_value(&value, &[run_token]);
    let (error_class, message) = if is_json {
        error_fields(&value)
    } else {
        (None, None)
    };
    let message = message.unwrap_or_else(|| match &value {
        Value::String(s) => short(s, 200),
        Value::Null => String::new(),
        other => short(&compact(other), 200),
    });
    let mut text = format!(
        "proxy call {} failed: HTTP {status}",
        quoted_str(tool_name, 80)
    );
    if let Some(class) = &error_class {
        text += &format!(" {class}");
    }
    if !message.is_empty() {
        text += &format!(": {message}");
    }
    let kept = match (&value, is_json) {
        (Value::String(s), false) => Value::String(short(s, 200)),
        _ => value.clone(),
    };
    let decision = retry_decision(status, error_class.as_deref());
    if decision == RetryDecision::Stale {
        text += " (the run is over)";
    }
    let error = ProxyError {
        kind: if decision == RetryDecision::Stale {
            ProxyErrorKind::StaleRunToken
        } else {
            ProxyErrorKind::Proxy
        },
        message: text,
        status_code: Some(status),
        error_class,
        body: Box::new(kept),
        tool_name: tool_name.to_string(),
        retry_after: parse_retry_after(retry_after_header, now),
    };
    match decision {
        RetryDecision::Retry => ProxyOutcome::Retry(error),
        _ => ProxyOutcome::Error(error),
    }
}

/// The one retry policy of tool calls and trace posts (§3.3, §7.4
/// kit-retry-numbers): at most 4 attempts for 429 and transient 503s, waits
/// of 0.5 s × 2ⁿ ±25 % capped at 4 s, `Retry-After` honoured up to 60 s, and
/// 2 more attempts after a transport failure, with the same key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all for 429 and transient 503s, the first included.
    pub max_attempts: u32,
    /// The first backoff; doubles on each retry.
    pub base_delay: Duration,
    /// Each computed wait is capped here.
    pub max_delay: Duration,
    /// ±25 %: waits are spread.
    pub jitter: f64,
    /// A `Retry-After` replaces the computed wait, capped here.
    pub max_retry_after: Duration,
    /// Retries of timeouts and refused or reset connections.
    pub transport_retries: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(4),
            jitter: 0.25,
            max_retry_after: Duration::from_secs(60),
            transport_retries: 2,
        }
    }
}

impl RetryPolicy {
    /// A reply as the policy takes it (§7.4 kit-retry-after-cap): a retry whose
    /// `Retry-After` is longer than `max_retry_after` is not waited but fails
    /// at once (retrying sooner than asked would hammer the proxy, sleeping
    /// that long would outlast the run), its message naming the wait asked for.
    pub fn settle(&self, outcome: ProxyOutcome) -> ProxyOutcome {
        match outcome {
            ProxyOutcome::Retry(mut error)
                if error.retry_after.is_some_and(|w| w > self.max_retry_after) =>
            {
                let asked = error.retry_after.unwrap_or_default().as_secs_f64();
                error.message += &format!(
                    " (the proxy asked to wait {asked} s before a retry, longer than the {} s this client waits: \
                     not retried)",
                    self.max_retry_after.as_secs_f64()
                );
                ProxyOutcome::Error(error)
            }
            other => other,
        }
    }

    /// The wait before retry number `retry` (1 for the first): the
    /// `Retry-After` when given (capped), else the exponential backoff with
    /// jitter; `unit` is a uniform draw in `[0, 1)`.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>, unit: f64) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(self.max_retry_after);
        }
        let factor = 1.0 - self.jitter + unit * 2.0 * self.jitter;
        let wait =
            self.base_delay.as_secs_f64() * 2f64.powi(retry.saturating_sub(1) as i32) * factor;
        Duration::from_secs_f64(wait.clamp(0.0, self.max_delay.as_secs_f64()))
    }
}

/// What a driver does after one attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum RetryStep {
    /// The call returns this value.
    Return(Value),
    /// The call fails with this error.
    Raise(ProxyError),
    /// Send the same request again (its Idempotency-Key included) after
    /// `wait` (`None`: at once); `error` is what the attempt failed with.
    Retry {
        /// How long to wait first.
        wait: Option<Duration>,
        /// The attempt's failure, for the log line.
        error: ProxyError,
    },
}

/// One logical call's way through the retry policy (§3.3): every driver
/// makes an attempt, turns what came back into a [`ProxyOutcome`] and does
/// what [`RetryState::step`] answers.
#[derive(Debug, Clone)]
pub struct RetryState {
    policy: RetryPolicy,
    /// Every attempt so far, transport failures included.
    pub attempts: u32,
    /// Transport failures so far.
    pub transport_failures: u32,
    seed: u64,
}

impl RetryState {
    /// A fresh call; `seed` feeds the jitter (any value; the drivers use the clock).
    pub fn new(policy: RetryPolicy, seed: u64) -> Self {
        RetryState {
            policy,
            attempts: 0,
            transport_failures: 0,
            seed: seed | 1,
        }
    }

    fn unit(&mut self) -> f64 {
        // xorshift64*: the jitter needs spread, not secrecy
        self.seed ^= self.seed >> 12;
        self.seed ^= self.seed << 25;
        self.seed ^= self.seed >> 27;
        (self.seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next step after an attempt that came to `outcome`.
    pub fn step(&mut self, outcome: ProxyOutcome) -> RetryStep {
        self.attempts += 1;
        match self.policy.settle(outcome) {
            ProxyOutcome::Value(value) => RetryStep::Return(value),
            ProxyOutcome::Error(error) => RetryStep::Raise(error),
            ProxyOutcome::Transport { error, stale } => {
                self.transport_failures += 1;
                if self.transport_failures > self.policy.transport_retries {
                    return RetryStep::Raise(error);
                }
                let unit = self.unit();
                let wait = (!stale).then(|| self.policy.delay(self.transport_failures, None, unit));
                RetryStep::Retry { wait, error }
            }
            ProxyOutcome::Retry(error) if self.attempts < self.policy.max_attempts => {
                let unit = self.unit();
                let wait = self.policy.delay(self.attempts, error.retry_after, unit);
                RetryStep::Retry {
                    wait: Some(wait),
                    error,
                }
            }
            ProxyOutcome::Retry(error) => RetryStep::Raise(error),
        }
    }
}

/// Client-side pacing (§3.1 rate-limit, §7.4 kit-pacing): at most `limit`
/// requests per run token in any `window`, a sliding log of slots. A caller
/// over the limit is told how long to wait for its reserved slot. At most
/// 4096 runs are remembered.
#[derive(Debug)]
pub struct Pacer {
    /// Requests per window.
    pub limit: usize,
    /// The window.
    pub window: Duration,
    slots: HashMap<String, VecDeque<Instant>>,
    order: VecDeque<String>,
}

impl Pacer {
    /// At most `limit` requests per run token in any `window`.
    pub fn new(limit: usize, window: Duration) -> Self {
        Pacer {
            limit: limit.max(1),
            window,
            slots: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Takes the next slot for `key` (a run token) at `now`; how long to wait for it.
    pub fn reserve(&mut self, key: &str, now: Instant) -> Duration {
        if !self.slots.contains_key(key) {
            if self.order.len() >= 4096 {
                if let Some(old) = self.order.pop_front() {
                    self.slots.remove(&old);
                }
            }
            self.order.push_back(key.to_string());
        }
        let log = self.slots.entry(key.to_string()).or_default();
        let mut slot = now;
        if log.len() >= self.limit {
            let earliest = log[log.len() - self.limit] + self.window;
            if earliest > now {
                slot = earliest;
            }
        }
        log.push_back(slot);
        while log.len() > self.limit {
            log.pop_front();
        }
        slot - now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(retry_after: Option<Duration>) -> ProxyError {
        let mut e = ProxyError::new(ProxyErrorKind::Proxy, "x", "t");
        e.retry_after = retry_after;
        e
    }

    #[test]
    fn retries_are_bounded_and_spread() {
        let mut state = RetryState::new(RetryPolicy::default(), 42);
        let mut waits = vec![];
        loop {
            match state.step(ProxyOutcome::Retry(err(None))) {
                RetryStep::Retry { wait, .. } => waits.push(wait.unwrap()),
                RetryStep::Raise(_) => break,
                RetryStep::Return(_) => unreachable!(),
            }
        }
        assert_eq!(waits.len(), 3);
        for (i, w) in waits.iter().enumerate() {
            let base = 0.5 * 2f64.powi(i as i32);
            assert!(
                w.as_secs_f64() >= base * 0.75 && w.as_secs_f64() <= base * 1.25,
                "{w:?}"
            );
        }
    }

    #[test]
    fn retry_after_wins_and_one_past_the_cap_fails_at_once() {
        let mut state = RetryState::new(RetryPolicy::default(), 1);
        let step = state.step(ProxyOutcome::Retry(err(Some(Duration::from_secs(60)))));
        assert_eq!(
            step,
            RetryStep::Retry {
                wait: Some(Duration::from_secs(60)),
                error: err(Some(Duration::from_secs(60)))
            }
        );
        let RetryStep::Raise(e) =
            state.step(ProxyOutcome::Retry(err(Some(Duration::from_secs(3600)))))
        else {
            panic!("a Retry-After of an hour is not waited")
        };
        assert!(e.message.ends_with("(the proxy asked to wait 3600 s before a retry, longer than the 60 s this client waits: not retried)"), "{}", e.message);
        assert_eq!(state.attempts, 2);
    }

    #[test]
    fn transport_failures_retry_twice_and_stale_connections_at_once() {
        let mut state = RetryState::new(RetryPolicy::default(), 7);
        let t = |stale| ProxyOutcome::Transport {
            error: err(None),
            stale,
        };
        assert!(matches!(
            state.step(t(true)),
            RetryStep::Retry { wait: None, .. }
        ));
        assert!(matches!(
            state.step(t(false)),
            RetryStep::Retry { wait: Some(_), .. }
        ));
        assert!(matches!(state.step(t(false)), RetryStep::Raise(_)));
        assert_eq!(state.attempts, 3);
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let at = |secs| std::time::UNIX_EPOCH + Duration::from_secs(secs);
        let now = at(784_111_770); // Sun, 06 Nov 1994 08:49:30 GMT
        let wait = |text| parse_retry_after(Some(text), now);
        assert_eq!(wait("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(wait(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(wait("-3"), Some(Duration::ZERO));
        // the three formats of RFC 9110 §5.6.7, 7 s ahead
        for date in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(wait(date), Some(Duration::from_secs(7)), "{date}");
        }
        // a date in the past waits 0 (a date minus now, not now minus a date)
        let later = at(1_500_000_000); // 2017
        assert_eq!(
            parse_retry_after(Some("Wed, 21 Oct 2015 07:28:00 GMT"), later),
            Some(Duration::ZERO)
        );
        assert_eq!(
            wait("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::from_secs(1_000_000)) // far ahead: capped, then refused by `settle`
        );
        for unreadable in [
            "soon",
            "inf",
            "nan",
            "Sun, 06 Nov 1994 08:49:37 +0000",
            "Mon, 06 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(wait(unreadable), None, "{unreadable}");
        }
        assert_eq!(parse_retry_after(Some("  "), now), None);
        assert_eq!(parse_retry_after(None, now), None);
    }

    #[test]
    fn the_pacer_spreads_a_burst() {
        let mut pacer = Pacer::new(2, Duration::from_secs(60));
        let now = Instant::now();
        assert_eq!(pacer.reserve("a", now), Duration::ZERO);
        assert_eq!(pacer.reserve("a", now), Duration::ZERO);
        assert_eq!(pacer.reserve("a", now), Duration::from_secs(60));
        assert_eq!(pacer.reserve("b", now), Duration::ZERO);
    }

    #[test]
    fn stale_tokens_and_unwrapping() {
        let now = SystemTime::now();
        let body = json!({"detail": {"error_class": "run_token_expired", "message": "tok-1 gone"}})
            .to_string();
        let ProxyOutcome::Error(e) = interpret_reply(401, None, body.as_bytes(), "t", "tok-1", now)
        else {
            panic!()
        };
        assert_eq!(e.kind, ProxyErrorKind::StaleRunToken);
        assert!(!e.message.contains("tok-1") && !e.body.to_string().contains("tok-1"));
        assert_eq!(
            interpret_reply(200, None, b"", "t", "x", now),
            ProxyOutcome::Value(Value::Null)
        );
    }
}
