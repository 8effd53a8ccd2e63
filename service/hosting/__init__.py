"""Host plumbing: which addresses Ray and Serve listen on (listeners.py), and the processes a local
service starts and stops (processes.py: Ray, HAProxy, ports)."""
