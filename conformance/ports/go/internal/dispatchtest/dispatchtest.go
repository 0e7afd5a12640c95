// Package dispatchtest runs many concurrent dispatches, each with its own run
// token, through a dispatch handler mounted in a router: the mux tests of this
// module (mux_test.go) and of internal/chitest share it. Loopback only.
package dispatchtest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	pp "example.com/pipelines-port/go"
)

// Digest stands for a run token in replies: the first 16 hex digits of its
// SHA-256. A reply can show which run it belongs to without the token, which
// the handler would redact.
func Digest(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:8])
}

// Proxy stands in for the per-run proxy on 127.0.0.1: POST
// {proxy_url}/tools/whoami answers {"response": {"run": Digest(bearer)}}.
// The first gather calls are held until gather of them are in flight at once,
// so the dispatches that made them provably overlap; when they have not all
// arrived within 15 s, each held call is answered 500 not_concurrent.
type Proxy struct {
	*httptest.Server
	gather   int
	gathered chan struct{}

	mu      sync.Mutex
	arrived int
	bearers map[string]int
}

// NewProxy starts a Proxy that gathers the first gather calls; it closes when tb ends.
func NewProxy(tb testing.TB, gather int) *Proxy {
	p := &Proxy{gather: gather, gathered: make(chan struct{}), bearers: map[string]int{}}
	p.Server = httptest.NewServer(http.HandlerFunc(p.serve))
	tb.Cleanup(p.Close)
	return p
}

func (p *Proxy) serve(w http.ResponseWriter, r *http.Request) {
	bearer := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	_, _ = io.Copy(io.Discard, r.Body)
	p.mu.Lock()
	p.arrived++
	held := p.arrived <= p.gather
	if p.arrived == p.gather {
		close(p.gathered)
	}
	p.bearers[bearer]++
	p.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if held {
		select {
		case <-p.gathered:
		case <-time.After(15 * time.Second):
			w.WriteHeader(http.StatusInternalServerError)
			fmt.Fprintf(w, `{"error_class": "not_concurrent", "message": "fewer than %d calls were in flight together"}`, p.gather)
			return
		}
	}
	if !strings.HasSuffix(r.URL.Path, "/tools/whoami") {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"error_class": "unknown_tool", "message": "no tool at %s"}`, r.URL.Path)
		return
	}
	fmt.Fprintf(w, `{"response": {"run": %q}, "source": "odyssey"}`, Digest(bearer))
}

// RunTokens is how many distinct bearers the proxy has seen, and how many calls in all.
func (p *Proxy) RunTokens() (distinct, calls int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.bearers {
		calls += n
	}
	return len(p.bearers), calls
}

// Agent calls the tool whoami through the port's client and answers what the
// proxy said of its run: the digest of its own run token.
func Agent(ctx context.Context, env *pp.Envelope) (any, error) {
	reply, err := pp.Call(ctx, "whoami", map[string]any{"run_id": env.RunID})
	if err != nil {
		return nil, err
	}
	run, _ := reply.(map[string]any)["run"].(string)
	return run, nil
}

// Run posts n dispatches at once to dispatchURL (the handler's path as
// mounted), each with its own run token and run id, and checks each answer:
// 200, final_response the digest of its own run token, and no token in the body.
func Run(tb testing.TB, dispatchURL, agentToken, proxyURL string, n int) {
	tb.Helper()
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	defer client.CloseIdleConnections()
	var wg sync.WaitGroup
	problems := make(chan string, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			runToken := fmt.Sprintf("mounted-run-token-%03d", i)
			if problem := dispatch(client, dispatchURL, agentToken, proxyURL, runToken, i); problem != "" {
				problems <- fmt.Sprintf("dispatch %d: %s", i, problem)
			}
		}(i)
	}
	wg.Wait()
	close(problems)
	for problem := range problems {
		tb.Error(problem)
	}
}

func dispatch(client *http.Client, dispatchURL, agentToken, proxyURL, runToken string, runID int) string {
	body, _ := json.Marshal(map[string]any{
		"odyssey_proxy_url": proxyURL, "run_id": runID, "task_id": 1,
		"input": map[string]any{"task_id": 1, "user_instruction": "who am I?"},
	})
	req, err := http.NewRequest(http.MethodPost, dispatchURL, strings.NewReader(string(body)))
	if err != nil {
		return err.Error()
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+agentToken)
	req.Header.Set(pp.HeaderRunToken, runToken)
	resp, err := client.Do(req)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return err.Error()
	}
	if strings.Contains(string(raw), runToken) || strings.Contains(string(raw), agentToken) {
		return "a token in the reply"
	}
	var reply map[string]any
	if err := json.Unmarshal(raw, &reply); err != nil {
		return fmt.Sprintf("HTTP %d, not JSON: %.200s", resp.StatusCode, raw)
	}
	if resp.StatusCode != http.StatusOK || reply["final_response"] != Digest(runToken) {
		return fmt.Sprintf("HTTP %d %v, want 200 with final_response %s", resp.StatusCode, reply, Digest(runToken))
	}
	return ""
}

// Route is a request to a mounted router and what its answer must be: the
// status and a part of the body.
type Route struct {
	Method, Path string
	Status       int
	Body         string
}

// ServeMounted serves router (which mounts dispatch under prefix) on
// 127.0.0.1 with the port's server settings, runs n concurrent dispatches
// through prefix+"/dispatch" against proxy, asks each of routes, then drains
// and shuts down as Serve does on SIGTERM. The mux and chi tests share it.
func ServeMounted(tb testing.TB, dispatch *pp.DispatchHandler, router http.Handler, prefix, agentToken string,
	proxy *Proxy, n int, routes []Route) {
	tb.Helper()
	srv := pp.NewServer(dispatch) // the port's timeouts and body read deadline, for the whole router
	srv.Handler = router
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	base := "http://" + ln.Addr().String()

	Run(tb, base+prefix+"/dispatch", agentToken, proxy.URL+"/api/odyssey-proxy/runs/r", n)
	if distinct, calls := proxy.RunTokens(); distinct != n || calls != n {
		tb.Errorf("the proxy saw %d run tokens in %d calls, want %d in %d", distinct, calls, n, n)
	}
	for _, route := range routes {
		req, _ := http.NewRequest(route.Method, base+route.Path, strings.NewReader("{}"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			tb.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != route.Status || !strings.Contains(string(body), route.Body) {
			tb.Errorf("%s %s: %d %s, want %d with %q", route.Method, route.Path, resp.StatusCode, body, route.Status,
				route.Body)
		}
	}

	dispatch.Drain() // what Serve does on SIGTERM: new dispatches 503, in-flight ones finish
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		tb.Error(err)
	}
	if err := <-served; err != http.ErrServerClosed {
		tb.Error(err)
	}
}
