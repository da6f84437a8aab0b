"""Typed view of an InferenceService's spec, with the CRD's defaults (pure).

The CRD (`crds/inferenceservices.gaudiserve.io.yaml`) is the single source of
truth for the API; the defaults here equal the schema's `default:` values (a
unit test checks it), so an object that skipped API-server defaulting (an old
object, a test) is read the same way.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic.alias_generators import to_camel

GROUP = "gaudiserve.io"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
FIELD_MANAGER = "gaudi-serve-operator"

ALLOWED_SHARDS = (1, 2, 4, 8)
RUNTIME_PORT = 8080
DEFAULT_IMAGE = "ghcr.io/gaudi-serve/runtime:0.1.0"

# The runtime reads --api-key from this variable; spec.apiKeySecretRef fills it from a Secret.
API_KEY_ENV = "API_KEY"

# Syntaxes the CRD's patterns enforce: the API server would refuse a child that used a bad value.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
POSITIVE_QUANTITY = (r"^(([0-9]*[1-9][0-9]*(\.[0-9]*)?)|([0-9]*\.[0-9]*[1-9][0-9]*))"
                     r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,2}))?$")
IMAGE = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
LABEL_KEY = (r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?([.][a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*/)?"
             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
ObjectName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
DataKey = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=SECRET_KEY)]
Size = Annotated[str, StringConstraints(max_length=64, pattern=POSITIVE_QUANTITY)]
LabelKey = Annotated[str, StringConstraints(max_length=317, pattern=LABEL_KEY)]
LabelValue = Annotated[str, StringConstraints(max_length=63, pattern=LABEL_VALUE)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=32)]
RESERVED_MOUNTS = ("/data", "/dev/shm", "/etc/gaudi-serve/quant", "/kv-cache")
# spec.kvCache.offload: sizes of the host and disk tiers, a whole number of Mi, Gi or Ti (or M, G, T): the
# runtime's settings are in GiB, and a fraction of a byte or a bare byte count is not what anyone means.
BYTE_SIZE = r"^[1-9][0-9]{0,8}(Mi|Gi|Ti|M|G|T)$"
# A directory on the model cache claim, relative, without '.' or '..' parts.
SUB_PATH = r"^[A-Za-z0-9_][-A-Za-z0-9_.]*(/[A-Za-z0-9_][-A-Za-z0-9_.]*)*$"
KV_SUB_PATH = "kv-cache"
# A hub repository id (`org/name`, or a legacy single name): what a download Job can fetch.
HUB_ID = r"^[A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)?$"
# spec.model.adapters: a name a request gives as OpenAI's `model` (or TGI's adapter_id), a source that is a
# hub id or a path on the cache claim (mounted at /data), a hub revision. None of them may hold what the
# runtime's --lora-adapters syntax uses to split entries (`,`, spaces, `=`, `@`).
ADAPTER_NAME = r"^[A-Za-z0-9][-A-Za-z0-9_.:/]*$"
ADAPTER_PATH_PREFIX = "/data/"
ADAPTER_SOURCE = r"^([A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)?|/data/[-A-Za-z0-9_./]+)$"
REVISION = r"^[A-Za-z0-9][-A-Za-z0-9_.+/]*$"
MAX_ADAPTERS = 32

# Rules the CRD's CEL also enforces at admission, with the same messages.
API_KEY_ENV_MESSAGE = "spec.env must not set API_KEY when spec.apiKeySecretRef is set (the key comes from the Secret)"
MOUNT_MESSAGE = ("spec.quantization.measurements.mountPath must not be /data, /dev/shm, /etc/gaudi-serve/quant "
                 "or /kv-cache (the operator mounts those)")
PEER_MESSAGE = "spec.networkPolicy.from: each peer needs a namespaceSelector, a podSelector or both"
PREFETCH_CLAIM_MESSAGE = ("spec.model.cache.prefetch needs spec.model.cache.persistentVolumeClaim "
                          "(a ReadWriteMany claim the download Job fills)")
PREFETCH_READ_ONLY_MESSAGE = ("spec.model.cache.persistentVolumeClaim.readOnly must be false with prefetch "
                              "(the download Job writes the claim; the serving pods mount it read-only anyway)")
PREFETCH_ID_MESSAGE = "spec.model.id must be a hub id (org/name) with spec.model.cache.prefetch"
RECIPES_MESSAGE = ("spec.model.cache.recipes needs a cache the pods can write: a persistentVolumeClaim that is not "
                   "readOnly (or prefetch), or ephemeral")
ADAPTER_BASE_NAME_MESSAGE = ("spec.model.adapters: an adapter's name must differ from spec.model.id "
                             "(the base model's name on /v1/models)")
ADAPTER_CLAIM_MESSAGE = ("spec.model.adapters: a source that is a path (/data/...) needs "
                         "spec.model.cache.persistentVolumeClaim (the claim that holds it)")
ADAPTER_REVISION_MESSAGE = "spec.model.adapters[].revision is for a hub source only (a path on the claim has none)"
ADAPTER_FP8_MESSAGE = ("spec.model.adapters cannot be combined with spec.precision fp8 yet "
                       "(the runtime has no float8 adapter path)")
KV_DISK_CACHE_MESSAGE = ("spec.kvCache.offload.disk.volume modelCache needs a model cache the pods can write: "
                         "spec.model.cache.persistentVolumeClaim that is not readOnly (or prefetch), or ephemeral")
KV_SUB_PATH_MESSAGE = "spec.kvCache.offload.disk.subPath is for volume modelCache only (an emptyDir is the pod's own)"
KV_SUB_PATH_OWNED_MESSAGE = ("spec.kvCache.offload.disk.subPath must not be in hub/ or recipes/ (the model's and "
                             "the compiled graphs' directories on the claim)")
OWNED_SUB_PATHS = ("hub", "recipes")
SELECTOR_VALUES_MESSAGE = ("spec.networkPolicy.from: a matchExpressions entry needs values with In or NotIn, "
                           "and none with Exists or DoesNotExist")

# Seconds the container has to start answering HTTP (the startupProbe): the launcher binds its port
# before the model download, so this covers only the process starting, not download, load or warmup.
START_SECONDS = 300
# Default stall window (--warmup-stall-seconds): ten times the longest single step seen on Gaudi (a
# large prefill graph compiling, a 5 GB weight file from network storage: about a minute each), so no
# healthy start comes near it, and a stuck pod is back to warming within about ten minutes.
WARMUP_STALL_SECONDS = 600

# Graceful scale-down: the preStop hook holds SIGTERM back while the Service drops the pod;
# the runtime's drain gets spec.serving.drainSeconds less this hook and the shards' own stop.
PRESTOP_SECONDS = 5
DRAIN_MARGIN_SECONDS = 30  # preStop 5 s, cut requests 5 s, the shards 10 s, 10 s spare

__all__ = [
    "ALLOWED_SHARDS", "API_KEY_ENV", "Adapter", "FIELD_MANAGER", "GROUP", "PLURAL", "PRESTOP_SECONDS", "RUNTIME_PORT",
    "VERSION", "Autoscaling", "InferenceServiceSpec", "KVOffload", "OffloadDisk", "SpecError", "lora_adapters_flag", "parse_spec",
]


class SpecError(ValueError):
    """The spec cannot be read; the message names the field."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True,
                              strict=True)


class SecretKeyRef(_Model):
    name: ObjectName
    key: DataKey = "HF_TOKEN"


class ApiKeySecretRef(_Model):
    name: ObjectName
    key: DataKey = API_KEY_ENV


class PVCRef(_Model):
    claim_name: ObjectName
    read_only: bool = False


class EphemeralCache(_Model):
    size: Size = "100Gi"
    storage_class_name: ObjectName | None = None


class CacheVolume(_Model):
    persistent_volume_claim: PVCRef | None = None
    ephemeral: EphemeralCache | None = None
    # One download Job fills the claim before any replica starts; replicas then mount it read-only.
    prefetch: bool = False
    # Habana's compiled graph recipes kept on the cache volume (RECIPE_CACHE_DIR), across restarts.
    recipes: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> CacheVolume:
        pvc = self.persistent_volume_claim
        if pvc is not None and self.ephemeral is not None:
            raise ValueError("spec.model.cache: set persistentVolumeClaim or ephemeral, not both")
        if self.prefetch and pvc is None:
            raise ValueError(PREFETCH_CLAIM_MESSAGE)
        if self.prefetch and pvc is not None and pvc.read_only:
            raise ValueError(PREFETCH_READ_ONLY_MESSAGE)
        if self.recipes and not self.writable:
            raise ValueError(RECIPES_MESSAGE)
        return self

    @property
    def writable(self) -> bool:
        """The pods may write the cache volume (a prefetched claim through a subPath mount of its own)."""
        pvc = self.persistent_volume_claim
        return self.ephemeral is not None or (pvc is not None and not pvc.read_only)


class Adapter(_Model):
    """A LoRA adapter served beside the model (the runtime's --lora-adapters)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ADAPTER_NAME)]
    source: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=ADAPTER_SOURCE)]
    revision: Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=REVISION)] | None = None

    @model_validator(mode="after")
    def _revision_of_a_hub_source(self) -> Adapter:
        if self.revision is not None and self.is_path:
            raise ValueError(ADAPTER_REVISION_MESSAGE)
        return self

    @property
    def is_path(self) -> bool:
        """A directory on the cache claim, not a hub id: nothing to download."""
        return self.source.startswith("/")

    def flag_entry(self) -> str:
        """This adapter in the runtime's --lora-adapters syntax: `name=source[@revision]`."""
        return f"{self.name}={self.source}" + (f"@{self.revision}" if self.revision else "")


def lora_adapters_flag(adapters: list[Adapter] | tuple[Adapter, ...]) -> str:
    """The value of --lora-adapters for these adapters, in order."""
    return ",".join(a.flag_entry() for a in adapters)


class ModelSource(_Model):
    id: str = Field(min_length=1)
    revision: str | None = None
    hub_token_secret_ref: SecretKeyRef | None = None
    cache: CacheVolume | None = None
    adapters: list[Adapter] = Field([], max_length=MAX_ADAPTERS)

    @model_validator(mode="after")
    def _prefetch_a_hub_id(self) -> ModelSource:
        if self.cache is not None and self.cache.prefetch and not re.fullmatch(HUB_ID, self.id):
            raise ValueError(PREFETCH_ID_MESSAGE)
        return self

    @model_validator(mode="after")
    def _adapters(self) -> ModelSource:
        names = [a.name for a in self.adapters]
        if len(set(names)) < len(names):  # a list keyed by name (x-kubernetes-list-type: map)
            raise ValueError("spec.model.adapters: a name appears twice")
        if self.id in names:
            raise ValueError(ADAPTER_BASE_NAME_MESSAGE)
        claim = self.cache is not None and self.cache.persistent_volume_claim is not None
        if any(a.is_path for a in self.adapters) and not claim:
            raise ValueError(ADAPTER_CLAIM_MESSAGE)
        return self

    @property
    def hub_adapters(self) -> list[Adapter]:
        """The adapters a download fetches from the hub (a path on the claim is there already)."""
        return [a for a in self.adapters if not a.is_path]

    @property
    def prefetched(self) -> bool:
        """A download Job fills the cache claim before the replicas start (they mount it read-only)."""
        return self.cache is not None and self.cache.prefetch


class ConfigMapKeyRef(_Model):
    name: ObjectName
    key: DataKey = "quant_config.json"


class Measurements(_Model):
    persistent_volume_claim: PVCRef
    mount_path: str = Field("/quant/measurements", max_length=4096, pattern="^/")

    @model_validator(mode="after")
    def _own_mount(self) -> Measurements:
        if self.mount_path in RESERVED_MOUNTS:
            raise ValueError(MOUNT_MESSAGE)
        return self


class Quantization(_Model):
    config_map_ref: ConfigMapKeyRef | None = None
    measurements: Measurements | None = None


class Serving(_Model):
    max_input_tokens: int = Field(1024, ge=1)
    max_total_tokens: int = Field(2048, ge=2)
    max_batch_size: int | None = Field(None, ge=1)
    max_batch_prefill_tokens: int | None = Field(None, ge=1)
    max_batch_total_tokens: int | None = Field(None, ge=1)
    max_concurrent_requests: int = Field(128, ge=1)
    max_waiting_tokens: int = Field(20, ge=0)
    waiting_served_ratio: float = Field(0.0, ge=0)
    drain_seconds: int = Field(300, ge=DRAIN_MARGIN_SECONDS + 10)

    @model_validator(mode="after")
    def _input_below_total(self) -> Serving:
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError("spec.serving.maxInputTokens must be less than spec.serving.maxTotalTokens")
        return self


class Batching(_Model):
    batch_bucket_size: int = Field(8, ge=1)
    prefill_batch_bucket_size: int = Field(4, ge=1)
    pad_sequence_to_multiple_of: int = Field(128, ge=1)
    hpu_graphs: bool = True
    limit_hpu_graphs: bool = False
    warmup: bool = True


class ProbeTiming(_Model):
    period_seconds: int | None = Field(None, ge=1)
    timeout_seconds: int | None = Field(None, ge=1)
    failure_threshold: int | None = Field(None, ge=1)


class StartupProbeTiming(ProbeTiming):
    budget_seconds: int | None = Field(None, ge=1)


class Probes(_Model):
    warmup_stall_seconds: int = Field(WARMUP_STALL_SECONDS, ge=10)
    startup: StartupProbeTiming = StartupProbeTiming()
    readiness: ProbeTiming = ProbeTiming()
    liveness: ProbeTiming = ProbeTiming()


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)


class LabelSelectorRequirement(_Model):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field([], max_length=64)

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        if (self.operator in ("In", "NotIn")) != bool(self.values):
            raise ValueError(SELECTOR_VALUES_MESSAGE)
        return self


class LabelSelector(_Model):
    match_labels: Labels = {}
    match_expressions: list[LabelSelectorRequirement] = Field([], max_length=16)


class NetworkPolicyPeer(_Model):
    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None

    @model_validator(mode="after")
    def _one_selector(self) -> NetworkPolicyPeer:
        if self.namespace_selector is None and self.pod_selector is None:
            raise ValueError(PEER_MESSAGE)
        return self


class NetworkPolicySpec(_Model):
    from_: list[NetworkPolicyPeer] = Field([], alias="from", max_length=16)


class PodTemplateMeta(_Model):
    labels: Labels = {}
    annotations: Annotated[dict[LabelKey, str], Field(max_length=64)] = {}


class PodTemplate(_Model):
    metadata: PodTemplateMeta = PodTemplateMeta()
    spec: dict[str, Any] = {}


# ---- spec.kvCache ------------------------------------------------------------

ByteSize = Annotated[str, StringConstraints(max_length=16, pattern=BYTE_SIZE)]


class OffloadDisk(_Model):
    """The disk tier under the host tier: an emptyDir of the pod, or a directory on the model cache claim."""

    volume: Literal["emptyDir", "modelCache"] = "emptyDir"
    size: ByteSize  # the runtime's LRU bound (--kv-offloading-disk-size)
    sub_path: Annotated[str, StringConstraints(max_length=255, pattern=SUB_PATH)] | None = None

    @model_validator(mode="after")
    def _sub_path_on_the_claim(self) -> OffloadDisk:
        if self.sub_path is not None and self.volume != "modelCache":
            raise ValueError(KV_SUB_PATH_MESSAGE)
        if self.sub_path is not None and self.sub_path.split("/")[0] in OWNED_SUB_PATHS:
            raise ValueError(KV_SUB_PATH_OWNED_MESSAGE)
        return self

    @property
    def directory(self) -> str:
        """The directory on the model cache volume (volume modelCache)."""
        return self.sub_path or KV_SUB_PATH


class KVOffload(_Model):
    """Tiers under the device's prefix cache: host memory (--kv-offloading-size), optionally a disk."""

    host_memory: ByteSize
    disk: OffloadDisk | None = None


class KVCache(_Model):
    offload: KVOffload | None = None


# ---- spec.autoscaling -------------------------------------------------------

class AutoscalingTargets(_Model):
    """Per-pod averages the autoscaler keeps the fleet at (at least one is set)."""

    queue_size: int | None = Field(None, ge=1)  # waiting requests (vllm:num_requests_waiting)
    kv_cache_usage: float | None = Field(None, ge=0.01, le=1)  # fraction (vllm:kv_cache_usage_perc)
    running_requests: int | None = Field(None, ge=1)  # requests in the batch (vllm:num_requests_running)

    @model_validator(mode="after")
    def _one_target(self) -> AutoscalingTargets:
        if self.queue_size is None and self.kv_cache_usage is None and self.running_requests is None:
            raise ValueError("spec.autoscaling.targets needs at least one of queueSize, kvCacheUsage, "
                             "runningRequests")
        return self


class ScaleUp(_Model):
    # A pod takes minutes to load and warm up: scale up only on load that lasted a minute.
    stabilization_window_seconds: int = Field(60, ge=0, le=3600)
    pods: int = Field(2, ge=1)  # most pods added per period
    period_seconds: int = Field(60, ge=1, le=1800)


class ScaleDown(_Model):
    # Never remove a pod that took minutes to start because of a short lull.
    stabilization_window_seconds: int = Field(600, ge=0, le=3600)
    pods: int = Field(1, ge=1)  # most pods removed per period
    period_seconds: int = Field(120, ge=1, le=1800)


class ScalingBehavior(_Model):
    scale_up: ScaleUp = ScaleUp()
    scale_down: ScaleDown = ScaleDown()


class TriggerAuthenticationRef(_Model):
    name: str = Field(min_length=1)


class PrometheusSource(_Model):
    server_address: str = Field(min_length=1)
    authentication_ref: TriggerAuthenticationRef | None = None


class Autoscaling(_Model):
    engine: Literal["hpa", "keda"] = "hpa"
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    targets: AutoscalingTargets = AutoscalingTargets(queue_size=30, kv_cache_usage=0.6)
    behavior: ScalingBehavior = ScalingBehavior()
    prometheus: PrometheusSource | None = None  # where KEDA reads the metrics (engine keda)

    @model_validator(mode="after")
    def _consistent(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas")
        if self.engine == "keda" and self.prometheus is None:
            raise ValueError("spec.autoscaling.prometheus.serverAddress is required when "
                             "spec.autoscaling.engine is keda")
        return self


# ---- spec.gateway ------------------------------------------------------------

# A Service's name (DNS-1035 label) and a namespace's (DNS-1123 label): what the Gateway API refers to.
SERVICE_NAME = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
NAMESPACE_NAME = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# The Gateway API refuses these in a PathPrefix match (its HTTPRoute CRD's rules, same meaning).
ROUTE_PATH_MESSAGE = ("spec.gateway.route.path must be an absolute path starting with '/', without '//', '/./', "
                      "'/../', '%2f', '%2F' or '#', not ending in '/.' or '/..'")
_BAD_PATH_PARTS = ("//", "/./", "/../", "%2f", "%2F", "#")
ROUTE_PATH = r"^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$"


class PickerService(_Model):
    name: Annotated[str, StringConstraints(max_length=63, pattern=SERVICE_NAME)]
    port: int = Field(9002, ge=1, le=65535)  # the upstream picker's ext-proc (gRPC) port


class EndpointPicker(_Model):
    service: PickerService | None = None  # unset: the operator runs one (the chart's picker image)
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class GatewayParent(_Model):
    name: ObjectName
    namespace: Annotated[str, StringConstraints(max_length=63, pattern=NAMESPACE_NAME)] | None = None


class GatewayRoute(_Model):
    gateway: GatewayParent
    path: str = Field("/", min_length=1, max_length=1024, pattern=ROUTE_PATH)

    @model_validator(mode="after")
    def _path(self) -> GatewayRoute:
        p = self.path
        if not p.startswith("/") or any(b in p for b in _BAD_PATH_PARTS) or p.endswith(("/.", "/..")):
            raise ValueError(ROUTE_PATH_MESSAGE)
        return self


class Gateway(_Model):
    """An InferencePool of this service's pods behind an endpoint picker, and optionally an HTTPRoute to it."""

    endpoint_picker: EndpointPicker = EndpointPicker()
    route: GatewayRoute | None = None


class InferenceServiceSpec(_Model):
    model: ModelSource
    replicas: int = Field(1, ge=0)
    shards: int = 1
    precision: Literal["bf16", "fp8"] = "bf16"
    quantization: Quantization | None = None
    serving: Serving = Serving()
    batching: Batching = Batching()
    image: str = Field(DEFAULT_IMAGE, max_length=1024, pattern=IMAGE)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[dict[str, Any]] = []
    resources: dict[str, Any] = {}
    env: list[dict[str, Any]] = []
    node_selector: Labels = {}
    tolerations: list[dict[str, Any]] = []
    affinity: dict[str, Any] = {}
    service_account_name: ObjectName | None = None
    api_key_secret_ref: ApiKeySecretRef | None = None
    network_policy: NetworkPolicySpec | None = None
    shm_size: Size = "16Gi"
    service: ServiceSpec = ServiceSpec()
    probes: Probes = Probes()
    pod_template: PodTemplate = PodTemplate()
    autoscaling: Autoscaling | None = None
    gateway: Gateway | None = None
    kv_cache: KVCache | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceServiceSpec:
        if self.shards not in ALLOWED_SHARDS:
            raise ValueError("spec.shards must be one of 1, 2, 4 or 8 (Gaudi cards per replica)")
        if self.precision == "fp8" and (self.quantization is None or self.quantization.config_map_ref is None):
            raise ValueError("spec.quantization.configMapRef is required when spec.precision is fp8")
        if self.precision == "fp8" and self.model.adapters:
            raise ValueError(ADAPTER_FP8_MESSAGE)
        if self.api_key_secret_ref is not None and any(e.get("name") == API_KEY_ENV for e in self.env):
            raise ValueError(API_KEY_ENV_MESSAGE)
        disk = self.offload.disk if self.offload else None
        if disk is not None and disk.volume == "modelCache" and not (self.model.cache and self.model.cache.writable):
            raise ValueError(KV_DISK_CACHE_MESSAGE)
        for field, items in (("env", self.env), ("imagePullSecrets", self.image_pull_secrets)):
            names = [item.get("name") for item in items]
            if len(set(names)) < len(names):  # lists keyed by name (x-kubernetes-list-type: map)
                raise ValueError(f"spec.{field}: a name appears twice")
        return self

    # ---- derived values -------------------------------------------------

    @property
    def offload(self) -> KVOffload | None:
        """spec.kvCache.offload: the host (and disk) tiers of the prefix cache, None without them."""
        return self.kv_cache.offload if self.kv_cache else None

    def startup_budget_seconds(self) -> int:
        """Seconds the startupProbe allows the process to start answering HTTP (spec.probes.startup.budgetSeconds
        wins). Download, load and warmup are not in it: the liveness probe follows their progress."""
        return self.probes.startup.budget_seconds or START_SECONDS

    def shutdown_grace_seconds(self) -> int:
        """How long the runtime lets running requests finish after SIGTERM (--shutdown-grace-seconds)."""
        return self.serving.drain_seconds - DRAIN_MARGIN_SECONDS


def parse_spec(raw: dict[str, Any] | None) -> InferenceServiceSpec:
    """Read `spec`; raise SpecError with a message naming the offending field."""
    try:
        return InferenceServiceSpec.model_validate(raw or {})
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(_camel(str(p)) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"spec.{loc}: {msg}" if loc and not msg.startswith("spec.") else msg)
        raise SpecError("; ".join(parts)) from None


def _camel(s: str) -> str:
    return s if not s or "_" not in s else to_camel(s)
