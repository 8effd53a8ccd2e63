"""The serving layer: one Ray Serve deployment whose replicas batch HTTP requests onto onnxruntime.

Request path, a module per step: middleware.py -> routes_*.py (one per protocol: native, OpenAI,
v2, ops) -> tokenization.py -> deployment.py (the replica and its batch queue) -> batching.py
-> runtime.py (onnxruntime; cuda.py says whether CUDA can be used and which GPU Ray gave the
replica) -> responses.py. Never imports torch.
"""
