"""Route tables and the OpenAPI document built from them (`GET /openapi.json` on a node and the router).

A server lists its routes once as `Route`s: method, path (aiohttp's syntax), handler, the msgspec struct
of its JSON body and its access class (`common.server.security`). `add_routes` registers them,
`access_of` tells the auth middleware the class of a matched route and `openapi_document` describes
them, request bodies as the JSON Schema msgspec emits for the same structs that decode them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from common.protocol import error_body
from common.server.security import OPEN, PUBLIC

_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": ["string", "null"]}}}}}

# OpenAI-style endpoints clients call that this text-generation server does not serve: each answers a JSON 404
# that says so (a 5xx would make the OpenAI SDK retry)
UNSERVED = {"/v1/embeddings": "embeddings", "/v1/responses": "the Responses API",
            "/v1/audio/transcriptions": "audio", "/v1/audio/translations": "audio",
            "/v1/audio/speech": "audio",
            "/v1/images/generations": "images", "/v1/moderations": "moderation", "/v1/rerank": "reranking",
            "/v1/score": "scoring", "/v1/files": "files", "/v1/batches": "batches"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # aiohttp's syntax: "/workers/{id:.+}"
    handler: Callable[..., Any]
    body: type | None = None  # msgspec struct the JSON body decodes into
    access: str = PUBLIC
    summary: str = ""
    stream: bool = False  # may answer with server-sent events

    @property
    def openapi_path(self) -> str:
        return _PARAM.sub(r"{\1}", self.path)


def add_routes(app: web.Application, routes: Iterable[Route]) -> None:
    for r in routes:
        if r.method == "GET":
            app.router.add_get(r.path, r.handler)  # HEAD too
        else:
            app.router.add_route(r.method, r.path, r.handler)


def access_table(routes: Iterable[Route]) -> dict[str, str]:
    """Canonical aiohttp path -> access class (one class per path, whatever the method)."""
    table: dict[str, str] = {}
    for r in routes:
        canonical = _PARAM.sub(r"{\1}", r.path)
        if table.setdefault(canonical, r.access) != r.access:
            raise ValueError(f"{r.path}: one access class per path")
    return table


def access_of(request: web.Request, table: dict[str, str]) -> str:
    """The access class of the route a request matched; unknown routes count as public (the key is
    checked before a 404 is told)."""
    resource = getattr(request.match_info.route, "resource", None)
    if resource is None:
        return PUBLIC
    return table.get(resource.canonical, PUBLIC)


def _operation(r: Route) -> dict[str, Any]:
    error = {"description": "error in OpenAI's shape; a 400 names the field",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    ok_content: dict[str, Any] = {"application/json": {"schema": {}}}
    if r.stream:
        ok_content["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "operationId": (r.method.lower()
                        + r.openapi_path.replace("/", "_").replace("{", "").replace("}", "")),
        "summary": r.summary or r.path,
        "responses": {"200": {"description": "OK", "content": ok_content}, "default": error},
    }
    params = _PARAM.findall(r.path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                            for p in params]
    if r.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{r.body.__name__}"}}}}
    op["security"] = [] if r.access == OPEN else [{"bearer": []}]
    return op


def openapi_document(title: str, version: str, routes: Iterable[Route],
                     description: str = "") -> dict[str, Any]:
    routes = list(routes)
    bodies = list(dict.fromkeys(r.body for r in routes if r.body is not None))
    _, schemas = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    schemas["Error"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        paths.setdefault(r.openapi_path, {})[r.method.lower()] = _operation(r)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version, "description": description},
            "paths": paths,
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def unserved_routes() -> list[Route]:
    """A route for each of `UNSERVED`, answering 404 with code `unsupported_endpoint`."""

    async def handle(request: web.Request) -> web.Response:
        what = UNSERVED[request.match_info.route.resource.canonical]
        message = (f"{request.path} ({what}) is not served here: this server generates text; use "
                   "/v1/chat/completions, /v1/completions or /generate")
        return web.json_response(error_body(404, message, "unsupported_endpoint"), status=404)

    return [Route("POST", path, handle, summary=f"not served ({what}): a JSON 404 that says so")
            for path, what in UNSERVED.items()]


def with_openapi(routes: Iterable[Route], title: str, version: str, description: str = "") -> list[Route]:
    """`routes` plus an open `GET /openapi.json` that serves their document (and its own entry)."""
    body: list[bytes] = []

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=body[0], content_type="application/json")

    full = [*routes, Route("GET", "/openapi.json", handle, access=OPEN, summary="this OpenAPI document")]
    body.append(msgspec.json.encode(openapi_document(title, version, full, description)))
    return full
