"""The service's shape, kept by tests (issue 47, ../shared/DESIGN.md "The service"):

- Auth by declaration: every route the HTTP app mounts and every gRPC method it serves has exactly one
  policy its API declared (inference: the token and the in-flight count; or open), and a route or
  method that declares nothing stops the app from being built. Walked over the real app: with a token
  set, every inference route refuses a request without it (401 before its body is read) and no open
  route does.
- Import rules: APIs import only the front and the engine (and observability's spans), never a
  transport or another API; transports never import each other; the front imports no API and no
  transport; the engine imports no front, API or transport; runtimes, observability and hosting import
  nothing above them; no room imports the embedding job (jobs/, which runs the engine): the composition
  hands the Batch API what it needs of it (issue 55).
"""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter
from starlette.routing import Route

from service.apis import APIS, path_policies
from service.front.gate import Gate
from service.front.policy import UNROUTED, Api, UndeclaredRoute
from service.grpc.servicer import grpc_methods, grpc_policies, grpc_services
from service.http.server import DOCS, app, build_app

SERVICE = Path(__file__).resolve().parents[1] / "service"


def mounted_routes() -> list[tuple[str, str]]:
    return [(method, route.path) for route in app.routes if isinstance(route, Route)
            for method in sorted(route.methods or ()) if method != "HEAD"]


def test_every_mounted_route_has_the_policy_its_api_declared():
    routes = mounted_routes()
    assert len(routes) >= 35  # every API's routes are mounted: native, openai, kserve_v2, tei, cohere, ops, docs
    declared = {key: api for api in (*APIS, DOCS) for key in api.declared}
    for method, path in routes:
        api = declared.get(f"{method} {path}")
        assert api is not None, f"{method} {path} is mounted without a declaration"
        if api is DOCS:
            continue
        policy = path_policies().of(method, re.sub(r"\{[^}]+\}", "x", path))
        assert policy is not UNROUTED and policy.api == api.name, (method, path, policy)
        assert policy.inference == (f"{method} {path}" in api.inference), (method, path)
    inference = sorted(k for api in APIS for k in api.inference)
    # what the service has always counted as inference: the model runs, or the tokenizer does
    assert inference == sorted([
        "POST /v1/encode", "POST /v1/tokenize", "POST /v1/attention", "POST /v1/similarity", "POST /v1/rerank",
        "POST /v1/classify", "POST /v1/embeddings", "POST /v2/models/{name}/infer",
        "POST /v2/models/{name}/versions/{version}/infer", "POST /", "POST /embed", "POST /embed_all",
        "POST /rerank", "POST /predict", "POST /tokenize", "POST /decode", "POST /v2/embed", "POST /v2/rerank",
        "POST /embed_sparse", "POST /v1/score", "POST /score",
        # the model repository: loading and unloading a model costs memory and evicts others' (docs/models.md)
        "POST /v2/repository/models/{name}/load", "POST /v2/repository/models/{name}/unload"])
    # keyed: they need the key and run no inference, so none of its limits per minute counts them (issue 58): the
    # Batch API's (a key sees its own files and batches; its lines count, each as the key's request) and /v1/usage
    assert sorted(k for api in APIS for k in api.keyed) == sorted([
        "POST /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content", "DELETE /v1/files/{file_id}",
        "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}", "POST /v1/batches/{batch_id}/cancel",
        "GET /v1/usage"])


def test_every_grpc_method_has_the_policy_its_api_declared():
    served = {service.path(name) for service in grpc_services() for name in service.methods}
    assert served == set(grpc_policies()) and len(served) == 9
    assert sorted(full for full, p in grpc_policies().items() if p.inference) == [
        f"/inference.GRPCInferenceService/{m}" for m in ("ModelInfer", "RepositoryModelLoad", "RepositoryModelUnload")]
    assert {name for name in vars(grpc_methods()) if not name.startswith("_")} == {full.rsplit("/", 1)[1] for full in served}


def _with(api: Api) -> tuple[Api, ...]:
    return (*APIS, api)


def test_a_route_that_declares_nothing_stops_the_app_from_being_built(monkeypatch, tmp_path):
    import sys
    import types

    module = types.ModuleType("undeclared_routes")
    module.router = APIRouter()

    @module.router.post("/v1/sixth-api")
    async def sixth() -> dict:
        return {}

    monkeypatch.setitem(sys.modules, "undeclared_routes", module)
    with pytest.raises(UndeclaredRoute, match="POST /v1/sixth-api"):
        build_app(_with(Api("sixth", routes=("undeclared_routes",))))
    with pytest.raises(UndeclaredRoute, match="POST /v1/sixth-api"):  # declared both ways: no policy either
        build_app(_with(Api("sixth", routes=("undeclared_routes",), inference=frozenset({"POST /v1/sixth-api"}),
                            open=frozenset({"POST /v1/sixth-api"}))))
    with pytest.raises(UndeclaredRoute, match="POST /v1/seventh"):  # a declaration no route serves
        build_app(_with(Api("sixth", routes=("undeclared_routes",), inference=frozenset({"POST /v1/sixth-api",
                                                                                         "POST /v1/seventh"}))))
    built = build_app(_with(Api("sixth", routes=("undeclared_routes",), inference=frozenset({"POST /v1/sixth-api"}))))
    assert "/v1/sixth-api" in {getattr(r, "path", None) for r in built.routes}
    with pytest.raises(UndeclaredRoute, match="ModelInfer"):
        Api("sixth", routes=(), grpc_open=frozenset({"/x.Y/Other"})).grpc_policy_of("/inference.GRPCInferenceService/ModelInfer")


def test_with_a_token_set_every_inference_route_refuses_a_request_without_it_and_no_open_route_does(monkeypatch):
    """The real app, in process: the gate answers before any route runs (no replica is needed for a 401;
    an open route without a replica fails later, in its own way, but never with a 401)."""
    from service.front.keys import Keyring

    monkeypatch.setattr(Gate, "token", b"secret-for-the-walk")
    monkeypatch.setattr(Gate, "keyring", Keyring.load(None, b"secret-for-the-walk"))

    async def walk() -> dict[str, int]:
        statuses = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://test") as client:
            for method, path in mounted_routes():
                url = re.sub(r"\{[^}]+\}", "x", path)
                r = await client.request(method, url, json={})
                statuses[f"{method} {path}"] = r.status_code
                if r.status_code == 401:
                    assert r.headers["www-authenticate"].startswith("Bearer"), (method, path)
        return statuses

    statuses = asyncio.run(walk())
    keyed = {k for api in APIS for k in api.inference | api.keyed}  # keyed: the key, no inference (/v1/usage)
    assert {k for k, s in statuses.items() if s == 401} == keyed, statuses
    # a write to a path no route serves needs the token too: nothing new is ever served open
    assert path_policies().needs_token("POST", "/v1/not-yet-a-route")


# ---- import rules ----

ROOMS = ("apis", "front", "engine", "http", "grpc", "runtimes", "observability", "hosting")
# room -> the rooms it must not import (composition at service/'s top level may import anything)
FORBIDDEN = {
    "apis": {"http", "grpc", "hosting"},
    "front": {"apis", "http", "grpc", "hosting"},
    "engine": {"front", "apis", "http", "grpc", "hosting"},
    "http": {"grpc", "hosting"},
    "grpc": {"http", "hosting"},
    "runtimes": {"engine", "front", "apis", "http", "grpc", "hosting", "observability"},
    "observability": {"engine", "front", "apis", "http", "grpc", "hosting", "runtimes"},
    "hosting": {"engine", "front", "apis", "http", "grpc", "runtimes", "observability"},
}
COMPOSITION = {"deployment", "app", "__main__", "ingress_callback"}


WATCHED = {"service", "jobs"}  # the packages whose imports the rules look at (jobs/: the embedding job)


def imports_of(path: Path) -> set[str]:
    """Every `service...` (and `jobs...`) module a file imports, at any depth (functions' imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in WATCHED:
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in WATCHED)
    return found


def violations(root: Path) -> list[str]:
    """Every import in the tree under `root` (a `service` folder) that breaks the rules above."""
    broken = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        room = parts[0] if len(parts) > 1 else None
        for target in imports_of(path):
            names = target.split(".")
            if names[0] == "jobs":  # the job runs the engine: only the composition, above both, may hand it down
                if room is not None:
                    broken.append(f"{path.relative_to(root)} ({room}) imports the embedding job ({target})")
                continue
            into = names[1] if len(names) > 1 else None
            if into in COMPOSITION and room is not None:
                broken.append(f"{path.relative_to(root)} imports the composition ({target})")
            if room in FORBIDDEN and into in FORBIDDEN[room]:
                broken.append(f"{path.relative_to(root)} ({room}) imports {target}")
            if room == "apis" and len(parts) > 2 and into == "apis" and len(names) > 2 and names[2] != parts[1]:
                broken.append(f"{path.relative_to(root)} (API {parts[1]}) imports another API: {target}")
    return broken


def test_the_import_rules_hold():
    assert set(ROOMS) <= {p.name for p in SERVICE.iterdir() if p.is_dir()}
    broken = violations(SERVICE)
    assert not broken, "\n".join(broken)


def test_the_import_rules_catch_what_they_forbid(tmp_path):
    """Planted imports, at any depth (a function's own), are each found."""
    planted = {
        "http/x.py": "def f():\n    from service.grpc.servicer import answer\n",
        "apis/tei/y.py": "from service.apis.native.heads import rerank\n",
        "engine/z.py": "import service.front.call\n",
        "apis/cohere/w.py": "from service.http.errors import error_response\n",
        "front/v.py": "from service.deployment import Encoder\n",
        "apis/openai_batch/u.py": "def f():\n    from jobs.shards import read_records\n",
    }
    for name, code in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(code)
    (tmp_path / "apis" / "tei" / "fine.py").write_text("from service.apis.tei.schemas import X\nfrom service.front.call import Call\n")
    broken = violations(tmp_path)
    assert len(broken) == len(planted), broken
    assert all(any(name in line for line in broken) for name in planted), broken
