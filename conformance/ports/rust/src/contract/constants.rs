//! Constants: the contract's names and numbers.

use std::time::Duration;

/// The port's version, reported by `GET /healthz`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// §2.1 inbound headers (looked up case-insensitively).
pub const HEADER_RUN_TOKEN: &str = "X-Pipelines-Run-Token";
/// §2.1 the proxy URL header.
pub const HEADER_PROXY_URL: &str = "X-Pipelines-Odyssey-Proxy-Url";
/// §2.1 the proxy URL header under its name before a rename.
pub const HEADER_PROXY_URL_LEGACY: &str = "X-Pipelines-Pwsa-Proxy-Url";
/// §2.1 run id header.
pub const HEADER_RUN_ID: &str = "X-Pipelines-Run-Id";
/// §2.1 task id header.
pub const HEADER_TASK_ID: &str = "X-Pipelines-Task-Id";
/// §2.1 the token's correlation id (not the token).
pub const HEADER_RUN_TOKEN_JTI: &str = "X-Pipelines-Run-Token-Jti";
/// §3.5 outbound attribution to a sub-agent.
pub const HEADER_ACTOR_ID: &str = "X-Pipelines-Actor-Id";

/// §2.2 body field naming the proxy URL.
pub const FIELD_PROXY_URL: &str = "odyssey_proxy_url";
/// §2.2 the legacy body field.
pub const FIELD_PROXY_URL_LEGACY: &str = "pwsa_proxy_url";

/// §3.1 request body cap.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;
/// §3.1 reply cap (§7.5 kit-reply-cap).
pub const MAX_REPLY_BYTES: usize = 1 << 20;

/// §3.4 trace-event-types, in the contract's order.
pub const TRACE_EVENT_TYPES: [&str; 8] = [
    "assistant_message",
    "thinking",
    "system_prompt",
    "custom",
    "llm_payload",
    "handoff",
    "subagent_message",
    "subagent_final",
];

/// §3.3 the transient 503 classes (retried).
pub const TRANSIENT_503_CLASSES: [&str; 3] = [
    "lock_contention",
    "context_store_unavailable",
    "trace_sequence_contended",
];
/// §3.3 the stale run token classes of a 401 (the run is over).
pub const STALE_TOKEN_CLASSES: [&str; 3] = [
    "run_token_expired",
    "run_token_invalid",
    "run_token_rejected",
];

/// §2 the dispatch route by convention.
pub const DEFAULT_DISPATCH_PATH: &str = "/dispatch";
/// §7.1 the variable holding the agent token.
pub const DEFAULT_TOKEN_ENV: &str = "AGENT_TOKEN";
/// §7.1 kit-body-framing: 8 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
/// §2.3 step 7: 300 s by default.
pub const DEFAULT_RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// §2.3 step 7: 1800 s at most.
pub const MAX_RUN_TIMEOUT: Duration = Duration::from_secs(1800);
/// §3.1 generous-timeout: 120 s per attempt.
pub const DEFAULT_PROXY_TIMEOUT: Duration = Duration::from_secs(120);
/// §3.1 rate-limit: 60 requests per minute per run token.
pub const RATE_LIMIT_PER_MINUTE: usize = 60;
/// §7.3 kit-error-detail-shape: at most 500 characters.
pub const DETAIL_LIMIT: usize = 500;
/// §3.7 the probe's tool name.
pub const PROBE_TOOL: &str = "__reachability_probe__";
/// §7.6 what a secret becomes.
pub const REDACTED: &str = "[redacted]";
/// §4 final-response-length.
pub const FINAL_RESPONSE_SOFT_LIMIT: usize = 50_000;

/// The User-Agent of proxy requests.
pub fn user_agent() -> String {
    format!("pipelines-port-rust/{VERSION}")
}
