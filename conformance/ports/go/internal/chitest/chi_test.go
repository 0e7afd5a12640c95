package chitest_test

import (
	"io"
	"net/http"
	"testing"

	pp "example.com/pipelines-port/go"
	"example.com/pipelines-port/go/internal/chitest"
	"example.com/pipelines-port/go/internal/dispatchtest"
)

const agentToken = "chi-agent-token-3b3b3b3b"

func TestAChiRouterMountsTheHandlerUnderAPrefix(t *testing.T) {
	pp.SetLogOutput(io.Discard)
	const runs = 120
	proxy := dispatchtest.NewProxy(t, runs)
	dispatch, err := pp.NewDispatchHandler(dispatchtest.Agent, pp.Options{Token: agentToken})
	if err != nil {
		t.Fatal(err)
	}
	router := chitest.Router("/agents/support", dispatch)
	dispatchtest.ServeMounted(t, dispatch, router, "/agents/support", agentToken, proxy, runs, []dispatchtest.Route{
		{Method: http.MethodGet, Path: "/agents/support/healthz", Status: 200, Body: `"version":"` + pp.Version + `"`},
		{Method: http.MethodGet, Path: "/agents/support/dispatch", Status: 405, Body: "use POST"},
		{Method: http.MethodPost, Path: "/agents/support/elsewhere", Status: 404, Body: "dispatches go to POST /dispatch"},
		// outside the prefix: chi's own 404
		{Method: http.MethodPost, Path: "/dispatch", Status: 404, Body: "404 page not found"},
		{Method: http.MethodGet, Path: "/", Status: 200, Body: "the rest of the service"},
	})
}
