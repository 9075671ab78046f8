"""``/openapi.json`` as the server really answers: the error schema instead of FastAPI's 422 (a bad
request is a 400 in llama.cpp's shape; Anthropic's shape on /v1/messages*), 401 and a bearer scheme
when a key is required."""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .errors import ANTHROPIC_PATHS, AnthropicErrorResponse, ErrorResponse

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _bound_token_ids(node, vocab_size: int) -> None:
    """Every token id schema (``x-token-id``) gets the served model's last id as its maximum."""
    if isinstance(node, dict):
        if node.get("x-token-id") is True:
            node["maximum"] = vocab_size - 1
        for v in node.values():
            _bound_token_ids(v, vocab_size)
    elif isinstance(node, list):
        for v in node:
            _bound_token_ids(v, vocab_size)


def install_openapi(app: FastAPI, auth: bool, public_paths: frozenset[str],
                    operator_only: frozenset[str] = frozenset(),
                    vocab_size: Callable[[], int | None] = lambda: None) -> None:
    """``vocab_size``: the served model's vocabulary (None while it loads: the document is then made
    again on the next call, not kept)."""
    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, model in (("ErrorResponse", ErrorResponse), ("AnthropicErrorResponse", AnthropicErrorResponse)):
            if name not in schemas:
                schemas[name] = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schemas[name].pop("$defs", {}))
        for path, item in doc.get("paths", {}).items():
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None or "requestBody" in op or op.get("parameters"):
                    responses.setdefault("400", _error("invalid request"))
                if auth and path not in public_paths:
                    responses.setdefault("401", _error("missing or wrong API key"))
                    op["security"] = [{"bearer": []}]
                if path in operator_only:
                    responses.setdefault("403", _error("a tenant's key: this route answers the operator's key only"))
                if path.startswith(ANTHROPIC_PATHS):  # errors there take Anthropic's shape
                    for status, resp in responses.items():
                        if str(status)[:1] in "45" and "content" in resp:
                            resp["content"] = {"application/json": {"schema": _ANTHROPIC_ERROR_REF}}
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        if auth:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        vocab = vocab_size()
        if vocab is not None:
            _bound_token_ids(doc, vocab)
            app.openapi_schema = doc
        return doc

    app.openapi = openapi
