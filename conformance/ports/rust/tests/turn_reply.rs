//! Multi-turn runs (§4.2) over 127.0.0.1: a turn reply leaves the dispatch app
//! as the agent built it; a single-turn dispatch gets the envelope; lenient and
//! strict treat a malformed turn reply as a malformed envelope; then 120
//! concurrent multi-turn dispatches, each with its own run token and session.

mod common;

use common::{Proxy, Scripted};
use pipelines_port::contract::response::build_turn_reply;
use pipelines_port::{AgentError, DispatchApp, Options, Run};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;

const AGENT_TOKEN: &str = "agent-token-turns-9e9e9e9e";
const DISPATCHES: usize = 120;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn serve(rt: &tokio::runtime::Runtime, strict: bool) -> SocketAddr {
    let options = Options {
        token: Some(AGENT_TOKEN.into()),
        strict,
        ..Default::default()
    };
    let app = DispatchApp::new(agent, options).unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let router = app.router();
    rt.spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Calls `get_order`, then answers what the instruction names: `reply`
/// (`build_turn_reply`), `string`, `concurrent`, or the JSON value it holds.
async fn agent(run: Run) -> Result<Value, AgentError> {
    let env = run.envelope().clone();
    let order = run
        .call(
            "get_order",
            json!({ "run_id": env.run_id, "session": env.session_id }),
        )
        .await?;
    match env.user_instruction.as_str() {
        "reply" => {
            let metadata = Map::from_iter([("model".to_string(), json!("m-1"))]);
            Ok(serde_json::to_value(build_turn_reply(
                "Which order do you mean?",
                Some(metadata),
                true,
            )?)?)
        }
        "string" => Ok(json!("Which order?")),
        "concurrent" => {
            let session = env.session_id.clone().unwrap_or_default();
            let message = format!(
                "{}: order {}",
                session.as_str().unwrap_or_default(),
                order["order"]
            );
            let metadata = Map::from_iter([(
                "turn_id".to_string(),
                env.turn_id.clone().unwrap_or_default(),
            )]);
            Ok(serde_json::to_value(build_turn_reply(
                &message,
                Some(metadata),
                false,
            )?)?)
        }
        text => Ok(serde_json::from_str(text)?),
    }
}

async fn post(
    client: &reqwest::Client,
    addr: SocketAddr,
    proxy_url: &str,
    run_token: &str,
    instruction: &str,
    session: Option<&str>,
) -> (u16, Value) {
    let mut input = json!({"user_instruction": instruction, "input": {}});
    if let Some(session) = session {
        input["latest_user_prompt"] = json!("Cancel my order");
        input["session_id"] = json!(session);
        input["turn_id"] = json!(format!("{session}-t0"));
        input["messages"] = json!([]);
    }
    let body = json!({"run_id": 17, "odyssey_proxy_url": proxy_url, "input": input});
    let response = client
        .post(format!("http://{addr}/dispatch"))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Pipelines-Run-Token", run_token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (
        status,
        serde_json::from_str(&response.text().await.unwrap()).unwrap(),
    )
}

#[test]
fn a_turn_reply_leaves_the_app_as_built() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    proxy.reset(vec![Scripted::new(
        200,
        r#"{"response": {"order": "4521"}}"#,
    )]);
    let (lenient, strict) = (serve(&rt, false), serve(&rt, true));
    let client = reqwest::Client::new();
    let token = "run-token-turns-rust-1";
    let sess = Some("sess-1");
    rt.block_on(async {
        let reply = json!({"message": "Which order do you mean?", "session_done": true, "metadata": {"model": "m-1"}});
        for addr in [lenient, strict] {
            assert_eq!(post(&client, addr, &proxy.url, token, "reply", sess).await, (200, reply.clone()));
        }
        assert_eq!(
            post(&client, lenient, &proxy.url, token, "reply", None).await,
            (200, json!({"final_response": "Which order do you mean?", "metadata": {"model": "m-1"}}))
        );
        assert_eq!(
            post(&client, lenient, &proxy.url, token, "string", sess).await,
            (200, json!({"final_response": "Which order?"}))
        );
        let hand_built = r#"{"message": "ok", "session_done": false, "trace": {"step": 2}}"#;
        assert_eq!(
            post(&client, strict, &proxy.url, token, hand_built, sess).await,
            (200, serde_json::from_str::<Value>(hand_built).unwrap())
        );
        let malformed = r#"{"message": "ok", "session_done": "yes", "metadata": [1]}"#;
        assert_eq!(
            post(&client, lenient, &proxy.url, token, malformed, sess).await,
            (200, json!({"message": "ok", "session_done": false}))
        );
        let (status, body) = post(&client, strict, &proxy.url, token, malformed, sess).await;
        let detail = body["detail"].as_str().unwrap_or_default();
        assert_eq!(status, 500, "{body}");
        assert!(detail.contains("session_done: must be a boolean") && detail.contains("metadata"), "{detail}");
        let empty = r#"{"message": "", "session_done": true}"#;
        assert_eq!(post(&client, lenient, &proxy.url, token, empty, sess).await.0, 500);
        let leaky = r#"{"message": "token run-token-turns-rust-1", "session_done": false}"#;
        assert_eq!(
            post(&client, lenient, &proxy.url, token, leaky, sess).await,
            (200, json!({"message": "token [redacted]", "session_done": false}))
        );
    });
    assert!(proxy
        .sent()
        .iter()
        .all(|r| r.header("authorization") == Some(format!("Bearer {token}"))));
}

#[test]
fn build_turn_reply_refuses_what_a_strict_server_refuses() {
    let built = build_turn_reply("Which order?", None, false).unwrap();
    assert_eq!(
        serde_json::to_value(built).unwrap(),
        json!({"message": "Which order?", "session_done": false})
    );
    assert!(build_turn_reply("", None, false).is_err());
    assert!(build_turn_reply("  ", None, true).is_err());
    let mistyped = Map::from_iter([("total_input_tokens".to_string(), json!("many"))]);
    let err = build_turn_reply("x", Some(mistyped), false).unwrap_err();
    assert!(
        err.to_string().contains("metadata.total_input_tokens"),
        "{err}"
    );
}

#[test]
fn concurrent_multi_turn_dispatches_each_get_their_own_turn_reply() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    proxy.reset(vec![Scripted {
        delay_ms: 20,
        ..Scripted::new(200, r#"{"response": {"order": "4521"}}"#)
    }]);
    let addr = serve(&rt, false);
    let client = reqwest::Client::new();
    let replies = rt.block_on(async {
        let tasks: Vec<_> = (0..DISPATCHES)
            .map(|i| {
                let (client, url) = (client.clone(), proxy.url.clone());
                tokio::spawn(async move {
                    let session = format!("sess-{i}");
                    let token = format!("run-token-turns-{i}-rust");
                    post(&client, addr, &url, &token, "concurrent", Some(&session)).await
                })
            })
            .collect();
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    });
    for (i, reply) in replies.into_iter().enumerate() {
        let want = json!({"message": format!("sess-{i}: order \"4521\""), "session_done": false,
                          "metadata": {"turn_id": format!("sess-{i}-t0")}});
        assert_eq!(reply, (200, want));
    }
    let sent = proxy.sent();
    assert_eq!(sent.len(), DISPATCHES);
    for request in &sent {
        let session = request.json["session"].as_str().unwrap().to_string();
        let i = session.trim_start_matches("sess-");
        assert_eq!(
            request.header("authorization"),
            Some(format!("Bearer run-token-turns-{i}-rust"))
        );
    }
}
