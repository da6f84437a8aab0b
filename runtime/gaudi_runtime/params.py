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


def samples(p: SamplingParameters) -> bool:
    """Whether a row samples, TGI's token chooser's rule: `do_sample`, or any warper active. A
    temperature <= 0 (which validation refuses) is greedy rather than a division by zero. The router
    settles `do_sample` with this rule, and the shard applies the same one to any caller's parameters."""
    if p.temperature <= 0:
        return False
    return bool(p.do_sample or p.temperature != 1.0 or p.top_k != 0 or p.top_p < 1.0 or p.typical_p < 1.0)
