"""Fake of Intel Gaudi`s habana_frameworks package (tests only)."""
