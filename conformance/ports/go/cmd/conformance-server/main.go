// Command conformance-server serves the conformance agent
// (internal/conformanceagent) through the Go port's dispatch handler, for
// `python3 -m conformance check URL`.
//
//	conformance-server [--host 127.0.0.1] [--port 8080] [--path /dispatch]
//	    [--token-env AGENT_TOKEN] [--auth-header Authorization] [--no-auth] [--strict]
//	    [--max-body BYTES] [--timeout SECONDS] [--grace SECONDS]
//
// Its first stdout line reads "listening on http://HOST:PORT/PATH". SIGTERM
// or SIGINT: new connections are refused, in-flight dispatches finish (up to
// --grace seconds); the exit status is 0 when they all did. A bad argument is
// one line on stderr and exit status 2.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	pp "example.com/pipelines-port/go"
	"example.com/pipelines-port/go/internal/conformanceagent"
)

const usage = "usage: conformance-server [--host HOST] [--port PORT] [--path /dispatch] [--token-env NAME] " +
	"[--auth-header NAME] [--no-auth] [--strict] [--max-body BYTES] [--timeout SECONDS] [--grace SECONDS]"

type settings struct {
	host  string
	port  int
	grace time.Duration
	opts  pp.Options
}

// seconds is a flag value: a positive number of seconds.
type seconds struct{ d *time.Duration }

func (s seconds) String() string {
	if s.d == nil {
		return ""
	}
	return s.d.String()
}

func (s seconds) Set(text string) error {
	value, err := strconv.ParseFloat(text, 64)
	if err != nil || !(value > 0) || math.IsInf(value, 0) {
		return fmt.Errorf("must be a positive number of seconds, got %q", text)
	}
	*s.d = time.Duration(value * float64(time.Second))
	return nil
}

func parseArgs(args []string) (settings, error) {
	s := settings{grace: 30 * time.Second, opts: pp.Options{RunTimeout: pp.DefaultRunTimeout}}
	fs := flag.NewFlagSet("conformance-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&s.host, "host", "127.0.0.1", "interface to listen on")
	fs.IntVar(&s.port, "port", 8080, "port (0 picks a free one)")
	fs.StringVar(&s.opts.Path, "path", pp.DefaultDispatchPath, "dispatch path")
	fs.StringVar(&s.opts.TokenEnv, "token-env", pp.DefaultTokenEnv, "environment variable holding the agent token")
	fs.StringVar(&s.opts.AuthHeader, "auth-header", "Authorization", "auth header")
	fs.BoolVar(&s.opts.NoAuth, "no-auth", false, "run without inbound auth")
	fs.BoolVar(&s.opts.Strict, "strict", false, "refuse what the platform would only soften")
	fs.Int64Var(&s.opts.MaxBody, "max-body", pp.DefaultMaxBodyBytes, "request body limit in bytes")
	fs.Var(seconds{&s.opts.RunTimeout}, "timeout", "run timeout in seconds")
	fs.Var(seconds{&s.grace}, "grace", "seconds in-flight dispatches may finish after SIGTERM")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return s, errors.New(usage)
		}
		return s, fmt.Errorf("%v (%s)", err, usage)
	}
	if fs.NArg() > 0 {
		return s, fmt.Errorf("unexpected argument %q (%s)", fs.Arg(0), usage)
	}
	if s.port < 0 || s.port > 65535 {
		return s, fmt.Errorf("--port must be a port number (0 picks a free one), got %d", s.port)
	}
	if s.opts.MaxBody <= 0 {
		return s, fmt.Errorf("--max-body must be a positive integer, got %d", s.opts.MaxBody)
	}
	return s, nil
}

func run(args []string) int {
	s, err := parseArgs(args)
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance-server: %v\n", err)
		return 2
	}
	handler, err := pp.NewDispatchHandler(conformanceagent.Agent, s.opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance-server: %v\n", err)
		return 2
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(s.host, strconv.Itoa(s.port)))
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance-server: cannot listen on %s:%d: %v\n", s.host, s.port, err)
		return 2
	}
	fmt.Printf("pipelines_port (go) serve: listening on http://%s%s\n", ln.Addr(), handler.Path())
	fmt.Printf("pipelines_port (go) serve: auth: %s\n", handler.DescribeAuth())

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	err = pp.Serve(ctx, ln, handler, s.grace)
	pp.DefaultClient().CloseIdleConnections()
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance-server: %v\n", err)
		return 1
	}
	return 0
}

func main() { os.Exit(run(os.Args[1:])) }
