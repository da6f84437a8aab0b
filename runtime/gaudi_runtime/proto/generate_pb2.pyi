from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("dtype", "device_type", "block_size", "num_blocks", "vocab_size", "eos_token_ids", "max_position_embeddings", "world_size", "architecture", "quantization", "kv_cache_dtype", "prefix_caching", "attention", "recipe_cache", "startup_seconds", "weight_bytes", "warmup", "unwarmed_shapes", "buckets", "exponential_bucketing", "speculate", "kv_tiers")
    class BucketsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    RECIPE_CACHE_FIELD_NUMBER: _ClassVar[int]
    STARTUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    UNWARMED_SHAPES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    EXPONENTIAL_BUCKETING_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    device_type: str
    block_size: int
    num_blocks: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_position_embeddings: int
    world_size: int
    architecture: str
    quantization: str
    kv_cache_dtype: str
    prefix_caching: bool
    attention: str
    recipe_cache: RecipeCacheInfo
    startup_seconds: StartupSeconds
    weight_bytes: int
    warmup: WarmupSummary
    unwarmed_shapes: int
    buckets: _containers.ScalarMap[str, int]
    exponential_bucketing: bool
    speculate: int
    kv_tiers: KvTiers
    def __init__(self, dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_position_embeddings: _Optional[int] = ..., world_size: _Optional[int] = ..., architecture: _Optional[str] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., attention: _Optional[str] = ..., recipe_cache: _Optional[_Union[RecipeCacheInfo, _Mapping]] = ..., startup_seconds: _Optional[_Union[StartupSeconds, _Mapping]] = ..., weight_bytes: _Optional[int] = ..., warmup: _Optional[_Union[WarmupSummary, _Mapping]] = ..., unwarmed_shapes: _Optional[int] = ..., buckets: _Optional[_Mapping[str, int]] = ..., exponential_bucketing: _Optional[bool] = ..., speculate: _Optional[int] = ..., kv_tiers: _Optional[_Union[KvTiers, _Mapping]] = ...) -> None: ...

class KvTiers(_message.Message):
    __slots__ = ("block_bytes", "host_slots", "disk_dir")
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DISK_DIR_FIELD_NUMBER: _ClassVar[int]
    block_bytes: int
    host_slots: int
    disk_dir: str
    def __init__(self, block_bytes: _Optional[int] = ..., host_slots: _Optional[int] = ..., disk_dir: _Optional[str] = ...) -> None: ...

class KvCopies(_message.Message):
    __slots__ = ("save_blocks", "save_slots", "load_slots", "load_blocks", "staged_hashes", "staged_blocks", "spill_slots", "spill_hashes", "drop_hashes")
    SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGED_HASHES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPILL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPILL_HASHES_FIELD_NUMBER: _ClassVar[int]
    DROP_HASHES_FIELD_NUMBER: _ClassVar[int]
    save_blocks: _containers.RepeatedScalarFieldContainer[int]
    save_slots: _containers.RepeatedScalarFieldContainer[int]
    load_slots: _containers.RepeatedScalarFieldContainer[int]
    load_blocks: _containers.RepeatedScalarFieldContainer[int]
    staged_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    staged_blocks: _containers.RepeatedScalarFieldContainer[int]
    spill_slots: _containers.RepeatedScalarFieldContainer[int]
    spill_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    drop_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, save_blocks: _Optional[_Iterable[int]] = ..., save_slots: _Optional[_Iterable[int]] = ..., load_slots: _Optional[_Iterable[int]] = ..., load_blocks: _Optional[_Iterable[int]] = ..., staged_hashes: _Optional[_Iterable[bytes]] = ..., staged_blocks: _Optional[_Iterable[int]] = ..., spill_slots: _Optional[_Iterable[int]] = ..., spill_hashes: _Optional[_Iterable[bytes]] = ..., drop_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("hashes", "discard")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    discard: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., discard: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("loaded", "corrupt", "read_ns", "bytes")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    READ_NS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[bytes]
    corrupt: int
    read_ns: int
    bytes: int
    def __init__(self, loaded: _Optional[_Iterable[bytes]] = ..., corrupt: _Optional[int] = ..., read_ns: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class RecipeCacheInfo(_message.Message):
    __slots__ = ("dir", "key", "from_cache")
    DIR_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    dir: str
    key: str
    from_cache: bool
    def __init__(self, dir: _Optional[str] = ..., key: _Optional[str] = ..., from_cache: _Optional[bool] = ...) -> None: ...

class StartupSeconds(_message.Message):
    __slots__ = ("download", "load", "warmup")
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    download: float
    load: float
    warmup: float
    def __init__(self, download: _Optional[float] = ..., load: _Optional[float] = ..., warmup: _Optional[float] = ...) -> None: ...

class GraphStats(_message.Message):
    __slots__ = ("graphs", "captures", "replays")
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    CAPTURES_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    graphs: int
    captures: int
    replays: int
    def __init__(self, graphs: _Optional[int] = ..., captures: _Optional[int] = ..., replays: _Optional[int] = ...) -> None: ...

class WarmupSummary(_message.Message):
    __slots__ = ("enabled", "shapes", "seconds", "graphs", "from_cache")
    class ShapesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GraphsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: GraphStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[GraphStats, _Mapping]] = ...) -> None: ...
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    shapes: _containers.ScalarMap[str, int]
    seconds: float
    graphs: _containers.MessageMap[str, GraphStats]
    from_cache: bool
    def __init__(self, enabled: _Optional[bool] = ..., shapes: _Optional[_Mapping[str, int]] = ..., seconds: _Optional[float] = ..., graphs: _Optional[_Mapping[str, GraphStats]] = ..., from_cache: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ("batch_id", "sequence")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    sequence: int
    def __init__(self, batch_id: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupProgress(_message.Message):
    __slots__ = ("done", "total", "phase")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    done: int
    total: int
    phase: str
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class NextTokenChooserParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "frequency_penalty", "generated_frequency_penalty", "presence_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    generated_frequency_penalty: float
    presence_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., generated_frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "input_ids", "parameters", "top_n_tokens", "blocks", "prefill_logprobs", "images", "grammar", "cached_tokens", "adapter_index", "max_new_tokens", "sequence_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    parameters: NextTokenChooserParameters
    top_n_tokens: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    prefill_logprobs: bool
    images: _containers.RepeatedScalarFieldContainer[bytes]
    grammar: Grammar
    cached_tokens: int
    adapter_index: int
    max_new_tokens: int
    sequence_tokens: int
    def __init__(self, id: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., parameters: _Optional[_Union[NextTokenChooserParameters, _Mapping]] = ..., top_n_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., prefill_logprobs: _Optional[bool] = ..., images: _Optional[_Iterable[bytes]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., adapter_index: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., sequence_tokens: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("thinking", "id")
    THINKING_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    thinking: Thinking
    id: int
    def __init__(self, thinking: _Optional[_Union[Thinking, _Mapping]] = ..., id: _Optional[int] = ...) -> None: ...

class Thinking(_message.Message):
    __slots__ = ("start_token", "end_token", "open")
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    start_token: int
    end_token: int
    open: bool
    def __init__(self, start_token: _Optional[int] = ..., end_token: _Optional[int] = ..., open: _Optional[bool] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "requests")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    def __init__(self, id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ...) -> None: ...

class CachedBatch(_message.Message):
    __slots__ = ("id", "request_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillLogprobs(_message.Message):
    __slots__ = ("request_id", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Generations(_message.Message):
    __slots__ = ("request_ids", "token_ids", "logprobs", "top_n", "top_ids", "top_logprobs", "prefill")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_n: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillLogprobs]
    def __init__(self, request_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_n: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prefill: _Optional[_Iterable[_Union[PrefillLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("batch", "sequence", "kv_copies", "forget_grammars")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KV_COPIES_FIELD_NUMBER: _ClassVar[int]
    FORGET_GRAMMARS_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    sequence: int
    kv_copies: _containers.RepeatedCompositeFieldContainer[KvCopies]
    forget_grammars: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., sequence: _Optional[int] = ..., kv_copies: _Optional[_Iterable[_Union[KvCopies, _Mapping]]] = ..., forget_grammars: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "unwarmed_shapes", "kv_copy_ns", "kv_disk_write_failures", "kv_disk_writes")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    UNWARMED_SHAPES_FIELD_NUMBER: _ClassVar[int]
    KV_COPY_NS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_WRITES_FIELD_NUMBER: _ClassVar[int]
    generations: Generations
    batch: CachedBatch
    forward_ns: int
    unwarmed_shapes: int
    kv_copy_ns: int
    kv_disk_write_failures: int
    kv_disk_writes: int
    def __init__(self, generations: _Optional[_Union[Generations, _Mapping]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., unwarmed_shapes: _Optional[int] = ..., kv_copy_ns: _Optional[int] = ..., kv_disk_write_failures: _Optional[int] = ..., kv_disk_writes: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("batches", "sequence", "steps", "ride")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RIDE_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[CachedBatch]
    sequence: int
    steps: int
    ride: PrefillRequest
    def __init__(self, batches: _Optional[_Iterable[_Union[CachedBatch, _Mapping]]] = ..., sequence: _Optional[int] = ..., steps: _Optional[int] = ..., ride: _Optional[_Union[PrefillRequest, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("generations", "batch", "forward_ns", "unwarmed_shapes", "next_steps", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos", "ride", "ride_in_step")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    UNWARMED_SHAPES_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    RIDE_FIELD_NUMBER: _ClassVar[int]
    RIDE_IN_STEP_FIELD_NUMBER: _ClassVar[int]
    generations: Generations
    batch: CachedBatch
    forward_ns: int
    unwarmed_shapes: int
    next_steps: _containers.RepeatedCompositeFieldContainer[Generations]
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    ride: PrefillResponse
    ride_in_step: bool
    def __init__(self, generations: _Optional[_Union[Generations, _Mapping]] = ..., batch: _Optional[_Union[CachedBatch, _Mapping]] = ..., forward_ns: _Optional[int] = ..., unwarmed_shapes: _Optional[int] = ..., next_steps: _Optional[_Iterable[_Union[Generations, _Mapping]]] = ..., spec_drafts: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_accepted_per_pos: _Optional[_Iterable[int]] = ..., ride: _Optional[_Union[PrefillResponse, _Mapping]] = ..., ride_in_step: _Optional[bool] = ...) -> None: ...

class CompileGrammarRequest(_message.Message):
    __slots__ = ("type", "value", "id")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    type: str
    value: str
    id: int
    def __init__(self, type: _Optional[str] = ..., value: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class CompileGrammarResponse(_message.Message):
    __slots__ = ("error", "compile_ns")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPILE_NS_FIELD_NUMBER: _ClassVar[int]
    error: str
    compile_ns: int
    def __init__(self, error: _Optional[str] = ..., compile_ns: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("slot", "name", "path", "sequence", "load_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    path: str
    sequence: int
    load_id: int
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., sequence: _Optional[int] = ..., load_id: _Optional[int] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("load_ns", "host_hit")
    LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_FIELD_NUMBER: _ClassVar[int]
    load_ns: int
    host_hit: bool
    def __init__(self, load_ns: _Optional[int] = ..., host_hit: _Optional[bool] = ...) -> None: ...
