// Package conformanceagent is the conformance agent of conformance/README.md
// ("The conformance agent"), built only on the port's public functions: it
// reads the envelope, calls tools through the port's proxy client, and returns
// through the port's response builder. Nothing here talks HTTP itself.
// cmd/conformance-server serves it, and so does the chi-mounted server of
// internal/chitest.
//
//	echo mode:   final_response = {"envelope": E}, the envelope as the port parsed it
//	script mode: user_instruction is {"steps": [...]}; each step gives one result
package conformanceagent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	pp "example.com/pipelines-port/go"
)

var stepKinds = []string{"call", "parallel", "trace", "handoff", "sleep_ms", "raise", "return", "turn_reply"}

// Agent is echo mode, or script mode when user_instruction is a JSON object with a "steps" array.
func Agent(ctx context.Context, env *pp.Envelope) (any, error) {
	if steps, ok := parseScript(env.UserInstruction); ok {
		return runScript(ctx, env, steps)
	}
	return echo(env), nil
}

func parseScript(text string) ([]any, bool) {
	dec := json.NewDecoder(strings.NewReader(text))
	dec.UseNumber()
	var script map[string]any
	if err := dec.Decode(&script); err != nil || dec.More() {
		return nil, false
	}
	steps, ok := script["steps"].([]any)
	return steps, ok
}

// -- echo mode ------------------------------------------------------------------

func echo(env *pp.Envelope) map[string]any {
	digest := sha256.Sum256([]byte(env.RunToken))
	var jti, latest any
	if env.RunTokenJTI != "" {
		jti = env.RunTokenJTI
	}
	if env.LatestUserPrompt != nil {
		latest = *env.LatestUserPrompt
	}
	echoed := map[string]any{
		"proxy_url":          env.ProxyURL,
		"run_token_sha256":   hex.EncodeToString(digest[:]),
		"run_id":             env.RunID,
		"task_id":            env.TaskID,
		"agent_id":           env.AgentID,
		"run_token_jti":      jti,
		"user_instruction":   env.UserInstruction,
		"task_input":         env.TaskInput,
		"latest_user_prompt": latest,
		"session_id":         env.SessionID,
		"turn_id":            env.TurnID,
		"messages":           env.Messages,
		"scenario_state":     env.ScenarioState,
		"workspace":          env.Workspace,
		"tools_schema":       env.ToolsSchema,
		"sub_agents":         env.SubAgents,
		"api_url":            env.APIURL,
		"raw":                env.Raw,
	}
	return map[string]any{"final_response": pp.CompactJSON(map[string]any{"envelope": echoed})}
}

// -- script mode ----------------------------------------------------------------

// ScriptError names the malformed step; the port answers 500 "ScriptError: ...".
type ScriptError struct{ Message string }

func (e *ScriptError) Error() string { return e.Message }

func scriptError(format string, args ...any) error {
	return &ScriptError{fmt.Sprintf(format, args...)}
}

// stepKind is the step's kind; a *ScriptError for an unknown or malformed step.
func stepKind(step any, where string) (string, error) {
	object, _ := step.(map[string]any)
	var kinds []string
	for _, kind := range stepKinds {
		if _, has := object[kind]; has {
			kinds = append(kinds, kind)
		}
	}
	if len(kinds) != 1 {
		text := pp.CompactJSON(step)
		if len(text) > 200 {
			text = text[:200]
		}
		return "", scriptError("%s: a step is an object with exactly one of %s, got %s", where, strings.Join(stepKinds, ", "), text)
	}
	kind := kinds[0]
	required := map[string]string{"call": "args", "trace": "payload"}[kind]
	if _, has := object[required]; required != "" && !has {
		return "", scriptError(`%s: a %s step needs "%s"`, where, kind, required)
	}
	switch kind {
	case "parallel":
		calls, ok := object["parallel"].([]any)
		if !ok {
			return "", scriptError("%s.parallel: must be an array of call steps", where)
		}
		for i, call := range calls {
			inner := fmt.Sprintf("%s.parallel[%d]", where, i)
			if k, err := stepKind(call, inner); err != nil {
				return "", err
			} else if k != "call" {
				return "", scriptError("%s: not a call step", inner)
			}
		}
	case "handoff":
		handoff, ok := object["handoff"].(map[string]any)
		_, hasFrom := handoff["from"]
		_, hasTo := handoff["to"]
		if !ok || !hasFrom || !hasTo {
			return "", scriptError(`%s.handoff: must be an object with "from" and "to"`, where)
		}
	case "sleep_ms":
		if ms, ok := object["sleep_ms"].(json.Number); !ok || ms.String()[0] == '-' {
			return "", scriptError("%s.sleep_ms: must be a non-negative number", where)
		}
	case "raise":
		if _, ok := object["raise"].(string); !ok {
			return "", scriptError("%s.raise: must be a string", where)
		}
	case "turn_reply":
		spec, ok := object["turn_reply"].(map[string]any)
		_, isString := spec["message"].(string)
		metadata, hasMetadata := spec["metadata"]
		_, isObject := metadata.(map[string]any)
		done, hasDone := spec["session_done"]
		_, isBool := done.(bool)
		if !ok || !isString || (hasMetadata && metadata != nil && !isObject) || (hasDone && !isBool) {
			return "", scriptError(`%s.turn_reply: must be an object with a string "message", an object "metadata" and a boolean "session_done"`, where)
		}
	}
	return kind, nil
}

// outcome is {"ok": true, "value": V} or {"ok": false, "error": {"kind", "status_code", "error_class"}};
// an error that is not a proxy failure ends the run.
func outcome(value any, err error) (map[string]any, error) {
	if err == nil {
		return map[string]any{"ok": true, "value": value}, nil
	}
	var failure pp.ProxyFailure
	if !errors.As(err, &failure) {
		return nil, err
	}
	var status, class any
	if p := failure.Proxy(); p.StatusCode != 0 {
		status = p.StatusCode
	}
	if p := failure.Proxy(); p.ErrorClass != "" {
		class = p.ErrorClass
	}
	return map[string]any{"ok": false, "error": map[string]any{"kind": failure.Kind(), "status_code": status, "error_class": class}}, nil
}

// actorOptions is the call option of a step's "actor": none when absent or null; a non-string is refused by the port.
func actorOptions(step map[string]any) ([]pp.CallOption, error) {
	switch actor := step["actor"].(type) {
	case nil:
		return nil, nil
	case string:
		return []pp.CallOption{pp.Actor(actor)}, nil
	default:
		_, err := pp.ValidateActorLabel(actor)
		return nil, err
	}
}

// label is a handoff label; a non-string is refused by the port.
func label(value any) (string, error) {
	if text, ok := value.(string); ok {
		return text, nil
	}
	return pp.ValidateActorLabel(value)
}

func sleep(ctx context.Context, ms json.Number) error {
	f, _ := ms.Float64()
	timer := time.NewTimer(time.Duration(f * float64(time.Millisecond)))
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// shownArguments are a call's arguments as a transcript may show them (§4): an object, or the JSON text of anything else.
func shownArguments(args any) any {
	if _, ok := args.(map[string]any); ok {
		return args
	}
	return pp.CompactJSON(args)
}

// call makes one tool call; it returns its outcome and its two transcript messages.
func call(ctx context.Context, step map[string]any, id string) (map[string]any, []any, error) {
	var value any
	var err error
	if opts, actorErr := actorOptions(step); actorErr != nil {
		err = actorErr
	} else if name, ok := step["call"].(string); ok {
		value, err = pp.Call(ctx, name, step["args"], opts...)
	} else {
		_, err = pp.ValidateToolName(step["call"]) // a name that is not a string: the port refuses it
	}
	if raise, _ := step["raise_on_error"].(bool); raise && err != nil {
		return nil, nil, err // the call's error leaves the agent as it is: the port answers 500 with its text
	}
	result, err := outcome(value, err)
	if err != nil {
		return nil, nil, err
	}
	name, ok := step["call"].(string)
	if !ok || name == "" {
		name = pp.CompactJSON(step["call"])
	}
	messages := []any{
		map[string]any{"role": "assistant", "content": nil,
			"tool_calls": []any{map[string]any{"id": id, "name": name, "arguments": shownArguments(step["args"])}}},
		map[string]any{"role": "tool", "tool_call_id": id, "content": pp.CompactJSON(result)},
	}
	return result, messages, nil
}

func runScript(ctx context.Context, env *pp.Envelope, steps []any) (any, error) {
	started := time.Now()
	// Check the whole script first: a malformed one fails before anything is sent.
	kinds := make([]string, len(steps))
	for i, step := range steps {
		kind, err := stepKind(step, fmt.Sprintf("steps[%d]", i))
		if err != nil {
			return nil, err
		}
		kinds[i] = kind
	}
	results := []any{}
	transcript := []any{map[string]any{"role": "user", "content": env.UserInstruction}}
	calls := 0
	nextID := func() string {
		calls++
		return fmt.Sprintf("call_%d", calls)
	}

	for i, raw := range steps {
		step := raw.(map[string]any)
		switch kinds[i] {
		case "call":
			result, messages, err := call(ctx, step, nextID())
			if err != nil {
				return nil, err
			}
			results = append(results, result)
			transcript = append(transcript, messages...)
		case "parallel":
			list := step["parallel"].([]any)
			type done struct {
				result   map[string]any
				messages []any
				err      error
			}
			finished := make([]done, len(list))
			var wg sync.WaitGroup
			for j, inner := range list {
				id := nextID() // ids in listed order
				wg.Add(1)
				go func(j int, inner map[string]any, id string) {
					defer wg.Done()
					result, messages, err := call(ctx, inner, id)
					finished[j] = done{result, messages, err}
				}(j, inner.(map[string]any), id)
			}
			wg.Wait()
			outcomes := make([]any, len(list))
			for j, d := range finished {
				if d.err != nil {
					return nil, d.err
				}
				outcomes[j] = d.result
				transcript = append(transcript, d.messages...)
			}
			results = append(results, map[string]any{"parallel": outcomes})
		case "trace":
			opts, err := actorOptions(step)
			var value any
			if err == nil {
				eventType, ok := step["trace"].(string)
				if !ok {
					eventType = pp.CompactJSON(step["trace"]) // never a reserved type: the port refuses it
				}
				value, err = pp.Trace(ctx, eventType, step["payload"], opts...)
			}
			result, err := outcome(value, err)
			if err != nil {
				return nil, err
			}
			results = append(results, result)
		case "handoff":
			h := step["handoff"].(map[string]any)
			var value any
			from, err := label(h["from"])
			to, toErr := label(h["to"])
			if err == nil {
				err = toErr
			}
			if err == nil {
				value, err = pp.PostHandoff(ctx, pp.Handoff{From: from, To: to, Reason: h["reason"], PayloadPreview: h["payload_preview"]})
			}
			result, err := outcome(value, err)
			if err != nil {
				return nil, err
			}
			results = append(results, result)
		case "sleep_ms":
			if err := sleep(ctx, step["sleep_ms"].(json.Number)); err != nil {
				return nil, err
			}
			results = append(results, map[string]any{"ok": true, "value": nil})
		case "raise":
			return nil, errors.New(step["raise"].(string))
		case "return":
			return step["return"], nil
		case "turn_reply": // what the port's turn-reply builder builds (§4.2)
			spec := step["turn_reply"].(map[string]any)
			metadata, _ := spec["metadata"].(map[string]any)
			done, _ := spec["session_done"].(bool)
			return pp.BuildTurnReply(spec["message"].(string), metadata, done)
		}
	}

	finalResponse := pp.CompactJSON(map[string]any{"results": results})
	transcript = append(transcript, map[string]any{"role": "assistant", "content": finalResponse})
	return map[string]any{
		"final_response": finalResponse,
		"messages":       transcript,
		"metadata":       map[string]any{"model": "conformance-agent", "agent_runtime_ms": time.Since(started).Milliseconds()},
	}, nil
}
