"""The model bundle: the contract between export/ (torch) and service/ (no torch).

Importing this package must never import torch: the serving image has none.
"""
