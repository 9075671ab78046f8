"""One HTTP route per row of the operations table (``opencoti.ops.table``).

Each route's signature is built from its row: path parameters, the query model, the body model and
the operations context (a dependency), so FastAPI validates, documents and calls exactly what the
in-process client calls through ``opencoti.ops.call``.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from ..ops import OPERATIONS, Context, Operation
from ..ops.table import PATH_PARAMS
from .errors import SafeJSONResponse, error_responses
from .routing import JsonRoute
from .state import get_ctx


def _endpoint(op: Operation):
    params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, default=Depends(get_ctx),
                                annotation=Context)]
    for name in op.path_params:
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                        annotation=Annotated[PATH_PARAMS[name], Path()]))
    if op.query is not None:
        params.append(inspect.Parameter("query", inspect.Parameter.KEYWORD_ONLY,
                                        annotation=Annotated[op.query, Query()]))
    if op.body is not None:
        params.append(inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=op.body))
    run = op.run

    if op.blocking:
        def endpoint(**kw: Any):  # a plain function: FastAPI runs it in a worker thread, and the answer
            return SafeJSONResponse(run(kw.pop("ctx"), **kw))  # is encoded there too (it can be large)
    else:
        async def endpoint(**kw: Any):
            return SafeJSONResponse(run(kw.pop("ctx"), **kw))

    endpoint.__signature__ = inspect.Signature(params)
    endpoint.__name__ = op.name
    endpoint.__doc__ = op.summary
    return endpoint


def operations_router() -> APIRouter:
    router = APIRouter(route_class=JsonRoute)
    for op in OPERATIONS.values():
        if not op.route:
            continue
        endpoint = _endpoint(op)
        responses = error_responses(op.errors)
        if op.result is not None:
            responses[200] = {"model": op.result}
        router.add_api_route(op.path, endpoint, methods=[op.method], summary=op.summary or None,
                             tags=list(op.tags), responses=responses, operation_id=op.name)
        for alias in op.aliases:
            router.add_api_route(alias, endpoint, methods=[op.method], include_in_schema=False)
    return router
