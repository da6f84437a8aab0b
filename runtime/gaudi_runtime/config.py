"""One typed configuration for the launcher, router and shards.

Flags and environment variables carry TGI's names and defaults: every flag
`--max-batch-size` also reads `MAX_BATCH_SIZE`, the flag winning. Settings
that contradict each other fail at start with one line naming the setting.
The resolved `Config` is grouped by concern (server, scheduling, model,
device, structured output, limits, adapters), and each part is handed to the
code that reads it; the flag table below stays the one list of settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from gaudi_runtime.adapters import AdapterSpec

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting is wrong; the message names it."""


def _bool(v: str | bool) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def _words(v: str | list[str]) -> str:
    """A flag that takes several values (`--lora-modules a=x b=y`) or their comma-separated text."""
    return ",".join(v) if isinstance(v, list) else str(v)


# The default budget of one prefill (--max-batch-prefill-tokens) when prompts may be longer: a running
# stream then waits at most one pass that holds such a chunk between two tokens (docs/performance.md,
# "Chunked prefill" and "Chunks in the decode step's pass, and a budget of 256").
DEFAULT_PREFILL_CHUNK = 256

# (flag, env var, type, default, help). The env var is the flag's TGI name in
# upper snake case unless given. None as default means "derived" (see resolve).
FLAGS: list[tuple[str, str | None, type, object, str]] = [
    ("--model-id", None, str, None, "Local directory or Hugging Face hub id of the model."),
    ("--revision", None, str, None, "Hub revision (branch, tag or commit) of the model."),
    ("--huggingface-hub-cache", "HUGGINGFACE_HUB_CACHE", str, None, "Where hub downloads are cached."),
    ("--dtype", None, str, "bfloat16", "Weights and activations dtype: bfloat16, float16 or float32."),
    ("--device", None, str, "auto", "auto, hpu, cuda or cpu."),
    ("--max-input-tokens", None, int, None, "Longest prompt in tokens (default: max-total-tokens - 1)."),
    ("--max-input-length", None, int, None, "Old name of --max-input-tokens."),
    ("--max-total-tokens", None, int, 2048, "Longest prompt + generation in tokens."),
    ("--max-batch-size", None, int, None, "Most requests in one batch (default: the bucket limits)."),
    ("--max-batch-prefill-tokens", None, int, None, "Most prompt tokens one prefill computes (vLLM's "
     "--max-num-batched-tokens, less the decodes): a longer prompt is prefilled in chunks of at most this many "
     "tokens (whole KV blocks), each in the forward pass of a decode step of the running requests, so that "
     "they never wait for a whole long prompt (default: max-input-tokens + 50, at most 256). At least --block-size."),
    ("--max-batch-total-tokens", None, int, None, "KV-cache budget in tokens (default: sized from the device)."),
    ("--max-waiting-tokens", None, int, 20, "Decode steps before waiting requests are forced into the batch."),
    ("--waiting-served-ratio", None, float, 0.0, "Waiting/running ratio that allows a prefill to interrupt decoding (0: a waiting "
     "request joins at the next step)."),
    ("--decode-steps", None, int, 4, "Most decode steps one call to the shards runs while no request waits, "
     "as many as fit 20 ms at the recent step time; their tokens stream together (1: a call per token, as in TGI)."),
    ("--speculate", None, int, 0, "Speculative decoding as TGI's launcher names it: draft up to this many "
     "tokens per step by n-gram lookup over the prompt and the output so far, and verify them in one forward "
     "pass; greedy outputs and the sampling distribution stay those of plain decoding. Drafting backs off "
     "in large batches and for requests whose drafts keep being rejected (0: off)."),
    ("--batch-invariant", None, _bool, False, "A request's greedy tokens do not depend on what else is in the "
     "step, how its prompt was chunked, whether its prefix came from the prefix cache, or speculation: every "
     "linear layer and attention runs a kernel that sums each row in one fixed order (CPU, bfloat16 or float32; "
     "not with LoRA, quantized weights or a float8 KV cache). vLLM's VLLM_BATCH_INVARIANT=1 turns it on too. "
     "Costs time per token (docs/performance.md)."),
    ("--prefix-caching", None, _bool, True, "Keep the KV blocks of prompts (and of generated text) to reuse for "
     "requests that start with the same tokens: a shared system prompt or a conversation's earlier turns are "
     "computed once."),
    ("--lora-adapters", None, str, None, "LoRA adapters served beside the base model, comma-separated (TGI's "
     "syntax): `id` (a hub id, downloaded into the hub cache as the model is, or a local directory; served "
     "under that name), `id@revision`, `name=path`. A request picks one with `parameters.adapter_id` "
     "(/generate) or `model` (/v1). PEFT format: adapter_config.json and adapter_model.safetensors."),
    ("--lora-modules", None, _words, None, "vLLM's spelling of --lora-adapters: `name=path` entries, "
     "space- or comma-separated; both flags may be given."),
    ("--max-loras", None, int, None, "Adapters that can run in one batch: the device slots of the adapters' "
     "stacked weights, fixed at start; a request for an adapter in no slot waits until a slot no running "
     "request uses takes it (default: the adapters given, 4 more with --allow-runtime-lora-updating; with only "
     "--max-cpu-loras given, that number, as before)."),
    ("--max-lora-rank", None, int, 16, "Largest adapter rank; every adapter is padded to it, so shapes "
     "stay the same whichever adapters a batch uses."),
    ("--allow-runtime-lora-updating", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", _bool, False, "Serve vLLM's "
     "`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (absent otherwise: 404), to add and "
     "remove adapters while serving. Anyone who can reach the API can then load files the server can read."),
    ("--max-cpu-loras", None, int, None, "Adapters whose weights are kept in host memory (an LRU cache, vLLM's "
     "meaning): one copied into a device slot from there is not read from its source again; at least "
     "--max-loras (default: --max-loras, or the adapters given if more). Registered adapters (given and "
     "loaded while serving) are not bounded by either."),
    ("--max-concurrent-requests", None, int, 128, "Requests in flight before new ones get 429."),
    ("--max-stop-sequences", None, int, 4, "Most stop sequences in one request."),
    ("--max-top-n-tokens", None, int, 5, "Largest top_n_tokens a request may ask for."),
    ("--max-best-of", None, int, 2, "Largest best_of a request may ask for."),
    ("--max-n", None, int, 16, "Most choices (OpenAI's n) one /v1 request may ask for; each is a sequence of its "
     "own, sampled with its own seed."),
    ("--max-client-batch-size", None, int, 4, "Most prompts in one /generate or /v1/completions body."),
    ("--max-request-bytes", None, int, 8 * 1024 * 1024, "Largest request body in bytes; a larger one gets 413."),
    ("--max-images-per-request", None, int, 4, "Most images one prompt may hold (vision models)."),
    ("--max-json-schema-bytes", None, int, 32 * 1024, "Largest JSON schema or grammar a request may carry "
     "(grammar, response_format, each tool's parameters), in bytes of compact JSON."),
    ("--max-json-schema-depth", None, int, 32, "Deepest nesting of objects and arrays in such a JSON schema."),
    ("--allowed-media-domains", None, str, None, "Comma-separated hosts whose image URLs the router fetches, "
     "whatever their addresses (default: any host whose addresses are all public)."),
    ("--disable-image-urls", None, _bool, False, "Take images only inline as data: URLs; fetch no URL."),
    ("--hostname", None, str, "0.0.0.0", "Address the HTTP server listens on."),
    ("--port", None, int, 80, "Port the HTTP server listens on."),
    ("--shard-uds-path", None, str, "/tmp/gaudi-serve-server", "Prefix of the shards' unix sockets."),
    ("--sharded", None, _bool, None, "Shard the model across cards (default: when more than one is visible)."),
    ("--num-shard", None, int, None, "Number of shards (default: every visible card; 1 on CPU or with --sharded false)."),
    ("--json-output", None, _bool, False, "Log JSON lines instead of text."),
    ("--api-key", None, str, None, "Bearer token every route requires but /health, /ping, /metrics and the API "
     "description (/api-doc/openapi.json, /docs)."),
    ("--cors-allow-origin", None, str, None, "Comma-separated origins allowed by CORS."),
    ("--block-size", None, int, None, "KV-cache block size in tokens (default: 128 on HPU, 16 elsewhere)."),
    ("--memory-fraction", "MEMORY_FRACTION", float, 0.9, "Share of free device memory the KV cache may take."),
    ("--model-name", None, str, None, "Name served at /v1/models (default: the model id)."),
    ("--quantize", None, str, None, "fp8: float8 weights (Intel Neural Compressor on Gaudi, native elsewhere), "
     "or the format of a pre-quantized checkpoint (TGI's names: fp8, compressed-tensors, gptq, awq), which "
     "config.json's quantization_config also tells when this is unset."),
    ("--kv-cache-dtype", None, str, None, "fp8_e4m3fn: float8 KV cache with per-tensor scales (default: --dtype)."),
    ("--rope-scaling", None, str, None, "Override the model's RoPE scaling: linear or dynamic (factor from --rope-factor)."),
    ("--rope-factor", None, float, None, "RoPE scaling factor (default 1.0 with --rope-scaling; alone it implies linear)."),
    ("--tokenizer-config-path", None, str, None, "A tokenizer_config.json whose chat_template replaces the model's."),
    ("--recipe-cache-dir", None, str, None, "Gaudi: keep Habana's compiled graph recipes under this writable "
     "directory (PT_HPU_RECIPE_CACHE_CONFIG), keyed by what changes them, so that a restart warms up from it."),
    ("--kv-events-config", None, str, None, "Publish KV-cache events as vLLM does, for a prefix-cache-aware "
     "router: a JSON object with vLLM's KVEventsConfig fields, e.g. "
     "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv\"}' "
     "(docs/operations.md, \"Model-server protocol\")."),
    ("--kv-offloading-size", "KV_OFFLOADING_SIZE", float, None, "GiB of host memory for a second tier of the "
     "prefix cache, in all: the shards share it, as vLLM's flag is summed over tensor-parallel ranks (staging for "
     "blocks read back from disk included). KV blocks evicted from the device are copied there instead of "
     "dropped, and a prompt found there is copied back before its prefill, so only the rest is computed "
     "(pinned memory on CUDA and Gaudi). Unset: no host tier."),
    ("--kv-offloading-disk-path", "KV_OFFLOADING_DISK_PATH", str, None, "A writable directory (local disk, an "
     "emptyDir, the model cache volume) for a third tier under the host tier: every block that enters host "
     "memory is written there too, checksummed, and a restarted server finds them (needs --kv-offloading-size and "
     "--kv-offloading-disk-size)."),
    ("--kv-offloading-disk-size", "KV_OFFLOADING_DISK_SIZE", float, None, "GiB the disk tier may hold (every "
     "shard's files together); the least recently used blocks are deleted beyond it."),
    ("--otlp-endpoint", None, str, None, "OTLP/HTTP collector (e.g. http://collector:4318) receiving request traces."),
    ("--otlp-service-name", None, str, "text-generation-inference.router", "service.name of the exported traces."),
    ("--disable-grammar-support", None, _bool, False, "Refuse constrained generation: grammar, response_format, "
     "guided_*, and tool_choice required or named get a 422."),
    ("--grammar-compile-timeout-s", None, float, 10.0, "Longest the router waits for the shards to compile a "
     "request's grammar (a JSON schema, a regex, a tool set); past it the request gets a 422."),
    ("--tool-call-parser", None, str, None, "Tool-call format of the model's output: llama3_json, mistral, "
     "hermes or deepseek_v3 (default: recognised from the chat template; llama3_json for a template that does "
     "not render tools, which then get them in a prompt)."),
    ("--reasoning-parser", None, str, None, "How the model marks its thinking, by vLLM's names: deepseek_r1 or "
     "qwen3 (<think>...</think>). Chat completions then carry the thinking in `reasoning` and the answer in "
     "`content`, and grammars (TGI's grammar, response_format, guided_*, tool_choice required or named) "
     "apply to the answer only. "
     "Default: none (the thinking is content)."),
    ("--warmup-stall-seconds", None, float, 600.0, "While the server is not serving yet (model download, load, "
     "warmup): seconds without any step done (a downloaded chunk, a loaded weight, a warmed shape) after which the "
     "start counts as stuck: /livez answers 503 and, 10 s later (a liveness probe sees it first), the launcher "
     "exits with code 75, the reason in its log and termination message. A start that keeps making steps is never stopped, however long it takes. 0: never."),
    ("--shutdown-grace-seconds", None, float, 20.0, "On SIGTERM, how long running requests may still finish (new "
     "ones get 503, /health 503); those left then end with an error. Keep it below the pod's "
     "terminationGracePeriodSeconds less preStop."),
]

# Environment-only settings (TGI and TGI-Gaudi names).
ENV_ONLY: list[tuple[str, type, object, str]] = [
    ("QUEUE_THRESHOLD_MS", int, 120, "A request waiting longer than this makes the scheduler prefer prefill."),
    ("SKIP_TOKENIZER_IN_TGI", _bool, False, "Inputs are comma-separated token ids, outputs are ids."),
    ("TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN", _bool, False, "Generate until max_new_tokens, ignoring EOS."),
    ("LOG_LEVEL", str, "info", "Log level: debug, info, warning, error."),
    ("BATCH_BUCKET_SIZE", int, 8, "Decode batch sizes are padded to a multiple of this."),
    ("PREFILL_BATCH_BUCKET_SIZE", int, 4, "Prefill batch sizes are padded to a multiple of this."),
    ("PAD_SEQUENCE_TO_MULTIPLE_OF", int, 128, "Prompt lengths are padded to a multiple of this."),
    ("WARMUP_ENABLED", _bool, True, "Run every bucket once before serving."),
    ("EXPONENTIAL_BUCKETING", _bool, False, "Buckets grow as step * 2^k instead of linearly."),
    ("ENABLE_HPU_GRAPH", _bool, True, "Capture a device graph per bucket (HPU graphs; CUDA graphs on NVIDIA)."),
    ("LIMIT_HPU_GRAPH", _bool, False, "Keep prefill out of graphs (decode only), to save device memory."),
    ("BASE_IMAGE_TOKENS", int, 2048, "Vision models (Llava): the image-token budget every prompt must have "
     "room for; --max-input-tokens must be at least this."),
    ("MAX_IMAGE_BYTES", int, 5 * 1024 * 1024, "Largest image in a prompt (encoded bytes, inline or fetched)."),
    ("IMAGE_FETCH_TIMEOUT_S", float, 10.0, "Longest the router waits for an http(s) image of a prompt."),
    ("PROF_WAITSTEP", int, 0, "Profiler: decode steps skipped before the profiler warms up."),
    ("PROF_WARMUPSTEP", int, 0, "Profiler: decode steps profiled but discarded (warm-up) before recording."),
    ("PROF_STEP", int, 0, "Profiler: decode steps recorded into a Chrome trace (0: profiler off)."),
    ("PROF_PATH", str, "/tmp/hpu_profile", "Profiler: directory the Chrome-trace files are written to."),
    ("PROF_RANKS", str, "0", "Profiler: comma-separated shard ranks that record a trace."),
    ("PROF_RECORD_SHAPES", _bool, False, "Profiler: record operator input shapes."),
    ("USE_FLASH_ATTENTION", _bool, True, "Fused attention (FusedSDPA on HPU, whose decode attends over the blocks "
     "in use laid out flat; torch SDPA elsewhere); false: explicit softmax(QK^T)V over gathered blocks."),
    ("FLASH_ATTENTION_RECOMPUTE", _bool, False, "FusedSDPA recompute mode for the first token (HPU; saves memory)."),
    ("CPU_PAGED_ATTENTION", _bool, True, "CPU: decode attention reads the paged KV cache in place with a C kernel, "
     "prebuilt for the CPU's instruction-set level by `gaudi-serve build-kernels` (into $GAUDI_SERVE_KERNELS, "
     "as the CPU image does), else compiled at start with the system compiler (CC, else cc) into "
     "$XDG_CACHE_HOME/gaudi-serve/kernels; false, or neither, or a float8 KV cache: each step gathers the "
     "blocks into a copy first."),
    ("VLLM_BATCH_INVARIANT", _bool, False, "vLLM's name for --batch-invariant: 1 turns the mode on."),
    ("CPU_GEMV", _bool, True, "CPU: a product of one to eight activation rows (decode at small batches, a "
     "speculative step's few tokens) runs through a C kernel over the plain "
     "weights, compiled as CPU_PAGED_ATTENTION's is; each linear layer "
     "keeps its plain weight for it beside oneDNN's reordered copy, twice the linear weights' memory. false, "
     "or no kernel (prebuilt or compiled): oneDNN for every product."),
    ("CPU_LAYER_OPS", _bool, True, "CPU: each RMSNorm (with its residual add), rotary embedding and KV cache write "
     "of a float32 or bfloat16 model runs as one C call, compiled as CPU_PAGED_ATTENTION's is, instead of "
     "several torch operators. false, or no kernel: torch's operators."),
    ("CPU_LORA", _bool, True, "CPU: each LoRA layer adds its rows' adapter products in one C call, compiled as "
     "CPU_PAGED_ATTENTION's is, the rows grouped by adapter so each adapter's weights are read once and rows "
     "of the base model cost nothing. false, or no kernel: every row's A and B gathered and two batched "
     "matmuls (the static-shaped path graphs use)."),
    ("CPU_MOE", _bool, True, "CPU: a mixture-of-experts layer's routed experts run as one C call per layer, "
     "compiled as CPU_PAGED_ATTENTION's is, when its experts average at most 32 rows each (decode, short "
     "prefills); larger steps and false, or no compiler: each routed expert's rows as torch calls of their own."),
    ("RECIPE_CACHE_SIZE_MB", int, 16384, "Gaudi: most megabytes of recipes each shard keeps under "
     "--recipe-cache-dir (Habana drops the oldest beyond it)."),
    ("TERMINATION_MESSAGE_PATH", str, "/dev/termination-log", "Where the launcher writes why it gave up (a "
     "stalled start) for Kubernetes to show: the container's terminationMessagePath. Written only where the "
     "file exists (the kubelet creates it)."),
    ("QUANT_CONFIG", str, None, "INC FP8 JSON (QUANTIZE mode, allowlist/blocklist, dump_stats_path); implies "
     "--quantize fp8."),
]


# Settings whose values are secrets: the start-up log shows only whether they are set.
SECRET_SETTINGS = ("api_key",)
REDACTED = "<redacted>"


# The configuration is grouped by concern, one frozen dataclass a part, and each part is handed only to
# the code that reads it (docs/design.md, "Configuration parts"). The flag table above stays the one
# source of the settings: every FLAGS and ENV_ONLY setting lands in the one part that declares a field of
# its name (the folded flags below excepted), and `resolve` fills the parts from the flat values it derives.


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and the processes: where they listen, logs, traces, auth, start and stop."""

    hostname: str = "0.0.0.0"
    port: int = 80
    shard_uds_path: str = "/tmp/gaudi-serve-server"
    json_output: bool = False
    log_level: str = "info"
    api_key: str | None = None
    cors_allow_origin: list[str] = field(default_factory=list)
    max_request_bytes: int = 8 * 1024 * 1024
    otlp_endpoint: str | None = None
    otlp_service_name: str = "text-generation-inference.router"
    warmup_stall_seconds: float = 600.0
    shutdown_grace_seconds: float = 20.0
    termination_message_path: str = "/dev/termination-log"

    def shard_socket(self, rank: int) -> str:
        """The unix socket shard `rank` serves gRPC on (the router and the offline API connect to it)."""
        return f"{self.shard_uds_path}-{rank}"


@dataclass(frozen=True)
class SchedulingConfig:
    """How the router batches: batch and prefill budgets, when waiting requests join, speculation, the
    prefix cache and its events."""

    max_batch_size: int = 0
    max_batch_prefill_tokens: int = 0
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 0.0
    decode_steps: int = 4
    queue_threshold_ms: int = 120
    speculate: int = 0
    prefix_caching: bool = True
    kv_events_config: dict | None = None  # vLLM's KVEventsConfig, every field filled; None: no events
    kv_offloading_size: float | None = None  # GiB of host memory for the host tier, all shards together; None: none
    kv_offloading_disk_path: str | None = None  # the disk tier's directory; None: no disk tier
    kv_offloading_disk_size: float | None = None  # GiB the disk tier holds, every shard's files together


@dataclass(frozen=True)
class ServedModelConfig:
    """What is served: the model, its name, its numeric formats and quantization, RoPE, the tokenizer.
    (Not `models.base.ModelConfig`, which is a model's parsed config.json.)"""

    model_id: str = ""
    revision: str | None = None
    huggingface_hub_cache: str | None = None
    model_name: str = ""
    dtype: str = "bfloat16"
    quantize: str | None = None
    quant_config: str | None = None
    kv_cache_dtype: str | None = None
    rope_scaling: str | None = None
    rope_factor: float | None = None
    tokenizer_config_path: str | None = None
    skip_tokenizer_in_tgi: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    """Where and how the shards compute: cards, KV blocks and memory, static shapes (buckets), graphs,
    warmup, the recipe cache, the profiler and the attention and CPU kernel switches."""

    device: str = "auto"
    num_shard: int = 1
    sharded: bool = False
    block_size: int = 16
    memory_fraction: float = 0.9
    batch_bucket_size: int = 8
    prefill_batch_bucket_size: int = 4
    pad_sequence_to_multiple_of: int = 128
    exponential_bucketing: bool = False
    warmup_enabled: bool = True
    enable_hpu_graph: bool = True
    limit_hpu_graph: bool = False
    use_flash_attention: bool = True
    flash_attention_recompute: bool = False
    cpu_paged_attention: bool = True
    cpu_gemv: bool = True
    cpu_layer_ops: bool = True
    cpu_lora: bool = True
    cpu_moe: bool = True
    batch_invariant: bool = False
    recipe_cache_dir: str | None = None
    recipe_cache_size_mb: int = 16384
    prof_waitstep: int = 0
    prof_warmupstep: int = 0
    prof_step: int = 0
    prof_path: str = "/tmp/hpu_profile"
    prof_ranks: list[int] = field(default_factory=lambda: [0])
    prof_record_shapes: bool = False

    @property
    def may_be_gaudi(self) -> bool:
        """Whether the shards may run on Gaudi cards (chosen, or found by --device auto)."""
        return self.device in ("auto", "hpu")

    @property
    def decodes_flat(self) -> bool:
        """Whether decode runs over the flat layout of the blocks in use (``layers/flat_paged_attention.py``):
        on Gaudi with fused attention; elsewhere, and with the explicit math, over block tables. Read where
        no backend is at hand (the operator's warmup count); the shards ask their backend."""
        return self.device == "hpu" and self.use_flash_attention


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Constrained generation: whether it is served, how long a grammar may compile, how large a schema
    may be, and the tool-call format."""

    disable_grammar_support: bool = False
    grammar_compile_timeout_s: float = 10.0
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    max_json_schema_bytes: int = 32 * 1024
    max_json_schema_depth: int = 32


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may carry and ask for (tokens, choices, stop sequences, images and where they are
    fetched from), and how many may be in flight: what validation checks."""

    max_input_tokens: int = 0
    max_total_tokens: int = 2048
    max_concurrent_requests: int = 128
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_best_of: int = 2
    max_n: int = 16
    max_client_batch_size: int = 4
    text_generation_server_ignore_eos_token: bool = False
    max_images_per_request: int = 4
    base_image_tokens: int = 2048
    max_image_bytes: int = 5 * 1024 * 1024
    image_fetch_timeout_s: float = 10.0
    allowed_media_domains: list[str] | None = None
    disable_image_urls: bool = False


@dataclass(frozen=True)
class AdaptersConfig:
    """LoRA adapters: those given at start, the slots and ranks, loading while serving."""

    # In slot order; the launcher resolves each (its path and digest) before any shard starts.
    lora_adapters: tuple[AdapterSpec, ...] = ()
    max_loras: int = 0  # device slots besides slot 0 (the base model): the adapters one batch may use
    max_lora_rank: int = 16
    allow_runtime_lora_updating: bool = False
    max_cpu_loras: int = 0  # adapters' weights each shard keeps in host memory (LRU)

    def __post_init__(self):
        # from_json hands each adapter over as the JSON object `asdict` made of it.
        specs = tuple(a if isinstance(a, AdapterSpec) else AdapterSpec(**a) for a in self.lora_adapters)
        object.__setattr__(self, "lora_adapters", specs)


@dataclass(frozen=True)
class Config:
    """Every part; the launcher, the router's and the shards' set-up hand each part to its readers."""

    server: ServerConfig = field(default_factory=ServerConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    model: ServedModelConfig = field(default_factory=ServedModelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)

    @classmethod
    def of(cls, **settings: object) -> Config:
        """A Config from flat settings named as the flags are (`Config.of(model_id="m", port=8080)`), each
        put in the part that declares it, the rest defaulted: how `resolve` builds one, and tests."""
        by_part = _by_part(settings)
        return cls(**{part: typ(**by_part.get(part, {})) for part, typ in PARTS.items()})

    def replace(self, **settings: object) -> Config:
        """A copy with some settings changed, named flat as in `of`."""
        return dataclasses.replace(self, **{part: dataclasses.replace(getattr(self, part), **changed)
                                            for part, changed in _by_part(settings).items()})

    def setting(self, name: str) -> object:
        """One setting by its flat name, for code that lists settings by name (the recipe cache's key)."""
        return getattr(getattr(self, PART_OF[name]), name)

    def to_json(self) -> str:
        """The parts as nested JSON objects: what the launcher hands the router and shards."""
        return json.dumps(dataclasses.asdict(self))

    def to_log_json(self) -> str:
        """Every setting as resolved, part by part, secrets masked: what the start-up log may show."""
        values = dataclasses.asdict(self)
        for name in SECRET_SETTINGS:
            part = values[PART_OF[name]]
            if part[name] is not None:
                part[name] = REDACTED
        return json.dumps(values)

    @classmethod
    def from_json(cls, s: str) -> Config:
        parts = json.loads(s)
        return cls(**{part: typ(**parts[part]) for part, typ in PARTS.items()})


PARTS: dict[str, type] = {
    "server": ServerConfig, "scheduling": SchedulingConfig, "model": ServedModelConfig, "device": DeviceConfig,
    "structured_output": StructuredOutputConfig, "limits": LimitsConfig, "adapters": AdaptersConfig,
}
# setting -> the part that declares it.
PART_OF: dict[str, str] = {f.name: part for part, typ in PARTS.items() for f in dataclasses.fields(typ)}
# Flags read but not kept under their own name: their value is folded into another setting by `_derive`.
FOLDED_FLAGS: dict[str, str] = {"max_input_length": "max_input_tokens", "lora_modules": "lora_adapters",
                                "vllm_batch_invariant": "batch_invariant"}


def _by_part(settings: dict[str, object]) -> dict[str, dict[str, object]]:
    """Flat settings grouped by the part that declares each; an unknown name is a TypeError, as a wrong
    keyword argument is."""
    unknown = sorted(set(settings) - set(PART_OF))
    if unknown:
        raise TypeError(f"no such setting: {', '.join(unknown)}")
    by_part: dict[str, dict[str, object]] = {}
    for name, value in settings.items():
        by_part.setdefault(PART_OF[name], {})[name] = value
    return by_part


def _attr(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag, defaulting to None so that env and derived defaults apply later."""
    for flag, env, _typ, default, help_ in FLAGS:
        env = env or _attr(flag).upper()
        shown = "derived" if default is None else default
        # Booleans may be given bare (`--disable-grammar-support`), as TGI's switches are.
        bare = {"nargs": "?", "const": "true"} if _typ is _bool else {"nargs": "+"} if _typ is _words else {}
        parser.add_argument(flag, default=None, help=f"{help_} [env: {env}] [default: {shown}]", **bare)


def _visible_device_count(device: str) -> int:
    from gaudi_runtime.device import visible_device_count

    return visible_device_count(device)


def resolve(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None,
            device_count: Callable[[str], int] | None = None) -> Config:
    """Flags over env over defaults; then derived values and cross-checks.

    `device_count(device)` counts the visible cards (the default of --num-shard); tests pass their own."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for flag, env, typ, default, _ in FLAGS:
        name = _attr(flag)
        env = env or name.upper()
        raw = getattr(args, name, None) if args is not None else None
        source = flag
        if raw is None and env in environ:
            raw, source = environ[env], env
        if raw is None:
            values[name] = default
            continue
        try:
            values[name] = typ(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: expected {typ.__name__.lstrip('_')}, got {raw!r}") from None
    for env, typ, default, _ in ENV_ONLY:
        raw = environ.get(env)
        try:
            values[env.lower()] = default if raw is None else typ(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{env}: expected {typ.__name__.lstrip('_')}, got {raw!r}") from None
    return _derive(values, device_count or _visible_device_count)


def _derive(v: dict[str, object], device_count: Callable[[str], int]) -> Config:
    if not v["model_id"]:
        raise ConfigError("--model-id is required (a local directory or a hub id)")
    _derive_token_limits(v)
    _derive_batching(v)
    _derive_device(v)
    _derive_shards(v, device_count)
    _derive_quantization(v)
    _derive_knobs(v)
    _derive_structured_output(v)
    _derive_request_limits(v)
    v["kv_events_config"] = kv_events_config(v["kv_events_config"])
    check_kv_offloading(v)
    origins = v["cors_allow_origin"]
    v["cors_allow_origin"] = [o.strip() for o in origins.split(",") if o.strip()] if origins else []
    v["model_name"] = v["model_name"] or v["model_id"]
    _derive_adapters(v)
    _derive_batch_invariant(v)
    v["log_level"] = str(v["log_level"]).lower()
    return Config.of(**v)


# vLLM's KVEventsConfig: field -> (default, type). `publisher` defaults to "zmq" when events are on.
KV_EVENTS_FIELDS: dict[str, tuple[object, type]] = {
    "enable_kv_cache_events": (False, bool), "publisher": (None, str), "endpoint": ("tcp://*:5557", str),
    "replay_endpoint": (None, str), "buffer_steps": (10_000, int), "hwm": (100_000, int),
    "max_queue_size": (100_000, int), "topic": ("", str),
}


def kv_events_config(raw: str | dict | None) -> dict | None:
    """--kv-events-config as vLLM reads it: a JSON object of KVEventsConfig fields, the rest defaulted;
    None when the flag is unset or events are off (publisher "null")."""
    if raw is None or raw == "":
        return None
    try:
        given = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kv-events-config: not JSON ({e})") from None
    if not isinstance(given, dict):
        raise ConfigError("--kv-events-config: expected a JSON object")
    unknown = sorted(set(given) - set(KV_EVENTS_FIELDS))
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
    out = {name: given.get(name, default) for name, (default, _) in KV_EVENTS_FIELDS.items()}
    for name, (_, typ) in KV_EVENTS_FIELDS.items():
        value = out[name]
        if value is not None and (not isinstance(value, typ) or (typ is int and isinstance(value, bool))):
            raise ConfigError(f"--kv-events-config: {name} must be a {typ.__name__}, got {value!r}")
    if out["publisher"] is None:
        out["publisher"] = "zmq" if out["enable_kv_cache_events"] else "null"
    if out["publisher"] not in ("zmq", "null"):
        raise ConfigError(f"--kv-events-config: publisher {out['publisher']!r}: choose zmq or null")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if out[name] < 1:
            raise ConfigError(f"--kv-events-config: {name} must be positive")
    if not out["enable_kv_cache_events"] or out["publisher"] == "null":
        return None
    return out


def check_kv_offloading(v: dict[str, object]) -> None:
    """The host and disk tiers' settings agree with each other and with prefix caching (whose blocks they keep)."""
    size, path, disk = v["kv_offloading_size"], v["kv_offloading_disk_path"] or None, v["kv_offloading_disk_size"]
    v["kv_offloading_disk_path"] = path
    for name, value in (("--kv-offloading-size", size), ("--kv-offloading-disk-size", disk)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be a positive number of GiB, got {value}")
    if (path is None) != (disk is None):
        raise ConfigError("--kv-offloading-disk-path and --kv-offloading-disk-size go together: set both or neither")
    if path is not None and size is None:
        raise ConfigError("--kv-offloading-disk-path needs --kv-offloading-size: disk blocks are read through host memory")
    if size is not None and not v["prefix_caching"]:
        raise ConfigError("--kv-offloading-size needs --prefix-caching: the tiers keep the prefix cache's blocks")


# Tool-call formats the router parses (and constrains, for tool_choice required or named).
TOOL_CALL_PARSERS = ("llama3_json", "mistral", "hermes", "deepseek_v3")
# Reasoning formats the router splits from the answer (router/reasoning.py), by vLLM's names.
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _derive_structured_output(v: dict[str, object]) -> None:
    """Choices (--max-n), grammar compilation and the tool-call format."""
    if v["max_n"] < 1:
        raise ConfigError("--max-n must be positive")
    if not v["grammar_compile_timeout_s"] > 0:
        raise ConfigError("--grammar-compile-timeout-s must be positive")
    parser = v["tool_call_parser"]
    if parser in ("", "auto"):
        v["tool_call_parser"] = None
    elif parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"--tool-call-parser {parser!r}: choose one of {', '.join(TOOL_CALL_PARSERS)}")
    reasoning = v["reasoning_parser"]
    if reasoning in ("", "none"):
        v["reasoning_parser"] = None
    elif reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser {reasoning!r}: choose one of {', '.join(REASONING_PARSERS)}")


def _derive_token_limits(v: dict[str, object]) -> None:
    """Input, total and prefill token limits, with TGI's defaults and its older --max-input-length alias."""
    if v["max_input_length"] is not None:
        if v["max_input_tokens"] is not None and v["max_input_tokens"] != v["max_input_length"]:
            raise ConfigError("--max-input-tokens and --max-input-length disagree; give one")
        v["max_input_tokens"] = v["max_input_length"]
    del v["max_input_length"]
    total = v["max_total_tokens"]
    if total < 2:
        raise ConfigError(f"--max-total-tokens ({total}) must be at least 2")
    if v["max_input_tokens"] is None:
        v["max_input_tokens"] = total - 1
    if v["max_input_tokens"] < 1:
        raise ConfigError("--max-input-tokens must be positive")
    if v["max_input_tokens"] >= total:
        raise ConfigError(
            f"--max-input-tokens ({v['max_input_tokens']}) must be < --max-total-tokens ({total})"
        )
    if v["max_batch_prefill_tokens"] is None:
        v["max_batch_prefill_tokens"] = min(v["max_input_tokens"] + 50, DEFAULT_PREFILL_CHUNK)
    bt = v["max_batch_total_tokens"]
    if bt is not None and bt < total:
        raise ConfigError(f"--max-batch-total-tokens ({bt}) must be >= --max-total-tokens ({total})")


def _derive_batching(v: dict[str, object]) -> None:
    if v["speculate"] < 0:
        raise ConfigError(f"--speculate must be >= 0, got {v['speculate']}")
    for name in ("max_concurrent_requests", "max_client_batch_size", "max_waiting_tokens", "decode_steps"):
        if v[name] < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    if v["shutdown_grace_seconds"] < 0:
        raise ConfigError("--shutdown-grace-seconds must be >= 0")
    if v["warmup_stall_seconds"] < 0:
        raise ConfigError("--warmup-stall-seconds must be >= 0 (0: never)")
    for name in ("batch_bucket_size", "prefill_batch_bucket_size", "pad_sequence_to_multiple_of"):
        if v[name] < 1:
            raise ConfigError(f"{name.upper()} must be positive")
    if v["max_batch_size"] is None:
        v["max_batch_size"] = max(v["batch_bucket_size"], min(256, v["max_concurrent_requests"]))
    if v["max_batch_size"] < 1:
        raise ConfigError("--max-batch-size must be positive")


def _derive_request_limits(v: dict[str, object]) -> None:
    """What one request may carry, and which image URLs the router may fetch."""
    for name in ("max_request_bytes", "max_json_schema_bytes", "max_json_schema_depth"):
        if v[name] < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    for name in ("max_stop_sequences", "max_top_n_tokens", "max_images_per_request"):
        if v[name] < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if v["max_best_of"] < 1:
        raise ConfigError("--max-best-of must be positive")
    domains = v["allowed_media_domains"]
    if domains is not None:
        v["allowed_media_domains"] = [normalize_host(d) for d in domains.split(",") if d.strip()]


def normalize_host(host: str) -> str:
    """A host name as the router compares it: lower case, no trailing dot, no IPv6 brackets."""
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def _derive_device(v: dict[str, object]) -> None:
    if not 0 < v["memory_fraction"] <= 1:
        raise ConfigError("--memory-fraction must be in (0, 1]")
    if v["dtype"] not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"--dtype {v['dtype']!r}: choose bfloat16, float16 or float32")
    if v["device"] not in ("auto", "hpu", "cuda", "cpu"):
        raise ConfigError(f"--device {v['device']!r}: choose auto, hpu, cuda or cpu")
    if v["block_size"] is None:
        v["block_size"] = 128 if v["device"] == "hpu" else 16
    if v["block_size"] < 1:
        raise ConfigError("--block-size must be positive")
    if v["max_batch_prefill_tokens"] < v["block_size"]:
        raise ConfigError(f"--max-batch-prefill-tokens ({v['max_batch_prefill_tokens']}) must be >= --block-size "
                          f"({v['block_size']}): a prompt is prefilled in chunks of whole blocks")


def _derive_shards(v: dict[str, object], device_count: Callable[[str], int]) -> None:
    sharded, num = v["sharded"], v["num_shard"]
    if sharded is False and num not in (None, 1):
        raise ConfigError(f"--sharded false contradicts --num-shard {num}")
    if sharded and num == 1:
        raise ConfigError("--sharded true needs --num-shard > 1")
    if num is None and sharded is not False:
        # TGI: without --num-shard, shard over every visible card (--sharded false forces one).
        num = device_count(v["device"])
        if sharded and num < 2:
            raise ConfigError(f"--sharded true but only {num} visible {v['device']} device(s); "
                              "give --num-shard or --sharded false")
    v["num_shard"] = num or 1
    v["sharded"] = v["num_shard"] > 1
    if v["num_shard"] < 1:
        raise ConfigError("--num-shard must be positive")


def _derive_adapters(v: dict[str, object]) -> None:
    """--lora-adapters and --lora-modules into one list, with --max-loras and --max-lora-rank."""
    from gaudi_runtime.adapters import AdapterError, parse_specs

    try:
        adapters = parse_specs(v.pop("lora_adapters"), v.pop("lora_modules"))
    except AdapterError as e:
        raise ConfigError(f"--lora-adapters: {e}") from None
    for a in adapters:
        if a.name in (v["model_name"], v["model_id"]):
            raise ConfigError(f"--lora-adapters: adapter name {a.name!r} is the base model's name")
    v["lora_adapters"] = tuple(adapters)
    if v["max_lora_rank"] < 1:
        raise ConfigError("--max-lora-rank must be positive")
    _derive_adapter_slots(v, len(adapters))
    if (adapters or v["allow_runtime_lora_updating"]) and v["quantize"]:
        raise ConfigError(f"--quantize {v['quantize']} cannot be combined with LoRA adapters yet (the adapters' "
                          "matmuls run in --dtype beside quantized layers that are not built)")


def _derive_batch_invariant(v: dict[str, object]) -> None:
    """--batch-invariant (or vLLM's VLLM_BATCH_INVARIANT): CPU kernels only, and only where every layer on the
    path has a fixed-order kernel (docs/design.md, "Batch-invariant mode")."""
    vllm = v.pop("vllm_batch_invariant")
    v["batch_invariant"] = bool(v["batch_invariant"] or vllm)
    if not v["batch_invariant"]:
        return
    refused = [("--device " + str(v["device"]), v["device"] in ("hpu", "cuda")),
               ("--dtype float16", v["dtype"] == "float16"), ("--quantize", v["quantize"] is not None),
               ("--kv-cache-dtype", v["kv_cache_dtype"] is not None),
               ("LoRA adapters", bool(v["lora_adapters"]) or v["allow_runtime_lora_updating"])]
    for what, bad in refused:
        if bad:
            raise ConfigError(f"--batch-invariant cannot be combined with {what}: it runs the CPU's fixed-order "
                              "kernels, for bfloat16 and float32 dense weights")


# Device slots beyond the adapters given when adapters may be loaded while serving and no slot count is given.
RUNTIME_LORA_SLOTS = 4


def _derive_adapter_slots(v: dict[str, object], given: int) -> None:
    """--max-loras (the device slots, fixed at start: shapes never change) and --max-cpu-loras (the host
    cache of adapters' weights, at least the device slots)."""
    if not given and not v["allow_runtime_lora_updating"]:
        v["max_loras"], v["max_cpu_loras"] = v["max_loras"] or 0, v["max_cpu_loras"] or 0
        return
    for flag, n in (("--max-loras", v["max_loras"]), ("--max-cpu-loras", v["max_cpu_loras"])):
        if n is not None and n < 1:
            raise ConfigError(f"{flag} must be positive")
    slots, cached = v["max_loras"], v["max_cpu_loras"]
    if slots is None and cached is not None:
        slots = cached  # its meaning before it sized the host cache: the server keeps its device slots
        log.warning("--max-cpu-loras %d without --max-loras: %d device slots, as before; --max-loras now sets the "
                    "device slots and --max-cpu-loras the adapters kept in host memory (vLLM's meanings): give "
                    "--max-loras to set them apart", cached, cached)
    elif slots is None:
        slots = given + (RUNTIME_LORA_SLOTS if v["allow_runtime_lora_updating"] else 0)
    if cached is None:
        cached = max(slots, given)
    elif cached < slots:
        raise ConfigError(f"--max-cpu-loras ({cached}) must be >= --max-loras ({slots})")
    v["max_loras"], v["max_cpu_loras"] = slots, cached


# --quantize values, as TGI names them (fp8 also means "quantize at load" on a checkpoint that is not quantized),
# and TGI's names gaudi-serve does not serve (refused with that reason rather than as unknown).
QUANTIZE_NAMES = ("fp8", "compressed-tensors", "gptq", "awq")
UNSERVED_NAMES = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "exl2", "marlin")


def _derive_quantization(v: dict[str, object]) -> None:
    """--quantize, --kv-cache-dtype and QUANT_CONFIG (whose file `launch` checks before starting anything:
    `gaudi_runtime.quant.config.check_quant_config`; it may live only where the server runs)."""
    if v["quantize"] in UNSERVED_NAMES:
        raise ConfigError(f"--quantize {v['quantize']}: not served by gaudi-serve (choose {', '.join(QUANTIZE_NAMES)})")
    if v["quantize"] is not None and v["quantize"] not in QUANTIZE_NAMES:
        raise ConfigError(f"--quantize {v['quantize']!r}: choose one of {', '.join(QUANTIZE_NAMES)}")
    if v["quant_config"] and v["quantize"] not in (None, "fp8"):
        raise ConfigError(f"QUANT_CONFIG calibrates FP8; it cannot be combined with --quantize {v['quantize']}")
    if v["kv_cache_dtype"] not in (None, "auto", "fp8_e4m3fn"):
        raise ConfigError(f"--kv-cache-dtype {v['kv_cache_dtype']!r}: choose fp8_e4m3fn (or leave it unset)")
    if v["kv_cache_dtype"] == "auto":
        v["kv_cache_dtype"] = None
    if v["quant_config"]:
        v["quant_config"] = os.path.abspath(v["quant_config"])
        v["quantize"] = "fp8"


def _derive_knobs(v: dict[str, object]) -> None:
    """RoPE override (TGI's pairing of --rope-scaling and --rope-factor), profiler and attention settings."""
    scaling, factor = v["rope_scaling"], v["rope_factor"]
    if scaling is not None and scaling not in ("linear", "dynamic"):
        raise ConfigError(f"--rope-scaling {scaling!r}: choose linear or dynamic")
    if factor is not None and factor <= 0:
        raise ConfigError(f"--rope-factor ({factor}) must be positive")
    if scaling is not None or factor is not None:
        v["rope_scaling"], v["rope_factor"] = scaling or "linear", 1.0 if factor is None else factor
    if v["tokenizer_config_path"]:
        v["tokenizer_config_path"] = os.path.abspath(v["tokenizer_config_path"])
        if not os.path.isfile(v["tokenizer_config_path"]):
            raise ConfigError(f"--tokenizer-config-path {v['tokenizer_config_path']}: no such file")
    if v["recipe_cache_dir"]:
        v["recipe_cache_dir"] = os.path.abspath(v["recipe_cache_dir"])
    if v["recipe_cache_size_mb"] < 1:
        raise ConfigError("RECIPE_CACHE_SIZE_MB must be positive")
    for name in ("prof_waitstep", "prof_warmupstep", "prof_step"):
        if v[name] < 0:
            raise ConfigError(f"{name.upper()} must be >= 0")
    ranks = v["prof_ranks"]
    if isinstance(ranks, str):
        try:
            v["prof_ranks"] = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError:
            raise ConfigError(f"PROF_RANKS {ranks!r}: expected comma-separated ranks, e.g. 0,1") from None
