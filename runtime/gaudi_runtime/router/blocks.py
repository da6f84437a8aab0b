"""The KV-cache block budget, owned by the router: blocks are reserved per request at admission.

With prefix caching, a block that holds a full block of known tokens is registered under its hash
(router/prefix_cache.py) and may be held by several requests at once: blocks are reference counted.
A registered block that no request holds any more keeps its contents and its hash (cached, evictable)
until a request needs fresh room: then the least recently used one is taken. Blocks never
registered go straight back to the free list, as they always did.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class BlockAllocator:
    """Hands out block ids 1..num_blocks; block 0 is the shards' padding block."""

    def __init__(self, num_blocks: int, on_removed: Callable[[list[bytes]], None] | None = None,
                 on_evicted: Callable[[int, bytes], None] | None = None):
        self.num_blocks = num_blocks
        self._on_removed = on_removed  # told the hashes that no block holds any more (KV-cache events)
        self._on_evicted = on_evicted  # told each cached block given other content (the host tier keeps a copy)
        self._free = list(range(num_blocks, 0, -1))  # blocks holding nothing anyone may look up
        self._refs: dict[int, int] = {}  # held block -> how many requests hold it
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, held by none; least recent first

    @property
    def free_count(self) -> int:
        """Blocks a request may be given: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_count(self) -> int:
        """Blocks registered under a hash, held or not."""
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, held once each: free ones first, then the least recently used cached ones,
        whose hashes are forgotten."""
        if n > self.free_count:
            raise ValueError(f"{n} blocks asked, {self.free_count} free")
        plain = min(n, len(self._free))
        taken = self._free[len(self._free) - plain:][::-1]
        del self._free[len(self._free) - plain:]
        evicted = []
        for _ in range(n - plain):
            block, _ = self._evictable.popitem(last=False)
            evicted.append(self._hash_of.pop(block))
            del self._by_hash[evicted[-1]]
            taken.append(block)
            if self._on_evicted is not None:
                self._on_evicted(block, evicted[-1])
        if evicted and self._on_removed is not None:
            self._on_removed(evicted)
        for block in taken:
            self._refs[block] = 1
        return taken

    def free(self, blocks: list[int]) -> None:
        """Give back one hold on each of `blocks` (one request's). The last hold on a registered block
        leaves it cached; the tail of a request goes first in the eviction order."""
        for block in reversed(blocks):
            left = self._refs[block] - 1
            if left:
                self._refs[block] = left
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- sharing -------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks registered for the longest run of `hashes` from the first."""
        found = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def held(self, block: int) -> bool:
        return block in self._refs

    def acquire(self, blocks: list[int]) -> None:
        """One more hold on each of these registered blocks (a cached one is no longer evictable)."""
        for block in blocks:
            if block in self._refs:
                self._refs[block] += 1
            else:
                del self._evictable[block]
                self._refs[block] = 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Record that held `block` holds the tokens `block_hash` names. False (nothing recorded) when
        another block already holds them, or this one is registered already: it stays private."""
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def forget(self, block: int) -> None:
        """Drop a held block's registration: its contents may not be what its hash says."""
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._by_hash[block_hash]
            if self._on_removed is not None:
                self._on_removed([block_hash])
