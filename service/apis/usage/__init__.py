"""A key's own usage: GET /v1/usage with the key shows its limits and where it stands in each window now
(routes.py). Keyed: it needs the key, runs no inference and counts against none of the key's limits, so a key
at its limit can still see when it refills."""

from service.front.policy import Api

API = Api(
    name="usage",
    routes=("service.apis.usage.routes",),
    keyed=frozenset({"GET /v1/usage"}),
)
