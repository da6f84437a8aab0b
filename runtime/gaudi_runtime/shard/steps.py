"""The step functions of a shard: one forward pass each over a step's inputs (what device graphs capture).

Each takes the tensors its input builder made (`inputs.py`), runs the model over the shard's KV cache with
the attention metadata of its kind, and returns the logits where tokens are sampled (and the hidden states
where prompt log-probabilities may be wanted).
"""

from __future__ import annotations

import torch

from gaudi_runtime.layers.attention import AttentionMetadata
from gaudi_runtime.shard.prompt_images import prompt_embeds


def prefill_meta(slots, context_tables=None, context_lens=None) -> AttentionMetadata:
    """A prefill's metadata: its slots [rows, seq], and the cached blocks its rows start with (None: none)."""
    return AttentionMetadata(is_prefill=True, slots=slots, block_tables=context_tables, context_lens=context_lens)


def decode_meta(slots, tables, context_lens) -> AttentionMetadata:
    """A decode step's metadata: one slot per row [rows], each row's blocks and context length."""
    return AttentionMetadata(is_prefill=False, slots=slots[:, None], block_tables=tables, context_lens=context_lens)


class StepFunctions:
    def __init__(self, model, kv_cache, adapter_rows, image_processor):
        """`adapter_rows`: the model's per-row adapter index (None: no adapters); `image_processor`: a
        multimodal model's (None otherwise)."""
        self.model, self.kv_cache = model, kv_cache
        self.adapter_rows, self.image_processor = adapter_rows, image_processor

    def use_adapters(self, adapters) -> None:
        """Each row's adapter slot for the forward pass that follows (layers/lora.py)."""
        if self.adapter_rows is not None:
            self.adapter_rows.index = adapters

    def prefill_step(self, input_ids, positions, slots, last_idx, adapters):
        self.use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, prefill_meta(slots))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def prefill_images_step(self, images: list[bytes], input_ids, positions, slots, last_idx, adapters):
        """A prefill whose prompts hold images: the vision tower's features replace the placeholder
        tokens' embeddings. Eager (image tile counts vary), so text-only buckets and graphs are untouched."""
        embeds = prompt_embeds(self.model, self.image_processor, images, input_ids)
        self.use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, prefill_meta(slots), inputs_embeds=embeds)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def prefill_context_step(self, input_ids, positions, slots, last_idx, context_tables, context_lens, adapters,
                              inputs_embeds=None):
        """A prefill of the tokens after each prompt's cached blocks (`context_tables`, the first
        `context_lens` positions), which they attend to."""
        meta = prefill_meta(slots, context_tables, context_lens)
        self.use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, inputs_embeds=inputs_embeds)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden, self.model.compute_logits(hidden[rows, last_idx])

    def verify_step(self, input_ids, positions, slots, context_tables, context_lens, adapters):
        """Each row's fed token and drafts [rows, width] over its cached positions -> logits [width, rows, V]
        (position-major, so that each position's logits are one contiguous block for the sampler)."""
        meta = prefill_meta(slots, context_tables, context_lens)
        self.use_adapters(adapters)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        rows, width = input_ids.shape
        return self.model.compute_logits(hidden.transpose(0, 1).reshape(rows * width, -1)).view(width, rows, -1)

    def mixed_step(self, decode_args, prefill_args):
        """A decode step's rows (`decode_inputs`' arguments) and a prefill's (`prefill_step_inputs`', with or
        without cached blocks) in one forward pass over their tokens laid end to end -> logits of each decode
        row, then of each prompt's last token."""
        ids, positions, slots, tables, context_lens, _ = decode_args
        new_ids, new_positions, new_slots, last_idx, *context, _ = prefill_args  # context: cached blocks, lengths
        meta = AttentionMetadata(is_prefill=True, slots=None,
                                 parts=(decode_meta(slots, tables, context_lens), prefill_meta(new_slots, *context)))
        hidden = self.model(torch.cat([ids, new_ids.reshape(-1)])[None],
                            torch.cat([positions, new_positions.reshape(-1)])[None], self.kv_cache, meta)[0]
        d, (rows, seq) = ids.shape[0], new_ids.shape
        last = hidden[d:].view(rows, seq, -1)[torch.arange(rows, device=hidden.device), last_idx]
        return self.model.compute_logits(torch.cat([hidden[:d], last]))

    def decode_step(self, input_ids, positions, slots, tables, context_lens, adapters):
        self.use_adapters(adapters)
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, decode_meta(slots, tables, context_lens))
        return self.model.compute_logits(hidden[:, -1])

    def flat_decode_step(self, input_ids, positions, slots, block_list, block_groups, block_bias, adapters):
        """A decode step whose attention reads the blocks in use, laid out flat (`flat_layout`)."""
        self.use_adapters(adapters)
        meta = AttentionMetadata(is_prefill=False, slots=slots[:, None], block_list=block_list,
                                 block_groups=block_groups, block_bias=block_bias)
        hidden = self.model(input_ids[:, None], positions[:, None], self.kv_cache, meta)
        return self.model.compute_logits(hidden[:, -1])
