package pipelinesport

// The dispatch handler and server (§2.3): routing, auth, framing, JSON, ping,
// connectivity check, envelope, agent, response; graceful shutdown.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"reflect"
	"regexp"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"time"
)

// AgentFunc is an agent. It gets its run's envelope (ctx carries it too, so
// Call, Trace and PostHandoff need no envelope argument) and returns anything
// BuildResponse accepts: a string, a map with final_response, a
// ResponseEnvelope; in a multi-turn dispatch a TurnReply is sent as built
// (BuildReply). An error (or a panic) is answered 500.
type AgentFunc func(ctx context.Context, env *Envelope) (any, error)

// Options configure a DispatchHandler; the zero value of each field is its default.
type Options struct {
	Path        string        // the dispatch route; default /dispatch
	Token       string        // a fixed agent token; wins over TokenEnv
	TokenEnv    string        // the variable holding the agent token, read at every request; default AGENT_TOKEN
	AuthHeader  string        // "Authorization" (Bearer <token>, the default) or a custom header with the raw value
	NoAuth      bool          // run without inbound auth: an explicit choice, logged loudly
	Strict      bool          // refuse (500) what the platform would only soften; also PIPELINES_PORT_STRICT=1
	MaxBody     int64         // request body limit in bytes; default 8 MiB
	RunTimeout  time.Duration // default 300 s, at most 1800 s; an overrun is answered 504
	ReadTimeout time.Duration // the request body must arrive within this; default 30 s
	Client      *Client       // the proxy client the agent's calls use; default DefaultClient()
}

// DispatchHandler serves one agent over HTTP (§2.3): POST on its path runs
// a dispatch, GET /healthz reports the version. It implements http.Handler.
type DispatchHandler struct {
	agent    AgentFunc
	opts     Options
	path     string
	client   *Client
	draining atomic.Bool
}

var headerNamePattern = regexp.MustCompile(`^[A-Za-z0-9-]+$`)

// NewDispatchHandler checks the options and returns the handler.
func NewDispatchHandler(agent AgentFunc, opts Options) (*DispatchHandler, error) {
	if agent == nil {
		return nil, errors.New("agent must not be nil")
	}
	if opts.Path == "" {
		opts.Path = DefaultDispatchPath
	}
	if !strings.HasPrefix(opts.Path, "/") {
		return nil, fmt.Errorf("path must start with '/', got %s", quoted(opts.Path, 80))
	}
	if opts.TokenEnv == "" {
		opts.TokenEnv = DefaultTokenEnv
	}
	if opts.AuthHeader == "" {
		opts.AuthHeader = "Authorization"
	}
	if !headerNamePattern.MatchString(opts.AuthHeader) {
		return nil, fmt.Errorf("auth header must be an HTTP header name, got %s", quoted(opts.AuthHeader, 80))
	}
	if opts.NoAuth && opts.Token != "" {
		return nil, errors.New("no-auth and a token contradict each other: choose one")
	}
	if opts.RunTimeout == 0 {
		opts.RunTimeout = DefaultRunTimeout
	}
	if opts.RunTimeout < 0 || opts.RunTimeout > MaxRunTimeout {
		return nil, fmt.Errorf("run timeout must be in (0, %s] seconds, got %s", formatSeconds(MaxRunTimeout), formatSeconds(opts.RunTimeout))
	}
	if opts.MaxBody == 0 {
		opts.MaxBody = DefaultMaxBodyBytes
	}
	if opts.MaxBody < 0 {
		return nil, fmt.Errorf("max body must be a positive number of bytes, got %d", opts.MaxBody)
	}
	if opts.ReadTimeout <= 0 {
		opts.ReadTimeout = 30 * time.Second
	}
	client := opts.Client
	if client == nil {
		client = DefaultClient()
	}
	path := strings.TrimRight(opts.Path, "/")
	if path == "" {
		path = "/"
	}
	return &DispatchHandler{agent: agent, opts: opts, path: path, client: client}, nil
}

// Path is the dispatch route.
func (h *DispatchHandler) Path() string { return h.path }

// DescribeAuth says how auth is configured, for a start-up line (never the token).
func (h *DispatchHandler) DescribeAuth() string {
	if h.opts.NoAuth {
		return "DISABLED (--no-auth): anyone who can reach this endpoint can dispatch"
	}
	value := "<token>"
	if strings.EqualFold(h.opts.AuthHeader, "Authorization") {
		value = "Bearer <token>"
	}
	source := "$" + h.opts.TokenEnv
	if h.opts.Token != "" {
		source = "the configured token"
	}
	line := fmt.Sprintf("%s: %s (token from %s)", h.opts.AuthHeader, value, source)
	if h.opts.Token == "" && os.Getenv(h.opts.TokenEnv) == "" {
		line += fmt.Sprintf("; %s is NOT set: every request gets 503 until it is", h.opts.TokenEnv)
	}
	return line
}

// Drain makes the handler refuse new dispatches with 503 (the server is shutting down).
func (h *DispatchHandler) Drain() { h.draining.Store(true) }

// expectedToken is the agent token, read per request so a rotated variable takes effect; "" when unset.
func (h *DispatchHandler) expectedToken() string {
	if h.opts.Token != "" {
		return h.opts.Token
	}
	return os.Getenv(h.opts.TokenEnv)
}

// reply is one answer: a status, a JSON body and extra headers.
type reply struct {
	status int
	body   any
	header http.Header
	what   string // "dispatch", "ping", "health", "connectivity check", "rejected"
}

func refuse(status int, detail string, header ...string) reply {
	h := http.Header{}
	for i := 0; i+1 < len(header); i += 2 {
		h.Set(header[i], header[i+1])
	}
	return reply{status: status, body: map[string]any{"detail": detail}, header: h, what: "rejected"}
}

// routePath is a request path without its trailing "/".
func routePath(path string) string {
	path = strings.TrimRight(path, "/")
	if path == "" {
		return "/"
	}
	return path
}

// ServeHTTP answers one request in §2.3's order and writes one log line
// (method, path, status, run id, task id, jti, duration, proxy calls; never a
// token). A panic inside the handler is a 500, never a dropped connection.
func (h *DispatchHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	started := time.Now()
	state := &dispatchState{}
	var out reply
	func() {
		defer func() {
			if p := recover(); p != nil {
				logf("error", "request failed inside the dispatch handler: %s", redactString(fmt.Sprint(p), h.expectedToken()))
				out = refuse(http.StatusInternalServerError, "internal error in the dispatch server")
			}
		}()
		out = h.decide(r, state)
	}()
	h.write(w, out)
	if out.what == "health" {
		return
	}
	runID, taskID, jti := any(headerValue(r.Header, HeaderRunID)), any(headerValue(r.Header, HeaderTaskID)), headerValue(r.Header, HeaderRunTokenJTI)
	if env := state.envelope; env != nil {
		runID, taskID, jti = env.RunID, env.TaskID, env.RunTokenJTI
	}
	note := ""
	switch {
	case out.what == "dispatch":
	case out.status >= 400:
		detail, _ := out.body.(map[string]any)["detail"].(string)
		note = " (rejected: " + short(detail, 200) + ")"
	default:
		note = " (" + out.what + ")"
	}
	logf("info", "%s %s status=%d run_id=%s task_id=%s jti=%s duration_ms=%.1f proxy_calls=%d%s", r.Method,
		short(routePath(r.URL.Path), 100), out.status, logValue(runID), logValue(taskID), logValue(jti),
		float64(time.Since(started))/float64(time.Millisecond), state.proxyCalls.Load(), note)
}

func logValue(value any) string {
	if value == nil || value == "" {
		return "null"
	}
	return short(fmt.Sprint(value), 100)
}

func (h *DispatchHandler) write(w http.ResponseWriter, out reply) {
	text, err := compactJSON(out.body)
	if err != nil {
		out = refuse(http.StatusInternalServerError, "internal error: the reply cannot be encoded as JSON")
		text, _ = compactJSON(out.body)
	}
	for name, values := range out.header {
		for _, value := range values {
			w.Header().Add(name, value)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", fmt.Sprint(len(text)))
	w.WriteHeader(out.status)
	_, _ = io.WriteString(w, text)
}

func (h *DispatchHandler) decide(r *http.Request, state *dispatchState) reply {
	path := routePath(r.URL.Path)
	routes := map[string]string{h.path: http.MethodPost, "/healthz": http.MethodGet}
	allowed, known := routes[path]
	if !known {
		return refuse(http.StatusNotFound, fmt.Sprintf("no route for %s: dispatches go to POST %s", short(path, 100), h.path))
	}
	if r.Method != allowed {
		return refuse(http.StatusMethodNotAllowed, fmt.Sprintf("%s is not allowed on %s: use %s", short(r.Method, 20), path, allowed), "Allow", allowed)
	}
	if path == "/healthz" && path != h.path {
		return reply{status: http.StatusOK, body: map[string]any{"ok": true, "version": Version}, what: "health"}
	}
	if h.draining.Load() {
		return refuse(http.StatusServiceUnavailable, "server is shutting down: retry on another instance", "Connection", "close")
	}

	// Step 1: auth, before anything about the body (auth-first).
	expected := h.expectedToken()
	if !h.opts.NoAuth {
		if expected == "" {
			return refuse(http.StatusServiceUnavailable, fmt.Sprintf("this agent's wrapper is misconfigured: auth reads "+
				"environment variable %s, which is not set", h.opts.TokenEnv))
		}
		if !CheckCredential(r.Header, expected, h.opts.AuthHeader) {
			detail := fmt.Sprintf("missing or invalid credential in the %s header", h.opts.AuthHeader)
			if strings.EqualFold(h.opts.AuthHeader, "Authorization") {
				return refuse(http.StatusUnauthorized, detail, "WWW-Authenticate", "Bearer")
			}
			return refuse(http.StatusUnauthorized, detail)
		}
	}

	// Framing (§7.1 kit-body-framing): a length, within the limit, decided before reading.
	if len(r.TransferEncoding) > 0 {
		return refuse(http.StatusLengthRequired, "chunked request bodies are not supported: send the JSON body with a "+
			"Content-Length header", "Connection", "close")
	}
	if strings.TrimSpace(r.Header.Get("Content-Length")) == "" || r.ContentLength < 0 {
		return refuse(http.StatusLengthRequired, "a Content-Length header is required: send the JSON body with its length",
			"Connection", "close")
	}
	if r.ContentLength > h.opts.MaxBody {
		return refuse(http.StatusRequestEntityTooLarge, fmt.Sprintf("request body of %d bytes is over this endpoint's "+
			"%d-byte cap", r.ContentLength, h.opts.MaxBody), "Connection", "close")
	}
	raw, err := h.readBody(r)
	if err != nil {
		return refuse(http.StatusBadRequest, "request body is truncated: "+short(err.Error(), 100), "Connection", "close")
	}

	// Steps 2-4: JSON, ping, connectivity check.
	payload, err := decodeJSON(raw)
	if err != nil {
		return refuse(http.StatusBadRequest, "body is not valid JSON: "+short(err.Error(), 200))
	}
	if IsPing(payload) {
		if duplicateTopLevelKey(raw) {
			return refuse(http.StatusBadRequest, `body repeats the key "ping": send {"ping": true} once`)
		}
		return reply{status: http.StatusOK, body: map[string]any{"ok": true}, what: "ping"}
	}
	object, ok := payload.(map[string]any)
	if !ok {
		return refuse(http.StatusBadRequest, "body must be a JSON object, got "+jsonType(payload))
	}
	if check, _ := object["connectivity_check"].(bool); check {
		return h.connectivityCheck(object, r.Header)
	}

	// Step 5: the envelope; steps 6-8: the agent and its answer.
	env, err := EnvelopeFromDispatch(object, r.Header)
	if err != nil {
		return refuse(StatusOf(err), err.Error())
	}
	state.envelope = env
	return h.runAgent(state, expected)
}

type connKey struct{}

// readBody reads exactly Content-Length bytes, within ReadTimeout when the
// server keeps the connection in the context (Serve does).
func (h *DispatchHandler) readBody(r *http.Request) ([]byte, error) {
	if conn, ok := r.Context().Value(connKey{}).(net.Conn); ok {
		_ = conn.SetReadDeadline(time.Now().Add(h.opts.ReadTimeout))
		defer func() { _ = conn.SetReadDeadline(time.Time{}) }()
	}
	raw := make([]byte, r.ContentLength)
	_, err := io.ReadFull(r.Body, raw)
	return raw, err
}

// duplicateTopLevelKey reports whether a JSON object repeats a key at its top
// level ({"ping": false, "ping": true}): refused rather than guessed (§7.1 kit-hostile-input).
func duplicateTopLevelKey(raw []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if token, err := dec.Token(); err != nil || token != json.Delim('{') {
		return false
	}
	seen := map[string]bool{}
	for dec.More() {
		token, err := dec.Token()
		key, ok := token.(string)
		if err != nil || !ok {
			return false
		}
		if seen[key] {
			return true
		}
		seen[key] = true
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return false
		}
	}
	return false
}

// connectivityCheck answers §2.3 step 4 by probing the proxy (§3.7); it never runs the agent.
func (h *DispatchHandler) connectivityCheck(payload map[string]any, header http.Header) reply {
	var url any
	for _, field := range []string{FieldProxyURL, FieldProxyURLLegacy} {
		if url == nil && truthy(payload[field]) {
			url = payload[field]
		}
	}
	if value := headerValue(header, HeaderProxyURL); url == nil && value != "" {
		url = value
	}
	if url == nil {
		return refuse(http.StatusBadRequest, fmt.Sprintf("connectivity_check needs a proxy URL: body field '%s' or header %s",
			FieldProxyURL, HeaderProxyURL))
	}
	proxyURL, err := CheckProxyURL(url, "the connectivity check")
	if err != nil {
		return refuse(http.StatusBadRequest, err.Error())
	}
	outbound := ProbeProxy(context.Background(), proxyURL, 10*time.Second)
	return reply{status: http.StatusOK, body: map[string]any{"ok": true, "outbound": outbound}, what: "connectivity check"}
}

type agentResult struct {
	value any
	err   error
}

// runAgent runs the agent with this request's envelope bound (step 6), within
// the run timeout (step 7), and answers 500 when it fails (step 8).
func (h *DispatchHandler) runAgent(state *dispatchState, agentToken string) reply {
	env := state.envelope
	scrub := func(text string) string { return redactString(text, env.RunToken, agentToken) }
	// The agent's context is its own: neither the connection's read deadlines nor a
	// client that went away cancels it; the run timeout does.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ctx = WithClient(context.WithValue(ctx, dispatchKey{}, state), h.client)

	done := make(chan agentResult, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- agentResult{err: &PanicError{Value: p, Stack: debug.Stack()}}
			}
		}()
		value, err := h.agent(ctx, env)
		done <- agentResult{value, err}
	}()
	timer := time.NewTimer(h.opts.RunTimeout)
	defer timer.Stop()

	var result agentResult
	select {
	case result = <-done:
	case <-timer.C:
		state.cancelled.Store(true) // an overrunning agent may keep running; its proxy calls now fail at once
		cancel()
		timeout := &RunTimeoutError{h.opts.RunTimeout}
		logf("error", "run %s: the agent did not finish within %s s; answering 504", logValue(env.RunID), formatSeconds(h.opts.RunTimeout))
		return refuse(StatusOf(timeout), timeout.Error())
	}
	if result.err != nil {
		detail := scrub(DescribeError(result.err))
		logf("error", "run %s: the agent failed: %s", logValue(env.RunID), detail)
		var panicked *PanicError
		if errors.As(result.err, &panicked) {
			logger.Print(scrub(string(panicked.Stack))) // the stack goes to the log only
		}
		return refuse(http.StatusInternalServerError, oneLine(detail, detailLimit))
	}
	body, _, err := BuildReply(result.value, h.opts.Strict || StrictFromEnv(), env.IsMultiTurn())
	if err != nil {
		return refuse(StatusOf(err), oneLine(scrub("agent returned a value that cannot become a response: "+err.Error()), detailLimit))
	}
	if text := CompactJSON(body); strings.Contains(text, env.RunToken) || (agentToken != "" && strings.Contains(text, agentToken)) {
		logf("warning", "run %s: the agent's response contained a secret token; it was redacted", logValue(env.RunID))
		redactedBody, _ := redactValue(body, env.RunToken, agentToken).(map[string]any)
		body = redactedBody
	}
	return reply{status: http.StatusOK, body: body, what: "dispatch"}
}

// oneLine folds line breaks and runs of whitespace to one space and cuts the
// text to at most limit characters (§7.3 kit-error-detail-shape).
func oneLine(text string, limit int) string {
	return short(strings.Join(strings.Fields(text), " "), limit-1)
}

// DescribeError is "TypeName: message" for an error an agent returned or a
// panic: the error's type name without package or pointer (a plain
// errors.New or fmt.Errorf error reads "Error"), the bare type name when the
// message is empty.
func DescribeError(err error) string {
	t := reflect.TypeOf(err)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	name := t.Name()
	switch name {
	case "", "errorString", "wrapError", "wrapErrors", "joinError":
		name = "Error"
	}
	if message := err.Error(); message != "" {
		return name + ": " + message
	}
	return name
}

// ---------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------

// NewServer is an http.Server for the handler: keep-alive, request headers
// within 30 s and the body within the handler's ReadTimeout, no write timeout
// (a run may take up to 1800 s).
func NewServer(h *DispatchHandler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ConnContext:       func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) },
		ErrorLog:          log.New(os.Stderr, "pipelines_port: http: ", 0),
	}
}

// ErrGraceOver says the grace period ended with dispatches still running.
var ErrGraceOver = errors.New("grace period over with dispatches still running")

// Serve serves the handler on ln until ctx is done (SIGTERM, say), then shuts
// down gracefully: the listener closes at once (new connections are refused),
// new dispatches get 503, and in-flight ones have grace to finish. It returns
// nil when all finished, ErrGraceOver when the grace ran out, or the error
// that stopped serving.
func Serve(ctx context.Context, ln net.Listener, h *DispatchHandler, grace time.Duration) error {
	if h.opts.NoAuth {
		logf("warning", "auth is DISABLED: anyone who can reach this endpoint can dispatch")
	}
	srv := NewServer(h)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	logf("info", "shutting down: refusing new dispatches, waiting up to %s s for in-flight ones", formatSeconds(grace))
	h.Drain()
	shutdown, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		_ = srv.Close()
		return ErrGraceOver
	}
	return nil
}

// ListenAndServe listens on addr (host:port) and calls Serve.
func ListenAndServe(ctx context.Context, addr string, h *DispatchHandler, grace time.Duration) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return Serve(ctx, ln, h, grace)
}
