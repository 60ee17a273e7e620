"""`/docs`: Swagger UI served from the package, under a CSP that allows no other origin.

FastAPI's default page loads Swagger UI from a CDN without integrity checks, on the same origin
where the console keeps the API key and admin token in session storage: whoever controlled that
CDN's file could read them. The bundle (swagger-ui-dist 5.35.0, Apache-2.0, licence and notice
beside it) is vendored under `api/console/`, served like the console's own assets, and the page
runs no inline script. ReDoc (also from a CDN) is not served.
"""

from __future__ import annotations

import functools
import hashlib

from fastapi import APIRouter
from fastapi.responses import Response

from servewell.api.routes_console import asset
from servewell.errors import NotFound

router = APIRouter(tags=["docs"])

#: The packaged files the docs page loads, and their media types.
DOCS_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "docs.js": "text/javascript; charset=utf-8",
}
#: Swagger UI sets inline styles; scripts, fetches and images stay on this origin.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _url(name: str) -> str:
    return f"/console/assets/docs/{name}?v={hashlib.sha256(asset(name)).hexdigest()[:12]}"


@functools.cache
def _page() -> str:
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>servewell - API docs</title>'
        f'<link rel="stylesheet" href="{_url("swagger-ui.css")}"></head>'
        f'<body><div id="swagger-ui"></div><script src="{_url("swagger-ui-bundle.js")}"></script>'
        f'<script src="{_url("docs.js")}"></script></body></html>\n'
    )


@router.get("/docs", include_in_schema=False)
async def docs_page() -> Response:
    """The API documentation (open, like the console page: it holds no data)."""
    return Response(_page(), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


@router.get("/console/assets/docs/{name}", include_in_schema=False)
async def docs_asset(name: str) -> Response:
    """One of the docs page's packaged files (`DOCS_ASSETS`); 404 for any other name."""
    media_type = DOCS_ASSETS.get(name)
    if media_type is None:
        raise NotFound("no such docs asset")
    return Response(asset(name), media_type=media_type,
                    headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})
