"""OpenAI-style errors: every failure leaves as {"error": {message, type, param, code}}.

FastAPI's 422 for a malformed body becomes a 400, as OpenAI answers.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.http.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


_QUOTE_CHARS = 64       # user input quoted in a message: at most this many characters
_MESSAGE_CHARS = 500    # any error message: at most this many characters


def quote(text: str) -> str:
    """A short prefix of user input, for an error message."""
    return text if len(text) <= _QUOTE_CHARS else f"{text[:_QUOTE_CHARS]}... ({len(text)} characters)"


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def from_value_error(err: ValueError, fields: set[str]) -> OpenAIError:
    """A 400 for a rejected value; `param` is the field the message starts with, if any."""
    message = str(err)[:_MESSAGE_CHARS]
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first in fields else None)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{quote(name)}` does not exist.", param="model", code="model_not_found")


def internal(message: str) -> OpenAIError:
    return OpenAIError(500, message[:_MESSAGE_CHARS], type="internal_error")


def invalid_api_key() -> OpenAIError:
    return OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")


def admin_disabled() -> OpenAIError:
    return OpenAIError(403, "no admin key configured: start the router with $PDSERVE_ADMIN_KEY (or --admin-api-key) "
                       "to use /admin", type="permission_error", code="admin_disabled")


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="service_unavailable_error")


def error_body(error: OpenAIError) -> dict:
    return ErrorResponse(error=error.info).model_dump()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404 for an unknown path, 405 for a wrong method, in OpenAI's shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(OpenAIError(exc.status_code, str(exc.detail), type=kind)),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Anything unforeseen: a 500 in OpenAI's shape (the server logs the traceback)."""
    message = f"internal error: {type(exc).__name__}: {exc}"[:_MESSAGE_CHARS]
    return JSONResponse(error_body(OpenAIError(500, message, type="internal_error")), status_code=500)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return JSONResponse(error_body(bad_request(
            f"We could not parse the JSON body of your request ({first['msg']}).")), status_code=400)
    loc = [str(part) for part in first["loc"] if part != "body" and not _is_union_tag(part)]
    param = ".".join(loc) or None
    message = (f"{param}: {first['msg']}" if param else first["msg"])[:_MESSAGE_CHARS]
    return JSONResponse(error_body(bad_request(message, param)), status_code=400)


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member tried in an error's loc ("str", "list[int]"): not a field."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "none"})
