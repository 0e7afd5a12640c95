package pipelinesport_test

// Examples, one per public entry point, shown by `go doc -http` and
// pkg.go.dev and run by `go test` (those with an Output comment). A test
// server on 127.0.0.1 stands in for the platform's per-run proxy.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	pp "example.com/pipelines-port/go"
)

// An agent calls a tool through the run's proxy and answers; the dispatch
// handler does the rest (auth, the envelope, the response envelope).
func Example() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"response": {"order_id": "4521", "status": "shipped"}}`)
	}))
	defer proxy.Close()

	agent := func(ctx context.Context, env *pp.Envelope) (any, error) {
		order, err := pp.Call(ctx, "get_order", map[string]any{"order_id": env.TaskInput["order_id"]})
		if err != nil {
			return nil, err
		}
		return fmt.Sprintf("Order 4521 is %v.", order.(map[string]any)["status"]), nil
	}
	handler, err := pp.NewDispatchHandler(agent, pp.Options{Token: "agent-token-1234"})
	if err != nil {
		panic(err)
	}
	server := httptest.NewServer(handler)
	defer server.Close()

	// What the platform sends.
	body := `{"run_id": 17, "odyssey_proxy_url": "` + proxy.URL + `",
	          "input": {"user_instruction": "Where is my order?", "input": {"order_id": "4521"}}}`
	req, _ := http.NewRequest(http.MethodPost, server.URL+"/dispatch", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer agent-token-1234")
	req.Header.Set(pp.HeaderRunToken, "run-token-17")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	reply, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, string(reply))
	// Output: 200 {"final_response":"Order 4521 is shipped."}
}

func ExampleNewDispatchHandler() {
	agent := func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil }
	// Token: a fixed agent token; by default it is read from $AGENT_TOKEN at every request.
	handler, err := pp.NewDispatchHandler(agent, pp.Options{Token: "agent-token-1234", RunTimeout: time.Minute})
	if err != nil {
		panic(err)
	}
	server := httptest.NewServer(handler) // or mount it in a router of your own
	defer server.Close()
	for _, credential := range []string{"Bearer agent-token-1234", "Bearer guess"} {
		req, _ := http.NewRequest(http.MethodPost, server.URL+"/dispatch", strings.NewReader(`{"ping": true}`))
		req.Header.Set("Authorization", credential)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		reply, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(reply))
	}
	// Output:
	// 200 {"ok":true}
	// 401 {"detail":"missing or invalid credential in the Authorization header"}
}

// The handler is an http.Handler: mount it under a prefix of any router with
// http.StripPrefix (it routes POST /dispatch and GET /healthz itself).
func ExampleDispatchHandler_serveMux() {
	handler, err := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil },
		pp.Options{Token: "agent-token-1234"})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/agents/support/", http.StripPrefix("/agents/support", handler)) // POST /agents/support/dispatch
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "the rest of the site") })
	server := httptest.NewServer(mux)
	defer server.Close()

	req, _ := http.NewRequest(http.MethodPost, server.URL+"/agents/support/dispatch", strings.NewReader(`{"ping": true}`))
	req.Header.Set("Authorization", "Bearer agent-token-1234")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(resp.StatusCode, string(reply))
	// Output: 200 {"ok":true}
}

func ExampleDispatchHandler_Path() {
	agent := func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil }
	plain, _ := pp.NewDispatchHandler(agent, pp.Options{})
	custom, _ := pp.NewDispatchHandler(agent, pp.Options{Path: "/hooks/pipelines/"})
	fmt.Println(plain.Path(), custom.Path())
	// Output: /dispatch /hooks/pipelines
}

func ExampleDispatchHandler_DescribeAuth() {
	agent := func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil }
	handler, _ := pp.NewDispatchHandler(agent, pp.Options{TokenEnv: "EXAMPLE_SUPPORT_AGENT_TOKEN"})
	fmt.Println(handler.DescribeAuth()) // for a start-up line: never the token itself
	// Output: Authorization: Bearer <token> (token from $EXAMPLE_SUPPORT_AGENT_TOKEN); EXAMPLE_SUPPORT_AGENT_TOKEN is NOT set: every request gets 503 until it is
}

// Drain is the first half of a graceful shutdown when the handler is served
// by a server of your own (Serve calls it for you).
func ExampleDispatchHandler_Drain() {
	handler, _ := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil },
		pp.Options{Token: "agent-token-1234"})
	handler.Drain()
	req := httptest.NewRequest(http.MethodPost, "/dispatch", strings.NewReader(`{"ping": true}`))
	req.Header.Set("Authorization", "Bearer agent-token-1234")
	reply := httptest.NewRecorder()
	handler.ServeHTTP(reply, req)
	fmt.Println(reply.Code, reply.Body.String())
	// Output: 503 {"detail":"server is shutting down: retry on another instance"}
}

// Serve runs until its context is done, then lets in-flight dispatches finish.
func ExampleServe() {
	handler, _ := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil },
		pp.Options{Token: "agent-token-1234"})
	ln, err := net.Listen("tcp", "127.0.0.1:0") // port 0: a free one
	if err != nil {
		panic(err)
	}
	ctx, stop := context.WithCancel(context.Background()) // signal.NotifyContext(..., syscall.SIGTERM) in a program
	served := make(chan error, 1)
	go func() { served <- pp.Serve(ctx, ln, handler, 30*time.Second) }()

	resp, err := http.Get("http://" + ln.Addr().String() + "/healthz")
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println("health:", resp.StatusCode)
	stop()
	fmt.Println("stopped:", <-served)
	// Output:
	// health: 200
	// stopped: <nil>
}

func ExampleListenAndServe() {
	agent := func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil }
	handler, err := pp.NewDispatchHandler(agent, pp.Options{}) // the token from $AGENT_TOKEN: 503 while unset
	if err != nil {
		panic(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := pp.ListenAndServe(ctx, "0.0.0.0:8080", handler, 30*time.Second); err != nil {
		fmt.Fprintln(os.Stderr, err) // ErrGraceOver: dispatches were still running when the grace ran out
		os.Exit(1)
	}
}

// NewServer's settings (keep-alive, header and body read deadlines, no write
// timeout) serve a whole router, the handler mounted in it; the graceful
// shutdown is Drain, then the server's Shutdown.
func ExampleNewServer() {
	handler, _ := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil },
		pp.Options{Token: "agent-token-1234"})
	mux := http.NewServeMux()
	mux.Handle("/agents/support/", http.StripPrefix("/agents/support", handler))
	srv := pp.NewServer(handler)
	srv.Handler = mux
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	go func() { _ = srv.Serve(ln) }()

	resp, err := http.Get("http://" + ln.Addr().String() + "/agents/support/healthz")
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println("health:", resp.StatusCode)

	handler.Drain() // new dispatches get 503
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fmt.Println("shut down:", srv.Shutdown(ctx)) // in-flight ones finish first
	// Output:
	// health: 200
	// shut down: <nil>
}

// exampleRun binds a run's envelope to a context, as the dispatch handler
// does for each dispatch.
func exampleRun(proxyURL, runToken string) context.Context {
	env, err := pp.EnvelopeFromDispatch(map[string]any{"odyssey_proxy_url": proxyURL, "run_id": 17},
		http.Header{pp.HeaderRunToken: {runToken}})
	if err != nil {
		panic(err)
	}
	return pp.WithEnvelope(context.Background(), env)
}

func ExampleCall() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println(r.Method, r.URL.Path, r.Header.Get("Authorization"))
		fmt.Fprint(w, `{"response": {"status": "shipped"}, "source": "odyssey"}`)
	}))
	defer proxy.Close()
	ctx := exampleRun(proxy.URL+"/api/odyssey-proxy/runs/17", "run-token-call")

	order, err := pp.Call(ctx, "get_order", map[string]any{"order_id": "4521"})
	fmt.Println(order, err)
	// Output:
	// POST /api/odyssey-proxy/runs/17/tools/get_order Bearer run-token-call
	// map[status:shipped] <nil>
}

// A Client of your own: another retry policy, no pacing.
func ExampleNewClient() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprint(w, `{"error_class": "rate_limited", "message": "slow down"}`)
	}))
	defer proxy.Close()
	client := pp.NewClient()
	client.Retry.MaxAttempts = 2
	client.Retry.BaseDelay = time.Millisecond
	client.Pacer = nil

	_, err := client.Call(exampleRun(proxy.URL, "run-token-client"), "get_order", nil)
	fmt.Println(err)
	// Output: proxy call "get_order" failed: HTTP 429 rate_limited: slow down
}

func ExampleTrace() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println(r.URL.Path)
		fmt.Fprint(w, `{"accepted": true, "sequence": 1}`)
	}))
	defer proxy.Close()
	ctx := exampleRun(proxy.URL, "run-token-trace")

	reply, err := pp.Trace(ctx, pp.TraceAssistantMessage, map[string]any{"text": "Looking it up."})
	fmt.Println(reply, err)
	// Output:
	// /traces/assistant_message
	// map[accepted:true sequence:1] <nil>
}

func ExamplePostHandoff() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Println(r.URL.Path, strings.Contains(string(body), `"to_sub_agent":"refunds"`))
		fmt.Fprint(w, `{"accepted": true, "sequence": 2}`)
	}))
	defer proxy.Close()
	ctx := exampleRun(proxy.URL, "run-token-handoff")

	reply, err := pp.PostHandoff(ctx, pp.Handoff{From: "triage", To: "refunds", Reason: "a refund request"})
	fmt.Println(reply, err)
	reply, err = pp.PostHandoff(ctx, pp.Handoff{From: "refunds", To: "refunds"}) // a self-handoff: nothing sent
	fmt.Println(reply, err)
	// Output:
	// /traces/handoff true
	// map[accepted:true sequence:2] <nil>
	// <nil> <nil>
}

func ExampleWithActor() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"response": %q}`, r.Header.Get(pp.HeaderActorID))
	}))
	defer proxy.Close()
	ctx := pp.WithActor(exampleRun(proxy.URL, "run-token-actor"), " supervisor/refunds ")

	actor, _ := pp.Call(ctx, "whoami", nil)
	fmt.Println(actor)
	// Output: supervisor/refunds
}

func ExampleActor() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"response": %q}`, r.Header.Get(pp.HeaderActorID))
	}))
	defer proxy.Close()
	ctx := pp.WithActor(exampleRun(proxy.URL, "run-token-actor-option"), "supervisor")

	actor, _ := pp.Call(ctx, "whoami", nil, pp.Actor("supervisor/billing")) // the call's own label wins
	fmt.Println(actor)
	// Output: supervisor/billing
}

func ExampleIdempotencyKey() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"response": %q}`, r.Header.Get("Idempotency-Key"))
	}))
	defer proxy.Close()
	ctx := exampleRun(proxy.URL, "run-token-key")

	key, _ := pp.Call(ctx, "issue_refund", map[string]any{"order_id": "4521"}, pp.IdempotencyKey("refund-4521"))
	fmt.Println(key)
	// Output: refund-4521
}

// A per-attempt timeout: a proxy that never answers fails the call as a
// transport error.
func ExampleTimeout() {
	release := make(chan struct{})
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-release }))
	defer proxy.Close()
	defer close(release)
	client := pp.NewClient()
	client.Retry.TransportRetries = 0
	ctx := exampleRun(proxy.URL, "run-token-timeout")

	_, err := client.Call(ctx, "slow_tool", nil, pp.Timeout(50*time.Millisecond))
	var failure pp.ProxyFailure
	fmt.Println(errors.As(err, &failure), failure.Kind())
	// Output: true transport
}

// A failed tool call as a value a model can read, instead of an error.
func ExampleErrorsAsValues() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"detail": {"error_class": "unknown_tool", "message": "no tool named get_weather"}}`)
	}))
	defer proxy.Close()
	ctx := exampleRun(proxy.URL, "run-token-values")

	value, err := pp.Call(ctx, "get_weather", nil, pp.ErrorsAsValues())
	fmt.Println(value, err)
	// Output: map[error:proxy call "get_weather" failed: HTTP 404 unknown_tool: no tool named get_weather error_class:unknown_tool status_code:404] <nil>
}

// A trace event that may be lost: a failure is a log line, not an error.
func ExampleBestEffort() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusInternalServerError)
	}))
	defer proxy.Close()
	ctx := exampleRun(proxy.URL, "run-token-best-effort")

	reply, err := pp.Trace(ctx, pp.TraceThinking, map[string]any{"text": "hmm"}, pp.BestEffort())
	fmt.Println(reply, err)
	// Output: <nil> <nil>
}

func ExampleEnvelopeFromDispatch() {
	body := []byte(`{"run_id": 17, "task_id": "t-42", "odyssey_proxy_url": "https://proxy.example/runs/17/",
	                 "input": {"user_instruction": "Where is my order?", "input": {"order_id": "4521"}}}`)
	env, err := pp.EnvelopeFromDispatch(body, http.Header{pp.HeaderRunToken: {"run-token-17"}})
	if err != nil {
		panic(err)
	}
	fmt.Println(env.ProxyURL, env.RunID, env.TaskID, env.UserInstruction, env.TaskInput["order_id"])

	_, err = pp.EnvelopeFromDispatch(body, http.Header{})
	fmt.Println(pp.StatusOf(err), err)
	// Output:
	// https://proxy.example/runs/17 17 t-42 Where is my order? 4521
	// 400 dispatch is missing run token (looked for header X-Pipelines-Run-Token)
}

// Printing an envelope never shows its run token, whatever the verb.
func ExampleEnvelope_Format() {
	env, _ := pp.EnvelopeFromDispatch(map[string]any{"odyssey_proxy_url": "https://proxy.example/runs/17"},
		http.Header{pp.HeaderRunToken: {"run-token-17"}, pp.HeaderRunID: {"17"}})
	fmt.Printf("%+v\n", env)
	// Output: Envelope{proxy_url=https://proxy.example/runs/17 run_id=17 task_id=<nil> jti="" run_token=[redacted]}
}

func ExampleWithEnvelope() {
	env, _ := pp.EnvelopeFromDispatch(map[string]any{"odyssey_proxy_url": "https://proxy.example/runs/17"},
		http.Header{pp.HeaderRunToken: {"run-token-17"}})
	ctx := pp.WithEnvelope(context.Background(), env) // Call, Trace and PostHandoff under ctx use this run

	bound, ok := pp.EnvelopeFrom(ctx)
	fmt.Println(ok, bound.ProxyURL)
	_, err := pp.Call(context.Background(), "get_order", nil) // no run bound
	fmt.Println(err)
	// Output:
	// true https://proxy.example/runs/17
	// no dispatch envelope is bound to this context: call inside a dispatch, or wrap the context with WithEnvelope(ctx, envelope)
}

// Inside an agent, the dispatch's context carries its envelope.
func ExampleEnvelopeFrom() {
	agent := func(ctx context.Context, env *pp.Envelope) (any, error) {
		same, _ := pp.EnvelopeFrom(ctx)
		return fmt.Sprint(same == env), nil
	}
	handler, _ := pp.NewDispatchHandler(agent, pp.Options{Token: "agent-token-1234"})
	server := httptest.NewServer(handler)
	defer server.Close()
	body := `{"odyssey_proxy_url": "https://proxy.example/runs/17"}`
	req, _ := http.NewRequest(http.MethodPost, server.URL+"/dispatch", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer agent-token-1234")
	req.Header.Set(pp.HeaderRunToken, "run-token-17")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(string(reply))
	// Output: {"final_response":"true"}
}

func ExampleWithClient() {
	client := pp.NewClient()
	client.Pacer = nil // this run's calls are not paced
	ctx := pp.WithClient(context.Background(), client)
	fmt.Println(pp.ClientFrom(ctx) == client, pp.ClientFrom(context.Background()) == pp.DefaultClient())
	// Output: true true
}

func ExampleCheckCredential() {
	header := http.Header{"Authorization": {"bearer agent-token-1234"}} // the scheme in any case
	fmt.Println(pp.CheckCredential(header, "agent-token-1234", "Authorization"))
	fmt.Println(pp.CheckCredential(http.Header{"X-Api-Key": {"agent-token-1234"}}, "agent-token-1234", "X-API-Key"))
	fmt.Println(pp.CheckCredential(header, "", "Authorization")) // no expected token: never
	// Output:
	// true
	// true
	// false
}

func ExampleIsPing() {
	fmt.Println(pp.IsPing(map[string]any{"ping": true}), pp.IsPing(map[string]any{"ping": true, "run_id": 1}))
	// Output: true false
}

func ExampleCheckProxyURL() {
	url, err := pp.CheckProxyURL(" https://proxy.example/api/odyssey-proxy/runs/17/ ", "body field 'odyssey_proxy_url'")
	fmt.Println(url, err)
	_, err = pp.CheckProxyURL("https://proxy.example/runs/17?debug=1", "body field 'odyssey_proxy_url'")
	fmt.Println(err)
	// Output:
	// https://proxy.example/api/odyssey-proxy/runs/17 <nil>
	// proxy URL "https://proxy.example/runs/17?debug=1" from body field 'odyssey_proxy_url' must not carry a query or fragment
}

// Lenient (strict false), the body goes out as the platform would keep it,
// each change reported; strict, what the platform would soften is refused.
func ExampleBuildResponse() {
	structured := map[string]any{"final_response": map[string]any{"refund": 12.5, "order": "4521"}}
	body, _, _ := pp.BuildResponse(structured, false)
	fmt.Println(pp.CompactJSON(body))
	_, _, err := pp.BuildResponse(structured, true)
	fmt.Println(pp.StatusOf(err), err)

	body, warnings, _ := pp.BuildResponse(map[string]any{"final_response": "Refund issued.", "messages": "not a list"}, false)
	fmt.Println(pp.CompactJSON(body), warnings)
	// Output:
	// {"final_response":"{\"order\": \"4521\", \"refund\": 12.5}"}
	// 500 final_response must be a string, got an object
	// {"final_response":"Refund issued."} [messages: must be an array or null, got a string (the platform drops it); messages dropped, as the platform drops a malformed transcript]
}

// In a multi-turn run an agent answers each turn with a turn reply; the
// dispatch handler sends it as built (§4.2). session_done is a hint.
func ExampleBuildTurnReply() {
	reply, err := pp.BuildTurnReply("Which order do you mean?", map[string]any{"model": "example-model"}, false)
	fmt.Println(pp.CompactJSON(reply), err)
	_, err = pp.BuildTurnReply("   ", nil, true)
	fmt.Println(err)
	// Output:
	// {"message":"Which order do you mean?","session_done":false,"metadata":{"model":"example-model"}} <nil>
	// message: blank (only whitespace): the user has nothing to answer
}

// What a dispatch sends: a turn reply as built in a multi-turn dispatch, the
// response envelope in a single-turn one.
func ExampleBuildReply() {
	reply := map[string]any{"message": "Goodbye.", "session_done": true}
	body, _, _ := pp.BuildReply(reply, false, true)
	fmt.Println(pp.CompactJSON(body))
	body, warnings, _ := pp.BuildReply(reply, false, false)
	fmt.Println(pp.CompactJSON(body), len(warnings))
	// Output:
	// {"message":"Goodbye.","session_done":true}
	// {"final_response":"Goodbye."} 1
}

// An agent may answer with a ResponseEnvelope: the transcript and metadata
// beside the final response.
func ExampleResponseEnvelope() {
	reply := pp.ResponseEnvelope{
		FinalResponse: "Refund issued.",
		Messages: []pp.Message{
			{Role: "user", Content: "Refund order 4521."},
			{Role: "assistant", ToolCalls: []pp.ToolCall{{ID: "c1", Name: "issue_refund", Arguments: map[string]any{"order_id": "4521"}}}},
			{Role: "tool", ToolCallID: "c1", Content: `{"ok": true}`},
			{Role: "assistant", Content: "Refund issued."},
		},
		Metadata: map[string]any{"model": "example-model"},
	}
	body, _, err := pp.BuildResponse(reply, true)
	fmt.Println(len(body["messages"].([]any)), body["metadata"], err)
	// Output: 4 map[model:example-model] <nil>
}

func ExampleValidateResponse() {
	problems := pp.ValidateResponse(map[string]any{"final_response": "", "messages": []any{map[string]any{"role": "robot"}}})
	for _, problem := range problems {
		fmt.Println(problem.Path)
	}
	fmt.Println(len(pp.ValidateResponse(map[string]any{"final_response": "Refund issued."})))
	// Output:
	// final_response
	// messages[0].role
	// 0
}

func ExampleStrictFromEnv() {
	os.Setenv("PIPELINES_PORT_STRICT", "1")
	fmt.Println(pp.StrictFromEnv())
	os.Unsetenv("PIPELINES_PORT_STRICT")
	fmt.Println(pp.StrictFromEnv())
	// Output:
	// true
	// false
}

func ExampleValidateToolName() {
	name, err := pp.ValidateToolName("get_order")
	fmt.Println(name, err)
	_, err = pp.ValidateToolName("get order")
	fmt.Println(err)
	// Output:
	// get_order <nil>
	// invalid tool name "get order": must match ^[A-Za-z_][A-Za-z0-9_-]{0,127}$
}

func ExampleValidateActorLabel() {
	label, err := pp.ValidateActorLabel("  supervisor/refunds ")
	fmt.Printf("%q %v\n", label, err)
	_, err = pp.ValidateActorLabel("supervisor//refunds")
	var request *pp.ProxyRequestError
	fmt.Println(errors.As(err, &request), request.ErrorClass)
	// Output:
	// "supervisor/refunds" <nil>
	// true actor_id_invalid
}

func ExampleParseRetryAfter() {
	now := time.Date(2026, 1, 2, 15, 4, 0, 0, time.UTC)
	fmt.Println(*pp.ParseRetryAfter("2.5", now))
	fmt.Println(*pp.ParseRetryAfter("Fri, 02 Jan 2026 15:04:30 GMT", now))
	fmt.Println(pp.ParseRetryAfter("soon", now) == nil)
	// Output:
	// 2.5s
	// 30s
	// true
}

func ExampleInterpretReply() {
	ok := pp.InterpretReply(200, http.Header{}, []byte(`{"response": {"status": "shipped"}}`), "get_order", "run-token-17")
	fmt.Println(ok.Kind == pp.ReplyValue, ok.Value)

	busy := pp.InterpretReply(503, http.Header{"Retry-After": {"1"}},
		[]byte(`{"detail": {"error_class": "lock_contention", "message": "busy"}}`), "get_order", "run-token-17")
	fmt.Println(busy.Kind == pp.ReplyRetry, *busy.RetryAfter)

	over := pp.InterpretReply(401, http.Header{}, []byte(`{"detail": {"error_class": "run_token_expired"}}`), "get_order", "run-token-17")
	var stale *pp.StaleRunTokenError
	fmt.Println(over.Kind == pp.ReplyError, errors.As(over.Err, &stale))
	// Output:
	// true map[status:shipped]
	// true 1s
	// true true
}

func ExampleRetryPolicy_Delay() {
	policy := pp.DefaultRetryPolicy
	policy.Jitter = 0 // to print exact waits; the default spreads them ±25 %
	for retry := 1; retry <= 5; retry++ {
		fmt.Print(policy.Delay(retry, nil), " ")
	}
	asked := 7 * time.Second
	fmt.Println(policy.Delay(1, &asked))
	// Output: 500ms 1s 2s 4s 4s 7s
}

func ExampleRetryPolicy_Settle() {
	reply := pp.InterpretReply(429, http.Header{"Retry-After": {"120"}}, []byte(`{"error_class": "rate_limited", "message": "slow down"}`),
		"get_order", "run-token-17")
	settled := pp.DefaultRetryPolicy.Settle(reply) // longer than MaxRetryAfter: fail now rather than wait
	fmt.Println(settled.Kind == pp.ReplyError)
	fmt.Println(settled.Err)
	// Output:
	// true
	// proxy call "get_order" failed: HTTP 429 rate_limited: slow down (the proxy asked to wait 120 s before a retry, longer than the 60 s this client waits: not retried)
}

func ExamplePacer_Reserve() {
	pacer := pp.NewPacer(2, time.Minute) // at most 2 requests per run token in any minute
	now := time.Date(2026, 1, 2, 15, 4, 0, 0, time.UTC)
	fmt.Println(pacer.Reserve("run-a", now), pacer.Reserve("run-a", now), pacer.Reserve("run-a", now), pacer.Reserve("run-b", now))
	// Output: 0s 0s 1m0s 0s
}

func ExampleProbeProxy() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusUnauthorized) // the probe's fake bearer is refused: the proxy is reachable
	}))
	defer proxy.Close()
	result := pp.ProbeProxy(context.Background(), proxy.URL+"/runs/17", 10*time.Second)
	fmt.Println(result["reachable"], result["status_code"], result["error"])
	// Output: true 401 <nil>
}

func ExampleStatusOf() {
	fmt.Println(pp.StatusOf(&pp.EnvelopeError{Message: "no proxy URL"}), pp.StatusOf(&pp.RunTimeoutError{Limit: time.Minute}),
		pp.StatusOf(fmt.Errorf("step 2: %w", &pp.ResponseError{})), pp.StatusOf(errors.New("the agent failed")))
	// Output: 400 504 500 500
}

func ExampleDescribeError() {
	fmt.Println(pp.DescribeError(errors.New("no such order")))
	fmt.Println(pp.DescribeError(&pp.EnvelopeError{Message: "no proxy URL"}))
	// Output:
	// Error: no such order
	// EnvelopeError: no proxy URL
}

// Any of the four proxy error kinds, with errors.As.
func ExampleProxyFailure() {
	reply := pp.InterpretReply(404, http.Header{}, []byte(`{"detail": {"error_class": "unknown_tool", "message": "no such tool"}}`),
		"get_weather", "run-token-17")
	err := fmt.Errorf("step 1: %w", reply.Err)
	var failure pp.ProxyFailure
	if errors.As(err, &failure) {
		fmt.Println(failure.Kind(), failure.Proxy().StatusCode, failure.Proxy().ErrorClass)
	}
	// Output: proxy 404 unknown_tool
}

func ExampleCompactJSON() {
	fmt.Println(pp.CompactJSON(map[string]any{"b": []any{1, "<x>"}, "a": nil}))
	// Output: {"a":null,"b":[1,"<x>"]}
}

func ExampleSetLogOutput() {
	pp.SetLogOutput(io.Discard) // or a file; stderr by default. The log never shows a token.
}

// One Client serves any number of runs: each call takes its run from the context.
func ExampleClient() {
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println(r.URL.Path, r.Header.Get("Authorization"))
		fmt.Fprint(w, `{"response": "ok", "accepted": true}`)
	}))
	defer proxy.Close()
	client := pp.NewClient()
	defer client.CloseIdleConnections()

	for _, run := range []string{"run-a", "run-b"} {
		ctx := exampleRun(proxy.URL+"/runs/"+run, "token-of-"+run)
		_, _ = client.Call(ctx, "get_order", map[string]any{"order_id": "4521"})
	}
	ctx := exampleRun(proxy.URL+"/runs/run-c", "token-of-run-c")
	_, _ = client.Trace(ctx, pp.TraceCustom, map[string]any{"step": "triage"})
	_, _ = client.PostHandoff(ctx, pp.Handoff{From: "triage", To: "refunds"})
	// Output:
	// /runs/run-a/tools/get_order Bearer token-of-run-a
	// /runs/run-b/tools/get_order Bearer token-of-run-b
	// /runs/run-c/traces/custom Bearer token-of-run-c
	// /runs/run-c/traces/handoff Bearer token-of-run-c
}

func ExampleDefaultClient() {
	// The package-level Call, Trace and PostHandoff use it unless the context carries another.
	fmt.Println(pp.ClientFrom(context.Background()) == pp.DefaultClient())
	pp.DefaultClient().CloseIdleConnections() // at shutdown
	// Output: true
}

// The dispatch handler binds Options.Client to each run's context.
func ExampleClientFrom() {
	client := pp.NewClient()
	agent := func(ctx context.Context, env *pp.Envelope) (any, error) {
		return fmt.Sprint(pp.ClientFrom(ctx) == client), nil
	}
	handler, _ := pp.NewDispatchHandler(agent, pp.Options{Token: "agent-token-1234", Client: client})
	server := httptest.NewServer(handler)
	defer server.Close()
	req, _ := http.NewRequest(http.MethodPost, server.URL+"/dispatch", strings.NewReader(`{"odyssey_proxy_url": "https://proxy.example/runs/17"}`))
	req.Header.Set("Authorization", "Bearer agent-token-1234")
	req.Header.Set(pp.HeaderRunToken, "run-token-17")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(string(reply))
	// Output: {"final_response":"true"}
}

// Wrapped in middleware of your own, the handler answers as it does alone.
func ExampleDispatchHandler_ServeHTTP() {
	handler, _ := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) { return "done", nil },
		pp.Options{Token: "agent-token-1234"})
	withRequestID := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "req-1")
		handler.ServeHTTP(w, r)
	})
	server := httptest.NewServer(withRequestID)
	defer server.Close()
	resp, err := http.Get(server.URL + "/healthz")
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, resp.Header.Get("X-Request-Id"), resp.Header.Get("Content-Type"))
	// Output: 200 req-1 application/json
}

func ExampleNewPacer() {
	client := pp.NewClient()
	client.Pacer = pp.NewPacer(30, time.Minute) // stay well under the proxy's 60 a minute per run token
	fmt.Println(client.Pacer.Limit, client.Pacer.Window)
	// Output: 30 1m0s
}

func ExampleProxyError_Value() {
	reply := pp.InterpretReply(409, http.Header{}, []byte(`{"detail": {"error_class": "already_refunded", "message": "refunded on 2 May"}}`),
		"issue_refund", "run-token-17")
	var failure pp.ProxyFailure
	if errors.As(reply.Err, &failure) {
		fmt.Println(failure.Proxy().Value()) // a tool result a model can read
	}
	// Output: map[error:proxy call "issue_refund" failed: HTTP 409 already_refunded: refunded on 2 May error_class:already_refunded status_code:409]
}
