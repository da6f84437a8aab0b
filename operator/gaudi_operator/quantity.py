"""Kubernetes resource quantities as numbers and back (pure).

The operator adds its own sizes (spec.kvCache.offload's host tier, its emptyDir) to the user's
resources, which may be written in any suffix the API server accepts ("64Gi", "68719476736", "0.5Ti",
"64000M", 8), and hands the runtime sizes in GiB.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

__all__ = ["GIB", "MIB", "add", "bytes_of", "format_bytes", "gib_text"]

MIB, GIB = 2**20, 2**30
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


def bytes_of(quantity: str | int | float) -> Decimal:
    """The value of a quantity ("16Gi" -> 17179869184); ValueError when it is not one."""
    if isinstance(quantity, bool):
        raise ValueError(f"not a quantity: {quantity!r}")
    if isinstance(quantity, (int, float)):
        return Decimal(str(quantity))
    m = _QUANTITY.match(quantity.strip())
    if not m:
        raise ValueError(f"not a quantity: {quantity!r}")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** int(suffix[1:])
    return number * _DECIMAL[suffix]


def format_bytes(value: Decimal | int) -> str:
    """A whole number of bytes in the largest binary unit that writes it exactly (rounded up to a byte)."""
    n = int(Decimal(value).to_integral_value(rounding=ROUND_CEILING))
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        unit = _BINARY[suffix]
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def add(quantity: str | int | float, extra: Decimal | int) -> str:
    """`quantity` plus `extra` bytes, as a quantity."""
    return format_bytes(bytes_of(quantity) + extra)


def gib_text(value: Decimal | int) -> str:
    """Bytes in GiB as the runtime's --kv-offloading-* settings read them ("16", "0.5", "93.132257"), rounded
    down to a millionth so that the runtime never takes more than it was given."""
    gib = (Decimal(value) / GIB).quantize(Decimal("0.000001"), rounding=ROUND_FLOOR)
    return format(gib.normalize(), "f")
