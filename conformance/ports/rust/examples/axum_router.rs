//! The dispatch app mounted in an application's own axum `Router`: the
//! agent's endpoint under a prefix (`POST /agents/orders/dispatch`, with its
//! `GET /agents/orders/healthz`) beside the application's routes, served by
//! `axum::serve` with graceful shutdown.
//!
//! `axum::serve` sets no request-head timeout, so put it behind a front end
//! (a load balancer, a reverse proxy) that has one, or serve the app alone
//! with `pipelines_port::server::serve`, which does.
//!
//! ```sh
//! AGENT_TOKEN=dev-token-1234 cargo run --example axum_router
//! ```

use axum::routing::get;
use axum::Router;
use pipelines_port::{AgentError, DispatchApp, Options, Run};
use serde_json::json;

async fn agent(run: Run) -> Result<String, AgentError> {
    let args = json!({ "order_id": run.envelope().task_input.get("order_id") });
    let order = run.call("get_order", args).await?;
    Ok(format!("Order: {order}"))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let orders = DispatchApp::new(agent, Options::default()).expect("valid options");
    let app = Router::new()
        .route("/", get(|| async { "the application's own routes" }))
        // the nested app sees `/dispatch`: the prefix is stripped
        .nest("/agents/orders", orders.router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
    eprintln!("listening on http://127.0.0.1:8080/agents/orders/dispatch");
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = tokio::signal::ctrl_c().await;
            orders.drain(); // new dispatches get 503 while the running ones finish
        })
        .await
}
