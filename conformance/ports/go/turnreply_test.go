package pipelinesport_test

// Multi-turn runs (§4.2): a turn reply leaves the dispatch handler as the
// agent built it, over 127.0.0.1; a single-turn dispatch gets the envelope;
// lenient and strict treat a malformed turn reply as a malformed envelope;
// then 120 concurrent multi-turn dispatches, each with its own run token and
// session.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	pp "example.com/pipelines-port/go"
	"example.com/pipelines-port/go/internal/dispatchtest"
)

const turnAgentToken = "turn-agent-token-4d4d4d4d"

// turnAgent calls whoami, then answers what its instruction names: "reply"
// (BuildTurnReply), "string", or the JSON value the instruction holds.
func turnAgent(ctx context.Context, env *pp.Envelope) (any, error) {
	seen, err := pp.Call(ctx, "whoami", map[string]any{"session": env.SessionID})
	if err != nil {
		return nil, err
	}
	switch env.UserInstruction {
	case "reply":
		return pp.BuildTurnReply("Which order do you mean?", map[string]any{"model": "m-1"}, true)
	case "string":
		return "Which order?", nil
	case "concurrent":
		run := seen.(map[string]any)["run"]
		return pp.BuildTurnReply(fmt.Sprintf("%v: run %v", env.SessionID, run),
			map[string]any{"turn_id": env.TurnID}, fmt.Sprint(env.RunID) == "0")
	}
	var value any
	err = json.Unmarshal([]byte(env.UserInstruction), &value)
	return value, err
}

func postTurn(url, proxyURL, token, instruction string, multiTurn bool, session string) (int, map[string]any) {
	input := map[string]any{"user_instruction": instruction, "input": map[string]any{}}
	if multiTurn {
		input["latest_user_prompt"], input["session_id"], input["turn_id"] = "Cancel my order", session, session+"-t0"
		input["messages"] = []any{}
	}
	body, _ := json.Marshal(map[string]any{"odyssey_proxy_url": proxyURL, "run_id": 17, "input": input})
	req, _ := http.NewRequest(http.MethodPost, url+"/dispatch", strings.NewReader(string(body)))
	req.Header.Set("Authorization", "Bearer "+turnAgentToken)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Pipelines-Run-Token", token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, map[string]any{"error": err.Error()}
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	var reply map[string]any
	if err := json.Unmarshal(data, &reply); err != nil {
		return resp.StatusCode, map[string]any{"not JSON": string(data)}
	}
	return resp.StatusCode, reply
}

func serveTurns(t *testing.T, strict bool) string {
	t.Helper()
	handler, err := pp.NewDispatchHandler(turnAgent, pp.Options{Token: turnAgentToken, Strict: strict})
	if err != nil {
		t.Fatal(err)
	}
	server := httptest.NewServer(handler)
	t.Cleanup(server.Close)
	return server.URL
}

func TestATurnReplyLeavesTheHandlerAsBuilt(t *testing.T) {
	proxy := dispatchtest.NewProxy(t, 0)
	proxyURL := proxy.URL + "/api/odyssey-proxy/runs/r1"
	lenient, strict := serveTurns(t, false), serveTurns(t, true)
	const token = "run-token-turn-go-1"
	cases := []struct {
		url, instruction string
		multiTurn        bool
		status           int
		body             string
	}{
		{lenient, "reply", true, 200, `{"message":"Which order do you mean?","metadata":{"model":"m-1"},"session_done":true}`},
		{strict, "reply", true, 200, `{"message":"Which order do you mean?","metadata":{"model":"m-1"},"session_done":true}`},
		{lenient, "reply", false, 200, `{"final_response":"Which order do you mean?","metadata":{"model":"m-1"}}`},
		{lenient, "string", true, 200, `{"final_response":"Which order?"}`},
		{lenient, `{"message": "ok", "session_done": false, "trace": {"step": 2}}`, true, 200,
			`{"message":"ok","session_done":false,"trace":{"step":2}}`},
		{lenient, `{"message": "ok", "session_done": "yes", "metadata": [1]}`, true, 200, `{"message":"ok","session_done":false}`},
		{lenient, `{"message": "token run-token-turn-go-1", "session_done": false}`, true, 200,
			`{"message":"token [redacted]","session_done":false}`},
	}
	for _, c := range cases {
		status, reply := postTurn(c.url, proxyURL, token, c.instruction, c.multiTurn, "sess-1")
		var want map[string]any
		_ = json.Unmarshal([]byte(c.body), &want)
		if got, _ := json.Marshal(reply); status != c.status || string(got) != mustJSON(want) {
			t.Errorf("%s (multi-turn %v): HTTP %d %s, want %d %s", c.instruction, c.multiTurn, status, got, c.status, c.body)
		}
	}
	status, reply := postTurn(strict, proxyURL, token, `{"message": "ok", "session_done": "yes", "metadata": [1]}`, true, "s")
	if detail, _ := reply["detail"].(string); status != 500 || !strings.Contains(detail, "session_done: must be a boolean") ||
		!strings.Contains(detail, "metadata") {
		t.Errorf("strict: HTTP %d %v, want 500 naming session_done and metadata", status, reply)
	}
	if status, reply := postTurn(lenient, proxyURL, token, `{"message": "", "session_done": true}`, true, "s"); status != 500 {
		t.Errorf("an empty message: HTTP %d %v, want 500", status, reply)
	}
}

func mustJSON(value any) string {
	data, _ := json.Marshal(value)
	return string(data)
}

func TestConcurrentMultiTurnDispatchesEachGetTheirOwnTurnReply(t *testing.T) {
	const runs = 120
	proxy := dispatchtest.NewProxy(t, runs) // the calls are held until all 120 are in flight
	proxyURL := proxy.URL + "/api/odyssey-proxy/runs/r1"
	url := serveTurns(t, false)
	var wg sync.WaitGroup
	errs := make(chan error, runs)
	for i := 0; i < runs; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			token := fmt.Sprintf("run-token-turn-go-%03d", i)
			session := fmt.Sprintf("sess-%d", i)
			status, reply := postTurn(url, proxyURL, token, "concurrent", true, session)
			want := map[string]any{"message": fmt.Sprintf("%s: run %s", session, dispatchtest.Digest(token)),
				"metadata": map[string]any{"turn_id": session + "-t0"}, "session_done": false}
			if status != 200 || mustJSON(reply) != mustJSON(want) {
				errs <- fmt.Errorf("run %d: HTTP %d %v, want %v", i, status, reply, want)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
