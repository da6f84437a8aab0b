"""The runtime's version, importable without the package's lazy offline API (no import cycle)."""

__version__ = "0.1.0"
