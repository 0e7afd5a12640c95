//! An agent written as blocking code (a synchronous model SDK, say), served
//! by the dispatch app: it runs on tokio's blocking pool and reaches the proxy
//! through a [`BlockingClient`], inside the dispatch's own [`RunState`], so a
//! dispatch that overran its run timeout has its later calls refused.
//!
//! ```sh
//! AGENT_TOKEN=dev-token-1234 cargo run --example blocking_agent
//! ```

use pipelines_port::transport::{CallOptions, RunState};
use pipelines_port::{AgentError, BlockingClient, DispatchApp, Options, Run};
use serde_json::json;
use std::time::Duration;

/// The agent: plain blocking code, one tool call and a trace event.
fn answer(client: &BlockingClient, run: &RunState) -> Result<String, AgentError> {
    let plain = CallOptions::default();
    let args = json!({ "order_id": run.envelope.task_input.get("order_id") });
    let order = client.call_in(run, "get_order", args, &plain)?;
    let event = json!({ "text": "looked it up" });
    let traced = CallOptions {
        best_effort: true, // a failed trace post is a log line, not the run's end
        ..plain
    };
    client.trace_in(run, "assistant_message", event, &traced)?;
    Ok(format!("Order: {order}"))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let client = BlockingClient::default(); // one keep-alive pool for every run
    let agent = move |run: Run| {
        let (client, state) = (client.clone(), run.state().clone());
        // a panic in `answer` is a JoinError: the dispatch is answered 500
        async move { tokio::task::spawn_blocking(move || answer(&client, &state)).await? }
    };
    let app = DispatchApp::new(agent, Options::default()).expect("valid options");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
    eprintln!("listening on http://127.0.0.1:8080{}", app.path());
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    pipelines_port::server::serve(listener, app, shutdown, Duration::from_secs(30)).await?;
    Ok(())
}
