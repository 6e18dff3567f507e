"""Error translation: pydantic's validation errors -> one OpenAI-shaped 400 naming the field; a finished request's error
-> its HTTP status; the error responses every route documents (ERRORS)."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

from fastapi.exceptions import RequestValidationError

from kdtree.decode.request import Request, RequestCancelled, RequestTimeout
from kdtree.errors import KdtreeError
from kdtree.serve import protocol as P
from kdtree.serve.transport import ApiError


def param_and_message(err: Dict[str, Any]) -> Tuple[Optional[str], str]:
    loc = [x for x in err.get("loc", ()) if x != "body"]
    # union branches add their type as a location part ("str", "list[int]", "function-after[...]"): not a field
    path = [x for x in loc if isinstance(x, int) or ("[" not in x and x not in ("str", "int", "float", "bool"))]
    param = ".".join(str(x) for x in path) or None
    kind = err.get("type", "")
    if kind == "missing" and not path:
        return None, ('request body is empty; send a JSON object, e.g. {"prompt": "2+2=", "max_tokens": 8} '
                      '(Content-Type: application/json)')
    if kind == "missing":
        return param, f"missing required field '{param}'"
    if kind == "extra_forbidden":
        return param, (f"unknown parameter '{param}': not part of the OpenAI API or not supported by this server; "
                       f"remove it")
    if not path and kind in ("model_attributes_type", "dict_type", "model_type"):
        return None, "request body must be a JSON object (send Content-Type: application/json)"
    try:
        got = json.dumps(err.get("input"), allow_nan=False)[:80]
    except (TypeError, ValueError):
        got = repr(err.get("input"))[:80]
    msg = err.get("msg", "invalid value")
    if isinstance(err.get("ctx"), dict) and isinstance(err["ctx"].get("error"), ValueError):
        msg = str(err["ctx"]["error"])
    return param, f"{param or 'body'}: {msg}; got {got}"


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        return ApiError(400, f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    own = [e for e in errors if e.get("type") == "value_error"]      # our validators' messages say the most
    if own:
        param, msg = param_and_message(own[0])
        return ApiError(400, msg, param=param)
    # a union (prompt, stop) reports every branch; the branch that failed on a limit (a token id < 0, 17 stop strings)
    # says what is wrong, the branches of another type ("should be a valid string") do not
    limits = [e for e in errors if not str(e.get("type", "")).endswith("_type") and e.get("type") != "missing"]
    branches = {tuple(e.get("loc", ()))[:3] for e in limits}       # body, field, branch: one branch, one answer
    if len(errors) > 1 and len(branches) == 1:
        param, msg = param_and_message(limits[0])
        return ApiError(400, msg, param=param.split(".")[0] if param else None)     # the field; the item in msg
    params = {param_and_message(e)[0] for e in errors}
    if params == {"prompt"} and len(errors) > 1:       # every branch of prompt's union failed
        return ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list of those; got "
                             + param_and_message(errors[0])[1].rsplit("got ", 1)[-1], param="prompt")
    param, msg = param_and_message(errors[0])
    return ApiError(400, msg, param=param)


ERRORS = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}


def request_error(req: Request) -> ApiError:
    """The HTTP error of a request that ended with an error (a cancelled one that still has a client: the server
    stopped before it finished)."""
    if isinstance(req.error, RequestCancelled):
        return ApiError(503, "the server stopped before this completion finished (drain timeout, "
                             "serve.drain_timeout_s); retry", "service_unavailable", code="cut_by_shutdown")
    if isinstance(req.error, RequestTimeout):
        return ApiError(408, str(req.error), "timeout_error", code="request_timeout")
    if isinstance(req.error, KdtreeError):
        return ApiError(400, str(req.error), param="prompt")
    return ApiError(500, f"engine error: {type(req.error).__name__}: {req.error}", "server_error")
