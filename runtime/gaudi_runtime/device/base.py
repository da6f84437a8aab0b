"""The interface every device backend implements."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gaudi_runtime.device.attention import MathAttention
from gaudi_runtime.layers.attention_backend import AttentionBackend
from gaudi_runtime.layers.kernels import LayerKernels, install_kernels


class Backend:
    """Eager execution; backends override what their device does differently.

    What code outside ``device/`` needs to know about the device it asks as a fact of the backend (the
    attributes below), never by the device's name."""

    name = "cpu"
    distributed_backend = "gloo"
    # Whether the model computes on the host's cores: torch's threads are then the shard's compute, split
    # between the shards of one machine.
    computes_on_host = False
    # Whether the device compiles each graph into a recipe that --recipe-cache-dir keeps across starts (Gaudi).
    caches_compiled_graphs = False
    # The `torch.profiler.ProfilerActivity` member that records the device's own work (None: the host's only).
    profiler_activity: str | None = None
    # Whether float8 checkpoint layers run on the device's own FP8 matmul (else: dequantized per layer).
    native_fp8_checkpoints = False
    # Whether --quantize fp8 (and its calibration) goes through Intel Neural Compressor, not our own FP8 layers.
    quantizes_with_inc = False
    # Whether forward passes must run on the bucket shapes (graphs, or HPU lazy mode that compiles per
    # shape). Where they need not, padding is wasted work: the runner runs the batch's own shape.
    pads_to_buckets = False
    # Whether decode attention takes the batch's used blocks laid out flat (`layers/flat_paged_attention.py`)
    # rather than a block table padded to the widest row; the runner then buckets decode by total blocks.
    flat_decode = False

    def __init__(self, torch_device: torch.device):
        self.torch_device = torch_device

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where execution is synchronous)."""

    def mark_step(self) -> None:
        """End of a lazy-mode graph (HPU); no-op elsewhere."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory, or None when unknown."""
        return None

    def attention(self, use_flash: bool = True, recompute: bool = False, cpu_paged: bool = True,
                  batch_invariant: bool = False) -> AttentionBackend:
        """The attention kernels for a model on this device, chosen once per model (the runner sets them on
        its layers): torch SDPA here, or the explicit math with USE_FLASH_ATTENTION=false (`use_flash`).
        FLASH_ATTENTION_RECOMPUTE (`recompute`) means something only to Habana's FusedSDPA, and
        CPU_PAGED_ATTENTION (`cpu_paged`) only to the CPU's; --batch-invariant (`batch_invariant`) has the CPU's
        fixed-order kernels only."""
        if batch_invariant:
            raise ValueError(f"--batch-invariant: the fixed-order kernels are the CPU's; device {self.name!r} has none")
        return AttentionBackend() if use_flash else MathAttention()

    def layer_kernels(self, model: torch.nn.Module, cfg=None) -> LayerKernels:
        """The kernels for the loaded (and quantized) model's layers on this device, as the DeviceConfig `cfg`
        asks (building one may lay out the model's weights for it); none by default: torch's code."""
        return LayerKernels()

    def prepare_model(self, model: torch.nn.Module, cfg=None) -> None:
        """Give the loaded (and quantized) model's layers `layer_kernels`."""
        install_kernels(model, self.layer_kernels(model, cfg))

    def graphed(self, fn: Callable[..., torch.Tensor], name: str) -> Callable[..., torch.Tensor]:
        """`fn` over tensors, run through a device graph captured once per input shape where the
        device has graphs; the first call with a new shape captures, later calls replay."""
        return fn

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, copied without waiting for the device's queued work."""
        return host.to(self.torch_device, non_blocking=True)

    def graph_stats(self) -> dict:
        return {}

    # ---- the KV cache's host tier (shard/kv_tiers.py) -------------------

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies KV blocks to and from (pinned where the device DMAs from it)."""
        return torch.zeros(shape, dtype=dtype)

    def gather_blocks(self, device_cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """These blocks of one cache tensor, copied to host memory, in order."""
        idx = torch.tensor(blocks, dtype=torch.long, device=device_cache.device)
        return device_cache.index_select(0, idx).to("cpu")

    def copy_blocks(self, host: torch.Tensor, slots: list[int], device_cache: torch.Tensor, blocks: list[int]) -> None:
        """Host slots `slots` of one cache tensor onto its device blocks `blocks`."""
        src = host.index_select(0, torch.tensor(slots, dtype=torch.long))
        idx = torch.tensor(blocks, dtype=torch.long, device=device_cache.device)
        device_cache.index_copy_(0, idx, src.to(device_cache.device, non_blocking=True))


    def warm_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Compile the KV copies' shapes ahead of serving, where the device compiles per shape."""
