"""Imported first by a benchmark run as `python -m bench.<name>` rather than through the
`microserving` command (which does the same before any gRPC loads): the script's own gRPC
calls then go through the I/O stack that the stack's processes use (microserving/grpc_io.py),
so a timed call costs what the router's calls cost, not EventEngine's extra thread hops."""

from microserving.grpc_io import prefer_legacy_io

prefer_legacy_io()
