"""Prometheus metrics with TGI's names, in a registry owned by one app.

Counters are exposed under their TGI names (`tgi_request_count`, not
`tgi_request_count_total`) so that dashboards built for TGI work unchanged.
The HTTP layer records the per-request metrics; the engine sets the queue and
batch ones (`tgi_queue_size`, `tgi_batch_current_size`, ...) and, through
`Metrics.set_load`, the load gauges under vLLM's names that autoscalers and
the Gateway API Inference Extension's endpoint picker read
(`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, labelled `model_name`), and `vllm:cache_config_info`
(1, labelled with the KV cache's block size and block count). Those have no
sample until the engine is ready: a pod still loading or warming up shows no
load figure that would move an autoscaler.

`vllm:lora_requests_info` (labels `max_lora`, `waiting_lora_adapters`,
`running_lora_adapters`) belongs beside them once adapters are served: set from
`Requests.report_load`, as the load gauges are.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_DURATION = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# The load gauges under vLLM's names (see `Metrics.set_load`).
LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# Its labels (engine_metrics.cache_config_labels gives their values): a subset of vLLM's CacheConfig fields.
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                       "gpu_memory_utilization", "engine")


class Counter:
    """A monotonically increasing counter, optionally labelled, exposed without `_total`."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = (),
                 registry: list[Counter] | None = None):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}
        if registry is not None:
            registry.append(self)

    def labels(self, *values: str, **kw: str) -> _Child:
        if kw:
            values = tuple(str(kw[n]) for n in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}")
        return _Child(self, tuple(str(v) for v in values))

    def inc(self, amount: float = 1.0) -> None:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {self.labelnames}; use .labels(...)")
        self._inc((), amount)

    def _inc(self, key: tuple[str, ...], amount: float) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, *labels: str, **kw: str) -> float:
        key = tuple(str(kw[n]) for n in self.labelnames) if kw else tuple(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def render(self) -> str:
        """Prometheus text format (0.0.4), under the counter's own name."""
        with self._lock:
            items = sorted(self._values.items())
        lines = [f"# HELP {self.name} {_escape_help(self.documentation)}", f"# TYPE {self.name} counter"]
        for key, v in items:
            labels = ",".join(f'{n}="{_escape_label(val)}"' for n, val in zip(self.labelnames, key, strict=True))
            lines.append(f"{self.name}{{{labels}}} {floatToGoString(v)}" if labels
                         else f"{self.name} {floatToGoString(v)}")
        return "\n".join(lines) + "\n"


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Child:
    def __init__(self, parent: Counter, key: tuple[str, ...]):
        self._parent, self._key = parent, key

    def inc(self, amount: float = 1.0) -> None:
        self._parent._inc(self._key, amount)


class Metrics:
    """Every metric the router exposes, as attributes named like the metric."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # vLLM's `model_name` label of the load gauges
        r = self.registry = CollectorRegistry(auto_describe=True)
        c: list[Counter] = []
        self.counters = c
        # Requests (recorded by the HTTP layer).
        self.tgi_request_count = Counter("tgi_request_count", "Requests received", registry=c)
        self.tgi_request_success = Counter("tgi_request_success", "Requests that succeeded", registry=c)
        self.tgi_request_failure = Counter("tgi_request_failure", "Requests that failed, by error type",
                                           ("err",), registry=c)
        self.tgi_request_duration = Histogram("tgi_request_duration", "End-to-end request time (s)",
                                              buckets=_DURATION, registry=r)
        self.tgi_request_validation_duration = Histogram(
            "tgi_request_validation_duration", "Validation and tokenization time (s)", buckets=_FAST, registry=r)
        self.tgi_request_queue_duration = Histogram("tgi_request_queue_duration", "Time in the queue (s)",
                                                    buckets=_DURATION, registry=r)
        self.tgi_request_inference_duration = Histogram(
            "tgi_request_inference_duration", "Time from first prefill to the end (s)", buckets=_DURATION,
            registry=r)
        self.tgi_request_mean_time_per_token_duration = Histogram(
            "tgi_request_mean_time_per_token_duration", "Inference time / generated tokens (s)",
            buckets=_FAST, registry=r)
        self.tgi_request_input_length = Histogram("tgi_request_input_length", "Prompt tokens",
                                                  buckets=_TOKENS, registry=r)
        self.tgi_request_generated_tokens = Histogram("tgi_request_generated_tokens", "Generated tokens",
                                                      buckets=_TOKENS, registry=r)
        self.tgi_request_max_new_tokens = Histogram("tgi_request_max_new_tokens", "Requested max_new_tokens",
                                                    buckets=_TOKENS, registry=r)
        self.tgi_request_time_to_first_token_duration = Histogram(
            "tgi_request_time_to_first_token_duration", "Time from arrival to the first token (s)",
            buckets=_DURATION, registry=r)
        self.tgi_request_inter_token_latency_duration = Histogram(
            "tgi_request_inter_token_latency_duration", "Time between consecutive tokens of a request (s)",
            buckets=_FAST, registry=r)
        # Queue and batches (set by the engine).
        self.tgi_queue_size = Gauge("tgi_queue_size", "Requests waiting in the queue", registry=r)
        self.tgi_batch_current_size = Gauge("tgi_batch_current_size", "Requests in the running batch",
                                            registry=r)
        self.tgi_batch_current_max_tokens = Gauge(
            "tgi_batch_current_max_tokens", "Most tokens the running batch may hold", registry=r)
        self.tgi_batch_next_size = Histogram("tgi_batch_next_size", "Size of each new (prefill) batch",
                                             buckets=_BATCH, registry=r)
        self.tgi_batch_inference_count = Counter("tgi_batch_inference_count", "Batch calls, by method",
                                                 ("method",), registry=c)
        self.tgi_batch_inference_success = Counter("tgi_batch_inference_success",
                                                   "Successful batch calls, by method", ("method",), registry=c)
        self.tgi_batch_inference_duration = Histogram(
            "tgi_batch_inference_duration", "Batch call time (s), by method (prefill, decode)",
            ("method",), buckets=_FAST + (5.0, 10.0, 30.0), registry=r)
        self.tgi_batch_forward_duration = Histogram(
            "tgi_batch_forward_duration", "Forward pass time (s), by method", ("method",),
            buckets=_FAST + (5.0, 10.0, 30.0), registry=r)
        self._warmup_and_cache_metrics(c, r)
        self._kv_tier_metrics(c, r)
        self._load_gauges(r)
        self._lora_metrics(c, r)
        self._spec_metrics(c)

    def _load_gauges(self, r: CollectorRegistry) -> None:
        """Load under vLLM's names, labelled `model_name` (set through set_load once the engine is ready)."""
        waiting, running, kv = LOAD_GAUGES
        self.vllm_num_requests_waiting = Gauge(waiting, "Requests waiting for a batch slot", ("model_name",),
                                               registry=r)
        self.vllm_num_requests_running = Gauge(running, "Requests in the running batch", ("model_name",),
                                               registry=r)
        self.vllm_kv_cache_usage_perc = Gauge(kv, "Fraction of the KV-cache blocks in use (1 means 100 percent)",
                                              ("model_name",), registry=r)
        self.vllm_cache_config_info = Gauge(CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                                            CACHE_CONFIG_LABELS, registry=r)

    def set_cache_config(self, labels: dict[str, str]) -> None:
        """vLLM's info metric: a gauge at 1 whose labels carry the KV cache's configuration."""
        self.vllm_cache_config_info.clear()
        self.vllm_cache_config_info.labels(**labels).set(1)

    def set_load(self, waiting: int, running: int, kv_usage: float) -> None:
        """The engine's load now: requests waiting, requests running, fraction of KV blocks in use."""
        self.vllm_num_requests_waiting.labels(self.model_name).set(waiting)
        self.vllm_num_requests_running.labels(self.model_name).set(running)
        self.vllm_kv_cache_usage_perc.labels(self.model_name).set(kv_usage)

    def _lora_metrics(self, c: list[Counter], r: CollectorRegistry) -> None:
        """LoRA adapters (set by the engine when it serves some): sequences queued per adapter, and vLLM's
        `vllm:lora_requests_info`, whose labels name the adapters running and waiting (comma-joined) and
        whose value is when they were seen (seconds since the epoch), as vLLM sets it."""
        self.gaudi_serve_lora_requests_total = Counter(
            "gaudi_serve_lora_requests_total", "Sequences queued for each LoRA adapter", ("adapter",), registry=c)
        self.gaudi_serve_lora_slot_writes_total = Counter(
            "gaudi_serve_lora_slot_writes_total", "Adapters written into a device slot (--max-loras), by where the "
            "weights came from: the shards' host copy (--max-cpu-loras) or the adapter's files", ("source",),
            registry=c)
        self.vllm_lora_requests_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), registry=r)

    def _spec_metrics(self, c: list[Counter]) -> None:
        """N-gram speculation (--speculate), under vLLM's names and labels as it exposes them: acceptance
        rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts."""
        label = ("model_name",)
        self.vllm_spec_decode_num_drafts = Counter(
            "vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", label, registry=c)
        self.vllm_spec_decode_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", label, registry=c)
        self.vllm_spec_decode_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", label, registry=c)
        self.vllm_spec_decode_num_accepted_tokens_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.",
            ("model_name", "position"), registry=c)

    def _warmup_and_cache_metrics(self, c: list[Counter], r: CollectorRegistry) -> None:
        """Warmup and prefix caching (set by the engine; see docs/design.md "Static shapes" and
        "Prefix caching")."""
        self.gaudi_serve_warmup_done = Gauge("gaudi_serve_warmup_done", "Shapes warmed up so far", registry=r)
        self.gaudi_serve_warmup_total = Gauge("gaudi_serve_warmup_total", "Shapes warmup runs", registry=r)
        self.gaudi_serve_unwarmed_shapes_total = Counter(
            "gaudi_serve_unwarmed_shapes_total", "Forward passes on a shape warmup did not cover (should stay 0)",
            registry=c)
        self.gaudi_serve_prefill_chunks_total = Counter(
            "gaudi_serve_prefill_chunks_total", "Chunks of long prompts prefilled before their last one "
            "(--max-batch-prefill-tokens)", registry=c)
        self.gaudi_serve_prefix_cache_queries_total = Counter(
            "gaudi_serve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", registry=c)
        self.gaudi_serve_prefix_cache_hits_total = Counter(
            "gaudi_serve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not computed again)",
            registry=c)
        self.gaudi_serve_prefix_cache_blocks = Gauge(
            "gaudi_serve_prefix_cache_blocks", "KV blocks registered in the prefix cache, held by a request or not",
            registry=r)

    def _kv_tier_metrics(self, c: list[Counter], r: CollectorRegistry) -> None:
        """The KV cache's host and disk tiers (docs/design.md, "KV cache tiers")."""
        self.gaudi_serve_kv_offload_hits_total = Counter(
            "gaudi_serve_kv_offload_hits_total", "Prompt tokens whose KV came from a tier below the device "
            "(tier: host, disk) instead of being computed", ("tier",), registry=c)
        self.gaudi_serve_kv_offload_bytes_total = Counter(
            "gaudi_serve_kv_offload_bytes_total", "KV bytes moved between tiers, every shard together "
            "(direction: device_to_host, host_to_device, host_to_disk, disk_to_device)", ("direction",), registry=c)
        self.gaudi_serve_kv_offload_copy_seconds_total = Counter(
            "gaudi_serve_kv_offload_copy_seconds_total", "Time rank 0 spent on tier copies before prefills "
            "(kind: copy), and reading disk blocks beside them (kind: disk_read)", ("kind",), registry=c)
        self.gaudi_serve_kv_offload_faults_total = Counter(
            "gaudi_serve_kv_offload_faults_total", "Disk tier faults (kind: corrupt: a file skipped; write_failed: "
            "a write that failed, rank 0; fetch_failed: a read call that failed)", ("kind",), registry=c)
        self.gaudi_serve_kv_offload_blocks = Gauge(
            "gaudi_serve_kv_offload_blocks", "KV blocks each tier holds (tier: host, disk, staged)", ("tier",),
            registry=r)

    def render(self) -> bytes:
        return "".join(c.render() for c in self.counters).encode() + generate_latest(self.registry)
