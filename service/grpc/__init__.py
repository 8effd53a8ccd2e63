"""KServe v2 over gRPC: the same models, inputs and outputs as v2 over HTTP (service/http/routes/v2.py),
answered by the same replicas through Ray Serve's gRPC ingress (docs/serving.md, "gRPC").

  protocol.py   the service definition (kserve_v2.proto), compiled when first used, and the
                function Serve's gRPC options name to register it
  inference.py  the six calls, as methods of the deployment, with the limits, auth, metrics,
                request ids and status codes of HTTP
"""
