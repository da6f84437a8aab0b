"""Intel Gaudi: lazy mode with mark_step, HPU graphs per bucket, hccl for collectives.

The only module (with quant/) that imports `habana_frameworks`, always lazily:
the package exists only on Gaudi machines. Tests replace it with a recording fake.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import sys
from functools import partial
from pathlib import Path

import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.flat_paged_attention import flat_paged_decode
from gaudi_runtime.layers.kernels import LayerKernels

log = logging.getLogger(__name__)

RECIPE_CACHE_ENV = "PT_HPU_RECIPE_CACHE_CONFIG"
# The habanalabs driver names the card type (GAUDI2, GAUDI3, ...) in sysfs, readable without the bridge.
DEVICE_TYPE_FILES = ("/sys/class/accel/accel*/device/device_type", "/sys/class/habanalabs/hl*/device_type")


def device_type() -> str | None:
    for pattern in DEVICE_TYPE_FILES:
        for path in sorted(glob.glob(pattern)):
            try:
                return Path(path).read_text().strip() or None
            except OSError:
                continue
    return None


def software_versions() -> dict:
    """Habana's software (the installed habana-torch-plugin distribution) and the card type, read without
    loading the bridge: they key the recipe cache, which must be configured before the bridge loads."""
    from importlib import metadata

    try:
        habana = metadata.version("habana-torch-plugin")
    except metadata.PackageNotFoundError:
        habana = None
    return {"habana": habana, "device_type": device_type()}


def installed() -> bool:
    """Whether habana_frameworks can be imported (without importing it: that loads the bridge)."""
    return importlib.util.find_spec("habana_frameworks") is not None


def use_recipe_cache(env_value: str) -> None:
    """Set PT_HPU_RECIPE_CACHE_CONFIG (`<dir>,<delete on start>,<max MB>`). The bridge reads it once, when it
    loads: this must run before the first `habana_frameworks` import of the process."""
    if "habana_frameworks.torch" in sys.modules:
        log.warning("%s is set after Habana's bridge loaded: this process compiles without the recipe cache",
                    RECIPE_CACHE_ENV)
    previous = os.environ.get(RECIPE_CACHE_ENV)
    if previous and previous != env_value:
        log.warning("--recipe-cache-dir replaces %s=%s", RECIPE_CACHE_ENV, previous)
    os.environ[RECIPE_CACHE_ENV] = env_value


def available() -> bool:
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return False
    return bool(hthpu.is_available())


def device_count() -> int:
    """Gaudi cards visible to this process: the device plugin's HABANA_VISIBLE_DEVICES list when it
    names cards, else what the bridge reports (0 when `habana_frameworks` is absent)."""
    visible = os.environ.get("HABANA_VISIBLE_DEVICES", "").strip()
    if visible and visible.lower() != "all":
        return len([d for d in visible.split(",") if d.strip()])
    try:
        import habana_frameworks.torch.hpu as hthpu
    except ImportError:
        return 0
    return int(hthpu.device_count()) if hthpu.is_available() else 0


def fused_sdpa(recompute: bool):
    """Habana's fused scaled-dot-product attention with torch SDPA's call shape (USE_FLASH_ATTENTION);
    `recompute` trades compute for memory (FLASH_ATTENTION_RECOMPUTE)."""
    from habana_frameworks.torch.hpex.kernels import FusedSDPA

    def attend(q, k, v, attn_mask=None, is_causal=False, scale=None):
        return FusedSDPA.apply(q, k, v, attn_mask, 0.0, is_causal, scale, "None", recompute)

    return attend


def block_softmax_adjustment():
    """Habana's fused rescale of flat paged attention's per-block softmaxes
    (``torch.ops.hpu.block_softmax_adjustment(block_max, block_sums, block_groups, batch_size)``, see
    `layers/flat_paged_attention.py`), or None where the installed bridge lacks it: decode then
    computes the same with plain ops."""
    import habana_frameworks.torch.core  # noqa: F401  (loading the bridge registers torch.ops.hpu)

    try:
        return torch.ops.hpu.block_softmax_adjustment
    except (AttributeError, RuntimeError):
        log.info("this Habana bridge has no block_softmax_adjustment op: decode rescales its blocks with plain ops")
        return None


def mixture_of_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """``layers/moe.ExpertsKernel`` through Habana's fused MoE op (``torch.ops.hpu.mixture_of_experts``):
    the experts' gated SiLU MLPs and the weighted sum in one op whose shapes depend only on the token
    count, so an HPU graph captures it. Each expert's ``w13`` rows are gate then up, the op's w12 layout.
    Float8 experts of a block-FP8 checkpoint (``quant/fp8_moe.Fp8ExpertStack``) go to the op's blockwise
    variant as stored: float8 weights and their square block scales, dequantized inside the op."""
    import habana_frameworks.torch.core  # noqa: F401  (loading the bridge registers torch.ops.hpu)

    common = dict(hidden_states=x, expert_routing_table=ids.to(torch.int64), router_weights=weights.to(x.dtype),
                  permuted_weights=True, activation="silu", experts_min=0, experts_max=w13.shape[0] - 1)
    scales = getattr(w13, "block_scales", None)
    if scales is not None:
        return torch.ops.hpu.mixture_of_experts.fp8_fused_weights_blockwise(
            w12=list(w13.qweight.unbind(0)), w3=list(w2.qweight.unbind(0)), d_scale_w12=list(scales.unbind(0)),
            d_scale_w3=list(w2.block_scales.unbind(0)), block_size=w13.block[0], **common).to(x.dtype)
    return torch.ops.hpu.mixture_of_experts(w12=list(w13.unbind(0)), w3=list(w2.unbind(0)), **common)


class HpuAttention(AttentionBackend):
    """Habana's FusedSDPA for prefill (`recompute`: FLASH_ATTENTION_RECOMPUTE, for the first token) and for
    the gathered decode; decode over the flat layout of the blocks in use (`flat_paged_decode`, with
    Habana's fused softmax rescale where the bridge has it)."""

    name = "fused_sdpa (decode: flat paged)"
    prefill_gqa = False

    def __init__(self, recompute: bool = False):
        self._prefill, self._decode = fused_sdpa(recompute), fused_sdpa(False)
        self.flat_decode = partial(flat_paged_decode, adjust=block_softmax_adjustment())

    def prefill(self, q, k, v, attn_mask=None, is_causal=False, scale=None):  # no enable_gqa: K/V repeated
        return self._prefill(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    def decode(self, q, k, v, attn_mask, scale=None):
        return self._decode(q, k, v, attn_mask=attn_mask, scale=scale)


class _Step(torch.nn.Module):
    """A step function as a module, the unit `wrap_in_hpu_graph` caches graphs for."""

    def __init__(self, fn, name: str):
        super().__init__()
        self.fn = fn
        self.name = name

    def forward(self, *args):
        return self.fn(*args)


class HpuBackend(Backend):
    name = "hpu"
    distributed_backend = "hccl"
    pads_to_buckets = True  # lazy mode compiles a graph per shape even without HPU graphs
    flat_decode = True  # as vLLM on Gaudi: no row pays for the widest one
    caches_compiled_graphs = True  # PT_HPU_RECIPE_CACHE_CONFIG
    profiler_activity = "HPU"  # where the installed torch knows it
    native_fp8_checkpoints = True  # fp8_gemm_v2 (`fp8_linear`)
    quantizes_with_inc = True

    def __init__(self, world_size: int = 1, graphs: bool = True, torch_device: torch.device | None = None):
        if world_size > 1:
            # Collectives inside HPU graphs need lazy collectives (set before the bridge loads).
            os.environ.setdefault("PT_HPU_ENABLE_LAZY_COLLECTIVES", "true")
        import habana_frameworks.torch.core as htcore  # loads the HPU bridge: the "hpu" device exists after

        self._htcore = htcore
        super().__init__(torch_device or torch.device("hpu"))
        self.graphs_enabled = graphs
        self._uploads: dict[tuple, torch.Tensor] = {}

    def attention(self, use_flash: bool = True, recompute: bool = False, cpu_paged: bool = True,
                  batch_invariant: bool = False) -> AttentionBackend:
        if batch_invariant or not use_flash:  # the math keeps the gathered decode: no flat layout
            return super().attention(use_flash, recompute, cpu_paged, batch_invariant)
        return HpuAttention(recompute)

    def layer_kernels(self, model: torch.nn.Module, cfg=None) -> LayerKernels:
        return LayerKernels(experts=mixture_of_experts)

    def synchronize(self) -> None:
        import habana_frameworks.torch.hpu as hthpu

        hthpu.synchronize()

    def mark_step(self) -> None:
        self._htcore.mark_step()

    def memory_info(self) -> tuple[int, int] | None:
        import habana_frameworks.torch.hpu as hthpu

        stats = hthpu.memory_stats()
        limit = stats.get("Limit")
        if not limit:
            return None
        return limit - stats.get("InUse", 0), limit

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """Into one device buffer per shape (a bucket's grammar bitmask): the same address every step,
        so lazy mode reuses its compiled recipe for the ops that read it."""
        key = (tuple(host.shape), host.dtype)
        buf = self._uploads.get(key)
        if buf is None:
            buf = self._uploads[key] = torch.empty(host.shape, dtype=host.dtype, device=self.torch_device)
        buf.copy_(host, non_blocking=True)
        return buf

    def graphed(self, fn, name):
        if not self.graphs_enabled:
            return fn
        import habana_frameworks.torch.hpu as hthpu

        # HPU graphs are cached per input shape inside the wrapper: warmup captures each bucket once.
        return hthpu.wrap_in_hpu_graph(_Step(fn, name), disable_tensor_cache=True)


    # ---- the KV cache's host tier: static shapes ------------------------
    # Every copy moves KV_COPY_BLOCKS blocks (padded with block 0 and slot 0, the padding block and slot):
    # lazy mode compiles one recipe per direction and tensor shape, which `warm_copies` compiles at start.

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        buf = torch.zeros(shape, dtype=dtype)
        try:
            return buf.pin_memory()  # DMA-able: copies to and from the card need no bounce buffer
        except RuntimeError as e:  # no pinning here (a bridge without it): pageable memory, slower copies
            log.warning("KV host tier: host memory not pinned (%s)", e)
            return buf

    def gather_blocks(self, device_cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        out = []
        for chunk in padded_chunks(blocks):
            out.append(super().gather_blocks(device_cache, chunk))
            self.mark_step()
        return torch.cat(out)[:len(blocks)]

    def copy_blocks(self, host: torch.Tensor, slots: list[int], device_cache: torch.Tensor, blocks: list[int]) -> None:
        for src, dst in zip(padded_chunks(slots), padded_chunks(blocks)):
            super().copy_blocks(host, src, device_cache, dst)
            self.mark_step()

    def warm_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run each tensor shape's copy both ways once, on the padding block and slot."""
        for device_cache, host in pairs:
            self.copy_blocks(host, [0], device_cache, [0])
            self.gather_blocks(device_cache, [0])


KV_COPY_BLOCKS = 16


def padded_chunks(ids: list[int], width: int = KV_COPY_BLOCKS) -> list[list[int]]:
    """`ids` in chunks of exactly `width`, the last padded with 0 (the padding block or slot)."""
    chunks = [ids[i:i + width] for i in range(0, len(ids), width)]
    return [c + [0] * (width - len(c)) for c in chunks]


# E4M3 as Gaudi 2 computes it: largest finite value 240 (IEEE-like), where Gaudi 3 and the OCP format
# torch.float8_e4m3fn stores reach 448.
GAUDI2_FP8_MAX = 240.0


def fp8_max() -> float:
    """The largest E4M3 value this card's FP8 matmuls take: weights and inputs are scaled into it."""
    return GAUDI2_FP8_MAX if (device_type() or "").upper().startswith("GAUDI2") else 448.0


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, fmax: float) -> torch.Tensor:
    """``x @ (qweight * weight_scale[:, None]).T + bias`` on Gaudi's FP8 matmul (`fp8_gemm_v2`): the input is
    cast to float8 with its static `input_scale`, else with this call's max-abs / `fmax` (dynamic per tensor)."""
    import habana_frameworks.torch.core  # noqa: F401  (loading the bridge registers torch.ops.hpu)

    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        input_scale = (x2.abs().amax().float() / fmax).clamp(min=1e-12).reshape(1)
    xq = torch.ops.hpu.cast_to_fp8_v2(x2, 1.0 / input_scale, False, False, torch.float8_e4m3fn)[0]
    y = torch.ops.hpu.fp8_gemm_v2(xq, False, qweight, True, None, x.dtype, input_scale, weight_scale, bias, False)
    return y.reshape(*x.shape[:-1], qweight.shape[0])
