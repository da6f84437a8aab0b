"""Every Prometheus metric the engine sets, in one place: queue and batch sizes, batch timings,
warmup progress, passes on unwarmed shapes, prefix-cache lookups, and the load gauges an autoscaler
reads.

The life cycle, the request registry and the batching loop each call this object rather than the
registry, so that what a metric means is decided here once. Without a registry (the offline
`LLM`) nothing is recorded, but the unwarmed-shape count that /info reports is still kept.
"""

from __future__ import annotations

import time

from gaudi_runtime.config import Config
from gaudi_runtime.proto import generate_pb2 as pb
from gaudi_runtime.router.metrics import Metrics


class EngineMetrics:
    def __init__(self, metrics: Metrics | None):
        self._m = metrics
        self.unwarmed_shapes = 0  # forward passes the shards ran on a shape warmup did not cover
        self._last_decode_answer = 0.0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (also kept without a registry)
        self.prefill_chunks = 0  # chunks of long prompts prefilled before their last one
        self.prefill_chunks_in_step = 0  # chunks (the last too) computed in a decode step's forward pass
        self.prefix_hits = 0
        self.serving = False  # the load gauges are published from the moment the engine is ready
        self.kv_offload: dict[str, float] = {}  # the KV tiers' counts, also kept without a registry (/info)

    def warmup(self, done: int, total: int) -> None:
        if self._m is not None:
            self._m.gaudi_serve_warmup_done.set(done)
            self._m.gaudi_serve_warmup_total.set(total)

    def load(self, waiting: int, running: int, kv_usage: float) -> None:
        """Requests waiting and running, fraction of KV blocks reserved: the queue size always, the
        load gauges once serving (a pod loading or warming up must not look idle to an autoscaler)."""
        if self._m is None:
            return
        self._m.tgi_queue_size.set(waiting)
        if self.serving:
            self._m.set_load(waiting, running, kv_usage)

    def cache_config(self, block_size: int, num_blocks: int, cfg: Config) -> None:
        """The KV cache as the shards sized it (`vllm:cache_config_info`), once known."""
        if self._m is not None:
            self._m.set_cache_config(cache_config_labels(block_size, num_blocks, cfg))

    def lora_request(self, adapter: str) -> None:
        if self._m is not None:
            self._m.gaudi_serve_lora_requests_total.labels(adapter).inc()

    def lora_slot_write(self, host_hit: bool) -> None:
        """An adapter written into a device slot: from the shards' host copy, or read from its files."""
        if self._m is not None:
            self._m.gaudi_serve_lora_slot_writes_total.labels("host_copy" if host_hit else "read").inc()

    def lora_load(self, max_loras: int, running: list[str], waiting: list[str]) -> None:
        """The adapters of the running and waiting requests, under vLLM's gauge, once serving."""
        if self._m is not None and self.serving:
            self._m.vllm_lora_requests_info.labels(
                str(max_loras), ",".join(waiting), ",".join(running)).set_to_current_time()

    def batch_size(self, running: int, max_tokens: int) -> None:
        """The running batch: its requests, and the tokens they may hold (prompts + max_new_tokens)."""
        if self._m is not None:
            self._m.tgi_batch_current_size.set(running)
            self._m.tgi_batch_current_max_tokens.set(max_tokens)

    def prefill_answered(self, made: float, resp: pb.PrefillResponse, size: int) -> None:
        """A prefill of `size` requests made at `made` (time.monotonic()) answered."""
        self._observe("prefill", time.monotonic() - made, resp.forward_ns)
        if self._m is not None:
            self._m.tgi_batch_next_size.observe(size)
        self._unwarmed(resp.unwarmed_shapes)
        self.kv_offload_count("copy_seconds", "copy", resp.kv_copy_ns / 1e9)
        failed = resp.kv_disk_write_failures - self.kv_offload.get("faults_write_failed", 0)
        self.kv_offload_count("faults", "write_failed", failed)  # rank 0's count, since start

    def decode_answered(self, made: float, resp: pb.DecodeResponse) -> None:
        """A decode call made at `made` answered.

        A queued call's time starts when the shards could take it: when the one before it answered.
        """
        now = time.monotonic()
        self._observe("decode", now - max(made, self._last_decode_answer), resp.forward_ns)
        self._last_decode_answer = now
        self._unwarmed(resp.unwarmed_shapes)
        self.speculation(resp)

    def speculation(self, resp: pb.DecodeResponse) -> None:
        """A decode call's drafts (--speculate), as vLLM counts them."""
        if self._m is None or not resp.spec_drafts:
            return
        m, name = self._m, self._m.model_name
        m.vllm_spec_decode_num_drafts.labels(name).inc(resp.spec_drafts)
        m.vllm_spec_decode_num_draft_tokens.labels(name).inc(resp.spec_draft_tokens)
        m.vllm_spec_decode_num_accepted_tokens.labels(name).inc(resp.spec_accepted_tokens)
        for pos, n in enumerate(resp.spec_accepted_per_pos):
            m.vllm_spec_decode_num_accepted_tokens_per_pos.labels(name, str(pos)).inc(n)

    def _observe(self, method: str, seconds: float, forward_ns: int) -> None:
        m = self._m
        if m is None:
            return
        m.tgi_batch_inference_count.labels(method=method).inc()
        m.tgi_batch_inference_success.labels(method=method).inc()
        m.tgi_batch_inference_duration.labels(method=method).observe(seconds)
        m.tgi_batch_forward_duration.labels(method=method).observe(forward_ns / 1e9)

    def prefill_chunk(self, last: bool, in_step: bool) -> None:
        """A chunk of a long prompt was prefilled (`in_step`: in a decode step's forward pass)."""
        self.prefill_chunks_in_step += in_step
        if last:
            return
        self.prefill_chunks += 1
        if self._m is not None:
            self._m.gaudi_serve_prefill_chunks_total.inc()

    def prefix_lookup(self, queried: int, found: int) -> None:
        """A prompt of `queried` tokens was looked up in the prefix cache; `found` were cached."""
        self.prefix_queries += queried
        self.prefix_hits += found
        if self._m is not None:
            self._m.gaudi_serve_prefix_cache_queries_total.inc(queried)
            self._m.gaudi_serve_prefix_cache_hits_total.inc(found)

    def kv_offload_count(self, metric: str, label: str, amount: float) -> None:
        """One of the KV tiers' counters (`gaudi_serve_kv_offload_<metric>_total{<label>}`) goes up."""
        if amount <= 0:
            return
        key = f"{metric}_{label}"
        self.kv_offload[key] = self.kv_offload.get(key, 0) + amount
        if self._m is not None:
            getattr(self._m, f"gaudi_serve_kv_offload_{metric}_total").labels(label).inc(amount)

    def kv_offload_blocks(self, host: int, disk: int, staged: int) -> None:
        for tier, count in (("host", host), ("disk", disk), ("staged", staged)):
            self.kv_offload[f"blocks_{tier}"] = count
            if self._m is not None:
                self._m.gaudi_serve_kv_offload_blocks.labels(tier).set(count)

    def cached_blocks(self, count: int) -> None:
        if self._m is not None:
            self._m.gaudi_serve_prefix_cache_blocks.set(count)

    def _unwarmed(self, count: int) -> None:
        """The shards report a running total; the counter gets what it grew by."""
        if count > self.unwarmed_shapes and self._m is not None:
            self._m.gaudi_serve_unwarmed_shapes_total.inc(count - self.unwarmed_shapes)
        self.unwarmed_shapes = count


def cache_config_labels(block_size: int, num_blocks: int, cfg: Config) -> dict[str, str]:
    """vLLM's CacheConfig fields that mean something here, as vLLM renders them (str() of the value).

    `num_gpu_blocks` counts the blocks requests may hold (block 0, the shards' padding block, is not
    one); `engine` is vLLM's engine index, always 0 for our single scheduler."""
    return {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
            "cache_dtype": cfg.model.kv_cache_dtype or "auto",
            "enable_prefix_caching": str(cfg.scheduling.prefix_caching),
            "gpu_memory_utilization": str(cfg.device.memory_fraction), "engine": "0"}
