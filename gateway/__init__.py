"""The OpenAI HTTP gateway: FastAPI routes that translate to the microserving.v1 Router service.

It meets the router only over gRPC (one long-lived channel); it imports no router or shim code.
"""
