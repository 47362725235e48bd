"""The embedded backend: `backend.py` drives the in-process engine (`engine_shim.engine`);
`kv_plane/` moves its KV between shims. Kept empty of imports: an engine core in its own
process unpickles `kv_plane` objects without loading the backend or gRPC."""
