"""What each client API declares, and the policy the transports build from the declarations.

An API (a folder of service/apis) declares its HTTP routes (a FastAPI router), which of them run
inference or tokenize (they need the bearer token and count as in flight) and which are open (health,
metadata, pages), the error body its clients parse, and its gRPC methods with the same split. The
transports build their tables from these declarations when the app is built: a route or method that
is declared neither inference nor open fails the build, so nothing new is ever served without a policy.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import compile_path

from service.front.errors import ErrorStyle, our_error_body


@dataclass(frozen=True)
class RoutePolicy:
    """How the front treats calls of one route: whether it runs inference (token, in-flight count), and
    which error body its clients parse."""

    api: str
    inference: bool
    error_style: ErrorStyle = our_error_body
    keyed: bool = False  # needs the key, runs no inference (no in-flight count, none of the key's limits)

    def needs_token(self, method: str) -> bool:
        """Whether a request of this route must carry the token: an inference route's, a keyed one's, or a
        write to a path no route serves."""
        return self.inference or self.keyed or (self is UNROUTED and method not in ("GET", "HEAD", "OPTIONS"))


# A path no route serves: refused by the app (404, 405) in our error body; a write to it needs the token
# when authentication is on, so that nothing answers a write without one, whatever is added later.
UNROUTED = RoutePolicy("none", inference=False)


@dataclass(frozen=True)
class GrpcMethod:
    """One unary gRPC method an API serves: its request and response classes, and the function that
    answers it, `answer(svc, request, call)`."""

    name: str
    request: type
    response: type
    answer: Callable[[Any, Any, Any], Awaitable[Any]]


@dataclass(frozen=True)
class GrpcService:
    """A gRPC service an API serves (`package.Service`), its methods by name."""

    name: str
    methods: dict[str, GrpcMethod]

    def path(self, method: str) -> str:
        """A method's full name on the wire, as clients and Ray's metrics write it."""
        return f"/{self.name}/{method}"


@dataclass(frozen=True)
class Api:
    """One client API, as data: where its routes are, which of them run inference and which are open,
    its error style, and the same for its gRPC methods. Importing a declaration imports no route (Serve's
    proxy reads the declarations to write its own errors in each API's style)."""

    name: str
    routes: tuple[str, ...]  # the modules whose `router` (front/deps.py api_router) holds the API's HTTP routes
    inference: frozenset[str] = frozenset()  # "METHOD /path" of the routes that run inference or tokenize
    open: frozenset[str] = frozenset()  # "METHOD /path" of the routes anyone may call
    keyed: frozenset[str] = frozenset()  # "METHOD /path" of routes that need the key and run no inference
    error_style: ErrorStyle = our_error_body
    grpc: str | None = None  # the module whose `SERVICE` (a GrpcService) holds its gRPC methods
    grpc_inference: frozenset[str] = frozenset()  # full method names (/package.Service/Method)
    grpc_open: frozenset[str] = frozenset()

    @property
    def declared(self) -> frozenset[str]:
        return self.inference | self.open | self.keyed

    def routers(self) -> list[Any]:
        return [importlib.import_module(module).router for module in self.routes]

    def grpc_service(self) -> GrpcService:
        return importlib.import_module(self.grpc).SERVICE

    def policy_of(self, method: str, path: str) -> RoutePolicy:
        """The declared policy of one route; a route declared neither way (or both) is an error."""
        key = f"{method} {path}"
        if (key in self.inference) + (key in self.open) + (key in self.keyed) != 1:
            raise UndeclaredRoute(f"API {self.name!r}: route {key} must be declared inference, open or keyed (once)")
        return RoutePolicy(self.name, key in self.inference, self.error_style, keyed=key in self.keyed)

    def grpc_policy_of(self, full_name: str) -> RoutePolicy:
        if (full_name in self.grpc_inference) == (full_name in self.grpc_open):
            raise UndeclaredRoute(f"API {self.name!r}: gRPC method {full_name} must be declared inference or open (once)")
        return RoutePolicy(self.name, full_name in self.grpc_inference, self.error_style)


class UndeclaredRoute(RuntimeError):
    """A route or gRPC method that its API declared neither inference nor open: the app does not start."""


@dataclass
class PathPolicies:
    """Every mounted route's policy, found from a request's method and path before the app routes it
    (so that the token is checked before the body is read): exact paths by dict, templated ones by their
    route's regex."""

    exact: dict[str, dict[str, RoutePolicy]] = field(default_factory=dict)
    templated: list[tuple[re.Pattern, dict[str, RoutePolicy]]] = field(default_factory=list)

    def add(self, path: str, regex: re.Pattern, methods: Iterable[str], policy: RoutePolicy) -> None:
        if "{" in path:
            for pattern, by_method in self.templated:
                if pattern.pattern == regex.pattern:
                    break
            else:
                by_method = {}
                self.templated.append((regex, by_method))
        else:
            by_method = self.exact.setdefault(path, {})
        for method in methods:
            by_method[method] = policy

    def of(self, method: str, path: str) -> RoutePolicy:
        """The policy of a request; a path served under other methods keeps their error style."""
        by_method = self.exact.get(path)
        if by_method is None:
            by_method = next((m for regex, m in self.templated if regex.match(path)), None)
        if not by_method:
            return UNROUTED
        policy = by_method.get(method)
        if policy is None:  # 405: the path's API answers it, in its clients' shape; nothing runs
            served = next(iter(by_method.values()))
            return RoutePolicy(served.api, False, served.error_style)
        return policy

    @classmethod
    def of_apis(cls, apis: Iterable[Api]) -> PathPolicies:
        """Every declared route's policy (the app checks, when it is built, that the routes it mounts are
        exactly the declared ones)."""
        table = cls()
        for api in apis:
            for key in sorted(api.declared):
                method, _, path = key.partition(" ")
                table.add(path, compile_path(path)[0], [method], api.policy_of(method, path))
        return table

    def needs_token(self, method: str, path: str) -> bool:
        """Whether a request must carry the token (RoutePolicy.needs_token of its route)."""
        return self.of(method, path).needs_token(method)
