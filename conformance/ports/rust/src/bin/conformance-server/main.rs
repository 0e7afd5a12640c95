//! `conformance-server` serves the conformance agent (`agent.rs`) through the
//! Rust port's axum adapter, for `python3 -m conformance check URL`.
//!
//! ```text
//! conformance-server [--host 127.0.0.1] [--port 8080] [--path /dispatch]
//!     [--token-env AGENT_TOKEN] [--auth-header Authorization] [--no-auth] [--strict]
//!     [--max-body BYTES] [--timeout SECONDS] [--grace SECONDS]
//! ```
//!
//! Its first stdout line reads `... listening on http://HOST:PORT/PATH`.
//! SIGTERM or SIGINT: new connections are refused, in-flight dispatches
//! finish (up to `--grace` seconds); the exit status is 0 when they all did.
//! A bad argument is one line on stderr and exit status 2.
#![forbid(unsafe_code)]

mod agent;

use pipelines_port::server::{serve, DispatchApp, Options};
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "usage: conformance-server [--host HOST] [--port PORT] [--path /dispatch] [--token-env NAME] \
[--auth-header NAME] [--no-auth] [--strict] [--max-body BYTES] [--timeout SECONDS] [--grace SECONDS]";

struct Settings {
    host: String,
    port: u16,
    grace: Duration,
    options: Options,
}

fn seconds(flag: &str, text: &str) -> Result<Duration, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!(
            "{flag} must be a positive number of seconds, got {text:?}"
        )),
    }
}

fn parse_args(args: &[String]) -> Result<Settings, String> {
    let mut s = Settings {
        host: "127.0.0.1".into(),
        port: 8080,
        grace: Duration::from_secs(30),
        options: Options::default(),
    };
    let mut i = 0;
    while i < args.len() {
        let (flag, inline) = match args[i].split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (args[i].clone(), None),
        };
        i += 1;
        match flag.as_str() {
            "--no-auth" => s.options.no_auth = true,
            "--strict" => s.options.strict = true,
            "-h" | "--help" => return Err(USAGE.into()),
            "--host" | "--port" | "--path" | "--token-env" | "--auth-header" | "--max-body"
            | "--timeout" | "--grace" => {
                let value = match inline {
                    Some(v) => v,
                    None if i < args.len() => {
                        i += 1;
                        args[i - 1].clone()
                    }
                    None => return Err(format!("{flag} needs a value ({USAGE})")),
                };
                match flag.as_str() {
                    "--host" => s.host = value,
                    "--port" => {
                        s.port = value.parse().map_err(|_| {
                            format!(
                                "--port must be a port number (0 picks a free one), got {value:?}"
                            )
                        })?
                    }
                    "--path" => s.options.path = value,
                    "--token-env" => s.options.token_env = value,
                    "--auth-header" => s.options.auth_header = value,
                    "--max-body" => {
                        s.options.max_body =
                            value.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                                format!("--max-body must be a positive integer, got {value:?}")
                            })?
                    }
                    "--timeout" => s.options.run_timeout = seconds("--timeout", &value)?,
                    _ => s.grace = seconds("--grace", &value)?,
                }
            }
            other => return Err(format!("unexpected argument {other:?} ({USAGE})")),
        }
    }
    Ok(s)
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // A panic's message may quote what the agent held (a token): the log gets its place only.
    std::panic::set_hook(Box::new(|info| {
        let place = info
            .location()
            .map_or_else(String::new, |l| format!(" at {}:{}", l.file(), l.line()));
        eprintln!("pipelines_port: the agent panicked{place}; answering 500");
    }));
    let args: Vec<String> = std::env::args().skip(1).collect();
    let settings = match parse_args(&args) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("conformance-server: {e}");
            return ExitCode::from(2);
        }
    };
    let app = match DispatchApp::new(agent::conformance_agent, settings.options) {
        Ok(app) => app,
        Err(e) => {
            eprintln!("conformance-server: {e}");
            return ExitCode::from(2);
        }
    };
    let listener =
        match tokio::net::TcpListener::bind((settings.host.as_str(), settings.port)).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "conformance-server: cannot listen on {}:{}: {e}",
                    settings.host, settings.port
                );
                return ExitCode::from(2);
            }
        };
    let address = listener
        .local_addr()
        .map_or_else(|_| settings.host.clone(), |a| a.to_string());
    println!(
        "pipelines_port (rust) serve: listening on http://{address}{}",
        app.path()
    );
    println!("pipelines_port (rust) serve: auth: {}", app.describe_auth());
    match serve(listener, app, shutdown_signal(), settings.grace).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("conformance-server: {e}");
            ExitCode::from(1)
        }
    }
}
