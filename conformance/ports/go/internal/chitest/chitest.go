// Package chitest mounts the port's dispatch handler under a prefix in a chi
// router (github.com/go-chi/chi/v5), beside the routes and middleware of an
// ordinary service. It is a module of its own so that the port itself keeps no
// dependencies; chi_test.go and cmd/chi-conformance-server use it.
package chitest

import (
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
)

// Router is a chi router serving dispatch under prefix (POST prefix+"/dispatch",
// GET prefix+"/healthz") and a page of its own at "/".
func Router(prefix string, dispatch http.Handler) *chi.Mux {
	r := chi.NewRouter()
	r.Use(middleware.RequestID, middleware.Recoverer)
	r.Get("/", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("the rest of the service")) })
	r.Mount(prefix, http.StripPrefix(prefix, dispatch))
	return r
}
