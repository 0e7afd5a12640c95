package pipelinesport_test

// The language-neutral JSON vectors of conformance/checker/vectors/, run against the
// port's public API. Pure cases call the functions directly; request, reply
// and trace cases go over a socket to a small recording proxy on 127.0.0.1.
// Code-mode cases (from: run|env) and build_response's result objects are
// Python-specific and skipped, as in conformance/ports/node/vectors.mjs.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	pp "example.com/pipelines-port/go"
)

const basePath = "/api/odyssey-proxy/runs/r1"

// -- loading ------------------------------------------------------------------------

type vectorFile struct {
	RunToken string
	ToolName string
	Cases    []map[string]any
}

// expand replaces every {"$repeat": s, "count": n} with s repeated n times.
func expand(value any) any {
	switch v := value.(type) {
	case []any:
		for i, item := range v {
			v[i] = expand(item)
		}
	case map[string]any:
		if s, ok := v["$repeat"].(string); ok && len(v) == 2 {
			n, _ := v["count"].(json.Number).Int64()
			return strings.Repeat(s, int(n))
		}
		for key, item := range v {
			v[key] = expand(item)
		}
	}
	return value
}

// decode is the JSON value of data (numbers as json.Number), or a string saying it is not JSON.
func decode(data []byte) any {
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.UseNumber()
	var value any
	if err := dec.Decode(&value); err != nil {
		return fmt.Sprintf("<not JSON: %v>", err)
	}
	return value
}

func load(t *testing.T, name string) vectorFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "checker", "vectors", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	doc := expand(decode(data)).(map[string]any)
	file := vectorFile{}
	file.RunToken, _ = doc["run_token"].(string)
	file.ToolName, _ = doc["tool_name"].(string)
	for _, c := range doc["cases"].([]any) {
		file.Cases = append(file.Cases, c.(map[string]any))
	}
	return file
}

// -- comparing ----------------------------------------------------------------------

// canon is a value as JSON decodes it (numbers as json.Number).
func canon(value any) any {
	data, err := json.Marshal(value)
	if err != nil {
		return fmt.Sprintf("<not JSON: %v>", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.UseNumber()
	var out any
	_ = dec.Decode(&out)
	return out
}

// same is JSON equality, types included; numbers compare by value (1.0 == 1).
func same(a, b any) bool { return equal(canon(a), canon(b)) }

func equal(a, b any) bool {
	switch x := a.(type) {
	case json.Number:
		y, ok := b.(json.Number)
		if !ok {
			return false
		}
		fx, _ := x.Float64()
		fy, _ := y.Float64()
		return fx == fy
	case []any:
		y, ok := b.([]any)
		if !ok || len(x) != len(y) {
			return false
		}
		for i := range x {
			if !equal(x[i], y[i]) {
				return false
			}
		}
		return true
	case map[string]any:
		y, ok := b.(map[string]any)
		if !ok || len(x) != len(y) {
			return false
		}
		for key, item := range x {
			other, has := y[key]
			if !has || !equal(item, other) {
				return false
			}
		}
		return true
	}
	return a == b
}

func show(value any) string {
	text := pp.CompactJSON(value)
	if len(text) > 200 {
		return text[:200] + "…"
	}
	return text
}

func headersOf(value any) http.Header {
	h := http.Header{}
	object, _ := value.(map[string]any)
	for name, item := range object {
		h.Add(name, fmt.Sprint(item))
	}
	return h
}

// checkError holds err to a vector's expect.error: the kind, status_code, error_class, mentions, never_mentions.
func checkError(err error, expect map[string]any) error {
	kind := expect["error"].(string)
	var ok bool
	switch kind {
	case "envelope":
		var e *pp.EnvelopeError
		ok = errors.As(err, &e)
	case "proxy":
		var e *pp.ProxyError
		ok = errors.As(err, &e)
	case "proxy_request":
		var e *pp.ProxyRequestError
		ok = errors.As(err, &e)
	case "stale_run_token":
		var e *pp.StaleRunTokenError
		ok = errors.As(err, &e)
	case "response":
		var e *pp.ResponseError
		ok = errors.As(err, &e)
	}
	if !ok {
		return fmt.Errorf("expected a %s error, got %T: %v", kind, err, err)
	}
	var failure pp.ProxyFailure
	if errors.As(err, &failure) {
		p := failure.Proxy()
		if want, has := expect["status_code"]; has {
			got := any(nil)
			if p.StatusCode != 0 {
				got = p.StatusCode
			}
			if !same(got, want) {
				return fmt.Errorf("status_code %v, want %v", got, want)
			}
		}
		if want, has := expect["error_class"]; has {
			got := any(nil)
			if p.ErrorClass != "" {
				got = p.ErrorClass
			}
			if !same(got, want) {
				return fmt.Errorf("error_class %v, want %v", got, want)
			}
		}
		for _, text := range list(expect["never_mentions"]) {
			if strings.Contains(pp.CompactJSON(p.Body), text.(string)) {
				return fmt.Errorf("%q leaked into the kept body", text)
			}
		}
	}
	for _, text := range list(expect["mentions"]) {
		if !strings.Contains(err.Error(), text.(string)) {
			return fmt.Errorf("%q not in %q", text, err.Error())
		}
	}
	for _, text := range list(expect["never_mentions"]) {
		if strings.Contains(err.Error(), text.(string)) {
			return fmt.Errorf("%q leaked into %q", text, err.Error())
		}
	}
	return nil
}

func list(value any) []any {
	items, _ := value.([]any)
	return items
}

// expectOutcome holds (value, err) to expect: an error of expect.error, or none.
func expectOutcome(value any, err error, expect map[string]any) (threw bool, problem error) {
	if _, wantsError := expect["error"]; wantsError {
		if err == nil {
			return false, fmt.Errorf("expected a %v error, got %s", expect["error"], show(value))
		}
		return true, checkError(err, expect)
	}
	if err != nil {
		return true, fmt.Errorf("unexpected error %T: %v", err, err)
	}
	return false, nil
}

// -- a recording proxy on 127.0.0.1 -----------------------------------------------------

type recorded struct {
	path   string
	header http.Header
	json   any
}

type scripted struct {
	status int
	header map[string]any
	body   string
}

type proxy struct {
	mu       sync.Mutex
	requests []recorded
	script   []scripted
	server   *httptest.Server
	url      string
}

func startProxy(t *testing.T) *proxy {
	p := &proxy{}
	p.server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		data, _ := io.ReadAll(r.Body)
		var body any
		if len(data) > 0 {
			body = decode(data)
		}
		p.mu.Lock()
		p.requests = append(p.requests, recorded{r.URL.EscapedPath(), r.Header.Clone(), body})
		spec := scripted{status: 200, body: `{"response": null}`}
		if len(p.script) > 1 {
			spec, p.script = p.script[0], p.script[1:]
		} else if len(p.script) == 1 {
			spec = p.script[0]
		}
		p.mu.Unlock()
		for name, value := range spec.header {
			w.Header().Set(name, fmt.Sprint(value))
		}
		if w.Header().Get("Content-Type") == "" {
			w.Header().Set("Content-Type", "application/json")
		}
		w.WriteHeader(spec.status)
		_, _ = io.WriteString(w, spec.body)
	}))
	t.Cleanup(p.server.Close)
	p.url = p.server.URL + basePath
	return p
}

func (p *proxy) reset(script ...scripted) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.requests, p.script = nil, script
}

func (p *proxy) sent() []recorded {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]recorded(nil), p.requests...)
}

// runContext is a context carrying a run on the proxy with the given token.
func (p *proxy) runContext(token string) context.Context {
	env, err := pp.EnvelopeFromDispatch(map[string]any{"odyssey_proxy_url": p.url}, http.Header{pp.HeaderRunToken: {token}})
	if err != nil {
		panic(err)
	}
	return pp.WithEnvelope(context.Background(), env)
}

var uuidPattern = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// tokenSent: the run token in exactly one of Authorization: Bearer <t> and X-Pipelines-Run-Token.
func tokenSent(h http.Header, token string) bool {
	auth, header := h.Values("Authorization"), h.Values(pp.HeaderRunToken)
	if (len(auth) == 0) == (len(header) == 0) {
		return false
	}
	if len(header) > 0 {
		return header[0] == token
	}
	scheme, rest, _ := strings.Cut(auth[0], " ")
	return strings.EqualFold(scheme, "bearer") && strings.TrimSpace(rest) == token
}

func checkRequest(r recorded, expect map[string]any, token string) error {
	if suffix, has := expect["path_suffix"].(string); has && r.path != basePath+suffix {
		return fmt.Errorf("path %s, want %s", r.path, basePath+suffix)
	}
	if body, has := expect["body_json"]; has && !same(r.json, body) {
		return fmt.Errorf("body %s, want %s", show(r.json), show(body))
	}
	headers, _ := expect["headers"].(map[string]any)
	for name, value := range headers {
		want := strings.ReplaceAll(value.(string), "{run_token}", token)
		if got := r.header.Get(name); got != want {
			return fmt.Errorf("header %s: %q, want %q", name, got, want)
		}
	}
	for _, name := range list(expect["headers_absent"]) {
		if _, has := r.header[http.CanonicalHeaderKey(name.(string))]; has {
			return fmt.Errorf("header %s sent", name)
		}
	}
	if sent, _ := expect["run_token_sent"].(bool); sent && !tokenSent(r.header, token) {
		return errors.New("the run token is not in exactly one token header")
	}
	if strings.HasPrefix(r.path, basePath+"/tools/") && !uuidPattern.MatchString(r.header.Get("Idempotency-Key")) {
		return errors.New("no Idempotency-Key")
	}
	return nil
}

// -- the suites -----------------------------------------------------------------------

var errSkip = errors.New("skip")

type suiteEnv struct {
	proxy  *proxy
	client *pp.Client
	waits  *[]time.Duration
}

// envelopeFields is the envelope under the vectors' field names.
func envelopeFields(env *pp.Envelope) any {
	var jti, latest any
	if env.RunTokenJTI != "" {
		jti = env.RunTokenJTI
	}
	if env.LatestUserPrompt != nil {
		latest = *env.LatestUserPrompt
	}
	return canon(map[string]any{
		"proxy_url": env.ProxyURL, "run_token": env.RunToken, "run_id": env.RunID, "task_id": env.TaskID,
		"agent_id": env.AgentID, "run_token_jti": jti, "user_instruction": env.UserInstruction,
		"task_input": env.TaskInput, "latest_user_prompt": latest, "session_id": env.SessionID, "turn_id": env.TurnID,
		"messages": env.Messages, "scenario_state": env.ScenarioState, "workspace": env.Workspace,
		"tools_schema": env.ToolsSchema, "sub_agents": env.SubAgents, "api_url": env.APIURL, "raw": env.Raw,
	})
}

func dig(value any, path string) any {
	for _, part := range strings.Split(path, ".") {
		object, _ := value.(map[string]any)
		value = object[part]
	}
	return value
}

var suites = map[string]func(c map[string]any, doc vectorFile, s suiteEnv) error{
	"envelope": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		if c["from"] != "dispatch" {
			return errSkip // code mode (§5) is Python-specific
		}
		body := c["body"]
		if text, has := c["body_text"]; has {
			body = text
		}
		expect := c["expect"].(map[string]any)
		env, err := pp.EnvelopeFromDispatch(body, headersOf(c["headers"]))
		if threw, problem := expectOutcome(env, err, expect); threw || problem != nil {
			return problem
		}
		fields := envelopeFields(env)
		for path, want := range expect["fields"].(map[string]any) {
			if got := dig(fields, path); !same(got, want) {
				return fmt.Errorf("%s: %s, want %s", path, show(got), show(want))
			}
		}
		return nil
	},

	"inbound": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := c["expect"].(map[string]any)
		if c["kind"] == "ping" {
			if got := pp.IsPing(c["body"]); got != expect["is_ping"] {
				return fmt.Errorf("IsPing %v", got)
			}
			return nil
		}
		if got := pp.CheckCredential(headersOf(c["headers"]), c["expected"].(string), c["header_name"].(string)); got != expect["ok"] {
			return fmt.Errorf("CheckCredential %v", got)
		}
		return nil
	},

	"tool_names": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := map[string]any{}
		if valid, _ := c["valid"].(bool); !valid {
			expect["error"] = "proxy_request"
		}
		name, err := pp.ValidateToolName(c["tool_name"])
		_, problem := expectOutcome(name, err, expect)
		return problem
	},

	"actor_labels": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := c["expect"].(map[string]any)
		label, err := pp.ValidateActorLabel(c["label"])
		if threw, problem := expectOutcome(label, err, expect); threw || problem != nil {
			return problem
		}
		want, _ := expect["label"].(string) // null: no header, the empty label
		if label != want {
			return fmt.Errorf("label %q, want %q", label, want)
		}
		return nil
	},

	"proxy_replies": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := c["expect"].(map[string]any)
		body := ""
		if value, has := c["body_json"]; has {
			body = pp.CompactJSON(value)
		} else if text, has := c["body_text"].(string); has {
			body = text
		}
		status64, _ := c["status"].(json.Number).Int64()
		status := int(status64)
		header := headersOf(c["headers"])
		pure := pp.DefaultRetryPolicy.Settle(pp.InterpretReply(status, header, []byte(body), doc.ToolName, doc.RunToken))
		retry, _ := expect["retry"].(bool)
		wantValue, isValue := expect["value"]
		switch {
		case isValue:
			if pure.Kind != pp.ReplyValue || !same(pure.Value, wantValue) {
				return fmt.Errorf("pure: kind %v value %s", pure.Kind, show(pure.Value))
			}
		case retry:
			if pure.Kind != pp.ReplyRetry {
				return fmt.Errorf("pure: kind %v, want a retry", pure.Kind)
			}
			if wait, ok := expect["retry_after_s"].(json.Number); ok {
				want, _ := wait.Float64()
				if pure.RetryAfter == nil || math.Abs(pure.RetryAfter.Seconds()-want) > 0.01 {
					return fmt.Errorf("pure: Retry-After %v, want %v s", pure.RetryAfter, want)
				}
			} else if pure.RetryAfter != nil {
				return fmt.Errorf("pure: Retry-After %v, want none", *pure.RetryAfter)
			}
		default:
			if pure.Kind != pp.ReplyError {
				return fmt.Errorf("pure: kind %v, want an error", pure.Kind)
			}
			if err := checkError(pure.Err, expect); err != nil {
				return fmt.Errorf("pure: %w", err)
			}
		}
		// The same over a socket: the case's reply, then a success.
		headerSpec, _ := c["headers"].(map[string]any)
		s.proxy.reset(scripted{status, headerSpec, body}, scripted{200, nil, `{"response": "after-retry"}`})
		value, err := s.client.Call(s.proxy.runContext(doc.RunToken), doc.ToolName, map[string]any{})
		sent := s.proxy.sent()
		switch {
		case retry:
			if err != nil || value != "after-retry" || len(sent) != 2 {
				return fmt.Errorf("%d requests, got %s, %v", len(sent), show(value), err)
			}
			if sent[0].header.Get("Idempotency-Key") != sent[1].header.Get("Idempotency-Key") {
				return errors.New("a new Idempotency-Key on the retry")
			}
			if wait, ok := expect["retry_after_s"].(json.Number); ok {
				want, _ := wait.Float64()
				if len(*s.waits) != 1 || math.Abs((*s.waits)[0].Seconds()-want) > 0.01 {
					return fmt.Errorf("waited %v, want %v s", *s.waits, want)
				}
			} else if len(*s.waits) != 1 || (*s.waits)[0] < 100*time.Millisecond {
				return fmt.Errorf("waited %v: a backoff is at least 0.1 s", *s.waits)
			}
		default:
			if len(sent) != 1 {
				return fmt.Errorf("%d requests: only 429 and the transient 503s are retried", len(sent))
			}
			if isValue {
				if err != nil || !same(value, wantValue) {
					return fmt.Errorf("value %s, %v", show(value), err)
				}
			} else if err == nil {
				return fmt.Errorf("expected an error, got %s", show(value))
			} else if problem := checkError(err, expect); problem != nil {
				return problem
			}
		}
		return nil
	},

	"proxy_requests": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := c["expect"].(map[string]any)
		var opts []pp.CallOption
		if actor, has := c["actor"]; has {
			label, _ := actor.(string)
			opts = append(opts, pp.Actor(label))
		}
		s.proxy.reset()
		value, err := s.client.Call(s.proxy.runContext(doc.RunToken), c["tool_name"].(string), c["args"], opts...)
		threw, problem := expectOutcome(value, err, expect)
		sent := s.proxy.sent()
		if problem != nil {
			return problem
		}
		if threw {
			if len(sent) != 0 {
				return fmt.Errorf("%d requests sent for a refused call", len(sent))
			}
			return nil
		}
		if len(sent) != 1 {
			return fmt.Errorf("%d requests sent", len(sent))
		}
		return checkRequest(sent[0], expect, doc.RunToken)
	},

	"trace_events": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := c["expect"].(map[string]any)
		s.proxy.reset(scripted{200, nil, `{"accepted": true, "sequence": 1}`})
		ctx := s.proxy.runContext(doc.RunToken)
		var value any
		var err error
		if c["kind"] == "trace" {
			value, err = s.client.Trace(ctx, c["event_type"].(string), c["payload"])
		} else {
			value, err = s.client.PostHandoff(ctx, pp.Handoff{From: c["from"].(string), To: c["to"].(string),
				Reason: c["reason"], PayloadPreview: c["payload_preview"]})
		}
		threw, problem := expectOutcome(value, err, expect)
		sent := s.proxy.sent()
		if problem != nil {
			return problem
		}
		if dropped, _ := expect["dropped"].(bool); threw || dropped {
			if len(sent) != 0 || value != nil {
				return errors.New("something was sent")
			}
			return nil
		}
		if !same(value, map[string]any{"accepted": true, "sequence": 1}) || len(sent) != 1 {
			return fmt.Errorf("reply %s after %d requests", show(value), len(sent))
		}
		if err := checkRequest(sent[0], expect, doc.RunToken); err != nil {
			return err
		}
		body, _ := sent[0].json.(map[string]any)
		has, _ := expect["body_has"].(map[string]any)
		for key, want := range has {
			if !same(body[key], want) {
				return fmt.Errorf("body %s: %s", key, show(body[key]))
			}
		}
		stamp := regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)$`)
		if stamped, _ := expect["stamped"].(bool); stamped && !stamp.MatchString(fmt.Sprint(body["__occurred_at"])) {
			return fmt.Errorf("__occurred_at %v", body["__occurred_at"])
		}
		return nil
	},

	"build_response": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		input := c["input"].(map[string]any)
		if _, has := input["object"]; has {
			return errSkip // result objects with attributes are Python-specific
		}
		value := input["value"]
		overrides := map[string]any{}
		for _, key := range []string{"messages", "metadata"} {
			if item, has := input[key]; has {
				overrides[key] = item
			}
		}
		if len(overrides) > 0 { // explicit overrides are folded into an envelope map, as the checker does
			folded := map[string]any{}
			if object, ok := value.(map[string]any); ok {
				for key, item := range object {
					folded[key] = item
				}
			} else {
				folded["final_response"] = value
			}
			for key, item := range overrides {
				folded[key] = item
			}
			value = folded
		}
		strict, _ := input["strict"].(bool)
		expect := c["expect"].(map[string]any)
		body, _, err := pp.BuildResponse(value, strict)
		if threw, problem := expectOutcome(body, err, expect); threw || problem != nil {
			return problem
		}
		for _, problem := range pp.ValidateResponse(body) {
			if !problem.Warning {
				return fmt.Errorf("built body has a problem: %s", problem)
			}
		}
		if !same(body, expect["body"]) {
			return fmt.Errorf("body %s, want %s", show(body), show(expect["body"]))
		}
		return nil
	},

	"turn_reply": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		input := c["input"].(map[string]any)
		strict, _ := input["strict"].(bool)
		multiTurn, _ := input["multi_turn"].(bool)
		expect := c["expect"].(map[string]any)
		body, _, err := pp.BuildReply(input["value"], strict, multiTurn)
		if threw, problem := expectOutcome(body, err, expect); threw || problem != nil {
			return problem
		}
		if !same(body, expect["body"]) {
			return fmt.Errorf("body %s, want %s", show(body), show(expect["body"]))
		}
		// BuildTurnReply builds what a strict server sends for a plain turn reply of the file.
		reply, ok := input["value"].(map[string]any)
		message, isString := reply["message"].(string)
		done, isBool := reply["session_done"].(bool)
		metadata, _ := reply["metadata"].(map[string]any)
		_, final := reply["final_response"]
		if ok && multiTurn && strict && isString && isBool && !final && len(reply) <= 3 && (reply["metadata"] == nil || metadata != nil) {
			built, err := pp.BuildTurnReply(message, metadata, done)
			if err != nil {
				return fmt.Errorf("BuildTurnReply: %v", err)
			}
			if encoded := pp.CompactJSON(built); !same(decode([]byte(encoded)), expect["body"]) {
				return fmt.Errorf("BuildTurnReply %s, want %s", encoded, show(expect["body"]))
			}
		}
		return nil
	},

	"dispatch": runDispatchVector,

	"validate_response": func(c map[string]any, doc vectorFile, s suiteEnv) error {
		expect := c["expect"].(map[string]any)
		var errorPaths, warningPaths []string
		for _, problem := range pp.ValidateResponse(c["body"]) {
			if problem.Warning {
				warningPaths = append(warningPaths, problem.Path)
			} else {
				errorPaths = append(errorPaths, problem.Path)
			}
		}
		if !samePaths(errorPaths, list(expect["error_paths"])) || !samePaths(warningPaths, list(expect["warning_paths"])) {
			return fmt.Errorf("errors %v, warnings %v", errorPaths, warningPaths)
		}
		return nil
	},
}

func samePaths(got []string, want []any) bool {
	set := map[string]bool{}
	for _, path := range got {
		set[path] = true
	}
	wanted := map[string]bool{}
	for _, path := range want {
		wanted[path.(string)] = true
	}
	if len(set) != len(wanted) {
		return false
	}
	for path := range set {
		if !wanted[path] {
			return false
		}
	}
	return true
}

// TestVectors runs every vector file; each case is a subtest named after the file and the case.
func TestVectors(t *testing.T) {
	p := startProxy(t)
	var waits []time.Duration
	client := pp.NewClient()
	client.Timeout = 10 * time.Second
	client.Pacer = nil // these cases are about the retry policy, whose waits are recorded here
	client.Sleep = func(ctx context.Context, d time.Duration) error { waits = append(waits, d); return nil }
	s := suiteEnv{proxy: p, client: client, waits: &waits}
	names := make([]string, 0, len(suites))
	for name := range suites {
		names = append(names, name)
	}
	sort.Strings(names)
	passed, failed, skipped := 0, 0, 0
	for _, name := range names {
		doc := load(t, name)
		for _, c := range doc.Cases {
			waits = waits[:0]
			c := c
			t.Run(name+"/"+c["name"].(string), func(t *testing.T) {
				switch err := suites[name](c, doc, s); {
				case errors.Is(err, errSkip):
					skipped++
					t.Skip("Python-specific")
				case err != nil:
					failed++
					t.Errorf("%s (rule %v)", err, c["rule"])
				default:
					passed++
				}
			})
		}
	}
	t.Logf("vectors: %d passed, %d failed, %d skipped", passed, failed, skipped)
	if passed < 200 {
		t.Errorf("only %d vectors passed", passed)
	}
}

// runDispatchVector runs a dispatch.json case through the DispatchHandler: the
// request as the vector gives it, the agent recording the envelope it gets.
func runDispatchVector(c map[string]any, doc vectorFile, s suiteEnv) error {
	endpoint, _ := c["endpoint"].(map[string]any)
	if _, has := endpoint["tools_schema"]; has {
		return errSkip // the GET /tools_schema route (kit-routes) is not ported
	}
	opts := pp.Options{TokenEnv: "PIPELINESPORT_VECTOR_TOKEN_UNSET"}
	switch token := c["expected_token"].(type) {
	case nil:
		opts.NoAuth = true
	case string:
		opts.Token = token
	}
	if header, ok := endpoint["auth_header"].(string); ok {
		opts.AuthHeader = header
	}
	if limit, ok := endpoint["max_body"].(json.Number); ok {
		opts.MaxBody, _ = limit.Int64()
	}
	var seen *pp.Envelope
	handler, err := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) {
		seen = env
		return "ran", nil
	}, opts)
	if err != nil {
		return err
	}
	body, _ := c["body_read"].(string)
	req := httptest.NewRequest(c["method"].(string), c["target"].(string), strings.NewReader(body))
	req.Header = headersOf(c["headers"])
	req.ContentLength = -1
	if length := req.Header.Get("Content-Length"); length != "" {
		fmt.Sscan(length, &req.ContentLength)
	}
	if te := req.Header.Get("Transfer-Encoding"); te != "" {
		req.TransferEncoding = []string{te}
		req.Header.Del("Transfer-Encoding")
	}
	recorder := httptest.NewRecorder()
	handler.ServeHTTP(recorder, req)
	var reply any
	if recorder.Body.Len() > 0 {
		reply = decode(recorder.Body.Bytes())
	}
	object, _ := reply.(map[string]any)
	detail := strings.ToLower(fmt.Sprint(object["detail"]))
	expect := c["expect"].(map[string]any)
	switch expect["action"] {
	case "run":
		if seen == nil || recorder.Code != 200 {
			return fmt.Errorf("the agent did not run: %d %s", recorder.Code, show(reply))
		}
		fields := envelopeFields(seen)
		for path, want := range expect["fields"].(map[string]any) {
			if got := dig(fields, path); !same(got, want) {
				return fmt.Errorf("%s: %s, want %s", path, show(got), show(want))
			}
		}
		return nil
	case "probe":
		outbound, _ := object["outbound"].(map[string]any)
		if recorder.Code != 200 || outbound == nil || seen != nil {
			return fmt.Errorf("no probe: %d %s", recorder.Code, show(reply))
		}
		return nil
	}
	if seen != nil {
		return errors.New("the agent ran")
	}
	if want, _ := expect["status"].(json.Number).Int64(); int64(recorder.Code) != want {
		return fmt.Errorf("status %d, want %d: %s", recorder.Code, want, show(reply))
	}
	if want, has := expect["body"]; has && !same(reply, want) {
		return fmt.Errorf("body %s, want %s", show(reply), show(want))
	}
	has, _ := expect["body_has"].(map[string]any)
	for key, want := range has {
		if !same(object[key], want) {
			return fmt.Errorf("body %s: %s", key, show(object[key]))
		}
	}
	headers, _ := expect["headers"].(map[string]any)
	for name, want := range headers {
		if got := recorder.Header().Get(name); got != want {
			return fmt.Errorf("header %s: %q, want %q", name, got, want)
		}
	}
	for _, text := range list(expect["detail_mentions"]) {
		if !strings.Contains(detail, strings.ToLower(text.(string))) {
			return fmt.Errorf("%q not in the detail %q", text, detail)
		}
	}
	for _, text := range list(expect["detail_never_mentions"]) {
		if strings.Contains(detail, strings.ToLower(text.(string))) {
			return fmt.Errorf("%q in the detail %q", text, detail)
		}
	}
	return nil
}
