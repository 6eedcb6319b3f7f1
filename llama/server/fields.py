"""What a client can get wrong: `ApiError`, OpenAI's one error shape, and the checks of one request field.

Plain Python, no HTTP and no tensors. Everything a client can get wrong is an `ApiError`, which is made into
OpenAI's one error shape here and nowhere else: `{"error": {"message", "type", "param", "code"}}`.
"""

import math
from typing import Any, Dict, Optional


class ApiError(Exception):
    """A request the server will not run, with the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error object: the one shape every error on the wire has."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def check_object(body: Any) -> Dict[str, Any]:
    """The request body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def number(body: Dict[str, Any], name: str, default: Optional[float], low: float, high: float,
           param: Optional[str] = None) -> Optional[float]:
    """`body[name]`, a number from `low` to `high`, or `default` where it is absent; errors name `param` (or `name`)."""
    value = body.get(name)
    param = param or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"Invalid type for '{param}': expected a number, but got {kind_of(value)} instead.", param,
                       "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"Invalid '{param}': expected a value from {low:g} to {high:g}, but got {value} instead.",
                       param, "invalid_value")
    return float(value)


def integer(body: Dict[str, Any], name: str, default: Optional[int], low: int, high: Optional[int] = None) -> Optional[int]:
    """`body[name]`, a whole number of at least `low` (and at most `high`), or `default` where it is absent."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"Invalid type for '{name}': expected an integer, but got {kind_of(value)} instead.", name,
                       "invalid_type")
    if value < low or (high is not None and value > high):
        expected = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ApiError(400, f"Invalid '{name}': expected an integer {expected}, but got {value} instead.", name,
                       "invalid_value")
    return value


def boolean(body: Dict[str, Any], name: str, default: bool, param: Optional[str] = None) -> bool:
    """`body[name]`, true or false, or `default` where it is absent; errors name `param` (or `name`)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{param or name}': expected a boolean, but got {kind_of(value)} "
                            "instead.", param or name, "invalid_type")
    return value


def kind_of(value: Any) -> str:
    """A JSON value's type as OpenAI's errors name it: "a string", "an array"."""
    return {str: "a string", bool: "a boolean", list: "an array", dict: "an object", int: "an integer",
            float: "a decimal"}.get(type(value), type(value).__name__)
