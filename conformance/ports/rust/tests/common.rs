//! A recording proxy on 127.0.0.1 for the tests: it records every request
//! (path, headers, JSON body) and answers from a script, then `{"response": null}`.
#![allow(dead_code)]

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use pipelines_port::contract::json::decode;
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

pub const BASE_PATH: &str = "/api/odyssey-proxy/runs/r1";

#[derive(Clone, Debug)]
pub struct Recorded {
    pub path: String,
    pub headers: HeaderMap,
    pub json: Value,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
}

#[derive(Clone, Debug)]
pub struct Scripted {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay_ms: u64,
}

impl Scripted {
    pub fn new(status: u16, body: &str) -> Self {
        Scripted {
            status,
            headers: vec![],
            body: body.to_string(),
            delay_ms: 0,
        }
    }
}

#[derive(Default)]
struct Shared {
    requests: Vec<Recorded>,
    script: VecDeque<Scripted>,
}

#[derive(Clone, Default)]
pub struct Proxy {
    shared: Arc<Mutex<Shared>>,
    pub url: String,
}

async fn answer(State(proxy): State<Proxy>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let data: Bytes = axum::body::to_bytes(body, 4 << 20)
        .await
        .unwrap_or_default();
    let json = if data.is_empty() {
        Value::Null
    } else {
        decode(&data).unwrap_or(Value::String("<not JSON>".into()))
    };
    let spec = {
        let mut shared = proxy.shared.lock().unwrap();
        shared.requests.push(Recorded {
            path: parts.uri.path().to_string(),
            headers: parts.headers.clone(),
            json,
        });
        if shared.script.len() > 1 {
            shared.script.pop_front().unwrap()
        } else {
            shared
                .script
                .front()
                .cloned()
                .unwrap_or_else(|| Scripted::new(200, r#"{"response": null}"#))
        }
    };
    if spec.delay_ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(spec.delay_ms)).await;
    }
    let mut response = (StatusCode::from_u16(spec.status).unwrap(), spec.body).into_response();
    let mut has_type = false;
    for (name, value) in &spec.headers {
        has_type |= name.eq_ignore_ascii_case("content-type");
        response.headers_mut().insert(
            axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    if !has_type {
        response
            .headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
    }
    response
}

impl Proxy {
    /// Serves on 127.0.0.1 on the given runtime.
    pub fn start(rt: &tokio::runtime::Runtime) -> Proxy {
        let mut proxy = Proxy::default();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        proxy.url = format!("http://{}{BASE_PATH}", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .fallback(answer)
            .with_state(proxy.clone());
        rt.spawn(async move { axum::serve(listener, app).await.unwrap() });
        proxy
    }

    pub fn reset(&self, script: Vec<Scripted>) {
        let mut shared = self.shared.lock().unwrap();
        shared.requests.clear();
        shared.script = script.into();
    }

    pub fn sent(&self) -> Vec<Recorded> {
        self.shared.lock().unwrap().requests.clone()
    }
}

/// JSON equality, types included; numbers compare by value (1.0 == 1).
pub fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}
