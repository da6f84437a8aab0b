"""Device backends behind one small interface, chosen automatically or by --device.

HPU when `habana_frameworks` imports and a card is visible, else CUDA, else
CPU. Every `habana_frameworks` import lives in `hpu.py` (and `quant/`).
"""

from __future__ import annotations

from gaudi_runtime.device.base import Backend


def select_device(name: str = "auto", rank: int = 0, world_size: int = 1, graphs: bool = True,
                  recipe_cache=None) -> Backend:
    """`recipe_cache` (a `recipe_cache.RecipeCache`): where Habana keeps compiled graphs, set up before the
    bridge loads; ignored off Gaudi."""
    if name in ("auto", "hpu"):
        from gaudi_runtime.device import hpu

        if recipe_cache is not None:
            hpu.use_recipe_cache(recipe_cache.env_value)
        if name == "hpu" or hpu.available():
            return hpu.HpuBackend(world_size=world_size, graphs=graphs)
    import torch

    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        from gaudi_runtime.device.cuda import CudaBackend

        return CudaBackend(rank=rank, graphs=graphs)
    from gaudi_runtime.device.cpu import CpuBackend

    return CpuBackend()


def visible_device_count(name: str = "auto") -> int:
    """Cards `--device name` would shard over: what `--num-shard` defaults to (TGI: all visible cards).

    HPU cards when there are any (auto) or asked for (hpu), else CUDA GPUs, else 1 (the CPU)."""
    if name == "cpu":
        return 1
    if name in ("auto", "hpu"):
        from gaudi_runtime.device import hpu

        n = hpu.device_count()
        if n or name == "hpu":
            return max(1, n)
    import torch

    if torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return 1


__all__ = ["Backend", "select_device", "visible_device_count"]
