"""JSON text exactly as `json.dumps(value, ensure_ascii=False)` writes it.

The router's per-token stream events are rendered from templates of their fixed parts, with only
the values that change serialized here: that costs a fraction of serializing a dict per token,
and the bytes are the same.
"""

from __future__ import annotations

import json
import math

# Made once: `json.dumps` with any argument builds a new encoder per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False)


def dumps(value) -> str:
    """`json.dumps(value, ensure_ascii=False)`."""
    return _ENCODER.encode(value)


string = dumps  # a str: quoted and escaped, characters outside ASCII as they are


def logprob(v: float | None) -> str:
    """A log-probability, or null where JSON has no number for it (NaN, infinities, None)."""
    if type(v) is float:
        return float.__repr__(v) if math.isfinite(v) else "null"  # json writes floats with float.__repr__
    return "null" if v is None or math.isnan(v) or math.isinf(v) else dumps(v)
