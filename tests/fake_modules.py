"""Recording fakes of modules that cannot be installed here (`habana_frameworks`, `neural_compressor`),
from tests/fakes, loaded fresh for one test."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

FAKES = str(Path(__file__).resolve().parent / "fakes")


def _modules(package: str) -> list[str]:
    return [m for m in sys.modules if m == package or m.startswith(package + ".")]


def _forget(monkeypatch, package: str) -> None:
    """Before a test: drop `package`'s modules, put back by monkeypatch's undo after the test."""
    for name in _modules(package):
        monkeypatch.delitem(sys.modules, name)


def _drop(package: str) -> None:
    """After a test: drop the modules the test imported. Not through monkeypatch, whose undo (after
    the fixture's end) would put them back for every later test."""
    for name in _modules(package):
        del sys.modules[name]


def load_fake(monkeypatch, package: str, module: str):
    """For a fixture to `yield from`: a fresh import of `module` (from `package`'s fake) with its record
    reset, yielded as that record; afterwards nothing of the fake stays importable."""
    monkeypatch.syspath_prepend(FAKES)
    _forget(monkeypatch, package)
    fake = importlib.import_module(module)
    fake.reset()
    yield fake.RECORD
    _drop(package)


def forget(package: str) -> None:
    """Drop every imported module of `package`: the next import runs it afresh, as a new process would.
    For a test inside `importable_fake` or `load_fake`, whose modules are the test's own imports."""
    _drop(package)


def importable_fake(monkeypatch, package: str):
    """For a fixture to `yield from`: `package`'s fake importable but not yet imported, so that the code under
    test makes the first import (as a fresh process does); afterwards nothing of it stays importable."""
    monkeypatch.syspath_prepend(FAKES)
    _forget(monkeypatch, package)
    yield
    _drop(package)
