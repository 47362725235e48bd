"""Launching the services as processes: one launcher (start, wait for `listening on
HOST:PORT`, stop), one `free_port`, the health probes, and `microserving up`, which starts a
whole local stack with them. Benchmarks and tests start their processes through the same
launcher. Imports no service: it runs them by their entry points."""
