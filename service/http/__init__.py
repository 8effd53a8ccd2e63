"""The HTTP transport: every API's routes in one FastAPI app, and what only HTTP knows.

  server.py      the app: every API's router mounted and checked against its declaration, every
                 failure answered as a JSON error in the style of the route's API
  middleware.py  the request's call record, the gate (token, in-flight count), its record when it
                 ends; the body limit (pure ASGI)
  headers.py     the headers it reads: X-Request-Id, X-Request-Timeout-Seconds, the unreadable mark
  errors.py      an error as an HTTP answer: status, Retry-After, the API's error body
  ingress.py     Ray Serve's own plain-text answers (queue full, 408, 404) as our JSON errors, and
                 the headers Serve cannot decode taken out before its code runs
"""
