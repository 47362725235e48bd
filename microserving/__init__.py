"""microserving: the generated `microserving.v1` gRPC bindings and the few pieces every
service shares without importing another service (the tokenizer and the CLI dispatcher)."""
