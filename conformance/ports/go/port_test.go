package pipelinesport_test

// Focused unit tests: concurrency, errors.As, the dispatch handler's failure
// answers, and the run token staying out of sight.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	pp "example.com/pipelines-port/go"
)

func TestMain(m *testing.M) {
	if os.Getenv("PIPELINESPORT_TEST_LOG") == "" {
		pp.SetLogOutput(io.Discard) // the retry warnings would drown the report
	}
	os.Exit(m.Run())
}

// whoamiProxy answers every tool call with the bearer it received, after a short pause.
func whoamiProxy(t *testing.T) *httptest.Server {
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(5 * time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"response": {"bearer": %q}, "source": "odyssey"}`, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
	}))
	t.Cleanup(server.Close)
	return server
}

func runContext(t *testing.T, proxyURL, token string) context.Context {
	env, err := pp.EnvelopeFromDispatch(map[string]any{"odyssey_proxy_url": proxyURL}, http.Header{pp.HeaderRunToken: {token}})
	if err != nil {
		t.Fatal(err)
	}
	return pp.WithEnvelope(context.Background(), env)
}

func TestConcurrentContextsNeverMix(t *testing.T) {
	server := whoamiProxy(t)
	client := pp.NewClient()
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			token := fmt.Sprintf("run-token-%02d", i)
			ctx := runContext(t, server.URL+"/runs/r", token)
			for j := 0; j < 2; j++ {
				value, err := client.Call(ctx, "whoami", nil)
				if err != nil {
					errs <- err
					return
				}
				if got := value.(map[string]any)["bearer"]; got != token {
					errs <- fmt.Errorf("run %d saw %v", i, got)
				}
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if _, ok := pp.EnvelopeFrom(context.Background()); ok {
		t.Error("a bare context carries an envelope")
	}
	if _, err := client.Call(context.Background(), "whoami", nil); !isEnvelopeError(err) {
		t.Errorf("a call without an envelope: %v", err)
	}
}

func isEnvelopeError(err error) bool {
	var envErr *pp.EnvelopeError
	return errors.As(err, &envErr)
}

func TestErrorsAsAndStatuses(t *testing.T) {
	reply := pp.InterpretReply(401, http.Header{}, []byte(`{"detail": {"error_class": "run_token_expired", "message": "gone"}}`), "get_order", "tok-secret-77")
	wrapped := fmt.Errorf("agent step: %w", reply.Err)
	var stale *pp.StaleRunTokenError
	var failure pp.ProxyFailure
	var plain *pp.ProxyError
	if !errors.As(wrapped, &stale) || !errors.As(wrapped, &failure) || errors.As(wrapped, &plain) {
		t.Fatalf("errors.As on %T", reply.Err)
	}
	if failure.Kind() != "stale_run_token" || failure.Proxy().StatusCode != 401 || failure.Proxy().ErrorClass != "run_token_expired" {
		t.Errorf("kind %s, fields %+v", failure.Kind(), failure.Proxy())
	}
	_, err := pp.ValidateActorLabel("a//b")
	var request *pp.ProxyRequestError
	if !errors.As(err, &request) || request.Kind() != "request" || request.ErrorClass != "actor_id_invalid" {
		t.Errorf("actor label error %T %v", err, err)
	}
	for err, want := range map[error]int{
		&pp.EnvelopeError{Message: "x"}:                      400,
		fmt.Errorf("wrapped: %w", &pp.ResponseError{}):       500,
		&pp.RunTimeoutError{Limit: time.Second}:              504,
		&pp.HTTPError{Status: 413}:                           413,
		errors.New("the agent failed"):                       500,
		&pp.ProxyError{Message: "terminal", StatusCode: 404}: 500,
	} {
		if got := pp.StatusOf(err); got != want {
			t.Errorf("StatusOf(%T) = %d, want %d", err, got, want)
		}
	}
}

func TestEnvelopeNeverShowsItsRunToken(t *testing.T) {
	env, err := pp.EnvelopeFromDispatch([]byte(`{"odyssey_proxy_url": "http://127.0.0.1:9/p", "run_id": 17}`),
		http.Header{"X-Pipelines-Run-Token": {" secret-run-token "}})
	if err != nil || env.RunToken != "secret-run-token" {
		t.Fatalf("%v %v", env, err)
	}
	data, _ := json.Marshal(env)
	for _, text := range []string{fmt.Sprint(env), fmt.Sprintf("%+v %#v %s", *env, env, env), string(data)} {
		if strings.Contains(text, "secret-run-token") {
			t.Errorf("the run token shows: %s", text)
		}
	}
}

// serve runs one request through a handler built on agent and returns the status and the decoded body.
func serve(t *testing.T, agent pp.AgentFunc, opts pp.Options, body string, header http.Header) (int, map[string]any) {
	t.Helper()
	handler, err := pp.NewDispatchHandler(agent, opts)
	if err != nil {
		t.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodPost, "/dispatch", strings.NewReader(body))
	for name, values := range header {
		req.Header[name] = values
	}
	req.Header.Set("Content-Length", fmt.Sprint(len(body))) // as a server sees it
	recorder := httptest.NewRecorder()
	handler.ServeHTTP(recorder, req)
	var reply map[string]any
	if err := json.Unmarshal(recorder.Body.Bytes(), &reply); err != nil {
		t.Fatalf("not JSON: %q", recorder.Body.String())
	}
	return recorder.Code, reply
}

func TestHandlerAnswersAFailingAgent(t *testing.T) {
	server := whoamiProxy(t)
	const agentToken, runToken = "agent-token-xyz", "run-token-abc"
	body := fmt.Sprintf(`{"odyssey_proxy_url": %q, "run_id": 5}`, server.URL+"/runs/r")
	header := http.Header{"Authorization": {"Bearer " + agentToken}, pp.HeaderRunToken: {runToken}}
	opts := pp.Options{Token: agentToken, RunTimeout: 200 * time.Millisecond}

	status, reply := serve(t, func(ctx context.Context, env *pp.Envelope) (any, error) {
		return nil, fmt.Errorf("cannot use %s\n  with %s", env.RunToken, agentToken)
	}, opts, body, header)
	if detail := reply["detail"].(string); status != 500 || detail != "Error: cannot use [redacted] with [redacted]" {
		t.Errorf("error: %d %q", status, detail)
	}

	status, reply = serve(t, func(ctx context.Context, env *pp.Envelope) (any, error) {
		var m map[string]int
		m["boom"]++ // a nil map: panics
		return "unreachable", nil
	}, opts, body, header)
	if detail := reply["detail"].(string); status != 500 || !strings.HasPrefix(detail, "PanicError: ") || strings.Contains(detail, ".go:") {
		t.Errorf("panic: %d %q", status, detail)
	}

	status, reply = serve(t, func(ctx context.Context, env *pp.Envelope) (any, error) {
		return map[string]any{"final_response": ""}, nil
	}, opts, body, header)
	if status != 500 || !strings.Contains(reply["detail"].(string), "final_response") {
		t.Errorf("empty final_response: %d %v", status, reply)
	}

	late := make(chan error, 1)
	status, reply = serve(t, func(ctx context.Context, env *pp.Envelope) (any, error) {
		time.Sleep(400 * time.Millisecond)
		_, err := pp.Call(ctx, "whoami", nil)
		late <- err
		return "too late", nil
	}, opts, body, header)
	if status != 504 || !strings.Contains(reply["detail"].(string), "run_timeout_s") {
		t.Errorf("timeout: %d %v", status, reply)
	}
	if status != 504 {
		return
	}
	if err := <-late; err == nil || !strings.Contains(err.Error(), "overran its run timeout") {
		t.Errorf("a call after the timeout: %v", err)
	}

	status, reply = serve(t, func(ctx context.Context, env *pp.Envelope) (any, error) {
		return pp.ResponseEnvelope{FinalResponse: "token " + env.RunToken, Messages: []pp.Message{{Role: "user", Content: "hi"}}}, nil
	}, opts, body, header)
	if status != 200 || reply["final_response"] != "token [redacted]" || len(reply["messages"].([]any)) != 1 {
		t.Errorf("a ResponseEnvelope around the token: %d %v", status, reply)
	}
}

func TestRetriesReuseTheKeyAndHonourRetryAfter(t *testing.T) {
	var mu sync.Mutex
	var keys []string
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		n := len(keys)
		mu.Unlock()
		if n < 3 {
			w.Header().Set("Retry-After", "7")
			w.WriteHeader(429)
			return
		}
		fmt.Fprint(w, `{"response": "done"}`)
	}))
	defer server.Close()
	client := pp.NewClient()
	var waits []time.Duration
	client.Sleep = func(ctx context.Context, d time.Duration) error { waits = append(waits, d); return nil }
	value, err := client.Call(runContext(t, server.URL, "tok"), "get_order", map[string]any{"id": 1})
	if err != nil || value != "done" || len(keys) != 3 || keys[0] != keys[1] || keys[1] != keys[2] {
		t.Fatalf("%v %v keys=%v", value, err, keys)
	}
	if len(waits) != 2 || waits[0] != 7*time.Second {
		t.Errorf("waits %v", waits)
	}
	for retry := 1; retry <= 6; retry++ {
		d := pp.DefaultRetryPolicy.Delay(retry, nil)
		if d < 375*time.Millisecond || d > 4*time.Second {
			t.Errorf("backoff %d: %v", retry, d)
		}
	}
	capped := 90 * time.Second
	if d := pp.DefaultRetryPolicy.Delay(1, &capped); d != time.Minute {
		t.Errorf("Retry-After cap: %v", d)
	}
}

func TestPacerSpreadsABurstPerRunToken(t *testing.T) {
	pacer := pp.NewPacer(2, time.Minute)
	start := time.Unix(1000, 0)
	waits := []time.Duration{
		pacer.Reserve("a", start), pacer.Reserve("a", start), pacer.Reserve("a", start),
		pacer.Reserve("a", start.Add(30*time.Second)), pacer.Reserve("b", start),
	}
	// The third waits for the first slot to leave the window; the fourth (30 s later) for the second's;
	// another run has a budget of its own.
	want := []time.Duration{0, 0, time.Minute, 30 * time.Second, 0}
	for i := range want {
		if waits[i] != want[i] {
			t.Fatalf("reservation %d waited %v, want %v (all: %v)", i, waits[i], want[i], waits)
		}
	}
}

func TestClientPacesEveryAttemptUnderTheRate(t *testing.T) {
	server := whoamiProxy(t)
	client := pp.NewClient()
	client.Pacer = pp.NewPacer(3, time.Minute)
	var waits []time.Duration
	client.Sleep = func(ctx context.Context, d time.Duration) error { waits = append(waits, d); return nil }
	ctx := runContext(t, server.URL+"/runs/r", "run-token-paced-1")
	for i := 0; i < 4; i++ {
		if _, err := client.Call(ctx, "get_order", nil); err != nil {
			t.Fatal(err)
		}
	}
	if len(waits) != 1 || waits[0] <= 59*time.Second || waits[0] > time.Minute {
		t.Fatalf("a fourth call within the minute must wait about 60 s, waited %v", waits)
	}
	if _, err := client.Call(runContext(t, server.URL+"/runs/r", "run-token-paced-2"), "get_order", nil); err != nil || len(waits) != 1 {
		t.Fatalf("another run must not wait: %v, %v", waits, err)
	}
	t.Setenv("PIPELINES_PROXY_RATE_PER_MINUTE", "0")
	if pp.NewClient().Pacer != nil {
		t.Fatal("PIPELINES_PROXY_RATE_PER_MINUTE=0 must turn pacing off")
	}
	t.Setenv("PIPELINES_PROXY_RATE_PER_MINUTE", "")
	if c := pp.NewClient(); c.Pacer == nil || c.Pacer.Limit != pp.RateLimitPerMinute {
		t.Fatal("pacing is on by default, at the proxy's limit")
	}
}

// A hand-built http.Header need not be canonical: names are looked up case-insensitively (§2.1).
func TestHeaderNamesInAnyCaseInAHandBuiltHeader(t *testing.T) {
	headers := http.Header{
		"x-pipelines-run-token":         {"run-token-lower-1"},
		"X-PIPELINES-ODYSSEY-PROXY-URL": {"http://127.0.0.1:9/p"},
		"x-pipelines-run-id":            {"17"},
	}
	env, err := pp.EnvelopeFromDispatch(map[string]any{}, headers)
	if err != nil {
		t.Fatalf("a non-canonical header map: %v", err)
	}
	if env.RunToken != "run-token-lower-1" || env.ProxyURL != "http://127.0.0.1:9/p" || env.RunID != "17" {
		t.Fatalf("got run id %v, proxy URL %q", env.RunID, env.ProxyURL)
	}
}

// __occurred_at is UTC whatever the machine's zone (§3.4 trace-occurred-at).
func TestOccurredAtIsUTCInAnyLocalZone(t *testing.T) {
	saved := time.Local
	time.Local = time.FixedZone("UTC-5", -5*3600)
	defer func() { time.Local = saved }()
	var body map[string]any
	server := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewDecoder(r.Body).Decode(&body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"accepted": true, "sequence": 1}`)
	}))
	defer server.Close()
	if _, err := pp.NewClient().Trace(runContext(t, server.URL+"/runs/r", "run-token-zone-1"), pp.TraceAssistantMessage,
		map[string]any{"text": "hi"}); err != nil {
		t.Fatal(err)
	}
	stamp, _ := body["__occurred_at"].(string)
	when, err := time.Parse(time.RFC3339Nano, stamp)
	if err != nil || !strings.HasSuffix(stamp, "Z") || time.Since(when).Abs() > time.Minute {
		t.Fatalf("__occurred_at %q is not the UTC time now (%v)", stamp, err)
	}
}
