"""OpenAI-style errors: one JSON shape for every refusal, whatever refused it.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status: 400
``invalid_request_error`` (the field at fault in ``param``), 401 ``authentication_error``, 404
``not_found_error`` (an unknown model: code ``model_not_found``, as OpenAI and vLLM answer), 413
``request_too_large``, 500 ``internal_error``.  :func:`install` routes FastAPI's own refusals
(malformed JSON, a type error pydantic found, an unknown route) through the same shape.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from .protocol import ErrorBody, ErrorResponse

__all__ = ["APIError", "error_response", "install", "param_of"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error"}

log = logging.getLogger("ninfer_kv.server")


class APIError(Exception):
    """A refusal with its HTTP status, message, the field at fault and a code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """The JSON response of a refusal."""
    body = ErrorResponse(error=ErrorBody(message=message, type=_TYPES.get(status, "internal_error"), param=param,
                                         code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_LEADING_NAME = re.compile(r"^([a-z_]+)(?:\[\d+\])?[=\s]")


def param_of(message: str) -> str | None:
    """The field a :class:`~ninfer_kv.engine.SamplingParams` message names first (``"temperature=-1 is
    out of range ..."`` -> ``"temperature"``), or ``None``."""
    m = _LEADING_NAME.match(message)
    return m.group(1) if m else None


def _validation_param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not isinstance(p, int)]
    return parts[0] if parts else None


def install(app: FastAPI) -> None:
    """Route every refusal through :func:`error_response`."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = first.get("loc", ())
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
        where = ".".join(str(p) for p in loc if p != "body") or "body"
        message = f"{where}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return error_response(400, message, param=_validation_param(loc), code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else "invalid request"
        return error_response(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error serving %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")
