package pipelinesport_test

// No run lost (issue 24, kit-json-safe-response): whatever an agent returns,
// the handler answers JSON over a real socket (200 when the lenient builder can
// make it JSON, else a JSON 500), never a dropped connection or a text page.
// json.Marshal fails on NaN and infinite floats inside structs, on channels and
// functions, on pointer cycles and on a MarshalJSON that fails or panics.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"

	pp "example.com/pipelines-port/go"
)

type marshalFails struct{}

func (marshalFails) MarshalJSON() ([]byte, error) { return nil, errors.New("cannot marshal") }

type marshalPanics struct{}

func (marshalPanics) MarshalJSON() ([]byte, error) { panic("marshal panicked") }

type node struct {
	Name string
	Next *node
}

func TestEveryHostileValueGetsAJSONReply(t *testing.T) {
	proxy := whoamiProxy(t)
	const agentToken, runToken = "agent-token-hostile", "run-token-hostile"
	loop := &node{Name: "loop"}
	loop.Next = loop
	cases := map[string]struct {
		value  any
		status int
	}{
		"nan in metadata":           {map[string]any{"final_response": "done", "metadata": map[string]any{"s": math.NaN(), "i": math.Inf(1)}}, 200},
		"a bare NaN as the result":  {math.NaN(), 500},
		"channel in metadata":       {map[string]any{"final_response": "done", "metadata": map[string]any{"c": make(chan int)}}, 200},
		"func in metadata":          {map[string]any{"final_response": "done", "metadata": map[string]any{"f": func() {}}}, 200},
		"invalid UTF-8":             {map[string]any{"final_response": "cut \xf0\x9f", "metadata": map[string]any{"k\xff": "v\xfe"}}, 200},
		"bytes":                     {map[string]any{"final_response": "done", "metadata": map[string]any{"b": []byte{0xff, 'a'}}}, 200},
		"struct with a NaN field":   {map[string]any{"final_response": "done", "metadata": map[string]any{"s": struct{ X float64 }{math.NaN()}}}, 500},
		"struct with a chan field":  {map[string]any{"final_response": "done", "metadata": map[string]any{"s": struct{ C chan int }{make(chan int)}}}, 500},
		"pointer cycle":             {map[string]any{"final_response": "done", "metadata": map[string]any{"n": loop}}, 500},
		"MarshalJSON fails":         {map[string]any{"final_response": "done", "metadata": map[string]any{"m": marshalFails{}}}, 500},
		"MarshalJSON panics":        {map[string]any{"final_response": "done", "metadata": map[string]any{"m": marshalPanics{}}}, 500},
		"unmarshalable result type": {make(chan int), 500},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			handler, err := pp.NewDispatchHandler(func(ctx context.Context, env *pp.Envelope) (any, error) {
				return c.value, nil
			}, pp.Options{Token: agentToken})
			if err != nil {
				t.Fatal(err)
			}
			server := httptest.NewServer(handler) // a real socket on 127.0.0.1
			defer server.Close()
			body := fmt.Sprintf(`{"odyssey_proxy_url": %q, "run_id": 5}`, proxy.URL+"/runs/r")
			req, _ := http.NewRequest(http.MethodPost, server.URL+"/dispatch", strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+agentToken)
			req.Header.Set(pp.HeaderRunToken, runToken)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatalf("no reply (a dropped connection?): %v", err)
			}
			defer resp.Body.Close()
			raw, _ := io.ReadAll(resp.Body)
			var reply map[string]any
			if resp.Header.Get("Content-Type") != "application/json" || !utf8.Valid(raw) || json.Unmarshal(raw, &reply) != nil {
				t.Fatalf("not a JSON reply: %d %q %q", resp.StatusCode, resp.Header.Get("Content-Type"), raw)
			}
			if bytes.Contains(raw, []byte(`\ud8`)) || bytes.Contains(raw, []byte(runToken)) {
				t.Fatalf("an escaped surrogate or the run token in %q", raw)
			}
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %q", resp.StatusCode, c.status, raw)
			}
			if c.status == 500 {
				if detail, _ := reply["detail"].(string); detail == "" {
					t.Fatalf("a 500 without a detail: %q", raw)
				}
			} else if final, _ := reply["final_response"].(string); final == "" {
				t.Fatalf("a 200 without a final_response: %q", raw)
			}
		})
	}
}
