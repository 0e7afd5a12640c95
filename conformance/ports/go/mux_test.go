package pipelinesport_test

// The dispatch handler mounted under a prefix in a standard http.ServeMux,
// served on 127.0.0.1 beside other routes (internal/chitest does the same in a
// chi router).

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

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
	srv := pp.NewServer(dispatch) // the port's timeouts and body read deadline, for the whole mux
	srv.Handler = mux
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	base := "http://" + ln.Addr().String()

	dispatchtest.Run(t, base+"/agents/support/dispatch", muxAgentToken, proxy.URL+"/api/odyssey-proxy/runs/r", runs)
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
		{http.MethodPost, "/dispatch", 200, "the rest of the site"}, // outside the prefix: not the handler's
		{http.MethodGet, "/", 200, "the rest of the site"},
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

	dispatch.Drain() // what Serve does on SIGTERM: new dispatches 503, in-flight ones finish
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		t.Error(err)
	}
	if err := <-served; err != http.ErrServerClosed {
		t.Error(err)
	}
}
