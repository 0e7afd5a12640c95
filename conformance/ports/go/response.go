package pipelinesport

// The response envelope (§4): building it from what an agent returned, and
// validating a body against §4 and its JSON Schema (§4.1).

import (
	"encoding"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"reflect"
	"sort"
	"strings"
	"unicode/utf8"
)

// ResponseEnvelope is the v1 response envelope (§4). An agent may return one
// (or a pointer to one) instead of a map.
type ResponseEnvelope struct {
	FinalResponse string         `json:"final_response"`
	Messages      []Message      `json:"messages,omitempty"`
	Metadata      map[string]any `json:"metadata,omitempty"`
}

// TurnReply is a multi-turn per-turn reply (§4.2), as BuildTurnReply builds
// it. In a multi-turn dispatch (Envelope.IsMultiTurn) it is sent as built; a
// map with "message" and "session_done" and no "final_response" is one too.
type TurnReply struct {
	Message     string         `json:"message"`
	SessionDone bool           `json:"session_done"`
	Metadata    map[string]any `json:"metadata,omitempty"`
}

// object is the reply as a generic JSON object, its metadata kept as built.
func (r TurnReply) object() map[string]any {
	object := map[string]any{"message": r.Message, "session_done": r.SessionDone}
	if r.Metadata != nil {
		object["metadata"] = r.Metadata
	}
	return object
}

// Message is one transcript message (§4 message-shape). Content is a string,
// a list of content parts, or nil (an assistant turn that only calls tools).
type Message struct {
	Role       string           `json:"role"`
	Content    any              `json:"content"`
	ToolCalls  []ToolCall       `json:"tool_calls,omitempty"`
	ToolCallID string           `json:"tool_call_id,omitempty"`
	Thinking   []map[string]any `json:"thinking,omitempty"`
}

// ToolCall is an assistant's tool call in the flat form the platform stores
// (§4 tool-call-forms): Arguments is an object or its JSON text.
type ToolCall struct {
	ID        string `json:"id,omitempty"`
	Name      string `json:"name"`
	Arguments any    `json:"arguments,omitempty"`
}

var messageRoles = []string{"system", "user", "assistant", "tool"}

const (
	finalResponseSoftLimit = 50000
	maxNesting             = 512
)

// Problem is one problem of a response body: the JSON path it concerns, what
// is wrong, and whether it is only a warning (what the platform softens or the
// renderer cannot use) rather than what the schema or the contract refuses.
type Problem struct {
	Path    string
	Message string
	Warning bool
}

// String reads "path: message", or "warning: path: message".
func (p Problem) String() string {
	if p.Warning {
		return "warning: " + p.Path + ": " + p.Message
	}
	return p.Path + ": " + p.Message
}

func hard(path, format string, args ...any) Problem {
	return Problem{Path: path, Message: fmt.Sprintf(format, args...)}
}

func soft(path, format string, args ...any) Problem {
	return Problem{Path: path, Message: fmt.Sprintf(format, args...), Warning: true}
}

// ---------------------------------------------------------------------------
// Values JSON can carry
// ---------------------------------------------------------------------------

// jsonable is a JSON-safe copy of value, as generic JSON values: maps and
// slices are copied, other Go values converted, each conversion noted with its
// path (NaN and infinities become null, []byte its text, a time its ISO text
// through MarshalJSON, a struct its JSON form, a channel or function null, or
// dropped from an object). Too deep a value is a *ResponseError.
func jsonable(value any, path string, notes *[]string, depth int) (any, error) {
	if depth > maxNesting {
		return nil, &ResponseError{[]string{path + ": nested too deeply to encode"}}
	}
	switch v := value.(type) {
	case nil, string, bool, json.Number:
		return v, nil
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			*notes = append(*notes, fmt.Sprintf("%s: %v is not JSON; sent as null", path, v))
			return nil, nil
		}
		return v, nil
	case float32:
		return jsonable(float64(v), path, notes, depth)
	case int, int8, int16, int32, int64, uint, uint8, uint16, uint32, uint64:
		return v, nil
	case []any:
		out := make([]any, len(v))
		for i, item := range v {
			converted, err := jsonable(item, fmt.Sprintf("%s[%d]", path, i), notes, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = converted
		}
		return out, nil
	case map[string]any:
		out := make(map[string]any, len(v))
		for key, item := range v {
			if unrepresentable(item) {
				*notes = append(*notes, fmt.Sprintf("%s: %T is not JSON; dropped", joinPath(path, key), item))
				continue
			}
			converted, err := jsonable(item, joinPath(path, key), notes, depth+1)
			if err != nil {
				return nil, err
			}
			out[key] = converted
		}
		return out, nil
	case []byte:
		*notes = append(*notes, fmt.Sprintf("%s: bytes are not JSON; sent as their UTF-8 text", path))
		return strings.ToValidUTF8(string(v), "\uFFFD"), nil
	case json.Marshaler, encoding.TextMarshaler:
		text, err := compactJSON(v)
		if err != nil {
			return nil, &ResponseError{[]string{fmt.Sprintf("%s: %T cannot become JSON: %v", path, v, err)}}
		}
		decoded, _ := decodeJSON([]byte(text))
		if _, plain := decoded.(map[string]any); !plain {
			*notes = append(*notes, fmt.Sprintf("%s: %T is not JSON; sent as %s", path, v, jsonType(decoded)))
		}
		return decoded, nil
	}
	rv := reflect.ValueOf(value)
	switch rv.Kind() {
	case reflect.Pointer, reflect.Interface:
		if rv.IsNil() {
			return nil, nil
		}
		return jsonable(rv.Elem().Interface(), path, notes, depth+1)
	case reflect.Slice, reflect.Array:
		if rv.Kind() == reflect.Slice && rv.IsNil() {
			return nil, nil
		}
		items := make([]any, rv.Len())
		for i := range items {
			items[i] = rv.Index(i).Interface()
		}
		return jsonable(items, path, notes, depth)
	case reflect.Map:
		if rv.IsNil() {
			return nil, nil
		}
		items := make(map[string]any, rv.Len())
		for _, key := range rv.MapKeys() {
			items[fmt.Sprint(key.Interface())] = rv.MapIndex(key).Interface()
		}
		return jsonable(items, path, notes, depth)
	case reflect.Struct:
		text, err := compactJSON(value)
		if err != nil {
			return nil, &ResponseError{[]string{fmt.Sprintf("%s: %T cannot become JSON: %v", path, value, err)}}
		}
		decoded, _ := decodeJSON([]byte(text))
		return decoded, nil
	case reflect.String:
		return rv.String(), nil
	case reflect.Bool:
		return rv.Bool(), nil
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return rv.Int(), nil
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return rv.Uint(), nil
	case reflect.Float32, reflect.Float64:
		return jsonable(rv.Float(), path, notes, depth)
	}
	*notes = append(*notes, fmt.Sprintf("%s: %T is not JSON; sent as null", path, value))
	return nil, nil
}

// unrepresentable: a channel, function or other value JSON has nothing for.
func unrepresentable(value any) bool {
	switch reflect.ValueOf(value).Kind() {
	case reflect.Chan, reflect.Func, reflect.Complex64, reflect.Complex128, reflect.UnsafePointer:
		return true
	}
	return false
}

func joinPath(prefix, key string) string {
	if prefix == "" {
		return key
	}
	return prefix + "." + key
}

// generic is value as generic JSON values, or the problem that prevents it.
func generic(value any) (any, error) {
	var notes []string
	converted, err := jsonable(value, "body", &notes, 0)
	if err != nil {
		return nil, err
	}
	if len(notes) > 0 {
		return nil, &ResponseError{notes}
	}
	return converted, nil
}

// spacedJSON is JSON text with Python's default separators (", " and ": "),
// so every port gives the same final_response for a structured value. Object
// keys come sorted (Go maps keep no order).
func spacedJSON(value any) string {
	switch v := value.(type) {
	case []any:
		parts := make([]string, len(v))
		for i, item := range v {
			parts[i] = spacedJSON(item)
		}
		return "[" + strings.Join(parts, ", ") + "]"
	case map[string]any:
		keys := make([]string, 0, len(v))
		for key := range v {
			keys = append(keys, key)
		}
		sort.Strings(keys)
		parts := make([]string, len(keys))
		for i, key := range keys {
			parts[i] = CompactJSON(key) + ": " + spacedJSON(v[key])
		}
		return "{" + strings.Join(parts, ", ") + "}"
	}
	return CompactJSON(value)
}

// ---------------------------------------------------------------------------
// Building the response
// ---------------------------------------------------------------------------

type unpacked struct {
	final              any // a string, or nil
	messages, metadata any
	extra              map[string]any
}

// finalText is a final response as a string; a structured value becomes its
// JSON text, except a non-string final_response in strict mode.
func finalText(value any, key string, strict bool) (any, error) {
	switch v := value.(type) {
	case nil:
		return nil, nil
	case string:
		return v, nil
	}
	if key == "final_response" && strict {
		return nil, &ResponseError{[]string{"final_response must be a string, got " + jsonType(value)}}
	}
	return spacedJSON(value), nil
}

// unpackResult reads what an agent returned (§7.7 kit-result-shapes): a
// string, or an object. Only an envelope-shaped object (with final_response)
// gives messages, metadata and extra top-level keys; a framework's result
// (final_output / output / message) gives its text alone.
func unpackResult(value any, strict bool) (unpacked, error) {
	switch v := value.(type) {
	case string:
		return unpacked{final: v}, nil
	case nil:
		return unpacked{}, nil
	case map[string]any:
		if final, has := v["final_response"]; has {
			text, err := finalText(final, "final_response", strict)
			if err != nil {
				return unpacked{}, err
			}
			result := unpacked{final: text, messages: v["messages"], metadata: v["metadata"], extra: map[string]any{}}
			for key, item := range v {
				if key != "final_response" && key != "messages" && key != "metadata" {
					result.extra[key] = item
				}
			}
			return result, nil
		}
		for _, key := range []string{"final_output", "output", "message"} {
			if item := v[key]; item != nil && !unrepresentable(item) {
				text, err := finalText(item, key, strict)
				return unpacked{final: text}, err
			}
		}
		return unpacked{}, nil
	}
	switch jsonType(value) {
	case "an object":
		converted, err := generic(value)
		if err != nil {
			return unpacked{}, err
		}
		if object, ok := converted.(map[string]any); ok {
			return unpackResult(object, strict)
		}
		return unpackResult(nil, strict)
	}
	return unpacked{}, &ResponseError{[]string{fmt.Sprintf("cannot build a response from %s: return a string, "+
		"an object with 'final_response', or an object with final_output / output / message", jsonType(value))}}
}

// toolCallName is a tool call's resolvable name (flat name or nested function.name), else "".
func toolCallName(call any) string {
	object, ok := call.(map[string]any)
	if !ok {
		return ""
	}
	if name, ok := object["name"].(string); ok && name != "" {
		return name
	}
	if fn, ok := object["function"].(map[string]any); ok {
		if name, ok := fn["name"].(string); ok {
			return name
		}
	}
	return ""
}

// flatToolCall rewrites the OpenAI nested form {type: "function", function: {name, arguments}} flat (§7.7 kit-flat-tool-calls).
func flatToolCall(call any) any {
	object, ok := call.(map[string]any)
	if !ok {
		return call
	}
	flat := make(map[string]any, len(object))
	fn, nested := object["function"].(map[string]any)
	_, hasName := object["name"]
	for key, value := range object {
		if nested && !hasName && (key == "function" || key == "type") {
			continue
		}
		flat[key] = value
	}
	if nested && !hasName {
		flat["name"] = fn["name"]
		if args, has := fn["arguments"]; has {
			flat["arguments"] = args
		}
	}
	return flat
}

func flatMessages(messages any) any {
	list, ok := messages.([]any)
	if !ok {
		return messages
	}
	out := make([]any, len(list))
	for i, message := range list {
		out[i] = message
		object, ok := message.(map[string]any)
		if !ok {
			continue
		}
		calls, ok := object["tool_calls"].([]any)
		if !ok {
			continue
		}
		copied := make(map[string]any, len(object))
		for key, value := range object {
			copied[key] = value
		}
		flat := make([]any, len(calls))
		for j, call := range calls {
			flat[j] = flatToolCall(call)
		}
		copied["tool_calls"] = flat
		out[i] = copied
	}
	return out
}

// asThePlatformKeeps changes body the way the platform treats what it cannot
// use (§7.7 kit-lenient-response): values JSON cannot carry converted, tool
// calls without a resolvable name dropped, and messages or metadata that still
// break the schema or the pairing rule dropped whole. final_response is never
// touched. Each change is one note.
func asThePlatformKeeps(body map[string]any) (map[string]any, []string, error) {
	var notes []string
	out := map[string]any{}
	if final, has := body["final_response"]; has { // a turn reply has none
		out["final_response"] = final
	}
	for key, value := range body {
		if key == "final_response" {
			continue
		}
		if unrepresentable(value) {
			notes = append(notes, fmt.Sprintf("%s: %T is not JSON; dropped", key, value))
			continue
		}
		converted, err := jsonable(value, key, &notes, 1)
		if err != nil {
			return nil, nil, err
		}
		out[key] = converted
	}
	if messages, ok := out["messages"].([]any); ok {
		for i, message := range messages {
			object, ok := message.(map[string]any)
			if !ok {
				continue
			}
			calls, ok := object["tool_calls"].([]any)
			if !ok {
				continue
			}
			kept := []any{}
			for j, call := range calls {
				if toolCallName(call) == "" {
					notes = append(notes, fmt.Sprintf("messages[%d].tool_calls[%d]: no resolvable tool name; dropped", i, j))
					continue
				}
				kept = append(kept, flatToolCall(call))
			}
			object["tool_calls"] = kept
		}
	}
	var ignored []Problem
	if problems := messageProblems(out["messages"], &ignored); len(problems) > 0 {
		more := ""
		if len(problems) > 1 {
			more = fmt.Sprintf(" (and %d more)", len(problems)-1)
		}
		notes = append(notes, problems[0].String()+more+"; messages dropped, as the platform drops a malformed transcript")
		delete(out, "messages")
	}
	if problems := metadataProblems(out["metadata"]); len(problems) > 0 {
		notes = append(notes, problems[0].String()+"; metadata dropped, as the platform drops it")
		delete(out, "metadata")
	}
	return out, notes, nil
}

// StrictFromEnv reports whether PIPELINES_PORT_STRICT asks for strict mode (1, true, yes, on).
func StrictFromEnv() bool {
	switch strings.ToLower(strings.TrimSpace(os.Getenv("PIPELINES_PORT_STRICT"))) {
	case "1", "true", "yes", "on":
		return true
	}
	return false
}

// BuildResponse turns what an agent returned into the v1 response envelope
// (§4): a string, a map with final_response (extra top-level keys kept), a
// ResponseEnvelope, or a framework-style map with final_output / output /
// message. Nested OpenAI tool calls become the flat form.
//
// Lenient (strict false): the body the platform would grade goes out; what it
// would drop is dropped the same way, and each change is returned as a
// warning naming its JSON path (and logged). Only a missing or empty
// final_response is a *ResponseError. Strict: every problem ValidateResponse
// reports, warnings included (but the truncation warning), is a
// *ResponseError listing them all (§7.7 kit-strict-mode).
func BuildResponse(value any, strict bool) (map[string]any, []string, error) {
	return BuildReply(value, strict, false)
}

// BuildReply is what a dispatch answers for what the agent returned: in a
// multi-turn dispatch (Envelope.IsMultiTurn) a turn reply (a TurnReply, or a
// map with message and session_done and no final_response) as built, checked
// by turnReplyBody; anything else, and a turn reply in a single-turn dispatch,
// the response envelope of BuildResponse (the turn reply's message as its
// final_response, session_done dropped with a warning). §4.2, §7.7
// kit-turn-reply-detected and kit-turn-reply-single-turn.
func BuildReply(value any, strict, multiTurn bool) (map[string]any, []string, error) {
	var notes []string
	if reply, ok := asTurnReply(value); ok {
		if multiTurn {
			return turnReplyBody(reply, strict)
		}
		envelope := map[string]any{}
		for key, item := range reply {
			switch key {
			case "message":
				envelope["final_response"] = item
			case "session_done":
			default:
				envelope[key] = item
			}
		}
		value = envelope
		notes = append(notes, "session_done: a single-turn dispatch has no session to end; the turn reply is sent "+
			"as the response envelope, its message as final_response")
	}
	found, err := unpackResult(value, strict)
	if err != nil {
		return nil, nil, err
	}
	body := map[string]any{}
	for key, item := range found.extra {
		body[key] = item
	}
	body["final_response"] = found.final
	if found.messages != nil {
		body["messages"] = flatMessages(found.messages)
	}
	if found.metadata != nil {
		body["metadata"] = found.metadata
	}
	if strict {
		converted, err := generic(body)
		if err != nil {
			return nil, nil, err
		}
		body = converted.(map[string]any)
	} else {
		var kept []string
		if body, kept, err = asThePlatformKeeps(body); err != nil {
			return nil, nil, err
		}
		notes = append(notes, kept...)
	}
	return checked(body, ValidateResponse(body), notes, strict)
}

// checked is body with its warnings (notes, then the soft problems), each
// logged; a *ResponseError for the hard problems, in strict mode for the soft
// ones too but the truncation warning (§7.7 kit-strict-mode).
func checked(body map[string]any, problems []Problem, notes []string, strict bool) (map[string]any, []string, error) {
	var errs, warnings []string
	for _, problem := range problems {
		truncation := problem.Path == "final_response" && strings.Contains(problem.Message, "truncates")
		switch {
		case !problem.Warning:
			errs = append(errs, problem.String())
		case strict && !truncation:
			errs = append(errs, problem.Path+": "+problem.Message)
		default:
			warnings = append(warnings, problem.Path+": "+problem.Message)
		}
	}
	if len(errs) > 0 {
		return nil, nil, &ResponseError{errs}
	}
	warnings = append(notes, warnings...)
	for _, warning := range warnings {
		logf("warning", "response: %s", warning)
	}
	return body, warnings, nil
}

// asTurnReply is value as a turn reply's generic object, when it is one.
func asTurnReply(value any) (map[string]any, bool) {
	var object map[string]any
	switch v := value.(type) {
	case TurnReply:
		return v.object(), true
	case *TurnReply:
		if v == nil {
			return nil, false
		}
		return v.object(), true
	case map[string]any:
		object = v
	default:
		return nil, false
	}
	_, message := object["message"]
	_, done := object["session_done"]
	_, final := object["final_response"]
	return object, message && done && !final
}

// turnReplyBody is a turn reply as it goes out, checked as an envelope is
// (§7.7 kit-turn-reply-checked). Lenient: a message that is not a string
// becomes its JSON text, a session_done that is not a boolean is sent as
// false (no hint), the rest as asThePlatformKeeps sends it, each change a
// warning; only a missing or empty message is an error. Strict: every problem
// is a *ResponseError, the soft ones too.
func turnReplyBody(reply map[string]any, strict bool) (map[string]any, []string, error) {
	body := make(map[string]any, len(reply))
	for key, item := range reply {
		body[key] = item
	}
	var notes []string
	if strict {
		converted, err := generic(body)
		if err != nil {
			return nil, nil, err
		}
		body = converted.(map[string]any)
	} else {
		if message := body["message"]; message != nil {
			if _, isString := message.(string); !isString {
				body["message"] = spacedJSON(message)
			}
		}
		if _, isBool := body["session_done"].(bool); !isBool {
			notes = append(notes, fmt.Sprintf("session_done: must be a boolean, got %s; sent as false (no hint)",
				jsonType(body["session_done"])))
			body["session_done"] = false
		}
		var kept []string
		var err error
		if body, kept, err = asThePlatformKeeps(body); err != nil {
			return nil, nil, err
		}
		notes = append(notes, kept...)
	}
	return checked(body, turnReplyProblems(body), notes, strict)
}

// turnReplyProblems lists every problem of a turn reply, worded as
// ValidateResponse words an envelope's.
func turnReplyProblems(body map[string]any) []Problem {
	var problems, warnings []Problem
	message, isString := body["message"].(string)
	switch {
	case body["message"] == nil || (isString && message == ""):
		problems = append(problems, hard("message", "required, a non-empty string (the user answers it)"))
	case !isString:
		problems = append(problems, hard("message", "must be a string, got %s", jsonType(body["message"])))
	case strings.TrimSpace(message) == "":
		warnings = append(warnings, soft("message", "blank (only whitespace): the user has nothing to answer"))
	}
	if _, isBool := body["session_done"].(bool); !isBool {
		problems = append(problems, hard("session_done", "must be a boolean, got %s", jsonType(body["session_done"])))
	}
	problems = append(problems, sharedProblems(body, &warnings)...)
	return append(problems, warnings...)
}

// BuildTurnReply builds a multi-turn per-turn reply (§4.2) and checks it as a
// strict server does: a blank message or metadata the platform cannot use is a
// *ResponseError (§7.7 kit-turn-reply-checked). sessionDone is a hint: the
// platform owns termination.
func BuildTurnReply(message string, metadata map[string]any, sessionDone bool) (TurnReply, error) {
	reply := TurnReply{Message: message, SessionDone: sessionDone, Metadata: metadata}
	if _, _, err := turnReplyBody(reply.object(), true); err != nil {
		return TurnReply{}, err
	}
	return reply, nil
}

// ---------------------------------------------------------------------------
// Validating a body
// ---------------------------------------------------------------------------

func metadataProblems(metadata any) []Problem {
	if metadata == nil || isObject(metadata) {
		return nil
	}
	return []Problem{hard("metadata", "must be an object or null, got %s (the platform drops it)", jsonType(metadata))}
}

// metadataWarnings: mistyped first-class metadata, which the schema allows and the renderer cannot use.
func metadataWarnings(metadata any) []Problem {
	object, ok := metadata.(map[string]any)
	if !ok {
		return nil
	}
	var warnings []Problem
	for _, key := range []string{"model", "system_prompt_id"} {
		if value := object[key]; value != nil {
			if _, ok := value.(string); !ok {
				warnings = append(warnings, soft("metadata."+key, "should be a string, got %s", jsonType(value)))
			}
		}
	}
	for _, key := range []string{"total_input_tokens", "total_output_tokens"} {
		if value := object[key]; value != nil {
			if f, integral, ok := number(value); !ok || !integral || f < 0 {
				warnings = append(warnings, soft("metadata."+key, "should be a non-negative integer, got %s", quoted(value, 40)))
			}
		}
	}
	if value := object["agent_runtime_ms"]; value != nil {
		if f, _, ok := number(value); !ok || math.IsInf(f, 0) || f < 0 {
			warnings = append(warnings, soft("metadata.agent_runtime_ms", "should be a non-negative number, got %s", quoted(value, 40)))
		}
	}
	return warnings
}

// toolCallProblems checks a tool call against the schema's oneOf: exactly one of the flat and the nested shape.
func toolCallProblems(call any, at string, seen map[string]bool, warnings *[]Problem) []Problem {
	object, ok := call.(map[string]any)
	if !ok {
		return []Problem{hard(at, "must be an object, got %s", jsonType(call))}
	}
	fn, fnObject := object["function"].(map[string]any)
	_, flat := object["name"].(string)
	typ, hasType := object["type"]
	fnName := false
	if fnObject {
		_, fnName = fn["name"].(string)
	}
	nested := fnObject && fnName && (!hasType || typ == "function")
	if flat && nested {
		return []Problem{hard(at, "has both 'name' and 'function': send one of the flat and the nested form")}
	}
	if !flat && !nested {
		if hasType && typ != "function" && fnObject {
			return []Problem{hard(at+".type", `must be "function" in the nested form, got %s`, quoted(typ, 40))}
		}
		return []Problem{hard(at+".name", "no resolvable tool name (neither 'name' nor 'function.name'); the platform drops it")}
	}
	var problems []Problem
	if id, has := object["id"]; has {
		if text, ok := id.(string); ok {
			seen[text] = true
		} else {
			problems = append(problems, hard(at+".id", "must be a string, got %s", jsonType(id)))
		}
	}
	args := object["arguments"]
	if !flat {
		args = fn["arguments"]
	}
	if _, isString := args.(string); args != nil && !isObject(args) && !isString {
		*warnings = append(*warnings, soft(at+".arguments", "should be an object or a JSON-encoded string, got %s", jsonType(args)))
	}
	return problems
}

// messageProblems checks messages against the schema and the pairing rule; soft problems go to warnings.
func messageProblems(messages any, warnings *[]Problem) []Problem {
	if messages == nil {
		return nil
	}
	list, ok := messages.([]any)
	if !ok {
		return []Problem{hard("messages", "must be an array or null, got %s (the platform drops it)", jsonType(messages))}
	}
	var problems []Problem
	seen := map[string]bool{}
	for i, message := range list {
		at := fmt.Sprintf("messages[%d]", i)
		object, ok := message.(map[string]any)
		if !ok {
			problems = append(problems, hard(at, "must be an object, got %s", jsonType(message)))
			continue
		}
		role, _ := object["role"].(string)
		known := false
		for _, r := range messageRoles {
			known = known || r == role
		}
		if !known {
			problems = append(problems, hard(at+".role", "must be one of %s, got %s", strings.Join(messageRoles, ", "), quoted(object["role"], 40)))
		}
		if content := object["content"]; content != nil {
			_, isString := content.(string)
			_, isList := content.([]any)
			if !isString && !isList {
				problems = append(problems, hard(at+".content", "must be a string, an array of parts or null, got %s", jsonType(content)))
			}
		}
		if calls, has := object["tool_calls"]; has {
			if list, ok := calls.([]any); !ok {
				problems = append(problems, hard(at+".tool_calls", "must be an array, got %s", jsonType(calls)))
			} else {
				if role != "assistant" && len(list) > 0 {
					*warnings = append(*warnings, soft(at+".tool_calls", "only assistant messages carry tool calls, this one is %s", quoted(object["role"], 40)))
				}
				for j, call := range list {
					problems = append(problems, toolCallProblems(call, fmt.Sprintf("%s.tool_calls[%d]", at, j), seen, warnings)...)
				}
			}
		}
		if thinking, has := object["thinking"]; has {
			if blocks, ok := thinking.([]any); !ok {
				problems = append(problems, hard(at+".thinking", "must be an array of objects, got %s", jsonType(thinking)))
			} else {
				for j, block := range blocks {
					if !isObject(block) {
						problems = append(problems, hard(fmt.Sprintf("%s.thinking[%d]", at, j), "must be an object, got %s", jsonType(block)))
					}
				}
			}
		}
		callID, hasID := object["tool_call_id"]
		text, isString := callID.(string)
		switch {
		case hasID && !isString:
			problems = append(problems, hard(at+".tool_call_id", "must be a string, got %s", jsonType(callID)))
		case role == "tool" && text == "":
			problems = append(problems, hard(at+".tool_call_id", "required on role 'tool'"))
		case role == "tool" && !seen[text]:
			problems = append(problems, hard(at+".tool_call_id", "%s does not match the id of an earlier assistant tool_calls entry", quoted(text, 60)))
		}
	}
	return problems
}

// unencodable is the first place in a value JSON cannot carry, or "".
func unencodable(value any, path string, depth int) string {
	if depth > maxNesting {
		return path + ": nested too deeply to encode"
	}
	switch v := value.(type) {
	case nil, string, bool, json.Number:
		return ""
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Sprintf("%s: %v is not JSON", path, v)
		}
		return ""
	case float32:
		return unencodable(float64(v), path, depth)
	case int, int8, int16, int32, int64, uint, uint8, uint16, uint32, uint64:
		return ""
	case []any:
		for i, item := range v {
			if found := unencodable(item, fmt.Sprintf("%s[%d]", path, i), depth+1); found != "" {
				return found
			}
		}
		return ""
	case map[string]any:
		keys := make([]string, 0, len(v))
		for key := range v {
			keys = append(keys, key)
		}
		sort.Strings(keys)
		for _, key := range keys {
			if found := unencodable(v[key], path+"."+key, depth+1); found != "" {
				return found
			}
		}
		return ""
	}
	return fmt.Sprintf("%s: %T is not a JSON type", path, value)
}

// ValidateResponse lists every problem of a response body against §4 and its
// JSON Schema (§4.1), each with its JSON path. Hard problems: what the schema
// rejects, the contract's rules (a non-empty final_response, tool_call_id
// pairing) and values JSON cannot carry. Warnings: a truncated or blank final
// response, mistyped first-class metadata, odd tool arguments, tool calls on
// a message that is not the assistant's. Empty: accepted as sent.
func ValidateResponse(body any) []Problem {
	object, ok := body.(map[string]any)
	if !ok && jsonType(body) == "an object" {
		if converted, err := generic(body); err == nil {
			object, ok = converted.(map[string]any)
		}
	}
	if !ok {
		return []Problem{hard("body", "must be a JSON object, got %s", jsonType(body))}
	}
	var problems, warnings []Problem
	final, has := object["final_response"]
	text, isString := final.(string)
	switch {
	case !has || final == nil:
		problems = append(problems, hard("final_response", "required, a non-empty string (the judge grades it)"))
	case !isString:
		problems = append(problems, hard("final_response", "must be a string, got %s", jsonType(final)))
	case text == "":
		problems = append(problems, hard("final_response", "must not be empty (the judge has nothing to grade)"))
	case strings.TrimSpace(text) == "":
		warnings = append(warnings, soft("final_response", "blank (only whitespace): the judge has nothing to grade"))
	case utf8.RuneCountInString(text) > finalResponseSoftLimit:
		warnings = append(warnings, soft("final_response", "%d characters; the platform truncates it at ~%d with a soft warning",
			utf8.RuneCountInString(text), finalResponseSoftLimit))
	}
	problems = append(problems, sharedProblems(object, &warnings)...)
	return append(problems, warnings...)
}

// sharedProblems lists the problems of what a turn reply shares with the
// envelope (messages, metadata, values JSON cannot carry); soft ones go to warnings.
func sharedProblems(object map[string]any, warnings *[]Problem) []Problem {
	problems := messageProblems(object["messages"], warnings)
	problems = append(problems, metadataProblems(object["metadata"])...)
	*warnings = append(*warnings, metadataWarnings(object["metadata"])...)
	if found := unencodable(object, "body", 0); found != "" {
		path, message, _ := strings.Cut(strings.TrimPrefix(found, "body."), ": ")
		problems = append(problems, hard(path, "%s", message))
	}
	return problems
}
