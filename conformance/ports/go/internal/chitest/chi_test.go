package chitest_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

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
	srv := pp.NewServer(dispatch) // the port's timeouts and body read deadline, for the whole router
	srv.Handler = chitest.Router("/agents/support", dispatch)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	base := "http://" + ln.Addr().String()

	dispatchtest.Run(t, base+"/agents/support/dispatch", agentToken, proxy.URL+"/api/odyssey-proxy/runs/r", runs)
	if distinct, calls := proxy.RunTokens(); distinct != runs || calls != runs {
		t.Errorf("the proxy saw %d run tokens in %d calls, want %d in %d", distinct, calls, runs, runs)
	}

	for _, route := range []struct {
		method, path string
		status       int
		body         string
	}{
		{http.MethodGet, "/agents/support/healthz", 200, `"version":"` + pp.Version + `"`},
		{http.MethodGet, "/agents/support/dispatch", 405, "use POST"},
		{http.MethodPost, "/agents/support/elsewhere", 404, "dispatches go to POST /dispatch"},
		{http.MethodPost, "/dispatch", 404, "404 page not found"}, // outside the prefix: chi's own 404
		{http.MethodGet, "/", 200, "the rest of the service"},
	} {
		req, _ := http.NewRequest(route.method, base+route.path, strings.NewReader("{}"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != route.status || !strings.Contains(string(body), route.body) {
			t.Errorf("%s %s: %d %s, want %d with %q", route.method, route.path, resp.StatusCode, body, route.status, route.body)
		}
	}

	dispatch.Drain()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Error(err)
	}
	if err := <-served; err != http.ErrServerClosed {
		t.Error(err)
	}
}
