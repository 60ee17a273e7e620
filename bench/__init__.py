"""servewell benchmarks: load generator, offline limits, naive baseline server, and the `make bench` driver."""
