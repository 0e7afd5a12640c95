//! The language-neutral JSON vectors of `conformance/checker/vectors/`, run against
//! the port's public API (the same files the Python, TypeScript and Go ports
//! read). Pure cases call the functions directly; request, reply and trace
//! cases go over a socket to a recording proxy on 127.0.0.1, through both
//! drivers (the async one and the blocking one). Code-mode cases (`from:
//! run|env`) and `build_response`'s result objects are Python-specific and
//! skipped, as in the Go port's `vectors_test.go`.

mod common;

use common::{same, Proxy, Recorded, Scripted, BASE_PATH};
use pipelines_port::contract::encoding::{validate_actor_label, validate_tool_name};
use pipelines_port::contract::inbound::{check_credential, is_ping};
use pipelines_port::contract::json::{compact, decode};
use pipelines_port::contract::reply::{interpret_reply, ProxyOutcome};
use pipelines_port::contract::response::{
    build_reply, build_response, build_turn_reply, validate_response,
};
use pipelines_port::server::{DispatchApp, Options};
use pipelines_port::transport::{CallOptions, ClientSettings, RunState};
use pipelines_port::{
    AgentError, AsyncClient, BlockingClient, Envelope, Handoff, Headers, ProxyError, Run,
};
use serde_json::{json, Map, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

struct VectorFile {
    run_token: String,
    tool_name: String,
    cases: Vec<Value>,
}

/// Replaces every `{"$repeat": s, "count": n}` with `s` repeated `n` times.
fn expand(value: Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.into_iter().map(expand).collect()),
        Value::Object(map) => {
            if let (2, Some(Value::String(s)), Some(n)) = (
                map.len(),
                map.get("$repeat"),
                map.get("count").and_then(Value::as_u64),
            ) {
                return Value::String(s.repeat(n as usize));
            }
            Value::Object(map.into_iter().map(|(k, v)| (k, expand(v))).collect())
        }
        other => other,
    }
}

fn load(name: &str) -> VectorFile {
    let path = format!(
        "{}/../../checker/vectors/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let doc = expand(decode(&std::fs::read(&path).unwrap()).unwrap());
    VectorFile {
        run_token: doc["run_token"].as_str().unwrap_or_default().to_string(),
        tool_name: doc["tool_name"].as_str().unwrap_or_default().to_string(),
        cases: doc["cases"].as_array().unwrap().clone(),
    }
}

fn show(value: &Value) -> String {
    compact(value).chars().take(200).collect()
}

fn headers_of(value: &Value) -> Headers {
    value
        .as_object()
        .into_iter()
        .flatten()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_str().map_or_else(|| v.to_string(), str::to_string),
            )
        })
        .collect()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// Holds an error to a vector's `expect`: its kind, status_code, error_class, mentions, never_mentions.
enum Failure {
    Envelope(String),
    Proxy(ProxyError),
    Response(String),
}

impl Failure {
    fn message(&self) -> String {
        match self {
            Failure::Envelope(m) | Failure::Response(m) => m.clone(),
            Failure::Proxy(e) => e.message.clone(),
        }
    }
}

fn check_error(err: &Failure, expect: &Value) -> Result<(), String> {
    let kind = expect["error"].as_str().unwrap();
    let ok = match (kind, err) {
        ("envelope", Failure::Envelope(_)) | ("response", Failure::Response(_)) => true,
        ("proxy", Failure::Proxy(e)) => {
            matches!(
                e.kind,
                pipelines_port::ProxyErrorKind::Proxy
                    | pipelines_port::ProxyErrorKind::StaleRunToken
            )
        }
        ("proxy_request", Failure::Proxy(e)) => e.kind == pipelines_port::ProxyErrorKind::Request,
        ("stale_run_token", Failure::Proxy(e)) => {
            e.kind == pipelines_port::ProxyErrorKind::StaleRunToken
        }
        _ => false,
    };
    if !ok {
        return Err(format!("expected a {kind} error, got {}", err.message()));
    }
    if let Failure::Proxy(p) = err {
        if let Some(want) = expect.get("status_code") {
            let got = p.status_code.map_or(Value::Null, |s| json!(s));
            if !same(&got, want) {
                return Err(format!("status_code {got}, want {want}"));
            }
        }
        if let Some(want) = expect.get("error_class") {
            let got = p.error_class.clone().map_or(Value::Null, Value::String);
            if !same(&got, want) {
                return Err(format!("error_class {got}, want {want}"));
            }
        }
        for text in strings(&expect["never_mentions"]) {
            if compact(&p.body).contains(&text) {
                return Err(format!("{text:?} leaked into the kept body"));
            }
        }
    }
    let message = err.message();
    for text in strings(&expect["mentions"]) {
        if !message.contains(&text) {
            return Err(format!("{text:?} not in {message:?}"));
        }
    }
    for text in strings(&expect["never_mentions"]) {
        if message.contains(&text) {
            return Err(format!("{text:?} leaked into {message:?}"));
        }
    }
    Ok(())
}

/// Holds an outcome to `expect`: an error of `expect.error`, or none. `Ok(true)`: it failed as expected.
fn expect_outcome<T>(result: &Result<T, Failure>, expect: &Value) -> Result<bool, String> {
    match (result, expect.get("error")) {
        (Err(e), Some(_)) => check_error(e, expect).map(|_| true),
        (Ok(_), Some(kind)) => Err(format!("expected a {kind} error, got a value")),
        (Err(e), None) => Err(format!("unexpected error: {}", e.message())),
        (Ok(_), None) => Ok(false),
    }
}

fn proxy_failure<T>(r: Result<T, ProxyError>) -> Result<T, Failure> {
    r.map_err(Failure::Proxy)
}

/// The envelope under the vectors' field names.
fn envelope_fields(env: &Envelope) -> Value {
    let or_null = |v: &Option<Value>| v.clone().unwrap_or(Value::Null);
    json!({
        "proxy_url": env.proxy_url, "run_token": env.run_token(), "run_id": or_null(&env.run_id),
        "task_id": or_null(&env.task_id), "agent_id": or_null(&env.agent_id), "run_token_jti": env.run_token_jti,
        "user_instruction": env.user_instruction, "task_input": env.task_input,
        "latest_user_prompt": env.latest_user_prompt, "session_id": or_null(&env.session_id),
        "turn_id": or_null(&env.turn_id), "messages": env.messages, "scenario_state": env.scenario_state,
        "workspace": env.workspace, "tools_schema": env.tools_schema, "sub_agents": env.sub_agents,
        "api_url": env.api_url, "raw": env.raw,
    })
}

fn dig<'a>(mut value: &'a Value, path: &str) -> &'a Value {
    for part in path.split('.') {
        value = value.get(part).unwrap_or(&Value::Null);
    }
    value
}

fn check_fields(fields: &Value, want: &Value) -> Result<(), String> {
    for (path, want) in want.as_object().into_iter().flatten() {
        let got = dig(fields, path);
        if !same(got, want) {
            return Err(format!("{path}: {}, want {}", show(got), show(want)));
        }
    }
    Ok(())
}

/// The run token in exactly one of `Authorization: Bearer <t>` and `X-Pipelines-Run-Token`.
fn token_sent(r: &Recorded, token: &str) -> bool {
    let auth: Vec<_> = r.headers.get_all("authorization").iter().collect();
    let header: Vec<_> = r.headers.get_all("x-pipelines-run-token").iter().collect();
    if auth.is_empty() == header.is_empty() {
        return false;
    }
    match header.first() {
        Some(h) => h.to_str().ok() == Some(token),
        None => auth[0]
            .to_str()
            .ok()
            .and_then(|a| a.split_once(' '))
            .is_some_and(|(s, t)| s.eq_ignore_ascii_case("bearer") && t.trim() == token),
    }
}

fn is_uuid(text: &str) -> bool {
    let parts: Vec<&str> = text.split('-').collect();
    parts.iter().map(|p| p.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
        && text
            .chars()
            .all(|c| c == '-' || c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
}

fn check_request(r: &Recorded, expect: &Value, token: &str) -> Result<(), String> {
    if let Some(suffix) = expect["path_suffix"].as_str() {
        if r.path != format!("{BASE_PATH}{suffix}") {
            return Err(format!("path {}, want {BASE_PATH}{suffix}", r.path));
        }
    }
    if let Some(body) = expect.get("body_json") {
        if !same(&r.json, body) {
            return Err(format!("body {}, want {}", show(&r.json), show(body)));
        }
    }
    for (name, value) in expect["headers"].as_object().into_iter().flatten() {
        let want = value.as_str().unwrap().replace("{run_token}", token);
        if r.header(name).as_deref() != Some(want.as_str()) {
            return Err(format!(
                "header {name}: {:?}, want {want:?}",
                r.header(name)
            ));
        }
    }
    for name in strings(&expect["headers_absent"]) {
        if r.headers.contains_key(name.as_str()) {
            return Err(format!("header {name} sent"));
        }
    }
    if expect["run_token_sent"] == json!(true) && !token_sent(r, token) {
        return Err("the run token is not in exactly one token header".into());
    }
    if r.path.starts_with(&format!("{BASE_PATH}/tools/"))
        && !r.header("idempotency-key").is_some_and(|k| is_uuid(&k))
    {
        return Err("no Idempotency-Key".into());
    }
    Ok(())
}

/// The two drivers, each with its waits recorded instead of slept.
struct Drivers {
    rt: tokio::runtime::Runtime,
    proxy: Proxy,
    aio: AsyncClient,
    blocking: BlockingClient,
    waits: Arc<Mutex<Vec<Duration>>>,
}

#[derive(Clone, Copy, Debug)]
enum Driver {
    Async,
    Blocking,
}

const DRIVERS: [Driver; 2] = [Driver::Async, Driver::Blocking];

impl Drivers {
    fn new() -> Drivers {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let proxy = Proxy::start(&rt);
        let waits = Arc::new(Mutex::new(Vec::new()));
        // These cases are about the retry policy, whose waits are recorded here.
        let settings = ClientSettings {
            timeout: Duration::from_secs(10),
            rate_per_minute: None,
            ..Default::default()
        };
        let recorded = waits.clone();
        let aio = AsyncClient::with_sleeper(
            settings.clone(),
            Arc::new(move |d| {
                recorded.lock().unwrap().push(d);
                Box::pin(async {})
            }),
        );
        let recorded = waits.clone();
        let blocking = BlockingClient::with_sleeper(
            settings,
            Arc::new(move |d| recorded.lock().unwrap().push(d)),
        );
        Drivers {
            rt,
            proxy,
            aio,
            blocking,
            waits,
        }
    }

    fn envelope(&self, token: &str) -> Envelope {
        Envelope::for_run(&self.proxy.url, token).unwrap()
    }

    fn call(
        &self,
        driver: Driver,
        token: &str,
        name: &str,
        args: Value,
        actor: Option<String>,
    ) -> Result<Value, ProxyError> {
        let options = CallOptions {
            actor,
            ..Default::default()
        };
        match driver {
            Driver::Async => {
                let run = Run::new(self.envelope(token), self.aio.clone());
                self.rt.block_on(run.call_with(name, args, &options))
            }
            Driver::Blocking => {
                self.blocking
                    .call_in(&RunState::new(self.envelope(token)), name, args, &options)
            }
        }
    }

    fn trace(
        &self,
        driver: Driver,
        token: &str,
        event_type: &str,
        payload: Value,
    ) -> Result<Value, ProxyError> {
        match driver {
            Driver::Async => self.rt.block_on(
                Run::new(self.envelope(token), self.aio.clone()).trace(event_type, payload),
            ),
            Driver::Blocking => self
                .blocking
                .trace(&self.envelope(token), event_type, payload),
        }
    }

    fn handoff(&self, driver: Driver, token: &str, handoff: &Handoff) -> Result<Value, ProxyError> {
        match driver {
            Driver::Async => self
                .rt
                .block_on(Run::new(self.envelope(token), self.aio.clone()).handoff(handoff)),
            Driver::Blocking => self.blocking.handoff(&self.envelope(token), handoff),
        }
    }
}

enum Verdict {
    Pass,
    Skip,
}

fn envelope_case(c: &Value) -> Result<Verdict, String> {
    if c["from"] != "dispatch" {
        return Ok(Verdict::Skip); // code mode (§5) is Python-specific
    }
    let headers = headers_of(&c["headers"]);
    let result = match c.get("body_text").and_then(Value::as_str) {
        Some(text) => Envelope::from_dispatch_bytes(text.as_bytes(), &headers),
        None => Envelope::from_dispatch(&c["body"], &headers),
    }
    .map_err(|e| Failure::Envelope(e.0));
    if expect_outcome(&result, &c["expect"])? {
        return Ok(Verdict::Pass);
    }
    check_fields(
        &envelope_fields(&result.ok().unwrap()),
        &c["expect"]["fields"],
    )
    .map(|_| Verdict::Pass)
}

fn inbound_case(c: &Value) -> Result<Verdict, String> {
    let expect = &c["expect"];
    if c["kind"] == "ping" {
        let got = is_ping(&c["body"]);
        return if json!(got) == expect["is_ping"] {
            Ok(Verdict::Pass)
        } else {
            Err(format!("is_ping {got}"))
        };
    }
    let got = check_credential(
        &headers_of(&c["headers"]),
        c["expected"].as_str().unwrap(),
        c["header_name"].as_str().unwrap(),
    );
    if json!(got) == expect["ok"] {
        Ok(Verdict::Pass)
    } else {
        Err(format!("check_credential {got}"))
    }
}

fn tool_name_case(c: &Value) -> Result<Verdict, String> {
    let expect = if c["valid"] == json!(true) {
        json!({})
    } else {
        json!({"error": "proxy_request"})
    };
    expect_outcome(&proxy_failure(validate_tool_name(&c["tool_name"])), &expect)
        .map(|_| Verdict::Pass)
}

fn actor_label_case(c: &Value) -> Result<Verdict, String> {
    let result = proxy_failure(validate_actor_label(&c["label"]));
    if expect_outcome(&result, &c["expect"])? {
        return Ok(Verdict::Pass);
    }
    let got = result.ok().flatten();
    let want = c["expect"]["label"].as_str().map(str::to_string); // null: no header, the empty label
    if got == want {
        Ok(Verdict::Pass)
    } else {
        Err(format!("label {got:?}, want {want:?}"))
    }
}

fn proxy_reply_case(c: &Value, doc: &VectorFile, d: &Drivers) -> Result<Verdict, String> {
    let expect = &c["expect"];
    let body = match (c.get("body_json"), c.get("body_text")) {
        (Some(json), _) => compact(json),
        (None, Some(Value::String(text))) => text.clone(),
        _ => String::new(),
    };
    let status = c["status"].as_u64().unwrap() as u16;
    let headers = headers_of(&c["headers"]);
    let retry_after = headers.get("retry-after");
    // the interpretation as the retry policy takes it (a Retry-After past the cap fails at once)
    let pure = pipelines_port::RetryPolicy::default().settle(interpret_reply(
        status,
        retry_after,
        body.as_bytes(),
        &doc.tool_name,
        &doc.run_token,
        SystemTime::now(),
    ));
    let retry = expect["retry"] == json!(true);
    let want_value = expect.get("value");
    match (&pure, want_value, retry) {
        (ProxyOutcome::Value(v), Some(want), _) if same(v, want) => {}
        (ProxyOutcome::Retry(e), None, true) => {
            match (expect["retry_after_s"].as_f64(), e.retry_after) {
                (Some(want), Some(got)) if (got.as_secs_f64() - want).abs() <= 0.01 => {}
                (None, None) => {}
                (want, got) => return Err(format!("pure: Retry-After {got:?}, want {want:?}")),
            }
        }
        (ProxyOutcome::Error(e), None, false) => {
            check_error(&Failure::Proxy(e.clone()), expect).map_err(|m| format!("pure: {m}"))?
        }
        (other, _, _) => return Err(format!("pure: {other:?}")),
    }
    // The same over a socket, through each driver: the case's reply, then a success.
    let spec_headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    for driver in DRIVERS {
        let first = Scripted {
            status,
            headers: spec_headers.clone(),
            body: body.clone(),
            delay_ms: 0,
        };
        d.proxy.reset(vec![
            first,
            Scripted::new(200, r#"{"response": "after-retry"}"#),
        ]);
        d.waits.lock().unwrap().clear();
        let result = d.call(driver, &doc.run_token, &doc.tool_name, json!({}), None);
        let sent = d.proxy.sent();
        let waits = d.waits.lock().unwrap().clone();
        if retry {
            if result.as_ref().ok() != Some(&json!("after-retry")) || sent.len() != 2 {
                return Err(format!(
                    "{driver:?}: {} requests, got {result:?}",
                    sent.len()
                ));
            }
            if sent[0].header("idempotency-key") != sent[1].header("idempotency-key") {
                return Err(format!("{driver:?}: a new Idempotency-Key on the retry"));
            }
            match expect["retry_after_s"].as_f64() {
                Some(want) if waits.len() != 1 || (waits[0].as_secs_f64() - want).abs() > 0.01 => {
                    return Err(format!("{driver:?}: waited {waits:?}, want {want} s"))
                }
                None if waits.len() != 1 || waits[0] < Duration::from_millis(100) => {
                    return Err(format!(
                        "{driver:?}: waited {waits:?}: a backoff is at least 0.1 s"
                    ))
                }
                _ => {}
            }
        } else {
            if sent.len() != 1 {
                return Err(format!(
                    "{driver:?}: {} requests: only 429 and the transient 503s are retried",
                    sent.len()
                ));
            }
            match (result, want_value) {
                (Ok(v), Some(want)) if same(&v, want) => {}
                (Err(e), None) => check_error(&Failure::Proxy(e), expect)
                    .map_err(|m| format!("{driver:?}: {m}"))?,
                (other, _) => return Err(format!("{driver:?}: {other:?}")),
            }
        }
    }
    Ok(Verdict::Pass)
}

fn proxy_request_case(c: &Value, doc: &VectorFile, d: &Drivers) -> Result<Verdict, String> {
    let expect = &c["expect"];
    let actor = c
        .get("actor")
        .map(|a| a.as_str().unwrap_or_default().to_string());
    for driver in DRIVERS {
        d.proxy.reset(vec![]);
        let result = proxy_failure(d.call(
            driver,
            &doc.run_token,
            c["tool_name"].as_str().unwrap(),
            c["args"].clone(),
            actor.clone(),
        ));
        let threw = expect_outcome(&result, expect).map_err(|m| format!("{driver:?}: {m}"))?;
        let sent = d.proxy.sent();
        if threw {
            if !sent.is_empty() {
                return Err(format!(
                    "{driver:?}: {} requests sent for a refused call",
                    sent.len()
                ));
            }
            continue;
        }
        if sent.len() != 1 {
            return Err(format!("{driver:?}: {} requests sent", sent.len()));
        }
        check_request(&sent[0], expect, &doc.run_token).map_err(|m| format!("{driver:?}: {m}"))?;
    }
    Ok(Verdict::Pass)
}

fn trace_case(c: &Value, doc: &VectorFile, d: &Drivers) -> Result<Verdict, String> {
    let expect = &c["expect"];
    for driver in DRIVERS {
        d.proxy.reset(vec![Scripted::new(
            200,
            r#"{"accepted": true, "sequence": 1}"#,
        )]);
        let result = if c["kind"] == "trace" {
            d.trace(
                driver,
                &doc.run_token,
                c["event_type"].as_str().unwrap(),
                c["payload"].clone(),
            )
        } else {
            let handoff = Handoff {
                from: c["from"].as_str().unwrap().into(),
                to: c["to"].as_str().unwrap().into(),
                reason: c.get("reason").cloned(),
                payload_preview: c.get("payload_preview").cloned(),
            };
            d.handoff(driver, &doc.run_token, &handoff)
        };
        let result = proxy_failure(result);
        let threw = expect_outcome(&result, expect).map_err(|m| format!("{driver:?}: {m}"))?;
        let sent = d.proxy.sent();
        if threw || expect["dropped"] == json!(true) {
            if !sent.is_empty() || result.as_ref().is_ok_and(|v| !v.is_null()) {
                return Err(format!("{driver:?}: something was sent"));
            }
            continue;
        }
        let value = result.ok().unwrap();
        if !same(&value, &json!({"accepted": true, "sequence": 1})) || sent.len() != 1 {
            return Err(format!(
                "{driver:?}: reply {} after {} requests",
                show(&value),
                sent.len()
            ));
        }
        check_request(&sent[0], expect, &doc.run_token)?;
        for (key, want) in expect["body_has"].as_object().into_iter().flatten() {
            if !same(&sent[0].json[key], want) {
                return Err(format!("body {key}: {}", show(&sent[0].json[key])));
            }
        }
        if expect["stamped"] == json!(true) {
            let stamp = sent[0].json["__occurred_at"].as_str().unwrap_or_default();
            if !(stamp.len() >= 20
                && stamp.as_bytes()[10] == b'T'
                && (stamp.ends_with('Z') || stamp.ends_with("+00:00")))
            {
                return Err(format!("__occurred_at {stamp:?}"));
            }
        }
    }
    Ok(Verdict::Pass)
}

fn build_response_case(c: &Value) -> Result<Verdict, String> {
    let input = &c["input"];
    if input.get("object").is_some() {
        return Ok(Verdict::Skip); // result objects with attributes are Python-specific
    }
    let mut value = input["value"].clone();
    let overrides: Map<String, Value> = ["messages", "metadata"]
        .iter()
        .filter_map(|k| input.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect();
    if !overrides.is_empty() {
        // explicit overrides are folded into an envelope map, as the checker does
        let mut folded = match value {
            Value::Object(map) => map,
            other => Map::from_iter([("final_response".to_string(), other)]),
        };
        folded.extend(overrides);
        value = Value::Object(folded);
    }
    let strict = input["strict"] == json!(true);
    let result = build_response(&value, strict).map_err(|e| Failure::Response(e.to_string()));
    if expect_outcome(&result, &c["expect"])? {
        return Ok(Verdict::Pass);
    }
    let body = Value::Object(result.ok().unwrap().0);
    if let Some(problem) = validate_response(&body).into_iter().find(|p| !p.warning) {
        return Err(format!("built body has a problem: {problem}"));
    }
    if same(&body, &c["expect"]["body"]) {
        Ok(Verdict::Pass)
    } else {
        Err(format!(
            "body {}, want {}",
            show(&body),
            show(&c["expect"]["body"])
        ))
    }
}

fn turn_reply_case(c: &Value) -> Result<Verdict, String> {
    let input = &c["input"];
    let strict = input["strict"] == json!(true);
    let multi_turn = input["multi_turn"] == json!(true);
    let result = build_reply(&input["value"], strict, multi_turn)
        .map_err(|e| Failure::Response(e.to_string()));
    if expect_outcome(&result, &c["expect"])? {
        return Ok(Verdict::Pass);
    }
    let body = Value::Object(result.ok().unwrap().0);
    if !same(&body, &c["expect"]["body"]) {
        return Err(format!(
            "body {}, want {}",
            show(&body),
            show(&c["expect"]["body"])
        ));
    }
    // build_turn_reply builds what a strict server sends for a plain turn reply of the file.
    let value = &input["value"];
    let plain = value.as_object().is_some_and(|o| {
        o.keys()
            .all(|k| ["message", "session_done", "metadata"].contains(&k.as_str()))
            && o.get("metadata").is_none_or(Value::is_object)
    });
    if let (true, true, true, Some(message), Some(done)) = (
        plain,
        multi_turn,
        strict,
        value["message"].as_str(),
        value["session_done"].as_bool(),
    ) {
        let metadata = value.get("metadata").and_then(Value::as_object).cloned();
        let built = build_turn_reply(message, metadata, done).map_err(|e| e.to_string())?;
        let built = serde_json::to_value(built).map_err(|e| e.to_string())?;
        if !same(&built, &c["expect"]["body"]) {
            return Err(format!("build_turn_reply {}", show(&built)));
        }
    }
    Ok(Verdict::Pass)
}

fn validate_response_case(c: &Value) -> Result<Verdict, String> {
    let problems = validate_response(&c["body"]);
    let paths = |warning: bool| -> std::collections::BTreeSet<String> {
        problems
            .iter()
            .filter(|p| p.warning == warning)
            .map(|p| p.path.clone())
            .collect()
    };
    let want = |key: &str| -> std::collections::BTreeSet<String> {
        strings(&c["expect"][key]).into_iter().collect()
    };
    if paths(false) == want("error_paths") && paths(true) == want("warning_paths") {
        Ok(Verdict::Pass)
    } else {
        Err(format!(
            "errors {:?}, warnings {:?}",
            paths(false),
            paths(true)
        ))
    }
}

/// A dispatch.json case through the dispatch app: the request as the vector
/// gives it, the agent recording the envelope it gets.
fn dispatch_case(c: &Value, d: &Drivers) -> Result<Verdict, String> {
    let endpoint = &c["endpoint"];
    let mut options = Options {
        token_env: "PIPELINESPORT_VECTOR_TOKEN_UNSET".into(),
        ..Default::default()
    };
    match &c["expected_token"] {
        Value::Null => options.no_auth = true,
        Value::String(t) if !t.is_empty() => options.token = Some(t.clone()),
        _ => {}
    }
    if let Some(header) = endpoint["auth_header"].as_str() {
        options.auth_header = header.into();
    }
    if let Some(limit) = endpoint["max_body"].as_u64() {
        options.max_body = limit as usize;
    }
    if let Some(schema) = endpoint["tools_schema"].as_array() {
        options.tools_schema = Some(schema.clone());
    }
    let seen: Arc<Mutex<Option<Envelope>>> = Arc::default();
    let recorder = seen.clone();
    let app = DispatchApp::new(
        move |run: Run| {
            let recorder = recorder.clone();
            async move {
                *recorder.lock().unwrap() = Some(run.envelope().clone());
                Ok::<_, AgentError>("ran")
            }
        },
        options,
    )?;
    let mut request = axum::http::Request::builder()
        .method(c["method"].as_str().unwrap())
        .uri(c["target"].as_str().unwrap());
    for (name, value) in headers_of(&c["headers"]).iter() {
        request = request.header(name, value);
    }
    let body = c["body_read"].as_str().unwrap_or_default().to_string();
    let request = request.body(axum::body::Body::from(body)).unwrap();
    let response = d.rt.block_on(app.handle(request));
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let data =
        d.rt.block_on(axum::body::to_bytes(response.into_body(), 1 << 20))
            .unwrap();
    let reply = if data.is_empty() {
        Value::Null
    } else {
        decode(&data).unwrap_or(Value::Null)
    };
    let detail = reply["detail"].as_str().unwrap_or_default().to_lowercase();
    let expect = &c["expect"];
    let seen = seen.lock().unwrap().clone();
    match expect["action"].as_str() {
        Some("run") => {
            let Some(env) = seen.filter(|_| status == 200) else {
                return Err(format!("the agent did not run: {status} {}", show(&reply)));
            };
            return check_fields(&envelope_fields(&env), &expect["fields"]).map(|_| Verdict::Pass);
        }
        Some("probe") => {
            return if status == 200 && reply["outbound"].is_object() && seen.is_none() {
                Ok(Verdict::Pass)
            } else {
                Err(format!("no probe: {status} {}", show(&reply)))
            };
        }
        _ => {}
    }
    if seen.is_some() {
        return Err("the agent ran".into());
    }
    if Some(u64::from(status)) != expect["status"].as_u64() {
        return Err(format!(
            "status {status}, want {}: {}",
            expect["status"],
            show(&reply)
        ));
    }
    if let Some(want) = expect.get("body") {
        if !same(&reply, want) {
            return Err(format!("body {}, want {}", show(&reply), show(want)));
        }
    }
    for (key, want) in expect["body_has"].as_object().into_iter().flatten() {
        if !same(&reply[key], want) {
            return Err(format!("body {key}: {}", show(&reply[key])));
        }
    }
    for (name, want) in expect["headers"].as_object().into_iter().flatten() {
        let got = headers.get(name.as_str()).and_then(|v| v.to_str().ok());
        if got != want.as_str() {
            return Err(format!("header {name}: {got:?}, want {want}"));
        }
    }
    for text in strings(&expect["detail_mentions"]) {
        if !detail.contains(&text.to_lowercase()) {
            return Err(format!("{text:?} not in the detail {detail:?}"));
        }
    }
    for text in strings(&expect["detail_never_mentions"]) {
        if detail.contains(&text.to_lowercase()) {
            return Err(format!("{text:?} in the detail {detail:?}"));
        }
    }
    Ok(Verdict::Pass)
}

#[test]
fn vectors() {
    let drivers = Drivers::new();
    let names = [
        "actor_labels",
        "build_response",
        "dispatch",
        "envelope",
        "inbound",
        "proxy_replies",
        "proxy_requests",
        "tool_names",
        "trace_events",
        "turn_reply",
        "validate_response",
    ];
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    let mut failures = Vec::new();
    for name in names {
        let doc = load(name);
        for c in &doc.cases {
            let verdict = match name {
                "envelope" => envelope_case(c),
                "inbound" => inbound_case(c),
                "tool_names" => tool_name_case(c),
                "actor_labels" => actor_label_case(c),
                "proxy_replies" => proxy_reply_case(c, &doc, &drivers),
                "proxy_requests" => proxy_request_case(c, &doc, &drivers),
                "trace_events" => trace_case(c, &doc, &drivers),
                "build_response" => build_response_case(c),
                "turn_reply" => turn_reply_case(c),
                "validate_response" => validate_response_case(c),
                _ => dispatch_case(c, &drivers),
            };
            match verdict {
                Ok(Verdict::Pass) => passed += 1,
                Ok(Verdict::Skip) => skipped += 1,
                Err(problem) => {
                    failed += 1;
                    failures.push(format!(
                        "{name}/{}: {problem} (rule {})",
                        c["name"], c["rule"]
                    ));
                }
            }
        }
    }
    for failure in &failures {
        eprintln!("FAIL {failure}");
    }
    println!("vectors: {passed} passed, {failed} failed, {skipped} skipped");
    assert!(failures.is_empty(), "{} vectors failed", failures.len());
    assert!(passed >= 250, "only {passed} vectors passed");
}
