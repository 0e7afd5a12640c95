//! The axum adapter over real sockets on 127.0.0.1: concurrency (per-request
//! binding under 120 concurrent dispatches), graceful shutdown and its grace
//! period, the run timeout, failing and panicking agents, strict framing.

mod common;

use common::{Proxy, Scripted};
use pipelines_port::server::{serve, DispatchApp, Options};
use pipelines_port::{current_run, AgentError, Run};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::oneshot;

const AGENT_TOKEN: &str = "agent-token-7a7a7a7a";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

struct Served {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<std::io::Result<bool>>,
}

fn start(rt: &tokio::runtime::Runtime, app: DispatchApp, grace: Duration) -> Served {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let done = rt.spawn(serve(
        listener,
        app,
        async move {
            let _ = stopped.await;
        },
        grace,
    ));
    Served {
        addr,
        stop: Some(stop),
        done,
    }
}

fn options() -> Options {
    Options {
        token: Some(AGENT_TOKEN.into()),
        ..Default::default()
    }
}

fn envelope(proxy: &Proxy, i: usize, instruction: &str) -> Value {
    json!({"run_id": i, "task_id": 42, "odyssey_proxy_url": proxy.url,
           "input": {"user_instruction": instruction, "input": {"i": i}}})
}

async fn dispatch(
    client: &reqwest::Client,
    addr: SocketAddr,
    body: &Value,
    token: &str,
) -> (u16, Value, bool) {
    let response = client
        .post(format!("http://{addr}/dispatch"))
        .bearer_auth(AGENT_TOKEN)
        .header("X-Pipelines-Run-Token", token)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let closes = response
        .headers()
        .get("connection")
        .is_some_and(|v| v == "close");
    let text = response.text().await.unwrap();
    assert!(
        !text.contains(token) && !text.contains(AGENT_TOKEN),
        "a token in {text}"
    );
    (status, serde_json::from_str(&text).unwrap(), closes)
}

/// A tool deep in the agent's code finds its run through the task-local.
async fn lookup(i: u64) -> Result<Value, pipelines_port::ProxyError> {
    current_run()
        .expect("bound by the dispatch app")
        .call("lookup", json!({ "i": i }))
        .await
}

#[test]
fn concurrent_dispatches_each_see_their_own_run() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    proxy.reset(vec![Scripted {
        delay_ms: 20,
        ..Scripted::new(200, r#"{"response": "ok"}"#)
    }]);
    let app = DispatchApp::new(
        |run: Run| async move {
            let i = run.envelope().task_input["i"].as_u64().unwrap();
            let first = lookup(i).await?; // through the task-local
            let second = run
                .with_actor("worker")
                .call("lookup", json!({ "i": i }))
                .await?; // explicit
            Ok::<_, AgentError>(format!("done {i} {first} {second}"))
        },
        options(),
    )
    .unwrap();
    let served = start(&rt, app, Duration::from_secs(5));
    let n = 120;
    let client = reqwest::Client::new();
    let replies = rt.block_on(async {
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let (client, body) = (client.clone(), envelope(&proxy, i, "go"));
                tokio::spawn(async move {
                    dispatch(&client, served.addr, &body, &format!("run-token-{i}-xyz")).await
                })
            })
            .collect();
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        replies
    });
    for (i, (status, body, _)) in replies.iter().enumerate() {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(
            body["final_response"],
            json!(format!("done {i} \"ok\" \"ok\""))
        );
    }
    let sent = proxy.sent();
    assert_eq!(sent.len(), 2 * n);
    for request in &sent {
        let i = request.json["i"].as_u64().unwrap();
        assert_eq!(
            request.header("authorization"),
            Some(format!("Bearer run-token-{i}-xyz"))
        );
    }
    let keys: std::collections::HashSet<_> = sent
        .iter()
        .map(|r| r.header("idempotency-key").unwrap())
        .collect();
    assert_eq!(
        keys.len(),
        2 * n,
        "one fresh Idempotency-Key per logical call"
    );
    assert_eq!(
        sent.iter()
            .filter(|r| r.header("x-pipelines-actor-id").as_deref() == Some("worker"))
            .count(),
        n
    );
}

#[test]
fn shutdown_lets_a_running_dispatch_finish_and_refuses_new_connections() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    proxy.reset(vec![Scripted {
        delay_ms: 300,
        ..Scripted::new(200, r#"{"response": "slow"}"#)
    }]);
    let app =
        DispatchApp::new(
            |run: Run| async move {
                Ok::<_, AgentError>(run.call("slow", json!({})).await?.to_string())
            },
            options(),
        )
        .unwrap();
    let mut served = start(&rt, app, Duration::from_secs(10));
    let client = reqwest::Client::new();
    let body = envelope(&proxy, 1, "go");
    let in_flight = rt.spawn({
        let client = client.clone();
        async move { dispatch(&client, served.addr, &body, "run-token-a1").await }
    });
    while proxy.sent().is_empty() {
        std::thread::sleep(Duration::from_millis(5));
    }
    served.stop.take().unwrap().send(()).unwrap();
    let (status, reply, _) = rt.block_on(in_flight).unwrap();
    assert_eq!(
        (status, reply["final_response"].clone()),
        (200, json!("\"slow\""))
    );
    assert!(
        rt.block_on(served.done).unwrap().unwrap(),
        "every dispatch finished in time"
    );
    assert!(
        std::net::TcpStream::connect(served.addr).is_err(),
        "the listener is closed"
    );
}

#[test]
fn a_dispatch_still_running_when_the_grace_ends_gets_a_503() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    let (started, mut is_started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let app = DispatchApp::new(
        move |_run: Run| {
            let started = started.clone();
            async move {
                let _ = started.send(());
                std::future::pending::<()>().await;
                Ok::<_, AgentError>("never")
            }
        },
        options(),
    )
    .unwrap();
    let mut served = start(&rt, app, Duration::from_millis(100));
    let client = reqwest::Client::new();
    let body = envelope(&proxy, 1, "go");
    let in_flight = rt.spawn({
        let client = client.clone();
        async move { dispatch(&client, served.addr, &body, "run-token-b2").await }
    });
    rt.block_on(is_started.recv()).unwrap();
    served.stop.take().unwrap().send(()).unwrap();
    let (status, reply, closes) = rt.block_on(in_flight).unwrap();
    assert_eq!(status, 503, "{reply}");
    assert!(closes && reply["detail"].as_str().unwrap().contains("shut down"));
    assert!(
        !rt.block_on(served.done).unwrap().unwrap(),
        "the grace ran out"
    );
}

#[test]
fn overruns_failures_and_panics_are_json_errors_without_secrets() {
    async fn agent(run: Run) -> Result<Value, AgentError> {
        let token = run.envelope().run_token().to_string();
        match run.envelope().user_instruction.as_str() {
            "sleep" => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok(json!("late"))
            }
            "fail" => Err(AgentError::msg(format!("boom {token} and {AGENT_TOKEN}"))),
            "panic" => panic!("kaboom"),
            "leak" => Ok(json!({"final_response": format!("the token is {token}")})),
            "empty" => Ok(json!("")),
            _ => {
                Ok(json!({"final_response": "ok", "messages": [{"role": "tool", "content": "x"}]}))
            }
        }
    }
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    let strict = Options {
        strict: true,
        ..options()
    };
    // the overrun on an app of its own: a panic's report (a backtrace under RUST_BACKTRACE=1) may take longer
    let hasty = Options {
        run_timeout: Duration::from_millis(200),
        ..strict.clone()
    };
    let hasty = start(
        &rt,
        DispatchApp::new(agent, hasty).unwrap(),
        Duration::from_secs(5),
    );
    let served = start(
        &rt,
        DispatchApp::new(agent, strict).unwrap(),
        Duration::from_secs(5),
    );
    let client = reqwest::Client::new();
    let ask_at = |addr: SocketAddr, instruction: &str| {
        rt.block_on(dispatch(
            &client,
            addr,
            &envelope(&proxy, 3, instruction),
            "run-token-c3",
        ))
    };
    let ask = |instruction: &str| ask_at(served.addr, instruction);
    let (status, reply, _) = ask_at(hasty.addr, "sleep");
    assert_eq!(status, 504);
    assert!(reply["detail"]
        .as_str()
        .unwrap()
        .contains("run_timeout_s=0.2"));
    let (status, reply, _) = ask("fail");
    assert_eq!(
        (status, reply["detail"].clone()),
        (500, json!("Error: boom [redacted] and [redacted]"))
    );
    let (status, reply, _) = ask("panic");
    assert_eq!(
        (status, reply["detail"].clone()),
        (500, json!("panic: kaboom"))
    );
    let (status, reply, _) = ask("leak");
    assert_eq!(
        (status, reply["final_response"].clone()),
        (200, json!("the token is [redacted]"))
    );
    assert_eq!(ask("empty").0, 500);
    let (status, reply, _) = ask("unpaired"); // strict: a tool message without its call
    assert!(
        status == 500 && reply["detail"].as_str().unwrap().contains("tool_call_id"),
        "{reply}"
    );
}

fn raw(addr: SocketAddr, request: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply); // to EOF: the server closes
    reply
}

#[test]
fn heads_a_front_end_could_frame_differently_are_refused_and_closed() {
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    let app = DispatchApp::new(
        |run: Run| async move { Ok::<_, AgentError>(run.call("smuggled", json!({})).await?) },
        options(),
    )
    .unwrap();
    let served = start(&rt, app, Duration::from_secs(5));
    let body = envelope(&proxy, 1, "go").to_string();
    let inner = format!(
        "POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_TOKEN}\r\nX-Pipelines-Run-Token: rt-1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let heads = [
        format!("Content-Length : {}", inner.len()),
        format!(
            "Content-Length: {}\r\nTransfer-Encoding: chunked",
            inner.len()
        ),
        format!("NoColonHere\r\nContent-Length: {}", inner.len()),
        format!("X-Note: a\r\n Content-Length: {}", inner.len()),
        format!("Content-Length: {}\r\nContent-Length: 0", inner.len()),
    ];
    for fields in heads {
        let reply = raw(
            served.addr,
            &format!("POST /dispatch HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT_TOKEN}\r\n{fields}\r\n\r\n{inner}"),
        );
        let status: u16 = reply.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
        assert!((400..500).contains(&status), "{fields:?}: {reply}");
        assert_eq!(
            reply.matches("HTTP/1.1 ").count(),
            1,
            "{fields:?}: a second reply: {reply}"
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(proxy.sent().is_empty(), "a hidden request ran");
    let reply = raw(
        served.addr,
        "GET /dispatch HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(
        reply.starts_with("HTTP/1.1 405") && reply.to_ascii_lowercase().contains("allow: post"),
        "{reply}"
    );
}

/// No run lost (issue 24, kit-json-safe-response): a result serde_json cannot
/// serialise (a map with non-string keys) is a JSON 500 naming the problem,
/// never a dropped connection; a NaN or infinite float goes as null (200).
#[test]
fn a_result_serde_cannot_serialise_is_a_json_500() {
    use std::collections::BTreeMap;
    let rt = runtime();
    let proxy = Proxy::start(&rt);
    let app = DispatchApp::new(
        |run: Run| async move {
            let mut value: BTreeMap<Vec<u8>, Value> = BTreeMap::new();
            match run.envelope().user_instruction.as_str() {
                "bytes keys" => value.insert(vec![1, 2], json!("x")),
                _ => value.insert(
                    b"final_response".to_vec(),
                    json!("unreachable: the key is not a string"),
                ),
            };
            Ok(value)
        },
        options(),
    )
    .unwrap();
    let served = start(&rt, app, Duration::from_secs(5));
    let client = reqwest::Client::new();
    for instruction in ["bytes keys", "final_response as bytes"] {
        let (status, reply, _) = rt.block_on(dispatch(
            &client,
            served.addr,
            &envelope(&proxy, 1, instruction),
            "run-token-serde",
        ));
        assert_eq!(status, 500, "{reply}");
        assert!(
            reply["detail"]
                .as_str()
                .unwrap()
                .contains("cannot become a response"),
            "{reply}"
        );
    }
    let app = DispatchApp::new(
        |_run: Run| async move {
            Ok(json!({"final_response": "done", "metadata": {"nan": f64::NAN, "inf": f64::INFINITY}}))
        },
        options(),
    )
    .unwrap();
    let served = start(&rt, app, Duration::from_secs(5));
    let (status, reply, _) = rt.block_on(dispatch(
        &client,
        served.addr,
        &envelope(&proxy, 2, "nan"),
        "run-token-serde",
    ));
    assert_eq!(
        (status, reply["metadata"].clone()),
        (200, json!({"nan": null, "inf": null}))
    );
}
