"""The pages a person opens: GET / (where to go) and GET /explorer (the attention explorer), with
the explorer's script and stylesheet. Everything ships with the service: no CDN, no other host.

The pages call the service's own JSON API (/info, /v1/attention, /v1/similarity; the rerank
explorer at /explorer/rerank, /v1/rerank). Links are
written with the request's root path, so the pages work under a Serve route prefix too.
No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import html
from pathlib import Path

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, Response

from service.engine.errors import NotFound
from service.engine.encoder_service import EncoderService
from service.front.deps import api_router, service
from service.front.gate import Gate
from service.front.responses import JSONResponse

EXPLORER_DIR = Path(__file__).resolve().parents[2] / "explorer"  # service/explorer/
# The only files GET /explorer/assets/{name} serves, with their content types.
ASSETS = {
    "explorer.js": "text/javascript; charset=utf-8",
    "rerank.js": "text/javascript; charset=utf-8",
    "explorer.css": "text/css; charset=utf-8",
}
# The page may talk to its own origin only; a script or style from anywhere else is refused by
# the browser, so a stray CDN link fails loudly in the browser test instead of working online.
router = api_router()

EXPLORER_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
NO_CACHE = {"Cache-Control": "no-cache"}  # revalidate: a new version of the service serves new assets


def read_explorer_file(name: str) -> str:
    """One of the explorer's files, as text (they are small; the OS caches them)."""
    return (EXPLORER_DIR / name).read_text(encoding="utf-8")


def root_path(request: Request) -> str:
    """Where this app is mounted (a Serve route prefix), without a trailing slash."""
    return request.scope.get("root_path", "").rstrip("/")


def wants_html(request: Request) -> bool:
    """Whether the client asked for a page (a browser) rather than data (curl sends */*)."""
    return "text/html" in request.headers.get("accept", "")


def landing_page(root: str, model: str) -> str:
    """GET / for a browser: what this service is and where to go."""
    r = html.escape(root, quote=True)
    m = html.escape(model)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{m} encoder service</title><link rel="icon" href="data:,">
<link rel="stylesheet" href="{r}/explorer/assets/explorer.css"></head>
<body class="landing"><main class="landing-card">
<h1>{m}</h1>
<p>A Transformer encoder served with Ray Serve and onnxruntime.</p>
<ul class="landing-links">
<li><a href="{r}/explorer">Attention explorer</a><span>type a text or two, see every layer and head</span></li>
<li><a href="{r}/docs">API docs</a><span>every route, with examples (OpenAPI at <a href="{r}/openapi.json">/openapi.json</a>)</span></li>
<li><a href="{r}/info">/info</a><span>the model, where it runs, its limits and parity report</span></li>
</ul></main></body></html>
"""


@router.get("/", include_in_schema=False)
async def landing(request: Request, svc: EncoderService = Depends(service)) -> Response:
    """A browser gets a page with links to the explorer, the API docs and /info; any other client
    the same links as JSON."""
    root = root_path(request)
    vary = {"Vary": "Accept"}
    if wants_html(request):
        return HTMLResponse(landing_page(root, svc.engines.default.name), headers=vary)
    return JSONResponse(
        {
            "service": "mha-encoder-serving",
            "model": svc.engines.default.name,
            "links": {"explorer": f"{root}/explorer", "docs": f"{root}/docs", "info": f"{root}/info"},
        },
        headers=vary,
    )


@router.get("/explorer", include_in_schema=False)
async def explorer(request: Request, svc: EncoderService = Depends(service)) -> HTMLResponse:
    """The attention explorer; `?text=...&text=...` opens with those texts analysed."""
    page = (
        read_explorer_file("index.html")
        .replace("{{root}}", html.escape(root_path(request), quote=True))
        .replace("{{auth}}", "required" if Gate.keyring is not None else "off")
        .replace("{{model}}", html.escape(svc.engines.default.name))
    )
    return HTMLResponse(page, headers={"Content-Security-Policy": EXPLORER_CSP, **NO_CACHE})


@router.get("/explorer/rerank", include_in_schema=False)
async def rerank_explorer(request: Request) -> HTMLResponse:
    """The rerank explorer: a query and documents ranked by a served cross-encoder, each word coloured
    by its attribution; `?query=...&doc=...&doc=...` opens with them ranked."""
    page = read_explorer_file("rerank.html").replace("{{root}}", html.escape(root_path(request), quote=True))
    return HTMLResponse(page, headers={"Content-Security-Policy": EXPLORER_CSP, **NO_CACHE})


@router.get("/explorer/assets/{name}", include_in_schema=False)
async def explorer_asset(name: str) -> Response:
    """The explorer's script and stylesheet; nothing else is served from here."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no explorer asset named {name!r}")
    return Response(read_explorer_file(name), media_type=media_type, headers=NO_CACHE)
