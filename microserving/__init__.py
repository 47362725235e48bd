"""microserving: the generated `microserving.v1` gRPC bindings and the few pieces every
service shares without importing another service (the tokenizer, the transport, the stream
multiplexer, the pattern names, the CLI dispatcher, and `stack`: launching the services as
processes, `microserving up` included)."""
