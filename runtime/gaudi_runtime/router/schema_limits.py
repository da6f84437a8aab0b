"""How large and how deep a JSON schema (or grammar) in a request may be.

A schema in a request is compiled into a grammar and rendered into chat templates; its cost grows
with its size and its nesting, so both are bounded (`--max-json-schema-bytes`,
`--max-json-schema-depth`) before anything reads it. Pure functions; the walk is iterative, so a
schema nested deeper than Python's recursion limit is measured, not crashed on.
"""

from __future__ import annotations

import json
from typing import Any

from gaudi_runtime.config import StructuredOutputConfig
from gaudi_runtime.router.errors import ValidationError


def json_depth(value: Any, stop_after: int) -> int:
    """Nesting of objects and arrays in `value` (a scalar is 0, `{}` is 1), counted up to
    `stop_after + 1`: past that it only matters that the limit is exceeded."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_schema(value: Any, field: str, max_bytes: int, max_depth: int) -> None:
    """Refuse (HTTP 422) a schema `value` of the request's `field` that is larger than `max_bytes`
    as compact JSON, or nested deeper than `max_depth`. A string (a regular expression, or a schema
    sent as JSON text) is measured as it is, and its depth once parsed."""
    if isinstance(value, str):
        size = len(value.encode("utf-8"))
        try:
            value = json.loads(value)
        except RecursionError:
            value = _too_deep(field, max_depth)
        except ValueError:
            value = None  # not JSON text (a regular expression): only its size is bounded
    else:
        size = None
    if json_depth(value, max_depth) > max_depth:
        _too_deep(field, max_depth)
    if size is None:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > max_bytes:
        raise ValidationError(f"`{field}` is {size} bytes, more than --max-json-schema-bytes ({max_bytes})")


def _too_deep(field: str, max_depth: int):
    raise ValidationError(f"`{field}` is nested more than {max_depth} levels deep (--max-json-schema-depth)")


def check_json_schemas(fields: list[tuple[str, Any]], structured: StructuredOutputConfig) -> None:
    """Every (field name, schema) of one request against the server's limits."""
    for name, value in fields:
        if value is not None:
            check_json_schema(value, name, structured.max_json_schema_bytes, structured.max_json_schema_depth)
