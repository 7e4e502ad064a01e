"""The request guard: what every request passes before any route or engine code runs.

A pure ASGI middleware (so it also covers bodies FastAPI never parses):

* with an API key, a request to anything but :data:`OPEN_PATHS` must carry ``Authorization: Bearer
  <key>``; the key is compared in constant time (``hmac.compare_digest``) and a missing or wrong one
  gets 401 before the body is read;
* the body is read up to ``max_body_bytes`` (a declared ``Content-Length`` above it is refused at
  once) and handed to the application whole; a larger body gets 413.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from .errors import error_response

__all__ = ["RequestGuard", "OPEN_PATHS"]

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key (a load balancer's health check)."""


class RequestGuard:
    """ASGI middleware (module docstring)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self._key is not None and scope.get("path") not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                response = error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(scope, receive, send)
        body, more, messages = bytearray(), True, []
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                messages.append(message)
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        replay = [{"type": "http.request", "body": bytes(body), "more_body": False}] + messages

        async def replayed():
            if replay:
                return replay.pop(0)
            return await receive()

        return await self.app(scope, replayed, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(413, f"the request body exceeds {self.max_body_bytes} bytes (the server's "
                                       f"--max-request-bytes)", code="request_too_large")
        await response(scope, receive, send)
