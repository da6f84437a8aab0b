"""Automatic prefix caching: which KV blocks a new request can take over instead of computing them.

A full block of a sequence is named by a hash chained from its parent block's hash and its own
token ids, plus what else decides its KV values: the digest of each image whose placeholder tokens
start in it (later blocks inherit it through the chain), and, at the root, the model, its dtype
and the KV cache's, and the request's LoRA adapter (its name and content digest): two adapters
never share a block. With LongRoPE (Phi-3), a prompt longer than the original length is rotated
with the long factor set and a shorter one with the short set (layers/rotary.py), so the two kinds
chain from different roots and never share a block. A request that is prefilled again once its answer
passes the original length (`reprefill_at`) rewrites its blocks in place, so it shares none: it takes
no cached block and registers its blocks only when it ends (under the long root once prefilled again).
Equal hashes mean equal KV, so a request whose first blocks' hashes are
registered (router/blocks.py) reads those blocks instead of computing them, and the shards compute
only the rest of its prompt (`Request.cached_tokens`).

Rules that keep every block's contents what its hash says:
- a partly filled block is never registered, and a request never takes a hit on the block holding
  its last prompt token, so at least one prompt token is computed (it gives the first new token)
  and no request ever writes into a block it shares;
- a prompt's full blocks are registered when its prefill is made (a prompt prefilled in chunks: each
  chunk's when that chunk's prefill is made); a later request's prefill that reads them is made after
  it, so the shards run it after the write (shard/call_order.py), and one in the same prefill reads
  them after they are written (each layer writes before it attends);
- generated tokens' blocks are registered when the request ends, and only the blocks whose every
  position holds a token the request streamed and fed back (a call made before the end may still
  write the positions after: the token that ended it, or tokens computed past it and dropped; a
  speculative step, rejected drafts);
- a request that ends with an error registers nothing and forgets what it registered.

With --kv-events-config, each run of consecutive blocks registered is announced (`BlockStored`, with
the hash of the block before it and its tokens), and each hash the allocator drops (evicted, or
forgotten) too (`BlockRemoved`): router/kv_events.py.

With --kv-offloading-size, a lookup continues past the device's blocks into host memory and disk
blocks staged from the disk tier (router/kv_tiers.py): those get fresh blocks, copied before the
prefill, registered at once and counted as cached.

Requests that want their prompt's log-probabilities (`decoder_input_details`) look nothing up, so
every prompt token is computed for them; their blocks are still registered for others.
"""

from __future__ import annotations

import hashlib
from array import array

from gaudi_runtime import buckets
from gaudi_runtime.config import Config
from gaudi_runtime.kv_root import root_hash
from gaudi_runtime.router.adapters import AdapterTable
from gaudi_runtime.router.blocks import BlockAllocator
from gaudi_runtime.router.engine_metrics import EngineMetrics
from gaudi_runtime.router.kv_events import KvEvents, removed, stored
from gaudi_runtime.router.kv_tiers import KvTiers

LONGROPE_TYPES = ("longrope", "su")


def longrope_original_length(model_config: dict, rope_override: str | None = None) -> int | None:
    """The prompt length past which a LongRoPE model rotates with its long factor set (config.json's
    original_max_position_embeddings, read as layers/rotary.py and models/phi3.py read it); None for
    any other RoPE, or when --rope-scaling replaces the model's."""
    if rope_override:
        return None
    rope = {**(model_config.get("rope_scaling") or {}), **(model_config.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type"))
    phi3 = model_config.get("model_type") == "phi3"
    if kind not in LONGROPE_TYPES and not (phi3 and kind == "yarn"):
        return None
    default = 4096 if phi3 else model_config.get("max_position_embeddings")
    return int(model_config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
               or default)


def reprefill_at(req, long_from: int | None, longest_prefill: int) -> int | None:
    """How many tokens `req` (a ValidRequest) generates before it is prefilled again, prompt and answer
    whole, so that its next token is computed with LongRoPE's long factor set throughout, as Phi-3's
    `generate()` recomputes it: its answer's token at position `long_from`, if its prompt is no longer
    than `long_from` and it may generate the token after it. None: never (also where that prefill would be
    longer than `longest_prefill`, the longest a prefill's shape holds, and for a request whose sampling
    reads what the shard kept of its answer: a grammar, random draws, OpenAI's penalties; those stay
    rotated short below `long_from`)."""
    n, s = len(req.input_ids), req.sampling
    if long_from is None or n > long_from or req.stopping.max_new_tokens < long_from - n + 2:
        return None
    if long_from + 1 > longest_prefill:
        return None
    if s.do_sample or req.grammar is not None or s.generated_frequency_penalty or s.presence_penalty:
        return None
    return long_from - n + 1


def adapter_root(base: bytes, name: str, digest: str) -> bytes:
    """The root of an adapter's chains, seeded with its name and the digest of its files: an adapter
    reloaded with other weights under the same name has a new root, so none of its old blocks match."""
    return hashlib.sha256(base + f"|lora|{name}|{digest}".encode()).digest()


def chain_hashes(tokens: list[int], block_size: int, parent: bytes, extras: dict[int, bytes] | None = None,
                 first: int = 0) -> list[bytes]:
    """The hash of each full block of `tokens`, chained from `parent`; `extras` maps a block's index
    (counted from `first`, the index of the block `tokens` starts at) to bytes that also name it."""
    out = []
    for i in range(len(tokens) // block_size):
        h = hashlib.sha256(parent)
        h.update(array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        if extras and first + i in extras:
            h.update(extras[first + i])
        parent = h.digest()
        out.append(parent)
    return out


def image_extras(image_starts: list[int], images: list[bytes], block_size: int) -> dict[int, bytes]:
    """Block index -> the digests of the images whose placeholder tokens start in that block (all of
    them in the first block when where they start is unknown: then every block depends on every image)."""
    if len(image_starts) != len(images):
        image_starts = [0] * len(images)
    extras: dict[int, bytes] = {}
    for start, data in zip(image_starts, images):
        block = start // block_size
        extras[block] = extras.get(block, b"") + hashlib.sha256(data).digest()
    return extras


class PrefixCache:
    """The lookups and registrations of each request's blocks (a no-op with --prefix-caching false)."""

    def __init__(self, cfg: Config, metrics: EngineMetrics, adapters: AdapterTable | None = None):
        self.enabled = cfg.scheduling.prefix_caching
        self.block_size = cfg.device.block_size
        self.speculates = cfg.scheduling.speculate > 0
        self.root = root_hash(cfg)
        self.adapters = adapters or AdapterTable(cfg.adapters, cfg.model)
        self.metrics = metrics
        self.events: KvEvents | None = None  # where registrations and removals are announced
        self.tiers: KvTiers | None = None  # host and disk tiers below the device (router/kv_tiers.py)
        self.long_rope_from: int | None = None  # `longrope_original_length` of the model served
        self.longest_prefill = buckets.prefill_seq_cap(cfg)

    def removed(self, hashes: list[bytes]) -> None:
        """The allocator dropped these hashes (its `on_removed`)."""
        if self.events is not None:
            self.events.add(removed(hashes))

    def prompt_hashes(self, state) -> list[bytes]:
        """The hashes of the full blocks of `state`'s prompt (computed once)."""
        if state.block_hashes is None:
            state.block_hashes = chain_hashes(state.req.input_ids, self.block_size, self._root(state),
                                              self._extras(state))
        return state.block_hashes

    def slot_root(self, slot: int) -> bytes:
        """The root of the chains of a request in adapter slot `slot` (the adapter it was given: a
        slot is not reused while a request holds it)."""
        entry = self.adapters.entry(slot)
        return self.root if entry is None else adapter_root(self.root, entry.name, entry.digest)

    def _root(self, state) -> bytes:
        """The root of `state`'s chain: its adapter's, apart for a sequence LongRoPE rotates long (a long
        prompt, or one prefilled again past the original length)."""
        root = self.slot_root(state.req.adapter)
        long = self.long_rope_from is not None and len(state.req.input_ids) > self.long_rope_from
        if long or state.rotated_long:
            return hashlib.sha256(root + b"|longrope-long").digest()
        return root

    def reprefill_at(self, req) -> int | None:
        """`reprefill_at` for the model served."""
        return reprefill_at(req, self.long_rope_from, self.longest_prefill)

    def _shares(self, state) -> bool:
        """Whether `state`'s prompt blocks are looked up and registered as its prefill is made: not for one
        that will rewrite them (`reprefill_at`)."""
        return self.enabled and self.reprefill_at(state.req) is None

    def _extras(self, state) -> dict[int, bytes] | None:
        req = state.req
        return image_extras(req.image_starts, req.images, self.block_size) if req.images else None

    def hits(self, allocator: BlockAllocator, state, skip: int = 0) -> list[int]:
        """The registered blocks `state`'s prompt may start with, after its first `skip` blocks."""
        if not self._shares(state) or state.req.decoder_input_details:
            return []
        usable = (len(state.req.input_ids) - 1) // self.block_size  # never the last prompt token's block
        return allocator.lookup(self.prompt_hashes(state)[skip:usable])

    def _below(self, state, skip: int) -> list[bytes]:
        """The hashes of `state`'s usable prompt blocks after its first `skip` (the device's run)."""
        if self.tiers is None or not self._shares(state) or state.req.decoder_input_details:
            return []
        usable = (len(state.req.input_ids) - 1) // self.block_size
        return self.prompt_hashes(state)[skip:usable]

    def waiting_view(self, allocator: BlockAllocator, state) -> tuple[int, int]:
        """(prompt tokens cached, blocks of them other requests hold) for the admission rules; blocks
        host memory or staging holds count as cached (copied, not computed) and cost fresh blocks."""
        found = self.hits(allocator, state)
        below = self.tiers.run(self._below(state, len(found))) if self.tiers is not None else []
        return (len(found) + len(below)) * self.block_size, sum(allocator.held(b) for b in found)

    def wanted_on_disk(self, allocator: BlockAllocator, state) -> list[bytes]:
        """The blocks `state` could read from the disk tier after its device, host and staged ones."""
        if self.tiers is None:
            return []
        found = len(self.hits(allocator, state))
        below = self._below(state, found)
        return self.tiers.on_disk(below[len(self.tiers.run(below)):])

    def hold_hits(self, allocator: BlockAllocator, state) -> None:
        """Hold the cached blocks `state` starts with, before any allocation may evict them (host blocks
        it will read too)."""
        state.blocks = self.hits(allocator, state)
        allocator.acquire(state.blocks)
        if self.tiers is not None:
            self.tiers.pin(self.tiers.run(self._below(state, len(state.blocks))))

    def fill(self, allocator: BlockAllocator, state, total: int) -> None:
        """Complete `state`'s `total` blocks: hits on blocks an earlier request of the same prefill
        registered, then fresh ones. Its prompt's blocks are registered by `register_prompt`."""
        more = self.hits(allocator, state, skip=len(state.blocks))
        allocator.acquire(more)
        hit_blocks = len(state.blocks) + len(more)
        below = self.tiers.run(self._below(state, hit_blocks)) if self.tiers is not None else []
        state.blocks = state.blocks + more + allocator.allocate(total - hit_blocks)
        if below:
            self.tiers.take(below, state.blocks[hit_blocks:hit_blocks + len(below)])
            # Registered now: the copies run before this prefill's forward pass, as writes would.
            self._register(allocator, state, self.prompt_hashes(state)[:hit_blocks + len(below)],
                           state.req.input_ids, hit_blocks)
        state.cached_tokens = (hit_blocks + len(below)) * self.block_size
        if self.enabled and not state.req.decoder_input_details:
            self.metrics.prefix_lookup(len(state.req.input_ids), state.cached_tokens)

    def register_prompt(self, allocator: BlockAllocator, state, start: int, end: int) -> None:
        """Register the full blocks of `state`'s prompt tokens [start, end) once the prefill that writes
        them is made (`start` a block boundary; a block `end` cuts is not full yet and waits)."""
        if not self._shares(state):
            return
        hashes = self.prompt_hashes(state)
        last = min(len(hashes), end // self.block_size)
        self._register(allocator, state, hashes[:last], state.req.input_ids, start // self.block_size)
        self.metrics.cached_blocks(allocator.cached_count)

    def release(self, allocator: BlockAllocator, state, failed: bool) -> None:
        """Give `state`'s blocks back, registering those its generated tokens filled first (or, when
        it failed, forgetting the ones it registered)."""
        if self.enabled:
            own = state.blocks[state.cached_tokens // self.block_size:]
            if failed:
                for block in own:
                    allocator.forget(block)
            else:
                self._register_generated(allocator, state)
        allocator.free(state.blocks)
        if self.enabled:
            self.metrics.cached_blocks(allocator.cached_count)

    def _register_generated(self, allocator: BlockAllocator, state) -> None:
        # Positions written with a streamed token: the prompt, then each token fed back by a call made
        # (the prefill gave token 1; a call's step k fed token k). With speculation a step may give
        # several tokens, each but the last fed back in it, and a call made after the last one's may
        # write past the budget at the last position: every streamed token but the last is fed.
        fed = len(state.output_ids) - 1 if self.speculates else min(len(state.output_ids), state.sent - 1)
        prompt = state.req.input_ids
        hashes = self.prompt_hashes(state) if self._shares(state) else []  # else none registered yet
        first = len(hashes)
        tokens = prompt + state.output_ids[:fed]
        parent = hashes[-1] if hashes else self._root(state)
        new = chain_hashes(tokens[first * self.block_size:], self.block_size, parent, self._extras(state), first)
        self._register(allocator, state, hashes + new, tokens, first)

    def _register(self, allocator: BlockAllocator, state, hashes: list[bytes], tokens: list[int], first: int) -> None:
        """Register `state`'s block i under `hashes[i]` from block `first` on (`tokens`: the sequence's,
        from its start), announcing each run of consecutive blocks registered."""
        run: list[int] = []
        for i in range(first, len(hashes)):
            if allocator.register(state.blocks[i], hashes[i]):
                run.append(i)
                continue
            self._announce(run, hashes, tokens, state.req.adapter)
            run = []
        self._announce(run, hashes, tokens, state.req.adapter)

    def _announce(self, run: list[int], hashes: list[bytes], tokens: list[int], adapter: int) -> None:
        if self.events is None or not run:
            return
        bs, i, j = self.block_size, run[0], run[-1] + 1
        parent = hashes[i - 1] if i else None  # the root is no block: a first block has no parent
        # vLLM names an adapter's blocks by its LoRA id and name; ours are the adapter's slot and name.
        lora = (adapter, self.adapters.name(adapter)) if adapter else (None, None)
        self.events.add(stored(hashes[i:j], parent, tokens[i * bs:j * bs], bs, *lora))
