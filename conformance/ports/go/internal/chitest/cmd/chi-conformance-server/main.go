// Command chi-conformance-server serves the conformance agent through the
// port's dispatch handler mounted under a prefix in a chi router
// (chitest.Router), for `python3 -m conformance check URL`.
//
//	chi-conformance-server [--host 127.0.0.1] [--port 8080] [--prefix /agents/support] [--strict]
//
// The agent token is read from $AGENT_TOKEN. Its first stdout line reads
// "listening on http://HOST:PORT/PREFIX/dispatch". SIGTERM or SIGINT: new
// dispatches get 503, in-flight ones finish (up to 30 s); the exit status is 0
// when they all did. A bad argument is one line on stderr and exit status 2.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	pp "example.com/pipelines-port/go"
	"example.com/pipelines-port/go/internal/chitest"
	"example.com/pipelines-port/go/internal/conformanceagent"
)

func run(args []string) int {
	fs := flag.NewFlagSet("chi-conformance-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	host := fs.String("host", "127.0.0.1", "interface to listen on")
	port := fs.Int("port", 8080, "port (0 picks a free one)")
	prefix := fs.String("prefix", "/agents/support", "where the dispatch handler is mounted")
	strict := fs.Bool("strict", false, "refuse what the platform would only soften")
	if err := fs.Parse(args); err != nil || fs.NArg() > 0 || !strings.HasPrefix(*prefix, "/") || strings.HasSuffix(*prefix, "/") {
		fmt.Fprintln(os.Stderr, "usage: chi-conformance-server [--host HOST] [--port PORT] [--prefix /PATH] [--strict]")
		return 2
	}
	dispatch, err := pp.NewDispatchHandler(conformanceagent.Agent, pp.Options{Strict: *strict})
	if err != nil {
		fmt.Fprintf(os.Stderr, "chi-conformance-server: %v\n", err)
		return 2
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		fmt.Fprintf(os.Stderr, "chi-conformance-server: cannot listen: %v\n", err)
		return 2
	}
	srv := pp.NewServer(dispatch) // keep-alive, read deadlines: for the whole router
	srv.Handler = chitest.Router(*prefix, dispatch)
	fmt.Printf("chi-conformance-server: listening on http://%s%s%s\n", ln.Addr(), *prefix, dispatch.Path())

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		fmt.Fprintf(os.Stderr, "chi-conformance-server: %v\n", err)
		return 1
	case <-ctx.Done():
	}
	dispatch.Drain()
	shutdown, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		fmt.Fprintf(os.Stderr, "chi-conformance-server: %v\n", err)
		return 1
	}
	return 0
}

func main() { os.Exit(run(os.Args[1:])) }
