//! The Pipelines agent wire contract in Rust: the Rust reference port of
//! `pipelines_port.py`.
//!
//! Section numbers (§2, §3.3, ...) point into `CONTRACT.md` at the root of
//! the repository; rule ids (`auth-first`, `idempotency-key-reuse`, ...) are
//! the contract's. The crate mirrors the Python module's parts:
//!
//! - [`contract`] is PART 1, "THE CONTRACT": pure functions and data, no I/O,
//!   no threads, no environment; it needs no feature, and depends on `serde`,
//!   `serde_json`, `sha2`, `subtle` and `httpdate`, none of which does I/O.
//! - [`blocking`] (feature `blocking`, `ureq` with rustls/ring) and [`aio`]
//!   (feature `async`, `reqwest` on tokio) are the two proxy drivers of PART 2;
//!   both loop over the same [`contract::reply::RetryState::step`].
//! - [`server`] (feature `axum`) is the dispatch app and its axum adapter:
//!   a `Router` serving an `async fn(Run) -> Result<T, AgentError>` agent,
//!   with graceful shutdown.
//!
//! Start with [`DispatchApp`] and [`Run`] (the crate's README has a quick
//! start and recipes: an axum `Router`, a blocking agent); the features are
//! `blocking`, `async` and `axum`, all on by default.
//!
//! The run token is a secret (§2.1 run-token-secret): it never appears in a
//! log line, an error message, a response body or the `Debug` form of an
//! [`Envelope`].
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod contract;

#[cfg(feature = "async")]
#[cfg_attr(docsrs, doc(cfg(feature = "async")))]
pub mod aio;
#[cfg(feature = "blocking")]
#[cfg_attr(docsrs, doc(cfg(feature = "blocking")))]
pub mod blocking;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod server;
#[cfg(any(feature = "async", feature = "blocking"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "async", feature = "blocking"))))]
pub mod transport;

pub use contract::encoding::Handoff;
pub use contract::envelope::{Envelope, Headers};
pub use contract::errors::{
    AgentError, EnvelopeError, ProxyError, ProxyErrorKind, ResponseError, RunTimeoutError,
};
pub use contract::reply::RetryPolicy;
pub use contract::response::{Message, ResponseEnvelope, ToolCall, TurnReply};

#[cfg(feature = "async")]
#[cfg_attr(docsrs, doc(cfg(feature = "async")))]
pub use aio::{current_run, AsyncClient, Run};
#[cfg(feature = "blocking")]
#[cfg_attr(docsrs, doc(cfg(feature = "blocking")))]
pub use blocking::BlockingClient;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use server::{DispatchApp, Options};
