"""A batch as a shard keeps it between calls: block tables, lengths, sampler state.

Host-side mirrors are numpy arrays so that per-step bookkeeping is vectorized,
never a Python loop over the requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gaudi_runtime import buckets
from gaudi_runtime.shard.sampling import BatchSampler
from gaudi_runtime.shard.speculation import DraftRows


@dataclass
class ShardBatch:
    id: int
    request_ids: list[int]
    block_tables: torch.Tensor  # [B, W] every reserved block of each request, 0-padded
    block_tables_host: np.ndarray  # the same, on the host, to lay out flat decode steps without a sync
    seq_lens: torch.Tensor  # [B] tokens in the KV cache (device)
    seq_lens_host: np.ndarray  # [B] the same, on the host, to pick buckets without a sync
    last_ids: torch.Tensor  # [B] the token the next decode step feeds
    sampler: BatchSampler
    adapters: torch.Tensor | None = None  # [B] each row's LoRA adapter slot; None: no row has one
    drafts: DraftRows | None = None  # each row's tokens so far and back-off (--speculate); None: off

    def adapter_slots(self) -> torch.Tensor:
        """[B] each row's adapter slot (0: none)."""
        if self.adapters is not None:
            return self.adapters
        return torch.zeros(len(self), dtype=torch.long, device=self.seq_lens.device)

    def __len__(self) -> int:
        return len(self.request_ids)

    def draft_plan(self, speculate: int, long_from: int | None) -> np.ndarray | None:
        """The tokens each row feeds this step, its drafts after them (`DraftRows.plan`); None: a plain step."""
        if self.drafts is None:
            return None
        grammar = self.sampler.grammar
        constrained = () if grammar is None else [m is not None for m in grammar.matchers]
        return self.drafts.plan(speculate, buckets.SPECULATION_MAX_ROWS, constrained, long_from)

    def advance(self, emitted: list[list[int]] | None, drafted: np.ndarray | None = None) -> None:
        """After a step, each row's next position: one token on (`emitted` None: without speculation), or
        as many as the row's `emitted` tokens. Under speculation a row's position stops at its last one
        (prompt + max_new_tokens - 1): a call the router made before the row ended may still name it, and
        must write nowhere past the blocks reserved for it."""
        if emitted is None:
            self.seq_lens, self.seq_lens_host = self.seq_lens + 1, self.seq_lens_host + 1
            return
        self.drafts.advance(emitted, drafted)
        last = np.array([row.limit - 1 for row in self.drafts.rows], dtype=np.int64)
        self.seq_lens_host = np.minimum(self.seq_lens_host + np.array([len(t) for t in emitted]), last)
        self.seq_lens = torch.from_numpy(self.seq_lens_host).to(self.seq_lens.device)

    def filter(self, request_ids: list[int]) -> ShardBatch:
        if request_ids == self.request_ids:
            return self
        pos = {rid: i for i, rid in enumerate(self.request_ids)}
        try:
            keep = [pos[r] for r in request_ids]
        except KeyError as e:
            raise ValueError(f"batch {self.id} has no request {e.args[0]}") from None
        idx = torch.tensor(keep, dtype=torch.long, device=self.seq_lens.device)
        return ShardBatch(
            id=self.id,
            request_ids=list(request_ids),
            block_tables=self.block_tables[idx],
            block_tables_host=self.block_tables_host[keep],
            seq_lens=self.seq_lens[idx],
            seq_lens_host=self.seq_lens_host[keep],
            last_ids=self.last_ids[idx],
            sampler=self.sampler.filter(keep),
            adapters=None if self.adapters is None else self.adapters[idx],
            drafts=None if self.drafts is None else self.drafts.filter(keep),
        )

    @staticmethod
    def concat(batches: list[ShardBatch]) -> ShardBatch:
        if len(batches) == 1:
            return batches[0]
        width = max(b.block_tables.shape[1] for b in batches)
        tables = [torch.nn.functional.pad(b.block_tables, (0, width - b.block_tables.shape[1])) for b in batches]
        host_tables = [np.pad(b.block_tables_host, ((0, 0), (0, width - b.block_tables_host.shape[1])))
                       for b in batches]
        return ShardBatch(
            id=batches[0].id,
            request_ids=[r for b in batches for r in b.request_ids],
            block_tables=torch.cat(tables),
            block_tables_host=np.concatenate(host_tables),
            seq_lens=torch.cat([b.seq_lens for b in batches]),
            seq_lens_host=np.concatenate([b.seq_lens_host for b in batches]),
            last_ids=torch.cat([b.last_ids for b in batches]),
            sampler=BatchSampler.concat([b.sampler for b in batches]),
            adapters=None if all(b.adapters is None for b in batches)
            else torch.cat([b.adapter_slots() for b in batches]),
            drafts=None if batches[0].drafts is None else DraftRows.concat([b.drafts for b in batches]),
        )
