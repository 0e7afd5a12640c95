//! The README's recipes over 127.0.0.1, 120 concurrent dispatches each (distinct
//! run tokens): the dispatch app mounted under a prefix in an application's
//! axum `Router` (`examples/axum_router.rs`), and a blocking agent on tokio's
//! blocking pool with a `BlockingClient` (`examples/blocking_agent.rs`).

mod common;

use common::{Proxy, Scripted};
use pipelines_port::transport::{CallOptions, RunState};
use pipelines_port::{AgentError, BlockingClient, DispatchApp, Options, Run};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::net::SocketAddr;

const AGENT_TOKEN: &str = "agent-token-8b8b8b8b";
const DISPATCHES: usize = 120;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn options() -> Options {
    Options {
        token: Some(AGENT_TOKEN.into()),
        ..Default::default()
    }
}

/// Serves `router` with `axum::serve` on a free port of 127.0.0.1.
fn serve(rt: &tokio::runtime::Runtime, router: axum::Router) -> SocketAddr {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// POSTs `body` to `url`; the status and the JSON reply.
async fn post(client: &reqwest::Client, url: &str, body: &Value, run_token: &str) -> (u16, Value) {
    let response = client
        .post(url)
        .bearer_auth(AGENT_TOKEN)
        .header("X-Pipelines-Run-Token", run_token)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    assert!(
        !text.contains(run_token) && !text.contains(AGENT_TOKEN),
        "a token in {text}"
    );
    (status, serde_json::from_str(&text).unwrap())
}

/// Dispatches `DISPATCHES` runs at once to `url`, each asking for its own order; checks every
/// answer and that each proxy call carried its own run's token and a fresh Idempotency-Key.
fn dispatch_many(rt: &tokio::runtime::Runtime, proxy: &Proxy, url: &str) {
    proxy.reset(vec![Scripted {
        delay_ms: 20,
        ..Scripted::new(200, r#"{"response": "found"}"#)
    }]);
    let client = reqwest::Client::new();
    let replies = rt.block_on(async {
        let tasks: Vec<_> = (0..DISPATCHES)
            .map(|i| {
                let body = json!({"run_id": i, "task_id": 7, "odyssey_proxy_url": proxy.url,
                                  "input": {"user_instruction": "find it", "input": {"order_id": i}}});
                let (client, url) = (client.clone(), url.to_string());
                tokio::spawn(async move {
                    post(&client, &url, &body, &format!("run-token-{i}-recipe")).await
                })
            })
            .collect();
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    });
    for (i, (status, body)) in replies.iter().enumerate() {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(
            body["final_response"],
            json!(format!("Order {i}: \"found\""))
        );
    }
    let sent = proxy.sent();
    assert_eq!(sent.len(), DISPATCHES);
    for request in &sent {
        assert!(
            request.path.ends_with("/tools/get_order"),
            "{}",
            request.path
        );
        let i = request.json["order_id"].as_u64().unwrap();
        assert_eq!(
            request.header("authorization"),
            Some(format!("Bearer run-token-{i}-recipe"))
        );
    }
    let keys: HashSet<_> = sent
        .iter()
        .map(|r| r.header("idempotency-key").unwrap())
        .collect();
    assert_eq!(keys.len(), DISPATCHES, "one fresh Idempotency-Key per call");
}

async fn async_agent(run: Run) -> Result<String, AgentError> {
    let order_id = run.envelope().task_input.get("order_id").cloned();
    let order = run
        .call("get_order", json!({ "order_id": order_id }))
        .await?;
    Ok(format!("Order {}: {order}", order_id.unwrap_or_default()))
}

#[test]
fn the_app_mounted_under_a_prefix_in_an_axum_router() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    let orders = DispatchApp::new(async_agent, options()).unwrap();
    let router = axum::Router::new()
        .route("/", axum::routing::get(|| async { "home" }))
        .nest("/agents/orders", orders.router());
    let addr = serve(&rt, router);
    dispatch_many(
        &rt,
        &proxy,
        &format!("http://{addr}/agents/orders/dispatch"),
    );
    let client = reqwest::Client::new();
    rt.block_on(async {
        let get = |path: &str| client.get(format!("http://{addr}{path}")).send();
        let home = get("/").await.unwrap();
        assert_eq!(home.status(), 200);
        assert_eq!(home.text().await.unwrap(), "home");
        assert_eq!(get("/agents/orders/healthz").await.unwrap().status(), 200);
        assert_eq!(get("/agents/orders/dispatch").await.unwrap().status(), 405);
        assert_eq!(get("/agents/orders/other").await.unwrap().status(), 404);
        assert_eq!(get("/dispatch").await.unwrap().status(), 404); // only under the prefix
        let ping = json!({"ping": true});
        let url = format!("http://{addr}/agents/orders/dispatch");
        assert_eq!(
            post(&client, &url, &ping, "unused").await,
            (200, json!({"ok": true}))
        );
        let anonymous = client.post(&url).json(&ping).send().await.unwrap();
        assert_eq!(anonymous.status(), 401); // auth holds under the prefix
    });
}

/// The agent of `examples/blocking_agent.rs`: blocking code inside the dispatch's run state.
fn blocking_agent(client: &BlockingClient, run: &RunState) -> Result<String, AgentError> {
    let order_id = run.envelope.task_input.get("order_id").cloned();
    let args = json!({ "order_id": order_id });
    let order = client.call_in(run, "get_order", args, &CallOptions::default())?;
    Ok(format!("Order {}: {order}", order_id.unwrap_or_default()))
}

#[test]
fn a_blocking_agent_on_the_blocking_pool() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    let client = BlockingClient::default();
    let agent = move |run: Run| {
        let (client, state) = (client.clone(), run.state().clone());
        async move { tokio::task::spawn_blocking(move || blocking_agent(&client, &state)).await? }
    };
    let app = DispatchApp::new(agent, options()).unwrap();
    let addr = serve(&rt, app.router());
    dispatch_many(&rt, &proxy, &format!("http://{addr}/dispatch"));
}
