use pipelines_port::{AgentError, DispatchApp, Options, Run};
use serde_json::json;
use std::time::Duration;

async fn agent(run: Run) -> Result<String, AgentError> {
    let input = &run.envelope().task_input;
    // POST {proxy_url}/tools/get_order with the run token, paced and retried as §3 says
    let args = json!({ "order_id": input.get("order_id") });
    let order = run.call("get_order", args).await?;
    // a live trace event; its failure need not end the run
    let event = json!({ "text": "looked it up" });
    let _ = run.trace("assistant_message", event).await;
    Ok(format!("Order: {order}")) // or a ResponseEnvelope with messages and metadata
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    // 503 for every request while AGENT_TOKEN is unset; 401 without the right bearer
    let app = DispatchApp::new(agent, Options::default()).expect("valid options");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    // on Ctrl-C: the listener closes, running dispatches get 30 s, then a 503 each
    pipelines_port::server::serve(listener, app, shutdown, Duration::from_secs(30)).await?;
    Ok(())
}
