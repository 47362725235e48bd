"""The engines a shim can serve, each behind `engine_shim.backend.Backend`: `embedded` (our
PyTorch engine in this process, with its KV data plane), `mlc` (a client of a running MLC-LLM
server) and `synthetic` (benchmark only). Nothing here is imported until a backend is chosen."""
