"""Per-request parameters shared by the router, the shards and the offline API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParameters:
    """What the shard needs to pick the next token (TGI's NextTokenChooserParameters)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    typical_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0
    # TGI's: minus penalty x count / length, over the prompt and the generated tokens (TGI's routes)
    frequency_penalty: float = 0.0
    # OpenAI's, over the generated tokens only (the OpenAI routes): minus penalty x times generated...
    generated_frequency_penalty: float = 0.0
    # ...and minus penalty once the token has been generated
    presence_penalty: float = 0.0
    seed: int = 0
