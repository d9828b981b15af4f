"""The edge's ASGI application: seed 002's routes and the OpenAI routes over the gateway's services.

Starlette, for its small routing and streaming layer and nothing else (no dependency injection,
no per-request validation framework): a request costs a route match, the body read, one strict
pydantic-core parse and the service call.
"""

from __future__ import annotations

from sluice.services.edge import openai_routes, seed_routes
from sluice.services.edge.errors import error_reply
from sluice.services.edge.web import EdgeServices
from sluice.services.errors import NotFound
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

NO_SUCH_ROUTE = "no route {method} {path}: see the README's HTTP API section for the endpoints"


async def _no_route(request: Request, exc: Exception) -> Response:
    """404/405 from the router in the same OpenAI error shape as every other refusal."""
    reply = error_reply(NotFound(NO_SUCH_ROUTE.format(method=request.method, path=request.url.path)))
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    return Response(reply.json_bytes(), status_code=status, media_type="application/json")


def build_app(edge: EdgeServices) -> Starlette:
    app = Starlette(routes=[*seed_routes.ROUTES, *openai_routes.ROUTES],
                    exception_handlers={404: _no_route, 405: _no_route})
    app.state.edge = edge
    return app

