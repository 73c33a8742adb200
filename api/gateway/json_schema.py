"""A JSON schema given in a request (a response format's, a tool's parameters) checked before use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llumdask.api.gateway.errors import InvalidRequest


# Objects and arrays a schema may nest: vLLM's bound (MAX_STRUCTURED_OUTPUT_JSON_NESTING), past
# which its grammar conversion refuses it; checked first, before anything recurses into it.
MAX_NESTING = 64


def check_schema(schema: Any, param: str) -> None:
    """400 naming `param` unless `schema` is an object that is a valid JSON schema (checked
    against its metaschema: a wrong one would otherwise fail inside the engine's grammar) nested
    at most MAX_NESTING levels."""
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{param} must be an object", param=param, code="invalid_type")
    if nesting(schema) > MAX_NESTING:
        raise InvalidRequest(f"{param} nests objects and arrays deeper than {MAX_NESTING} levels", param=param,
                             code="invalid_value")
    if not isinstance(schema.get("$schema", ""), str):
        raise InvalidRequest(f"{param}.$schema must be the URI of a JSON schema dialect", param=param,
                             code="invalid_value")
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"{param} is not a valid JSON schema: {exc.message}", param=param,
                             code="invalid_value") from None
    except Exception as exc:  # what jsonschema's own checks let through (a pattern's repeat count past re's)
        raise InvalidRequest(f"{param} is not a valid JSON schema: {exc}", param=param, code="invalid_value") from None


def nesting(value: Any) -> int:
    """How deep objects and arrays nest in `value` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest
