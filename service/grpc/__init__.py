"""The gRPC transport: every API's gRPC service through Ray Serve's gRPC ingress, as HTTP's routes go
through the HTTP transport (docs/serving.md, "gRPC"); the two never import each other.

  protocol.py     the function Serve's gRPC options name to register the services
  servicer.py     each call's record, gate, status codes and record when it ends; the methods of the
                  deployment Serve calls by name
  serve_hooks.py  what Serve does not hand a replica: the client's deadline, a retry hint on its own
                  refusals, the message size cap and the token before the message
"""
