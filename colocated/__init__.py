"""`microserving serve`: the OpenAI gateway with the router in its own process.

The gateway and the router stay separate services that never import each other; this package
is where they meet: the gateway's app (`gateway.app.create_app`) is handed a router run on its
event loop (`router.inprocess.InProcessRouter`) in place of a gRPC client of a router process.
"""
