// A module of its own, so that the port keeps no dependencies: chi is needed
// only to test the dispatch handler mounted in a chi router.
module example.com/pipelines-port/go/internal/chitest

go 1.24

require (
	example.com/pipelines-port/go v0.0.0-00010101000000-000000000000
	github.com/go-chi/chi/v5 v5.5.0
)

replace example.com/pipelines-port/go => ../..
