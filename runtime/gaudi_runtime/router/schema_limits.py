"""How large and how deep a JSON schema (or grammar) in a request may be.

A schema in a request is compiled into a grammar and rendered into chat templates; its cost grows
with its size and its nesting, so both are bounded (`--max-json-schema-bytes`,
`--max-json-schema-depth`) before anything reads it. Pure functions; the walk is iterative, so a
schema nested deeper than Python's recursion limit is measured, not crashed on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class MeasuredSchema:
    """A schema (or regex) of a request that passed the limits: `value` as parsed (a string sent as
    JSON text, parsed; None when it is not JSON, with the parser's complaint in `error`), and `text`,
    its compact JSON text when measuring had to write it (a value sent as an object): the grammar
    the shards compile reuses it, so the schema is serialised once."""

    value: Any
    text: str | None = None
    error: json.JSONDecodeError | None = None


def check_json_schema(value: Any, field: str, max_bytes: int, max_depth: int) -> MeasuredSchema:
    """Refuse (HTTP 422) a schema `value` of the request's `field` that is larger than `max_bytes`
    as compact JSON, or nested deeper than `max_depth`. A string (a regular expression, or a schema
    sent as JSON text) is measured as it is, and its depth once parsed."""
    text = error = None
    if isinstance(value, str):
        size = len(value.encode("utf-8"))
        try:
            value = json.loads(value)
        except RecursionError:
            value = _too_deep(field, max_depth)
        except json.JSONDecodeError as e:
            value, error = None, e  # not JSON text (a regular expression): only its size is bounded
        except ValueError:
            value = None
    else:
        size = None
    if json_depth(value, max_depth) > max_depth:
        _too_deep(field, max_depth)
    if size is None:
        text = compact(value)
        size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise ValidationError(f"`{field}` is {size} bytes, more than --max-json-schema-bytes ({max_bytes})")
    return MeasuredSchema(value, text, error)


def compact(value: Any) -> str:
    """A schema as the shards compile it: compact JSON, text as it is (no \\u escapes)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _too_deep(field: str, max_depth: int):
    raise ValidationError(f"`{field}` is nested more than {max_depth} levels deep (--max-json-schema-depth)")


def check_json_schemas(fields: list[tuple[str, Any]], structured: StructuredOutputConfig) -> list[MeasuredSchema | None]:
    """Every (field name, schema) of one request against the server's limits; None for a field
    that is absent."""
    return [None if value is None else measure(value, name, structured) for name, value in fields]


def measure(value: Any, field: str, structured: StructuredOutputConfig) -> MeasuredSchema:
    """One schema of a request against the server's limits."""
    return check_json_schema(value, field, structured.max_json_schema_bytes, structured.max_json_schema_depth)
