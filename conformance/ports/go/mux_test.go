package pipelinesport_test

// The dispatch handler mounted under a prefix in a standard http.ServeMux,
// served on 127.0.0.1 beside other routes (internal/chitest does the same in a
// chi router).

import (
	"io"
	"net/http"
	"testing"

	pp "example.com/pipelines-port/go"
	"example.com/pipelines-port/go/internal/dispatchtest"
)

const muxAgentToken = "mux-agent-token-7c7c7c7c"

func TestAServeMuxMountsTheHandlerUnderAPrefix(t *testing.T) {
	const runs = 120
	proxy := dispatchtest.NewProxy(t, runs)
	dispatch, err := pp.NewDispatchHandler(dispatchtest.Agent, pp.Options{Token: muxAgentToken})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/agents/support/", http.StripPrefix("/agents/support", dispatch))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "the rest of the site") })
	dispatchtest.ServeMounted(t, dispatch, mux, "/agents/support", muxAgentToken, proxy, runs, []dispatchtest.Route{
		{Method: http.MethodGet, Path: "/agents/support/healthz", Status: 200, Body: `"version":"` + pp.Version + `"`},
		{Method: http.MethodGet, Path: "/agents/support/dispatch", Status: 405, Body: "use POST"},
		{Method: http.MethodPost, Path: "/agents/support/elsewhere", Status: 404, Body: "dispatches go to POST /dispatch"},
		// outside the prefix: not the handler's
		{Method: http.MethodPost, Path: "/dispatch", Status: 200, Body: "the rest of the site"},
		{Method: http.MethodGet, Path: "/", Status: 200, Body: "the rest of the site"},
	})
}
