// Package pipelinesport is the Pipelines agent wire contract in Go: the
// reference Go port of pipelines_port.py, standard library only. Its module
// path is example.com/pipelines-port/go, required with a replace directive
// that points at a checkout (README.md says why):
//
//	import pp "example.com/pipelines-port/go"
//
// An agent is an AgentFunc; NewDispatchHandler serves it as an http.Handler,
// which Serve and ListenAndServe run with a graceful shutdown, or which mounts
// under a prefix in any router with http.StripPrefix. Inside a dispatch, Call,
// Trace and PostHandoff reach the run's proxy with the run's token.
//
// Section numbers in comments (§2, §3.3, ...) point into CONTRACT.md at the
// root of the repository; rule ids (auth-first, idempotency-key-reuse, ...)
// are the contract's. The package reads in the order a request flows:
//
//	pipelinesport.go  constants, errors, small helpers
//	envelope.go       the dispatch envelope (§2.2) and the request context
//	inbound.go        auth and ping (§2.3 steps 1 and 3)
//	client.go         the proxy client: requests, replies, retries (§3.1-§3.3),
//	                  trace events and handoffs (§3.4), actor labels (§3.5)
//	response.go       the response envelope (§4)
//	server.go         the dispatch handler and server (§2.3)
//
// JSON values are handled as encoding/json decodes them with UseNumber:
// map[string]any, []any, string, json.Number, bool and nil, so an id keeps its
// JSON type (17 stays a number, "17" a string) and big numbers keep every digit.
//
// The run token is a secret (§2.1 run-token-secret): it never appears in a log
// line, an error message, a response body or the printed form of an Envelope.
package pipelinesport

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net/http"
	"os"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"
)

// Version is the port's version, reported by GET /healthz.
const Version = "0.1.0"

// §2.1 inbound headers, as the platform spells them (looked up case-insensitively).
const (
	HeaderRunToken       = "X-Pipelines-Run-Token"
	HeaderProxyURL       = "X-Pipelines-Odyssey-Proxy-Url"
	HeaderProxyURLLegacy = "X-Pipelines-Pwsa-Proxy-Url"
	HeaderRunID          = "X-Pipelines-Run-Id"
	HeaderTaskID         = "X-Pipelines-Task-Id"
	HeaderRunTokenJTI    = "X-Pipelines-Run-Token-Jti"
	// HeaderActorID attributes an outbound proxy call to a sub-agent (§3.5).
	HeaderActorID = "X-Pipelines-Actor-Id"
)

// §2.2 body fields naming the proxy URL.
const (
	FieldProxyURL       = "odyssey_proxy_url"
	FieldProxyURLLegacy = "pwsa_proxy_url"
)

// §3.1 caps.
const (
	MaxRequestBytes = 1 << 20
	MaxReplyBytes   = 1 << 20
)

// Trace event types reserved by the platform (§3.4 trace-event-types).
const (
	TraceAssistantMessage = "assistant_message"
	TraceThinking         = "thinking"
	TraceSystemPrompt     = "system_prompt"
	TraceCustom           = "custom"
	TraceLLMPayload       = "llm_payload"
	TraceHandoff          = "handoff"
	TraceSubagentMessage  = "subagent_message"
	TraceSubagentFinal    = "subagent_final"
)

// TraceEventTypes lists the reserved trace event types in order.
var TraceEventTypes = []string{
	TraceAssistantMessage, TraceThinking, TraceSystemPrompt, TraceCustom,
	TraceLLMPayload, TraceHandoff, TraceSubagentMessage, TraceSubagentFinal,
}

// §3.3 error classes.
var (
	transient503Classes = map[string]bool{"lock_contention": true, "context_store_unavailable": true, "trace_sequence_contended": true}
	staleTokenClasses   = map[string]bool{"run_token_expired": true, "run_token_invalid": true, "run_token_rejected": true}
)

// Dispatch server defaults (§2, §7.1, §7.3).
const (
	DefaultDispatchPath = "/dispatch"
	DefaultTokenEnv     = "AGENT_TOKEN"
	DefaultMaxBodyBytes = 8 << 20
	DefaultRunTimeout   = 300 * time.Second
	MaxRunTimeout       = 1800 * time.Second
	detailLimit         = 500
	probeTool           = "__reachability_probe__"
	redacted            = "[redacted]"
	userAgent           = "pipelines-port-go/" + Version
)

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// EnvelopeError says a dispatch envelope is missing or malformed, or none is
// bound to the context (§2.2, §2.3 step 5). Answered 400 by the dispatch handler.
type EnvelopeError struct{ Message string }

// Error is the message.
func (e *EnvelopeError) Error() string { return e.Message }

// HTTPStatus is 400.
func (e *EnvelopeError) HTTPStatus() int { return http.StatusBadRequest }

// ProxyError says a tool call or trace post failed with a terminal reply (§3.3).
// StatusCode is the HTTP status (0: no reply arrived, or nothing was sent),
// ErrorClass the platform's machine-readable class ("" when none), Body the
// parsed reply (its first 200 characters when not JSON), scrubbed of the run
// token. The message never contains the run token.
type ProxyError struct {
	Message    string
	StatusCode int
	ErrorClass string
	Body       any
	ToolName   string
}

// Error is the message.
func (e *ProxyError) Error() string { return e.Message }

// Proxy returns the error's common fields; every proxy error kind has it.
func (e *ProxyError) Proxy() *ProxyError { return e }

// Kind names the error as the conformance agent reports it: "proxy".
func (e *ProxyError) Kind() string { return "proxy" }

// Value is the failure as an {"error": ...} tool result a model can read (§7.4 kit-errors-return).
func (e *ProxyError) Value() map[string]any {
	value := map[string]any{"error": e.Message}
	if e.ErrorClass != "" {
		value["error_class"] = e.ErrorClass
	}
	if e.StatusCode != 0 {
		value["status_code"] = e.StatusCode
	}
	return value
}

// StaleRunTokenError says the proxy refused the run token as expired, invalid or
// revoked (401 run_token_expired / _invalid / _rejected): the run is over and
// nothing is retried (§3.3 stale-token-distinct).
type StaleRunTokenError struct{ ProxyError }

// Kind is "stale_run_token".
func (e *StaleRunTokenError) Kind() string { return "stale_run_token" }

// ProxyTransportError says no usable reply arrived (timeout, refused or reset
// connection, TLS or DNS failure), after the transport retries.
type ProxyTransportError struct{ ProxyError }

// Kind is "transport".
func (e *ProxyTransportError) Kind() string { return "transport" }

// ProxyRequestError says a call was refused locally, before anything was sent: a bad tool
// name, arguments, size, actor label or trace event type.
type ProxyRequestError struct{ ProxyError }

// Kind is "request".
func (e *ProxyRequestError) Kind() string { return "request" }

// ProxyFailure is implemented by every proxy error kind: *ProxyError,
// *StaleRunTokenError, *ProxyTransportError and *ProxyRequestError. Use it
// with errors.As to catch any of them.
type ProxyFailure interface {
	error
	Proxy() *ProxyError
	Kind() string
}

// ResponseError says what the agent returned cannot become a response
// envelope (§4); Problems lists each problem, with its JSON path. Answered 500.
type ResponseError struct{ Problems []string }

// Error is the message.
func (e *ResponseError) Error() string { return strings.Join(e.Problems, "; ") }

// HTTPStatus is 500.
func (e *ResponseError) HTTPStatus() int { return http.StatusInternalServerError }

// RunTimeoutError says the agent overran its run timeout (§2.3 step 7). Answered 504.
type RunTimeoutError struct{ Limit time.Duration }

// Error is the message.
func (e *RunTimeoutError) Error() string {
	return fmt.Sprintf("agent did not finish within run_timeout_s=%s s", formatSeconds(e.Limit))
}

// HTTPStatus is 504.
func (e *RunTimeoutError) HTTPStatus() int { return http.StatusGatewayTimeout }

// HTTPError is a refusal of the dispatch server itself (§7.1 kit-error-statuses):
// 400 (body not JSON or not an object), 401, 404, 405, 411, 413, 503.
type HTTPError struct {
	Status int
	Detail string
	Header http.Header // extra reply headers (Allow, WWW-Authenticate, Connection)
}

// Error is the message.
func (e *HTTPError) Error() string { return e.Detail }

// HTTPStatus is the error's status.
func (e *HTTPError) HTTPStatus() int { return e.Status }

// PanicError is an agent's panic, recovered by the dispatch handler.
type PanicError struct {
	Value any
	Stack []byte
}

// Error is the message.
func (e *PanicError) Error() string { return fmt.Sprint(e.Value) }

// StatusOf maps an error to the HTTP status the dispatch handler answers with:
// the error's own HTTPStatus when it has one (EnvelopeError 400, ResponseError
// 500, RunTimeoutError 504, HTTPError its status), else 500 (the agent failed).
func StatusOf(err error) int {
	var withStatus interface{ HTTPStatus() int }
	if errors.As(err, &withStatus) {
		return withStatus.HTTPStatus()
	}
	return http.StatusInternalServerError
}

func formatSeconds(d time.Duration) string {
	return strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.3f", d.Seconds()), "0"), ".")
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

// decodeJSON parses one JSON document with numbers as json.Number; trailing data is an error.
func decodeJSON(data []byte) (any, error) {
	if !utf8.Valid(data) {
		return nil, errors.New("not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var value any
	if err := dec.Decode(&value); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("invalid character after the top-level value")
	}
	return value, nil
}

// compactJSON is the compact JSON text of a value, without HTML escaping.
func compactJSON(value any) (string, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(value); err != nil {
		return "", err
	}
	return strings.TrimSuffix(buf.String(), "\n"), nil
}

// CompactJSON is the compact JSON text of a JSON value (no HTML escaping), or
// its fmt text when it cannot be encoded.
func CompactJSON(value any) string {
	text, err := compactJSON(value)
	if err != nil {
		return fmt.Sprint(value)
	}
	return text
}

func isObject(value any) bool {
	_, ok := value.(map[string]any)
	return ok
}

// jsonType names a JSON value's type for a message: "an object", "a number", ...
func jsonType(value any) string {
	switch v := value.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case string:
		return "a string"
	case json.Number, float64, float32, int, int64, int32, int16, int8, uint, uint64, uint32, uint16, uint8:
		return "a number"
	case []any:
		return "an array"
	case map[string]any:
		return "an object"
	default:
		rv := reflect.ValueOf(v)
		switch rv.Kind() {
		case reflect.Slice, reflect.Array:
			return "an array"
		case reflect.Map, reflect.Struct:
			return "an object"
		}
		return fmt.Sprintf("%T", v)
	}
}

// short is at most limit characters of text, with an ellipsis when cut.
func short(text string, limit int) string {
	if utf8.RuneCountInString(text) <= limit {
		return text
	}
	runes := []rune(text)
	return string(runes[:limit]) + "…"
}

// quoted is a value as it may appear in a message: JSON-quoted, shortened.
func quoted(value any, limit int) any {
	if s, ok := value.(string); ok {
		return CompactJSON(short(s, limit))
	}
	return CompactJSON(value)
}

// redactString replaces every occurrence of each non-empty secret.
func redactString(text string, secrets ...string) string {
	for _, secret := range secrets {
		if secret != "" {
			text = strings.ReplaceAll(text, secret, redacted)
		}
	}
	return text
}

// redactValue replaces the secrets in every string of a JSON value, keys included.
func redactValue(value any, secrets ...string) any {
	switch v := value.(type) {
	case string:
		return redactString(v, secrets...)
	case []any:
		out := make([]any, len(v))
		for i, item := range v {
			out[i] = redactValue(item, secrets...)
		}
		return out
	case map[string]any:
		out := make(map[string]any, len(v))
		for key, item := range v {
			out[redactString(key, secrets...)] = redactValue(item, secrets...)
		}
		return out
	}
	return value
}

// number reads a JSON or Go number as a float64; integral says whether it is a whole number.
func number(value any) (f float64, integral bool, ok bool) {
	switch v := value.(type) {
	case json.Number:
		if i, err := v.Int64(); err == nil {
			return float64(i), true, true
		}
		x, err := v.Float64()
		if err != nil {
			return 0, false, false
		}
		return x, !strings.ContainsAny(string(v), ".eE") && !math.IsInf(x, 0), true
	case float64:
		return v, v == math.Trunc(v) && !math.IsInf(v, 0), !math.IsNaN(v)
	case float32:
		return float64(v), float64(v) == math.Trunc(float64(v)) && !math.IsInf(float64(v), 0), !math.IsNaN(float64(v))
	case int, int64, int32, int16, int8, uint, uint64, uint32, uint16, uint8:
		return float64(reflect.ValueOf(v).Convert(reflect.TypeOf(float64(0))).Float()), true, true
	}
	return 0, false, false
}

var logger = log.New(os.Stderr, "", 0)

// SetLogOutput sends the port's log lines (stderr by default) to w.
func SetLogOutput(w io.Writer) { logger.SetOutput(w) }

// logf writes one line to stderr; callers never pass a secret. Line breaks are folded.
func logf(level, format string, args ...any) {
	message := strings.NewReplacer("\r", " ", "\n", " | ").Replace(fmt.Sprintf(format, args...))
	logger.Printf("%s %s pipelines_port: %s", time.Now().UTC().Format("2006-01-02T15:04:05.000Z"), strings.ToUpper(level), message)
}
