"""Run 51's second call: stamps (perf_counter, one clock for every process on the host) at the
client's RemoteSend call and return (kv_bench) and at P's servicer entry and exit, applied to
a throwaway copy of the tree; then where an 8k send's time outside P's backend goes."""
import pathlib
import sys

root = pathlib.Path(sys.argv[1])
servicer = root / "engine_shim/servicer.py"
s = servicer.read_text()
s = s.replace(
    "        tokens, sampling = self._checked(request.request_id, request.token_ids, request.sampling)\n"
    "        begin, end = validation.remote_send_window(",
    "        import time as _t, logging as _l; _t0 = _t.perf_counter()\n"
    "        tokens, sampling = self._checked(request.request_id, request.token_ids, request.sampling)\n"
    "        begin, end = validation.remote_send_window(", 1)
s = s.replace(
    "            self._tracker.end_remote_send(request.request_id)\n        return send_result_to_pb(result)",
    "            self._tracker.end_remote_send(request.request_id)\n        _r = send_result_to_pb(result)\n"
    "        _l.getLogger('STAMP').warning('STAMP %s in %.6f out %.6f', request.request_id, _t0, _t.perf_counter())\n"
    "        return _r", 1)
assert s.count("STAMP") == 2
servicer.write_text(s)
bench = root / "bench/kv_bench.py"
b = bench.read_text()
b = b.replace("    elapsed = time.perf_counter() - start\n",
              "    elapsed = time.perf_counter() - start\n"
              "    print(f'CSTAMP {request_id} {start:.6f} {start + elapsed:.6f}', file=sys.stderr)\n", 1)
assert "CSTAMP" in b
bench.write_text(b)
