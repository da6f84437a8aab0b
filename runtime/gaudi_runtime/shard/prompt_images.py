"""The prompt embeddings of a multimodal prefill: image features at the placeholder tokens.

Preprocessed with the model's own processor (Llava); prefills with images run eagerly, since tile
counts vary, so text-only buckets and graphs are untouched.
"""

from __future__ import annotations

import numpy as np
import torch

from gaudi_runtime.shard.inputs import PrefillInput


def load_processor(model_dir: str, model):
    """The model's image processor, or None for a model that takes no images."""
    if not model.takes_images:
        return None
    from gaudi_runtime.models.llava_next import load_image_processor

    return load_image_processor(model_dir)


def _pixels(processor, images: list[bytes]):
    if processor is None:
        raise ValueError("this model takes no images")
    from gaudi_runtime.models.llava_next import pixel_inputs

    try:
        return pixel_inputs(processor, images)
    except Exception as e:  # the router validated them; a failure here is still the request's fault
        raise ValueError(f"cannot preprocess the prompt's images: {e}") from e


def prompt_embeds(model, processor, images: list[bytes], input_ids: torch.Tensor) -> torch.Tensor:
    """Embeddings [rows, seq, hidden] of whole prompts (`input_ids`, padded) holding `images` in order."""
    pixels, sizes = _pixels(processor, images)
    return model.embed_prompt(input_ids, pixels, sizes)


def context_embeds(model, processor, reqs: list[PrefillInput], rows: int, seq: int,
                   device: torch.device) -> torch.Tensor:
    """The embeddings [rows, seq, hidden] of the tokens after each prompt's cached ones, image features
    merged in: the features of an image whose placeholders the cached part cuts through are needed
    after the cut, so the whole prompts are embedded and the new tokens' rows picked."""
    pixels, sizes = _pixels(processor, [im for r in reqs for im in r.images])
    longest = max(len(r.input_ids) for r in reqs)
    full = torch.zeros(len(reqs), longest, dtype=torch.long, device=device)
    for i, r in enumerate(reqs):
        full[i, : len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long)
    embeds = model.embed_prompt(full, pixels, sizes)  # [n, longest, hidden]
    cached = np.array([r.cached_tokens for r in reqs], dtype=np.int64)
    index = torch.from_numpy(np.minimum(cached[:, None] + np.arange(seq)[None, :], longest - 1)).to(device)
    picked = embeds.gather(1, index[..., None].expand(-1, -1, embeds.shape[-1]))
    pad = torch.zeros(rows - len(reqs), seq, embeds.shape[-1], dtype=embeds.dtype, device=device)
    return torch.cat([picked, pad])
