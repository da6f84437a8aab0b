"""gaudi-serve runtime: a TGI-compatible router in front of tensor-parallel shards."""

__version__ = "0.1.0"
