package pipelinesport

// The dispatch envelope (§2.2) and the request context that carries it (§2.3 step 6).

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
)

// Envelope is one run's dispatch, as the agent sees it (§2.2).
//
// Ids keep the JSON type the body gave them (json.Number or string; ids read
// from headers are strings), nil when absent. RunToken is the run's bearer
// for the proxy: a secret, left out of the JSON form (json:"-") and of the
// printed form (Format), never logged.
type Envelope struct {
	ProxyURL         string         `json:"proxy_url"`
	RunToken         string         `json:"-"`
	RunID            any            `json:"run_id"`
	TaskID           any            `json:"task_id"`
	AgentID          any            `json:"agent_id"`
	RunTokenJTI      string         `json:"run_token_jti,omitempty"` // "" when absent
	UserInstruction  string         `json:"user_instruction"`
	TaskInput        map[string]any `json:"task_input"`         // body.input.input; {} when absent
	LatestUserPrompt *string        `json:"latest_user_prompt"` // multi-turn runs; nil when absent
	SessionID        any            `json:"session_id"`         // json.Number or string; nil when absent
	TurnID           any            `json:"turn_id"`            // any JSON type; nil when absent
	Messages         []any          `json:"messages"`           // earlier turns; nil when absent
	ScenarioState    map[string]any `json:"scenario_state"`     // nil when absent
	Workspace        map[string]any `json:"workspace"`          // coding runs: cwd, setup_mode, setup_instructions
	ToolsSchema      []any          `json:"tools_schema"`       // inlined tool list; nil when absent
	SubAgents        []string       `json:"sub_agents"`         // declared sub-agent labels; empty when none
	APIURL           string         `json:"api_url"`            // the proxy URL's origin
	Raw              map[string]any `json:"raw"`                // the whole body, unknown fields included
}

// Format prints the envelope without its run token, whatever the verb.
func (e Envelope) Format(f fmt.State, verb rune) {
	fmt.Fprintf(f, "Envelope{proxy_url=%s run_id=%v task_id=%v jti=%q run_token=%s}",
		e.ProxyURL, e.RunID, e.TaskID, e.RunTokenJTI, redacted)
}

var proxyURLPattern = regexp.MustCompile(`^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)([^?#]*)(\?[^#]*)?(#.*)?$`)
var controlOrSpace = regexp.MustCompile(`[\x00-\x20\x7f]`)
var controlChars = regexp.MustCompile(`[\x00-\x1f\x7f]`)

// CheckProxyURL returns the proxy base URL without its trailing "/": an
// http:// or https:// URL with a host and no query or fragment (§2.2
// proxy-url-source, §7.2 kit-proxy-url-checked). where names the source for
// the message.
func CheckProxyURL(url any, where string) (string, error) {
	text, ok := url.(string)
	if !ok || strings.TrimSpace(text) == "" {
		return "", &EnvelopeError{fmt.Sprintf("proxy URL from %s must be a non-empty string", where)}
	}
	text = strings.TrimRight(strings.TrimSpace(text), "/")
	parts := proxyURLPattern.FindStringSubmatch(text)
	scheme, hostPort := "", ""
	if parts != nil {
		scheme = strings.ToLower(parts[1])
		hostPort = parts[2]
		if at := strings.LastIndex(hostPort, "@"); at >= 0 {
			hostPort = hostPort[at+1:]
		}
	}
	host := regexp.MustCompile(`:\d*$`).ReplaceAllString(hostPort, "")
	if (scheme != "http" && scheme != "https") || host == "" {
		return "", &EnvelopeError{fmt.Sprintf("proxy URL %s from %s must be an http:// or https:// URL with a host", quoted(text, 200), where)}
	}
	if m := regexp.MustCompile(`:(\d*)$`).FindStringSubmatch(hostPort); m != nil && m[1] != "" {
		if port, err := strconv.Atoi(m[1]); err != nil || port > 65535 {
			return "", &EnvelopeError{fmt.Sprintf("proxy URL %s from %s is not a valid URL: port out of range", quoted(text, 200), where)}
		}
	}
	if parts[4] != "" || parts[5] != "" {
		return "", &EnvelopeError{fmt.Sprintf("proxy URL %s from %s must not carry a query or fragment", quoted(text, 200), where)}
	}
	if controlOrSpace.MatchString(text) {
		return "", &EnvelopeError{fmt.Sprintf("proxy URL from %s contains whitespace or control characters", where)}
	}
	return text, nil
}

func checkRunToken(token, where string) (string, error) {
	token = strings.TrimSpace(token)
	if token == "" {
		return "", &EnvelopeError{fmt.Sprintf("run token from %s must be a non-empty string", where)}
	}
	if controlChars.MatchString(token) { // never echo it: it is a secret
		return "", &EnvelopeError{fmt.Sprintf("run token from %s contains control characters", where)}
	}
	return token, nil
}

var integerText = regexp.MustCompile(`^-?[0-9]+$`)

// nativeID is an id as the body types it: an integer or a non-blank string (trimmed); anything else is absent.
func nativeID(value any) any {
	switch v := value.(type) {
	case json.Number:
		if integerText.MatchString(string(v)) {
			return v
		}
	case string:
		if s := strings.TrimSpace(v); s != "" {
			return s
		}
	case int, int64, int32:
		return v
	}
	return nil
}

func firstID(candidates ...any) any {
	for _, candidate := range candidates {
		if id := nativeID(candidate); id != nil {
			return id
		}
	}
	return nil
}

// headerValue is a header's trimmed first value ("" when absent or blank); names are case-insensitive.
func headerValue(h http.Header, name string) string {
	values := headerValues(h, name)
	if len(values) == 0 {
		return ""
	}
	return strings.TrimSpace(values[0])
}

// headerValues are every value of a header, its name matched case-insensitively (§2.1). net/http
// canonicalises the names it parses, but a hand-built http.Header (a serverless event's lower-case
// header map, say) need not be canonical, and Get looks up the canonical key only.
func headerValues(h http.Header, name string) []string {
	if values, ok := h[http.CanonicalHeaderKey(name)]; ok {
		return values
	}
	var keys []string
	for key := range h {
		if strings.EqualFold(key, name) {
			keys = append(keys, key)
		}
	}
	sort.Strings(keys) // a name sent in two spellings: the same order every time
	var found []string
	for _, key := range keys {
		found = append(found, h[key]...)
	}
	return found
}

// subAgentCatalog reads §2.2 sub_agents: label strings or {"actor_id": label}; malformed entries and repeats skipped.
func subAgentCatalog(value any) []string {
	labels := []string{}
	entries, _ := value.([]any)
	for _, entry := range entries {
		raw := entry
		if object, ok := entry.(map[string]any); ok {
			raw = object["actor_id"]
		}
		text, ok := raw.(string)
		if !ok {
			continue
		}
		label, err := ValidateActorLabel(text)
		if err != nil || label == "" {
			continue
		}
		seen := false
		for _, l := range labels {
			seen = seen || l == label
		}
		if !seen {
			labels = append(labels, label)
		}
	}
	return labels
}

// EnvelopeFromDispatch parses an HTTP dispatch (§2.2): the JSON body (a
// decoded map[string]any, or its raw []byte / string) plus the request
// headers. Body fields win; the ids, the jti and the proxy URL fall back to
// the X-Pipelines-* headers and the legacy pwsa names; the run token comes
// from X-Pipelines-Run-Token. An *EnvelopeError names what is missing and
// where it was looked for, and never shows the run token.
func EnvelopeFromDispatch(body any, headers http.Header) (*Envelope, error) {
	switch raw := body.(type) {
	case []byte:
		return envelopeFromText(raw, headers)
	case string:
		return envelopeFromText([]byte(raw), headers)
	}
	object, ok := body.(map[string]any)
	if !ok {
		return nil, &EnvelopeError{fmt.Sprintf("dispatch body must be a JSON object, got %s", jsonType(body))}
	}
	if headers == nil {
		headers = http.Header{}
	}

	url, where := "", ""
	for _, field := range []string{FieldProxyURL, FieldProxyURLLegacy} {
		if text, ok := object[field].(string); ok && url == "" && strings.TrimSpace(text) != "" {
			url, where = text, fmt.Sprintf("body field '%s'", field)
		}
	}
	for _, name := range []string{HeaderProxyURL, HeaderProxyURLLegacy} {
		if value := headerValue(headers, name); url == "" && value != "" {
			url, where = value, "header "+name
		}
	}
	token := headerValue(headers, HeaderRunToken)
	var missing []string
	if url == "" {
		missing = append(missing, fmt.Sprintf("proxy URL (looked for body field '%s', legacy '%s', and headers %s, legacy %s)",
			FieldProxyURL, FieldProxyURLLegacy, HeaderProxyURL, HeaderProxyURLLegacy))
	}
	if token == "" {
		missing = append(missing, fmt.Sprintf("run token (looked for header %s)", HeaderRunToken))
	}
	if len(missing) > 0 {
		return nil, &EnvelopeError{"dispatch is missing " + strings.Join(missing, " and ")}
	}
	proxyURL, err := CheckProxyURL(url, where)
	if err != nil {
		return nil, err
	}
	if token, err = checkRunToken(token, "header "+HeaderRunToken); err != nil {
		return nil, err
	}

	task, _ := object["input"].(map[string]any)
	if task == nil {
		task = map[string]any{}
	}
	env := &Envelope{
		ProxyURL:    proxyURL,
		RunToken:    token,
		RunID:       firstID(object["run_id"], headerValue(headers, HeaderRunID)),
		TaskID:      firstID(object["task_id"], task["task_id"], headerValue(headers, HeaderTaskID)),
		AgentID:     firstID(object["agent_id"]),
		RunTokenJTI: headerValue(headers, HeaderRunTokenJTI),
		TaskInput:   map[string]any{},
		SessionID:   nativeID(task["session_id"]),
		TurnID:      task["turn_id"],
		SubAgents:   subAgentCatalog(object["sub_agents"]),
		APIURL:      regexp.MustCompile(`^[^:]+://[^/]*`).FindString(proxyURL),
		Raw:         object,
	}
	if jti, ok := object["run_token_jti"].(string); ok && strings.TrimSpace(jti) != "" {
		env.RunTokenJTI = strings.TrimSpace(jti)
	}
	if text, ok := task["user_instruction"].(string); ok {
		env.UserInstruction = text
	}
	if input, ok := task["input"].(map[string]any); ok {
		env.TaskInput = input
	}
	if text, ok := task["latest_user_prompt"].(string); ok {
		env.LatestUserPrompt = &text
	}
	env.Messages, _ = task["messages"].([]any)
	env.ScenarioState, _ = task["scenario_state"].(map[string]any)
	env.Workspace, _ = task["workspace"].(map[string]any)
	env.ToolsSchema, _ = object["tools_schema"].([]any)
	return env, nil
}

func envelopeFromText(raw []byte, headers http.Header) (*Envelope, error) {
	body, err := decodeJSON(raw)
	if err != nil {
		return nil, &EnvelopeError{"dispatch body is not valid JSON: " + short(err.Error(), 200)}
	}
	return EnvelopeFromDispatch(body, headers)
}

// ---------------------------------------------------------------------------
// The request context: each dispatch carries its own envelope (§2.3 step 6)
// ---------------------------------------------------------------------------

type dispatchKey struct{}
type actorKey struct{}
type clientKey struct{}

// dispatchState is one dispatch's: its envelope, whether it overran its run
// timeout (its later proxy calls are then refused), and its proxy call count.
type dispatchState struct {
	envelope   *Envelope
	cancelled  atomic.Bool
	proxyCalls atomic.Int64
}

// WithEnvelope returns a context carrying env: Call, Trace and PostHandoff
// under it use this run's proxy URL and run token. Concurrent dispatches each
// have their own context, so they never see each other's envelope.
func WithEnvelope(ctx context.Context, env *Envelope) context.Context {
	return context.WithValue(ctx, dispatchKey{}, &dispatchState{envelope: env})
}

// EnvelopeFrom returns the envelope carried by ctx, if any.
func EnvelopeFrom(ctx context.Context) (*Envelope, bool) {
	state := stateFrom(ctx)
	if state == nil {
		return nil, false
	}
	return state.envelope, true
}

func stateFrom(ctx context.Context) *dispatchState {
	state, _ := ctx.Value(dispatchKey{}).(*dispatchState)
	if state == nil || state.envelope == nil {
		return nil
	}
	return state
}

func envelopeOrError(ctx context.Context) (*Envelope, *dispatchState, error) {
	state := stateFrom(ctx)
	if state == nil {
		return nil, nil, &EnvelopeError{"no dispatch envelope is bound to this context: call inside a dispatch, " +
			"or wrap the context with WithEnvelope(ctx, envelope)"}
	}
	return state.envelope, state, nil
}

// WithActor returns a context whose proxy calls and trace events are
// attributed to the sub-agent label (§3.5); "" means none. A call's own
// Actor option wins over it.
func WithActor(ctx context.Context, label string) context.Context {
	return context.WithValue(ctx, actorKey{}, label)
}

// WithClient returns a context whose package-level Call, Trace and
// PostHandoff use client instead of DefaultClient().
func WithClient(ctx context.Context, client *Client) context.Context {
	return context.WithValue(ctx, clientKey{}, client)
}

// ClientFrom is the client bound by WithClient, else DefaultClient().
func ClientFrom(ctx context.Context) *Client {
	if client, ok := ctx.Value(clientKey{}).(*Client); ok && client != nil {
		return client
	}
	return DefaultClient()
}

// IsMultiTurn reports whether the dispatch is a turn of a multi-turn run: its
// input carries session_id or turn_id (§2.2 multi-turn-fields).
func (e *Envelope) IsMultiTurn() bool {
	return e.SessionID != nil || e.TurnID != nil
}
