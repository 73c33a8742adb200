"""A JSON schema given in a request (a response format's, a tool's parameters) checked before use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llumdask.api.gateway.errors import InvalidRequest


def check_schema(schema: Any, param: str) -> None:
    """400 naming `param` unless `schema` is an object that is a valid JSON schema (checked
    against its metaschema: a wrong one would otherwise fail inside the engine's grammar)."""
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{param} must be an object", param=param, code="invalid_type")
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"{param} is not a valid JSON schema: {exc.message}", param=param,
                             code="invalid_value") from None
