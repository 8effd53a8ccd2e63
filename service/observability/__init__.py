"""Observability: the Prometheus families (metrics.py), OpenTelemetry tracing (tracing.py) and the
span exporter process that keeps export off the replica (span_export.py)."""
