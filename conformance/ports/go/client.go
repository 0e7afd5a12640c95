package pipelinesport

// The proxy client (§3): request validation and encoding (§3.1), reading a
// reply (§3.2), the retry policy (§3.3), trace events and handoffs (§3.4),
// actor labels (§3.5) and the reachability probe (§3.7).

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	mathrand "math/rand"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"
)

// ---------------------------------------------------------------------------
// §3.1 tool names, §3.5 actor labels
// ---------------------------------------------------------------------------

var (
	toolNamePattern     = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_-]{0,127}$`)
	actorSegmentPattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]{1,64}$`)
)

const (
	actorMaxSegments = 8
	actorMaxLength   = 256
)

// ValidateToolName returns name when it is a string matching
// ^[A-Za-z_][A-Za-z0-9_-]{0,127}$ (§3.1 tool-name-pattern); anything else is a
// *ProxyRequestError. It takes any JSON value, so a script's non-string name
// is refused the same way.
func ValidateToolName(name any) (string, error) {
	text, ok := name.(string)
	if !ok || !toolNamePattern.MatchString(text) {
		return "", &ProxyRequestError{ProxyError{
			Message:  fmt.Sprintf("invalid tool name %s: must match ^[A-Za-z_][A-Za-z0-9_-]{0,127}$", quoted(name, 80)),
			ToolName: text,
		}}
	}
	return text, nil
}

// ValidateActorLabel returns the normalised actor label (§3.5), "" for none:
// nil or a blank string. A label is trimmed and has at most 8 "/"-separated
// segments of 1 to 64 characters from [A-Za-z0-9_.:-], at most 256 characters
// in all; anything else (a non-string included) is a *ProxyRequestError with
// ErrorClass "actor_id_invalid".
func ValidateActorLabel(label any) (string, error) {
	invalid := func(problem string) error {
		return &ProxyRequestError{ProxyError{Message: problem, ErrorClass: "actor_id_invalid"}}
	}
	if label == nil {
		return "", nil
	}
	text, ok := label.(string)
	if !ok {
		return "", invalid("actor label must be a string, got " + jsonType(label))
	}
	text = strings.TrimSpace(text)
	if text == "" {
		return "", nil
	}
	segments := strings.Split(text, "/")
	problem := ""
	if n := utf8.RuneCountInString(text); n > actorMaxLength {
		problem = fmt.Sprintf("is %d characters long (at most %d)", n, actorMaxLength)
	} else if len(segments) > actorMaxSegments {
		problem = fmt.Sprintf("has %d segments (at most %d)", len(segments), actorMaxSegments)
	} else {
		for _, segment := range segments {
			if !actorSegmentPattern.MatchString(segment) {
				problem = fmt.Sprintf("has segment %s: each segment is 1-64 characters from [A-Za-z0-9_.:-]", quoted(segment, 80))
				break
			}
		}
	}
	if problem != "" {
		return "", invalid(fmt.Sprintf("invalid actor label %s: %s", quoted(text, 80), problem))
	}
	return text, nil
}

// ---------------------------------------------------------------------------
// §3.2, §3.3 reading a reply
// ---------------------------------------------------------------------------

var retryAfterNumber = regexp.MustCompile(`^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$`)

// ParseRetryAfter reads a Retry-After header value: delta-seconds or an HTTP
// date (a date in the past waits 0). It returns nil when the value is absent
// or unreadable (§7.4 kit-retry-after-cap).
func ParseRetryAfter(value string, now time.Time) *time.Duration {
	value = strings.TrimSpace(value)
	if value == "" {
		return nil
	}
	var seconds float64
	if retryAfterNumber.MatchString(value) {
		seconds, _ = strconv.ParseFloat(value, 64)
	} else {
		when, err := http.ParseTime(value)
		if err != nil {
			return nil
		}
		seconds = when.Sub(now).Seconds()
	}
	if math.IsNaN(seconds) {
		return nil
	}
	wait := time.Duration(math.Max(0, math.Min(seconds, 1e6)) * float64(time.Second))
	return &wait
}

func truthy(value any) bool {
	switch v := value.(type) {
	case nil:
		return false
	case string:
		return v != ""
	case bool:
		return v
	case json.Number:
		f, _, _ := number(v)
		return f != 0
	}
	return true
}

// errorFields finds error_class and the message in the three error body
// shapes of §3.3: {"detail": {"error_class", "message"}}, {"detail": "text"}
// and {"error_class", "message"} at the top level.
func errorFields(body any) (errorClass, message string, hasMessage bool) {
	object, ok := body.(map[string]any)
	if !ok {
		return "", "", false
	}
	detail, hasDetail := object["detail"]
	if inner, ok := detail.(map[string]any); ok {
		errorClass, _ = inner["error_class"].(string)
		text := inner["message"]
		if !truthy(text) {
			text = inner["detail"]
		}
		message, hasMessage = text.(string)
		return errorClass, message, hasMessage
	}
	errorClass, _ = object["error_class"].(string)
	if text, ok := detail.(string); ok {
		return errorClass, text, true
	}
	text := object["message"]
	if !truthy(text) {
		text = object["error"]
	}
	if hasDetail && detail != nil && text == nil {
		encoded := CompactJSON(detail)
		if len(encoded) > 200 {
			encoded = string([]rune(encoded)[:200])
		}
		text = encoded
	}
	message, hasMessage = text.(string)
	return errorClass, message, hasMessage
}

// decodeBody is the JSON value of a reply body, or its text when it is not JSON (isJSON false).
func decodeBody(data []byte) (value any, isJSON bool) {
	if len(data) == 0 {
		return nil, false
	}
	if value, err := decodeJSON(data); err == nil {
		return value, true
	}
	return strings.ToValidUTF8(string(data), "\uFFFD"), false
}

// ReplyKind says what a proxy reply means.
type ReplyKind int

// The three meanings of a reply.
const (
	ReplyValue ReplyKind = iota // a success: Value is what the call returns
	ReplyRetry                  // 429 or a transient 503: retry after RetryAfter, else a backoff
	ReplyError                  // a terminal error: Err
)

// Reply is what one proxy reply means (§3.2, §3.3), as InterpretReply reads it.
type Reply struct {
	Kind       ReplyKind
	Value      any
	Err        error          // a *ProxyError or *StaleRunTokenError (the error a retry reply ends with, too)
	RetryAfter *time.Duration // the reply's Retry-After, nil when none
}

// InterpretReply reads one proxy reply, with no I/O (§3.2, §3.3).
//
// A 2xx gives the unwrapped "response" (a legacy body without it whole,
// non-JSON text as the string, an empty body nil, never decoded twice).
// 429 and the transient 503 classes ask for a retry. A 401 with a stale-token
// class is a *StaleRunTokenError; anything else a *ProxyError. The run token
// is scrubbed from the error's message and body.
func InterpretReply(status int, header http.Header, body []byte, toolName, runToken string) Reply {
	value, isJSON := decodeBody(body)
	if status >= 200 && status < 300 {
		if object, ok := value.(map[string]any); ok && isJSON {
			if response, has := object["response"]; has {
				return Reply{Kind: ReplyValue, Value: response}
			}
		}
		return Reply{Kind: ReplyValue, Value: value}
	}
	value = redactValue(value, runToken) // an error body is kept and shown: scrub the token from it
	var errorClass, message string
	hasMessage := false
	if isJSON {
		errorClass, message, hasMessage = errorFields(value)
	}
	if !hasMessage {
		switch v := value.(type) {
		case string:
			message = short(v, 200)
		case nil:
			message = ""
		default:
			message = short(CompactJSON(v), 200)
		}
	}
	text := fmt.Sprintf("proxy call %s failed: HTTP %d", quoted(toolName, 80), status)
	if errorClass != "" {
		text += " " + errorClass
	}
	if message != "" {
		text += ": " + message
	}
	kept := value
	if s, ok := value.(string); ok && !isJSON {
		kept = short(s, 200)
	}
	failure := ProxyError{Message: text, StatusCode: status, ErrorClass: errorClass, Body: kept, ToolName: toolName}
	retryAfter := ParseRetryAfter(header.Get("Retry-After"), time.Now())
	if status == http.StatusTooManyRequests || (status == http.StatusServiceUnavailable && transient503Classes[errorClass]) {
		return Reply{Kind: ReplyRetry, Err: &failure, RetryAfter: retryAfter}
	}
	if status == http.StatusUnauthorized && staleTokenClasses[errorClass] {
		failure.Message += " (the run is over)"
		return Reply{Kind: ReplyError, Err: &StaleRunTokenError{failure}}
	}
	return Reply{Kind: ReplyError, Err: &failure}
}

// ---------------------------------------------------------------------------
// §3.3 the retry policy
// ---------------------------------------------------------------------------

// RetryPolicy is the one retry policy of tool calls and trace posts (§3.3, §7.4).
type RetryPolicy struct {
	MaxAttempts      int           // attempts in all for 429 and transient 503s, the first included
	BaseDelay        time.Duration // the first backoff; doubles on each retry
	MaxDelay         time.Duration // each computed wait is capped here
	Jitter           float64       // ±25 %: waits are spread
	MaxRetryAfter    time.Duration // a Retry-After replaces the computed wait; a longer one fails the call at once
	TransportRetries int           // retries of timeouts and refused or reset connections (same Idempotency-Key)
}

// DefaultRetryPolicy is the platform SDK's: 4 attempts, 0.5 s × 2ⁿ ±25 %
// capped at 4 s, Retry-After honoured up to 60 s (longer: no retry), 2 transport retries.
var DefaultRetryPolicy = RetryPolicy{
	MaxAttempts:      4,
	BaseDelay:        500 * time.Millisecond,
	MaxDelay:         4 * time.Second,
	Jitter:           0.25,
	MaxRetryAfter:    60 * time.Second,
	TransportRetries: 2,
}

var jitterSource = struct {
	sync.Mutex
	*mathrand.Rand
}{Rand: mathrand.New(mathrand.NewSource(time.Now().UnixNano()))}

func jitterFactor() float64 {
	jitterSource.Lock()
	defer jitterSource.Unlock()
	return jitterSource.Float64()
}

// Settle is a reply as the policy takes it (§7.4 kit-retry-after-cap): a retry
// whose Retry-After is longer than MaxRetryAfter is not waited but fails at
// once, its message naming the wait the proxy asked for.
func (p RetryPolicy) Settle(r Reply) Reply {
	if r.Kind != ReplyRetry || r.RetryAfter == nil || *r.RetryAfter <= p.MaxRetryAfter {
		return r
	}
	failure := ProxyError{Message: fmt.Sprint(r.Err)}
	if asked, ok := r.Err.(*ProxyError); ok {
		failure = *asked
	}
	failure.Message += fmt.Sprintf(" (the proxy asked to wait %s s before a retry, longer than the %s s this client waits: not retried)",
		strconv.FormatFloat(r.RetryAfter.Seconds(), 'g', -1, 64), strconv.FormatFloat(p.MaxRetryAfter.Seconds(), 'g', -1, 64))
	return Reply{Kind: ReplyError, Err: &failure}
}

// Delay is the wait before retry number retry (1 for the first): the
// Retry-After when given (Settle fails a reply asking for more than
// MaxRetryAfter), else the exponential backoff with jitter, capped at MaxDelay.
func (p RetryPolicy) Delay(retry int, retryAfter *time.Duration) time.Duration {
	if retryAfter != nil {
		if *retryAfter > p.MaxRetryAfter {
			return p.MaxRetryAfter
		}
		return *retryAfter
	}
	wait := float64(p.BaseDelay) * math.Pow(2, float64(retry-1)) * (1 - p.Jitter + jitterFactor()*2*p.Jitter)
	return time.Duration(math.Max(0, math.Min(wait, float64(p.MaxDelay))))
}

// ---------------------------------------------------------------------------
// §3.1 rate limit: client-side pacing
// ---------------------------------------------------------------------------

// RateLimitPerMinute is the proxy's limit per run token (§3.1 rate-limit);
// beyond it the proxy answers 429.
const RateLimitPerMinute = 60

// Pacer spreads a run's requests so that at most Limit of them fall in any
// Window (§7.4 kit-pacing): a sliding log of slots per run token. A caller
// over the limit is told how long to wait for its reserved slot, so a burst
// is spread out instead of collecting 429s. At most 4096 runs are remembered.
type Pacer struct {
	Limit  int
	Window time.Duration

	mu    sync.Mutex
	slots map[string][]time.Time
	order []string // runs by first use, oldest first, for forgetting
}

// NewPacer paces at most limit requests per run token in any window.
func NewPacer(limit int, window time.Duration) *Pacer {
	return &Pacer{Limit: limit, Window: window, slots: map[string][]time.Time{}}
}

// Reserve takes the next slot for key (a run token) at now and returns how
// long to wait for it.
func (p *Pacer) Reserve(key string, now time.Time) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	log, known := p.slots[key]
	if !known {
		if len(p.order) >= 4096 {
			delete(p.slots, p.order[0])
			p.order = p.order[1:]
		}
		p.order = append(p.order, key)
	}
	slot := now
	if len(log) >= p.Limit {
		if earliest := log[0].Add(p.Window); earliest.After(now) {
			slot = earliest
		}
	}
	log = append(log, slot)
	if len(log) > p.Limit {
		log = log[len(log)-p.Limit:]
	}
	p.slots[key] = log
	return slot.Sub(now)
}

// ---------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------

// Client calls the per-run proxy (§3): validation, keep-alive connections,
// pacing, retries. One client serves any number of concurrent runs; the run (proxy
// URL and run token) comes from the context (WithEnvelope). The zero value is
// not usable: build one with NewClient.
type Client struct {
	HTTP    *http.Client                                     // keep-alive transport; redirects are not followed
	Timeout time.Duration                                    // per attempt, the whole reply included (§7.4 kit-whole-reply-timeout)
	Retry   RetryPolicy                                      // DefaultRetryPolicy unless changed
	Pacer   *Pacer                                           // every attempt takes a slot; nil turns pacing off
	Sleep   func(ctx context.Context, d time.Duration) error // how retries wait; tests pass a fake
}

// NewClient returns a client with a keep-alive transport, the default retry
// policy, the timeout from PIPELINES_PROXY_TIMEOUT_S (120 s when unset;
// §3.1 generous-timeout, timeout-env) and pacing at
// PIPELINES_PROXY_RATE_PER_MINUTE requests per minute per run token (60 when
// unset; 0 turns it off).
func NewClient() *Client {
	rate := RateLimitPerMinute
	if text := strings.TrimSpace(os.Getenv("PIPELINES_PROXY_RATE_PER_MINUTE")); text != "" {
		if value, err := strconv.ParseFloat(text, 64); err == nil && value >= 0 && value < 1e6 {
			rate = int(value)
		} else {
			logf("warning", "PIPELINES_PROXY_RATE_PER_MINUTE must be a non-negative number, got %s; using %d",
				quoted(text, 40), RateLimitPerMinute)
		}
	}
	var pacer *Pacer
	if rate >= 1 {
		pacer = NewPacer(rate, time.Minute)
	}
	timeout := 120 * time.Second
	if text := strings.TrimSpace(os.Getenv("PIPELINES_PROXY_TIMEOUT_S")); text != "" {
		if seconds, err := strconv.ParseFloat(text, 64); err == nil && seconds > 0 && !math.IsInf(seconds, 0) {
			timeout = time.Duration(seconds * float64(time.Second))
		} else {
			logf("warning", "PIPELINES_PROXY_TIMEOUT_S must be a positive number of seconds, got %s; using 120", quoted(text, 40))
		}
	}
	transport := &http.Transport{
		Proxy:                 nil, // the run's proxy URL is called directly
		DialContext:           (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   64,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   15 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
	return &Client{
		HTTP: &http.Client{
			Transport:     transport,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
		Timeout: timeout,
		Retry:   DefaultRetryPolicy,
		Pacer:   pacer,
		Sleep:   sleepContext,
	}
}

func sleepContext(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

var (
	sharedClient     *Client
	sharedClientOnce sync.Once
)

// DefaultClient is the client behind the package-level Call, Trace and
// PostHandoff, made on first use.
func DefaultClient() *Client {
	sharedClientOnce.Do(func() { sharedClient = NewClient() })
	return sharedClient
}

// CloseIdleConnections closes the client's idle keep-alive connections.
func (c *Client) CloseIdleConnections() { c.HTTP.CloseIdleConnections() }

// CallOption adjusts one tool call, trace post or handoff.
type CallOption func(*callOptions)

type callOptions struct {
	actor          *string
	timeout        time.Duration
	idempotencyKey string
	errorsAsValues bool
	bestEffort     bool
}

// Actor attributes the call to a sub-agent label (§3.5), winning over the
// context's WithActor; "" sends no X-Pipelines-Actor-Id header.
func Actor(label string) CallOption { return func(o *callOptions) { o.actor = &label } }

// Timeout sets this call's per-attempt timeout.
func Timeout(d time.Duration) CallOption { return func(o *callOptions) { o.timeout = d } }

// IdempotencyKey sets the call's Idempotency-Key instead of a fresh UUID.
func IdempotencyKey(key string) CallOption { return func(o *callOptions) { o.idempotencyKey = key } }

// ErrorsAsValues turns a failed tool call into the value {"error": message,
// "error_class"?, "status_code"?} for the model instead of an error; a stale
// run token is an error all the same (§7.4 kit-errors-return).
func ErrorsAsValues() CallOption { return func(o *callOptions) { o.errorsAsValues = true } }

// BestEffort turns a failed trace post into a log line and a nil reply, so
// tracing never ends a run (§3.4 trace-best-effort).
func BestEffort() CallOption { return func(o *callOptions) { o.bestEffort = true } }

func collect(opts []CallOption) callOptions {
	var o callOptions
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// actorLabel is the validated label of a call: its Actor option, else the context's.
func actorLabel(ctx context.Context, o callOptions) (string, error) {
	if o.actor != nil {
		return ValidateActorLabel(*o.actor)
	}
	if label, ok := ctx.Value(actorKey{}).(string); ok {
		return ValidateActorLabel(label)
	}
	return "", nil
}

// encodeObject is the compact JSON of a request body: a JSON object within
// the 1 MiB cap (§3.1 args-object-body, size-caps); nil is sent as {}.
func encodeObject(name string, value any, what string) ([]byte, error) {
	refuse := func(format string, args ...any) error {
		return &ProxyRequestError{ProxyError{Message: fmt.Sprintf(format, args...), ToolName: name}}
	}
	if value == nil {
		return []byte("{}"), nil
	}
	if _, ok := value.(map[string]any); !ok && jsonType(value) != "an object" {
		return nil, refuse("%s for %s must be a JSON object, got %s", what, quoted(name, 80), jsonType(value))
	}
	text, err := compactJSON(value)
	if err != nil {
		return nil, refuse("%s for %s are not JSON-serialisable: %s", what, quoted(name, 80), short(err.Error(), 200))
	}
	if text == "null" {
		text = "{}"
	}
	if !strings.HasPrefix(text, "{") {
		return nil, refuse("%s for %s must be a JSON object, got %s", what, quoted(name, 80), jsonType(value))
	}
	if len(text) > MaxRequestBytes {
		return nil, refuse("%s for %s are %d bytes as JSON, over the %d-byte cap", what, quoted(name, 80), len(text), MaxRequestBytes)
	}
	return []byte(text), nil
}

var undeclared = struct {
	sync.Mutex
	seen map[string]bool
}{seen: map[string]bool{}}

// warnIfUndeclared logs, once per run and label, a label outside the run's
// sub_agents catalog: it is sent all the same (§3.5 actor-undeclared-allowed).
func warnIfUndeclared(env *Envelope, label string) {
	if len(env.SubAgents) == 0 {
		return
	}
	last := label[strings.LastIndex(label, "/")+1:]
	for _, declared := range env.SubAgents {
		if declared == label || declared == last {
			return
		}
	}
	key := fmt.Sprint(env.RunID, "\x00", env.RunTokenJTI, "\x00", env.ProxyURL, "\x00", label)
	undeclared.Lock()
	defer undeclared.Unlock()
	if undeclared.seen[key] {
		return
	}
	if len(undeclared.seen) >= 4096 {
		undeclared.seen = map[string]bool{}
	}
	undeclared.seen[key] = true
	logf("warning", "actor label %s is not in this run's declared sub_agents %s; the platform will show it as undeclared",
		quoted(label, 80), CompactJSON(env.SubAgents))
}

// Call posts args to {proxy_url}/tools/{name} for the run carried by ctx and
// returns the unwrapped "response" (§3.1, §3.2). args is a JSON object (a
// map or a struct); nil is sent as {}. Errors are *ProxyRequestError (refused
// before sending), *ProxyError (a terminal reply), *StaleRunTokenError,
// *ProxyTransportError, or *EnvelopeError when ctx carries no envelope.
func (c *Client) Call(ctx context.Context, name string, args any, opts ...CallOption) (any, error) {
	o := collect(opts)
	value, err := c.call(ctx, name, args, o)
	var failure ProxyFailure
	var stale *StaleRunTokenError
	if err != nil && o.errorsAsValues && errors.As(err, &failure) && !errors.As(err, &stale) {
		logf("info", "tool %s failed, returning the error to the agent: %s", quoted(name, 80), failure.Error())
		return failure.Proxy().Value(), nil
	}
	return value, err
}

func (c *Client) call(ctx context.Context, name string, args any, o callOptions) (any, error) {
	if _, err := ValidateToolName(name); err != nil {
		return nil, err
	}
	label, err := actorLabel(ctx, o)
	if err != nil {
		return nil, err
	}
	env, state, err := envelopeOrError(ctx)
	if err != nil {
		return nil, err
	}
	if label != "" {
		warnIfUndeclared(env, label)
	}
	body, err := encodeObject(name, args, "tool arguments")
	if err != nil {
		return nil, err
	}
	return c.request(ctx, env, state, "tools", name, body, label, o)
}

// Trace posts a live trace event to {proxy_url}/traces/{eventType} (§3.4) and
// returns the proxy's reply ({"accepted": true, "sequence": N}; nil for an
// empty body). eventType is one of TraceEventTypes; payload a JSON object (nil
// is {}). __occurred_at is stamped once, before the first attempt, unless the
// payload has one. With BestEffort a failure is logged and nil returned.
func (c *Client) Trace(ctx context.Context, eventType string, payload any, opts ...CallOption) (any, error) {
	o := collect(opts)
	value, err := c.trace(ctx, eventType, payload, o)
	if err != nil && o.bestEffort {
		var failure ProxyFailure
		var envErr *EnvelopeError
		if errors.As(err, &failure) || errors.As(err, &envErr) {
			logf("warning", "trace event %s not recorded: %s", quoted(eventType, 60), err.Error())
			return nil, nil
		}
	}
	return value, err
}

func (c *Client) trace(ctx context.Context, eventType string, payload any, o callOptions) (any, error) {
	reserved := false
	for _, known := range TraceEventTypes {
		reserved = reserved || known == eventType
	}
	if !reserved {
		sorted := append([]string(nil), TraceEventTypes...)
		sort.Strings(sorted)
		return nil, &ProxyRequestError{ProxyError{
			Message:  fmt.Sprintf("unknown trace event type %s: expected one of %s", quoted(eventType, 60), strings.Join(sorted, ", ")),
			ToolName: eventType,
		}}
	}
	label, err := actorLabel(ctx, o)
	if err != nil {
		return nil, err
	}
	event, err := payloadObject(eventType, payload)
	if err != nil {
		return nil, err
	}
	if _, has := event["__occurred_at"]; !has {
		event["__occurred_at"] = time.Now().UTC().Format("2006-01-02T15:04:05.000Z")
	}
	env, state, err := envelopeOrError(ctx)
	if err != nil {
		return nil, err
	}
	body, err := encodeObject(eventType, event, "trace payload")
	if err != nil {
		return nil, err
	}
	reply, err := c.request(ctx, env, state, "traces", eventType, body, label, o)
	if object, ok := reply.(map[string]any); ok && err == nil {
		return object, nil
	}
	return nil, err
}

// payloadObject is a copy of a trace payload as a JSON object.
func payloadObject(eventType string, payload any) (map[string]any, error) {
	refuse := func() error {
		return &ProxyRequestError{ProxyError{Message: "trace payload must be a JSON object, got " + jsonType(payload), ToolName: eventType}}
	}
	switch p := payload.(type) {
	case nil:
		return map[string]any{}, nil
	case map[string]any:
		event := make(map[string]any, len(p)+1)
		for key, value := range p {
			event[key] = value
		}
		return event, nil
	}
	if jsonType(payload) != "an object" {
		return nil, refuse()
	}
	text, err := compactJSON(payload)
	if err != nil {
		return nil, refuse()
	}
	value, err := decodeJSON([]byte(text))
	event, ok := value.(map[string]any)
	if err != nil || !ok {
		return nil, refuse()
	}
	return event, nil
}

// Handoff is a control transfer between sub-agents (§3.4 handoff-shape).
// Reason and PayloadPreview are optional (nil: left out).
type Handoff struct {
	From, To       string
	Reason         any
	PayloadPreview any
}

// PostHandoff posts a handoff trace event {"from_sub_agent", "to_sub_agent",
// "reason"?, "payload_preview"?}. Both labels are validated as §3.5 says; a
// self-handoff is dropped (nil, nil: nothing sent; §3.4 self-handoff-dropped).
func (c *Client) PostHandoff(ctx context.Context, h Handoff, opts ...CallOption) (any, error) {
	source, err := ValidateActorLabel(h.From)
	if err != nil {
		return nil, err
	}
	target, err := ValidateActorLabel(h.To)
	if err != nil {
		return nil, err
	}
	if source == "" || target == "" {
		return nil, &ProxyRequestError{ProxyError{Message: "a handoff needs non-empty from and to labels", ErrorClass: "actor_id_invalid"}}
	}
	if source == target {
		logf("info", "dropping self-handoff %s -> %s", quoted(source, 80), quoted(target, 80))
		return nil, nil
	}
	event := map[string]any{"from_sub_agent": source, "to_sub_agent": target}
	if h.Reason != nil {
		event["reason"] = h.Reason
	}
	if h.PayloadPreview != nil {
		event["payload_preview"] = h.PayloadPreview
	}
	return c.Trace(ctx, TraceHandoff, event, opts...)
}

// Call calls a tool through ClientFrom(ctx); see Client.Call.
func Call(ctx context.Context, name string, args any, opts ...CallOption) (any, error) {
	return ClientFrom(ctx).Call(ctx, name, args, opts...)
}

// Trace posts a live trace event through ClientFrom(ctx); see Client.Trace.
func Trace(ctx context.Context, eventType string, payload any, opts ...CallOption) (any, error) {
	return ClientFrom(ctx).Trace(ctx, eventType, payload, opts...)
}

// PostHandoff posts a handoff through ClientFrom(ctx); see Client.PostHandoff.
func PostHandoff(ctx context.Context, h Handoff, opts ...CallOption) (any, error) {
	return ClientFrom(ctx).PostHandoff(ctx, h, opts...)
}

// ---------------------------------------------------------------------------
// One logical call: the retry loop around single exchanges
// ---------------------------------------------------------------------------

func newUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand never fails on supported platforms
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// replyTooLarge: a reply over the 1 MiB cap, refused without reading it all (§7.5 kit-reply-cap).
type replyTooLarge struct{ length int64 }

func (e *replyTooLarge) Error() string {
	if e.length >= 0 {
		return fmt.Sprintf("is %d bytes, over the %d-byte cap", e.length, MaxReplyBytes)
	}
	return fmt.Sprintf("exceeds the %d-byte cap", MaxReplyBytes)
}

// readAll reads at most limit bytes; more is an error.
func readAll(r io.Reader, limit int64) ([]byte, bool, error) {
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if int64(len(data)) > limit {
		return nil, true, err
	}
	return data, false, err
}

// exchange is one HTTP attempt; reused says whether it went over a pooled connection.
func (c *Client) exchange(ctx context.Context, target string, header http.Header, body []byte, timeout time.Duration) (
	status int, replyHeader http.Header, reply []byte, reused bool, err error) {
	attempt, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) { reused = info.Reused }}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(attempt, trace), http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, false, err
	}
	req.Header = header.Clone()
	req.GetBody = nil // re-sending is this client's decision (same key, counted), not the transport's
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, nil, nil, reused, err
	}
	defer resp.Body.Close()
	if resp.ContentLength > MaxReplyBytes {
		return resp.StatusCode, resp.Header, nil, reused, &replyTooLarge{resp.ContentLength}
	}
	data, over, err := readAll(resp.Body, MaxReplyBytes)
	if over {
		return resp.StatusCode, resp.Header, nil, reused, &replyTooLarge{-1}
	}
	if err != nil {
		return 0, nil, nil, reused, err
	}
	return resp.StatusCode, resp.Header, data, reused, nil
}

// retryableTransport: timeouts and refused, reset or dropped connections are
// retried; DNS and certificate failures are not (§7.4 kit-transport-retries).
func retryableTransport(err error) bool {
	var dnsErr *net.DNSError
	var unknownAuthority x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	var record tls.RecordHeaderError
	return !(errors.As(err, &dnsErr) || errors.As(err, &unknownAuthority) || errors.As(err, &hostname) ||
		errors.As(err, &invalid) || errors.As(err, &record))
}

// staleConnection: a pooled keep-alive connection the server had closed while idle.
func staleConnection(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || strings.Contains(err.Error(), "server closed idle connection")
}

// describeTransport is a transport failure's text without the request URL.
func describeTransport(err error) string {
	var urlErr *url.Error
	if errors.As(err, &urlErr) {
		err = urlErr.Err
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "timed out"
	}
	return err.Error()
}

func (c *Client) request(ctx context.Context, env *Envelope, state *dispatchState, kind, name string, body []byte,
	label string, o callOptions) (any, error) {
	refusedLate := func() error {
		return &ProxyError{Message: fmt.Sprintf("proxy call %s refused: this dispatch overran its run timeout and was "+
			"answered already", quoted(name, 80)), ToolName: name}
	}
	if state.cancelled.Load() {
		return nil, refusedLate()
	}
	state.proxyCalls.Add(1)
	target := env.ProxyURL + "/" + kind + "/" + url.PathEscape(name)
	key := o.idempotencyKey
	if key == "" {
		key = newUUID() // one key per logical call, sent on every attempt (§3.1 idempotency-key-reuse)
	}
	header := http.Header{}
	header.Set("Content-Type", "application/json")
	header.Set("Accept", "application/json")
	header.Set("Authorization", "Bearer "+env.RunToken)
	header.Set("Idempotency-Key", key)
	header.Set("User-Agent", userAgent)
	if label != "" {
		header.Set(HeaderActorID, label)
	}
	timeout := o.timeout
	if timeout <= 0 {
		timeout = c.Timeout
	}
	policy := c.Retry
	sleep := c.Sleep
	if sleep == nil {
		sleep = sleepContext
	}

	transportFailures := 0
	for attempt := 1; ; attempt++ {
		if state.cancelled.Load() {
			return nil, refusedLate()
		}
		if c.Pacer != nil {
			if wait := c.Pacer.Reserve(env.RunToken, time.Now()); wait > 0 {
				logf("info", "pacing proxy calls under %d/min: waiting %.2f s", c.Pacer.Limit, wait.Seconds())
				if err := sleep(ctx, wait); err != nil {
					return nil, &ProxyTransportError{ProxyError{Message: fmt.Sprintf("proxy call %s not sent: %s while "+
						"waiting for a pacing slot", quoted(name, 80), describeTransport(err)), ToolName: name}}
				}
			}
			if state.cancelled.Load() {
				return nil, refusedLate()
			}
		}
		status, replyHeader, reply, reused, err := c.exchange(ctx, target, header, body, timeout)
		if err != nil {
			var tooLarge *replyTooLarge
			if errors.As(err, &tooLarge) {
				return nil, &ProxyError{Message: fmt.Sprintf("proxy reply to %s %s", quoted(name, 80), tooLarge.Error()),
					StatusCode: status, ToolName: name}
			}
			failure := &ProxyTransportError{ProxyError{Message: fmt.Sprintf("proxy call %s failed before a reply arrived: %s",
				quoted(name, 80), short(redactString(describeTransport(err), env.RunToken), 200)), ToolName: name}}
			transportFailures++
			if ctx.Err() != nil || !retryableTransport(err) || transportFailures > policy.TransportRetries {
				return nil, failure
			}
			wait := policy.Delay(transportFailures, nil)
			if reused && staleConnection(err) {
				wait = 0 // the pool handed out a connection the proxy had closed: re-send at once
			}
			logf("warning", "%s; retrying in %.2f s", failure.Message, wait.Seconds())
			if sleep(ctx, wait) != nil {
				return nil, failure
			}
			continue
		}
		outcome := policy.Settle(InterpretReply(status, replyHeader, reply, name, env.RunToken))
		switch {
		case outcome.Kind == ReplyValue:
			return outcome.Value, nil
		case outcome.Kind == ReplyRetry && attempt < policy.MaxAttempts:
			wait := policy.Delay(attempt, outcome.RetryAfter)
			logf("warning", "%s; retry %d in %.2f s", outcome.Err.Error(), attempt, wait.Seconds())
			if sleep(ctx, wait) != nil {
				return nil, outcome.Err
			}
			continue
		}
		return nil, outcome.Err
	}
}

// ---------------------------------------------------------------------------
// §3.7 the reachability probe
// ---------------------------------------------------------------------------

// ProbeProxy tests egress to a proxy (§3.7): it POSTs {} to
// {proxy_url}/tools/__reachability_probe__ with a fake bearer, never the run
// token. A 401 or 403 (or a 2xx) means reachable. The result is
// {"reachable", "status_code", "latency_ms", "error"}.
func ProbeProxy(ctx context.Context, proxyURL any, timeout time.Duration) map[string]any {
	started := time.Now()
	result := func(reachable bool, status any, problem any) map[string]any {
		latency := math.Round(float64(time.Since(started))/float64(time.Millisecond)*10) / 10
		return map[string]any{"reachable": reachable, "status_code": status, "latency_ms": latency, "error": problem}
	}
	base, err := CheckProxyURL(proxyURL, "the probe")
	if err != nil {
		return result(false, nil, short(err.Error(), 200))
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/tools/"+probeTool, strings.NewReader("{}"))
	if err != nil {
		return result(false, nil, short(err.Error(), 200))
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer fake-token")
	req.Header.Set("User-Agent", userAgent)
	client := &http.Client{
		Transport:     &http.Transport{Proxy: nil, DisableKeepAlives: true},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	resp, err := client.Do(req)
	if err != nil {
		return result(false, nil, short(describeTransport(err), 200))
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	status := resp.StatusCode
	if status == http.StatusUnauthorized || status == http.StatusForbidden || (status >= 200 && status < 300) {
		return result(true, status, nil)
	}
	return result(false, status, fmt.Sprintf("unexpected HTTP %d from the proxy", status))
}
