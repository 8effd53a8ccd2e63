"""The serving layer: Ray Serve deployments that batch HTTP requests onto onnxruntime sessions.

Request path, a module per step: api.py (routes, validation) -> tokenization.py ->
batching.py (the encoder deployment and its batch queue) -> runtime.py (onnxruntime) -> back.
Never imports torch.
"""
