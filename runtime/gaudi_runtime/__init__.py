"""gaudi-serve runtime: a TGI-compatible router in front of tensor-parallel shards."""

from gaudi_runtime.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # `from gaudi_runtime import LLM` loads the offline API on first use: `import gaudi_runtime` stays cheap.
    if name in ("LLM", "SamplingParams"):
        from gaudi_runtime import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'gaudi_runtime' has no attribute {name!r}")
