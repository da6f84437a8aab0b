"""The KV-cache block budget, owned by the router: blocks are reserved per request at admission."""

from __future__ import annotations


class BlockAllocator:
    """Hands out block ids 1..num_blocks; block 0 is the shards' padding block."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks, 0, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked, {len(self._free)} free")
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
