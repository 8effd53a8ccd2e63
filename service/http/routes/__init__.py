"""Routes, one module per protocol; each adds its routes to service.http.app.app when imported
(service/deployment.py imports them all) and gets the replica's EncoderService as a dependency."""
