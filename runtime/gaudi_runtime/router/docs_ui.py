"""Swagger UI at /docs, over the OpenAPI document at /api-doc/openapi.json.

The UI's files come from the `swagger-ui-bundle-v2` package (installed with the runtime), so the page
loads nothing from outside the server: it works in a cluster without egress. Only the files the
page needs are served, by name.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from aiohttp import web

ASSETS = frozenset({"swagger-ui.css", "index.css", "swagger-ui-bundle.js", "swagger-ui-standalone-preset.js",
                    "favicon-32x32.png", "favicon-16x16.png"})

# Relative links: the page works behind a proxy that serves the router under a path prefix.
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="UTF-8">
  <title>gaudi-serve API</title>
  <link rel="stylesheet" type="text/css" href="docs/swagger-ui.css">
  <link rel="stylesheet" type="text/css" href="docs/index.css">
  <link rel="icon" type="image/png" href="docs/favicon-32x32.png" sizes="32x32">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="docs/swagger-ui-bundle.js" charset="UTF-8"></script>
  <script src="docs/swagger-ui-standalone-preset.js" charset="UTF-8"></script>
  <script>
    window.onload = function () {
      window.ui = SwaggerUIBundle({
        url: "api-doc/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
        presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
        plugins: [SwaggerUIBundle.plugins.DownloadUrl], layout: "StandaloneLayout",
      });
    };
  </script>
</body>
</html>
"""


def _assets_dir() -> Path | None:
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return Path(swagger_ui_path)


async def handle_docs(request: web.Request) -> web.Response:
    if _assets_dir() is None:
        raise web.HTTPNotFound(text="Swagger UI is not installed (pip install swagger-ui-bundle-v2); "
                                    "the API document is at /api-doc/openapi.json")
    return web.Response(text=PAGE, content_type="text/html")


async def handle_docs_asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    root = _assets_dir()
    if root is None or name not in ASSETS or not (root / name).is_file():
        raise web.HTTPNotFound()
    content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return web.FileResponse(root / name, headers={"Content-Type": content_type,
                                                  "Cache-Control": "public, max-age=86400"})
