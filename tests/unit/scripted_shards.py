"""Scripted shards for driving the router's engine without a model: they run calls in the order they
were made, as numbered calls do on real shards, answer a fixed token, and check every KV block
write and read.

The KV cache is simulated token by token: a prefill writes its prompt's tokens after the cached ones
(`Request.cached_tokens`), a decode step writes the token it feeds; every request that a call names
then reads its whole sequence back through its block table, as attention does, and any position that
does not hold the request's own token there is a bad read (a block holding another request's tokens,
or a cached block whose contents are not what its hash said)."""

from __future__ import annotations

import asyncio
import itertools

from gaudi_runtime.config import resolve
from gaudi_runtime.params import SamplingParameters
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.client import ShardError
from gaudi_runtime.router.engine import BatchingEngine
from gaudi_runtime.router.types import StoppingParameters, ValidRequest

TOKEN = 40  # what the scripted shards generate, until a request's scripted EOS
BLOCK_SIZE = 16


class ScriptedShards:
    """Stands in for ShardClient: runs calls (a decode of one or more steps) in the order they were
    made, as numbered calls do on real shards, and answers TOKEN for each request and step, or EOS at
    the step `eos_at` gives it.

    While `gate` is cleared, calls wait before they run; the call numbered `fail_at` (from 0, in the
    order calls were made) fails as a crashed shard's would."""

    def __init__(self, eos_id: int, eos_at: dict[int, int], num_blocks: int = 64, swap_answers: bool = False,
                 gate: asyncio.Event | None = None, fail_at: int | None = None, varied: bool = False,
                 step_ms: float = 0.0, host_slots: int = 0, disk_dir=None, disk: dict | None = None):
        self.eos_id, self.eos_at, self.num_blocks = eos_id, eos_at, num_blocks
        # KV tiers (--kv-offloading-size): host slot -> the tokens its block holds; the disk tier's blocks by
        # hash (kept across a restart when passed in), an empty file each under `disk_dir` for the listing.
        self.host_slots, self.disk_dir = host_slots, disk_dir
        self.host: dict[int, list[int | None]] = {}
        self.disk: dict[bytes, list[int | None]] = {} if disk is None else disk
        self.staged: dict[bytes, list[int | None]] = {}
        self.corrupt: set[bytes] = set()  # disk blocks whose file fails its checks
        self.copy_log: list[pb.KvCopies] = []
        self.step_ms = step_ms  # the forward time each decode step reports (forward_ns)
        self.gate, self.fail_at = gate, fail_at
        # Answer calls in pairs, the second first (gRPC does not promise answers in call order); the
        # n-th token of a request is then TOKEN + n, so that its order shows.
        self.swap_answers = swap_answers
        self.varied = varied  # the n-th token is TOKEN + n % 5 (different sequences, not one token repeated)
        self.answered: set[int] = set()
        self.made = 0
        self.blocks: dict[int, list[int]] = {}  # request id -> its KV blocks
        self.owner: dict[int, int] = {}  # block -> the request whose prefill wrote it last (blocks it filled)
        self.stale_writes: list[tuple[int, int]] = []  # (request, block another request owns) a step wrote
        self.kv: dict[int, list[int | None]] = {}  # block -> the token whose KV each slot holds
        self.sequences: dict[int, list[int]] = {}  # request id -> the tokens its KV should hold, in order
        self.bad_reads: list[tuple[int, int]] = []  # (request, first position holding another token)
        self.cached_tokens: dict[int, int] = {}  # request id -> prompt tokens its prefill found cached
        self.generated: dict[int, int] = {}  # request id -> tokens computed for it
        self.fed: dict[int, int] = {}  # request id -> positions its KV holds
        # Each decode call: the requests it names, decodes unanswered when it was made, its steps, and
        # how many requests waited for a prefill then.
        self.decodes: list[tuple[list[int], int, int, int]] = []
        # Every call in the order made: ("prefill", {request: (cached tokens, prompt tokens sent)}),
        # ("decode", request ids) or ("clear", batch id).
        self.calls: list[tuple[str, object]] = []
        self.engine: BatchingEngine | None = None
        self.unanswered = 0
        self._turns = itertools.count()
        self._done = 0
        self._changed = asyncio.Condition()

    async def connect(self, timeout_s, alive=None):
        pass

    async def info(self):
        tiers = None if not self.host_slots else pb.KvTiers(block_bytes=1024, host_slots=self.host_slots,
                                                            disk_dir=str(self.disk_dir or ""))
        return pb.InfoResponse(block_size=16, num_blocks=self.num_blocks, eos_token_ids=[self.eos_id],
                               max_position_embeddings=4096, dtype="float32", device_type="cpu", world_size=1,
                               kv_tiers=tiers)

    async def warmup(self, on_progress):
        on_progress(0, 0, "done")

    async def close(self):
        pass

    def _turn(self) -> int:
        self.made += 1
        return next(self._turns)

    async def _in_turn(self, turn: int, work):
        if self.gate is not None:
            await self.gate.wait()
        async with self._changed:
            await self._changed.wait_for(lambda: self._done == turn)
            if turn == self.fail_at:
                self._done += 1
                self._changed.notify_all()
                raise ShardError("UNAVAILABLE: scripted shard crash")
            result = work()
            self._done += 1
            self._changed.notify_all()
            if self.swap_answers and turn % 2 == 0:  # wait for the next call's answer, if it was made
                await self._changed.wait_for(lambda: turn + 1 in self.answered or self.made == turn + 1)
            self.answered.add(turn)
            self._changed.notify_all()
        return result

    def _tokens(self, ids: list[int]) -> pb.Generations:
        out = []
        for rid in ids:
            self.generated[rid] = self.generated.get(rid, 0) + 1
            n = self.generated[rid]
            token = TOKEN + n if self.swap_answers else TOKEN + n % 5 if self.varied else TOKEN
            out.append(self.eos_id if n == self.eos_at.get(rid) else token)
            self.sequences[rid].append(out[-1])  # the next step feeds it: its KV goes at that position
        return pb.Generations(request_ids=ids, token_ids=out, logprobs=[0.0] * len(ids))

    def _write(self, rid: int, position: int) -> None:
        block = self.blocks[rid][position // BLOCK_SIZE]
        if self.owner.get(block) != rid:
            self.stale_writes.append((rid, block))
        self.kv.setdefault(block, [None] * BLOCK_SIZE)[position % BLOCK_SIZE] = self.sequences[rid][position]

    def _read(self, rid: int, length: int) -> None:
        """Attention over the request's first `length` positions, through its block table."""
        table, expected = self.blocks[rid], self.sequences[rid]
        for p in range(length):
            if self.kv.get(table[p // BLOCK_SIZE], [None] * BLOCK_SIZE)[p % BLOCK_SIZE] != expected[p]:
                self.bad_reads.append((rid, p))
                return

    def _write_kv(self, ids: list[int]) -> None:
        """One decode step: each request writes the token it feeds, then attends over its sequence."""
        for rid in ids:
            self._write(rid, self.fed[rid])
            self.fed[rid] += 1
        for rid in ids:
            self._read(rid, self.fed[rid])

    def prefill(self, batch: pb.Batch, kv_copies: list[pb.KvCopies] | None = None,
                forget_grammars: list[int] | None = None):
        return self._in_turn(self._turn(), self._prefilled(batch, kv_copies))

    def _prefilled(self, batch: pb.Batch, kv_copies: list[pb.KvCopies] | None):
        """A prefill's call recorded now; -> what runs it in its turn and answers."""
        ids = [r.id for r in batch.requests]
        prompts = {r.id: (list(r.input_ids), list(r.blocks), r.cached_tokens) for r in batch.requests}
        self.calls.append(("prefill", {rid: (cached, len(prompt)) for rid, (prompt, _, cached) in prompts.items()}))

        def answer():
            for copies in kv_copies or []:
                self._copy(copies)
            for rid, (prompt, blocks, cached) in prompts.items():
                assert cached % BLOCK_SIZE == 0 and cached < len(prompt), (rid, cached, len(prompt))
                self.blocks[rid], self.sequences[rid], self.cached_tokens[rid] = blocks, prompt, cached
                self.owner.update({b: rid for b in blocks[cached // BLOCK_SIZE:]})
                for p in range(cached, len(prompt)):
                    self._write(rid, p)
                self.fed[rid] = len(prompt)
            for rid, (prompt, _, _) in prompts.items():  # each layer writes its batch's K/V, then attends
                self._read(rid, len(prompt))
            return pb.PrefillResponse(generations=self._tokens(ids), batch=pb.CachedBatch(id=batch.id, request_ids=ids))
        return answer

    # ---- the KV tiers below the device (router/kv_tiers.py), as shard/kv_tiers.py runs them -----------

    def _copy(self, c: pb.KvCopies) -> None:
        """One admission's copies in the shards' order: device reads, loads, host writes, then the disk."""
        self.copy_log.append(c)
        saved = [list(self.kv.get(b, [None] * BLOCK_SIZE)) for b in c.save_blocks]
        for slot, block in zip(c.load_slots, c.load_blocks):
            self.kv[block] = list(self.host[slot])
        for key, block in zip(c.staged_hashes, c.staged_blocks):
            self.kv[block] = self.staged.pop(bytes(key))
        for slot, content in zip(c.save_slots, saved):
            self.host[slot] = content
        for key in c.drop_hashes:
            self.disk.pop(bytes(key), None)
            (self.disk_dir / "rank0" / bytes(key).hex()).unlink(missing_ok=True)
        for slot, key in zip(c.spill_slots, c.spill_hashes):
            self.disk[bytes(key)] = list(self.host[slot])
            (self.disk_dir / "rank0").mkdir(parents=True, exist_ok=True)
            (self.disk_dir / "rank0" / bytes(key).hex()).write_bytes(b"")

    async def fetch_blocks(self, hashes: list[bytes], discard: list[bytes]) -> list[pb.FetchBlocksResponse]:
        for key in discard:
            self.staged.pop(key, None)
        loaded = [h for h in hashes if h in self.disk and h not in self.corrupt]
        self.staged.update({h: list(self.disk[h]) for h in loaded})
        return [pb.FetchBlocksResponse(loaded=loaded, corrupt=len(set(hashes) & self.corrupt))]

    def decode(self, batches: list[pb.CachedBatch], steps: int = 1, ride: pb.PrefillRequest | None = None):
        """A decode call; `ride`: a prefill computed in its first step's pass (recorded as a prefill made
        just before the decode)."""
        prefilled = None if ride is None else self._prefilled(ride.batch, list(ride.kv_copies))
        ids = [rid for b in batches for rid in b.request_ids]
        self.decodes.append((ids, self.unanswered, steps, self.engine.queue_size()))
        self.calls.append(("decode", ids))
        self.unanswered += 1

        def answer():
            self.unanswered -= 1
            ridden = {} if prefilled is None else {"ride": prefilled(), "ride_in_step": True}
            gens = []
            for _ in range(steps):
                self._write_kv(ids)
                gens.append(self._tokens(ids))
            return pb.DecodeResponse(generations=gens[0], next_steps=gens[1:],
                                     batch=pb.CachedBatch(id=batches[0].id, request_ids=ids),
                                     forward_ns=int(steps * self.step_ms * 1e6), **ridden)
        return self._in_turn(self._turn(), answer)

    def clear(self, batch_id=None):
        self.calls.append(("clear", batch_id))
        return self._in_turn(self._turn(), lambda: None)


def request(max_new_tokens: int, stop: tuple[str, ...] = (), prompt: list[int] | None = None) -> ValidRequest:
    return ValidRequest(input_ids=prompt or [5, 6, 7], inputs="abc", sampling=SamplingParameters(),
                        stopping=StoppingParameters(max_new_tokens=max_new_tokens, stop_sequences=stop))


def make_engine(shards: ScriptedShards, tokenizer, decode_steps: int = 4, **env: str) -> BatchingEngine:
    engine = BatchingEngine(resolve(None, {"MODEL_ID": "unused", "DECODE_STEPS": str(decode_steps), **env}), shards,
                            tokenizer)
    shards.engine = engine
    return engine


def serve(shards: ScriptedShards, tokenizer, max_new_tokens: list[int], decode_steps: int = 4):
    """Run one request per entry of `max_new_tokens`, all at once, through an engine over `shards`;
    returns each request's (token ids, end)."""
    engine = make_engine(shards, tokenizer, decode_steps)

    async def run():
        await engine.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(collect(engine, request(n)) for n in max_new_tokens)), 30)
        finally:
            await engine.stop()

    return asyncio.run(run())


async def collect(engine: BatchingEngine, req: ValidRequest):
    tokens, end = [], None
    async for ev in engine.generate(req):
        tokens.append(ev.token.id)
        end = ev.end
    return tokens, end
