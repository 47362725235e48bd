"""An OpenAI-compatible streaming load generator: workloads, the request loop, statistics,
JSON results and plots. Speaks only HTTP, so it benchmarks this project's gateway, MLC's
router, vLLM or any other OpenAI-compatible server the same way."""
