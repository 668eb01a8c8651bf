"""``GET /docs`` (Swagger UI) and ``GET /redoc`` (ReDoc), served from installed packages.

FastAPI's own docs pages load their JavaScript and CSS from a CDN, so on a host without
internet (as many model-serving hosts are) ``/docs`` is a blank page. Here the pages are
FastAPI's own HTML, pointed at assets the gateway serves itself from the installed
``fastapi-offline`` package (which ships Swagger UI's bundle and stylesheet and ReDoc's
standalone script), and ReDoc without Google Fonts: nothing leaves the machine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

DOCS_URL = "/docs"
"""Swagger UI's page (the status page links each pipeline's operation there)."""
REDOC_URL = "/redoc"
"""ReDoc's page."""
ASSETS_URL = "/docs-assets"
"""Where the pages' scripts, stylesheet and icon are served."""

ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
"""The files served, from ``fastapi_offline/static``, with their media types."""


def _asset(name: str) -> bytes:
    return files("fastapi_offline").joinpath("static", name).read_bytes()


def _page(html: bytes) -> Callable[[], Awaitable[HTMLResponse]]:
    async def page() -> HTMLResponse:
        return HTMLResponse(html)

    return page


def add_docs_routes(app: FastAPI) -> None:
    """Add ``/docs``, ``/redoc`` and their assets to ``app`` (created with ``docs_url``
    and ``redoc_url`` None, so FastAPI adds no CDN-backed pages of its own).

    Raises:
        FileNotFoundError: an asset is missing from the installed package (at start, not
            at the first visit).
    """
    loaded = {name: (_asset(name), media) for name, media in ASSETS.items()}
    title = f"{app.title}: API docs"
    openapi_url = app.openapi_url or "/openapi.json"
    icon = f"{ASSETS_URL}/favicon.png"
    pages = {  # the same at every visit: rendered once
        DOCS_URL: get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=icon,
        ).body,
        REDOC_URL: get_redoc_html(
            openapi_url=openapi_url,
            title=title,
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=icon,
            with_google_fonts=False,
        ).body,
    }
    for path, html in pages.items():
        app.add_api_route(path, _page(bytes(html)), include_in_schema=False)

    @app.get(ASSETS_URL + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        found = loaded.get(name)
        if found is None:
            raise HTTPException(404, "no such asset")
        body, media = found
        return Response(body, media_type=media, headers={"Cache-Control": "max-age=86400"})

    app.state.docs_url = DOCS_URL
