"""The front: what every call has, whichever protocol and API it came in on.

  call.py         the typed record of one call (id, protocol, route, model, task, texts, tokens, bytes by
                  kind, deadline, failure reason), and the one deadline rule
  gate.py         who may call (the bearer token) and how many are inside (in flight, admitted)
  errors.py       the error taxonomy: each error type's HTTP status and gRPC code; our error body
  finish.py       where a finished call records its metrics, its access log line and its span
  policy.py       what an API declares (its routes' policy, its error style, its gRPC methods)
  request_ids.py  the request id rule, the id of the call this task serves
  json_values.py  a JSON body's values counted before it is parsed (the parser holds the GIL throughout)
  responses.py    JSON bodies written fast, off the event loop when large, bytes counted by kind
  schemas.py      the request-body building blocks every JSON API shares, the error body
  deps.py         what an API's HTTP route gets: the replica's EncoderService and its call

Transports (service/http, service/grpc) build a Call and pass it through the gate and `finish`;
APIs (service/apis) read and fill it. Nothing here knows a transport or an API.
"""
