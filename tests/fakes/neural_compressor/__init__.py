"""Fake of Intel Neural Compressor (tests only): the FP8 API the runtime calls on Gaudi, recording each call."""
