"""NVIDIA: CUDA graphs captured per bucket (the stand-in for HPU graphs), nccl for collectives."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gaudi_runtime.device.base import Backend
from gaudi_runtime.layers.kernels import LayerKernels
from gaudi_runtime.layers.moe import grouped_experts


class _CudaGraphs:
    """One CUDA graph per input-shape signature, with static input and output tensors."""

    def __init__(self, fn: Callable[..., torch.Tensor], pool):
        self.fn = fn
        self.pool = pool
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], torch.Tensor]] = {}
        self.captures = 0
        self.replays = 0

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            static = [a.clone() for a in args]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.fn(*static)  # allocator warm-up outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.fn(*static)
            entry = self.graphs[key] = (graph, static, out)
            self.captures += 1
        graph, static, out = entry
        for s, a in zip(static, args):
            s.copy_(a)
        graph.replay()
        self.replays += 1
        return out


class CudaBackend(Backend):
    name = "cuda"
    distributed_backend = "nccl"
    profiler_activity = "CUDA"

    def __init__(self, rank: int = 0, graphs: bool = True):
        super().__init__(torch.device("cuda", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(self.torch_device)
        self.graphs_enabled = graphs
        self._pool = None
        self._runners: dict[str, _CudaGraphs] = {}

    @property
    def pads_to_buckets(self) -> bool:  # graphs are captured per bucket shape; eager CUDA needs no padding
        return self.graphs_enabled

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def memory_info(self) -> tuple[int, int] | None:
        return torch.cuda.mem_get_info(self.torch_device)

    def graphed(self, fn, name):
        if not self.graphs_enabled:
            return fn
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        runner = self._runners[name] = _CudaGraphs(fn, self._pool)
        return runner

    def layer_kernels(self, model: torch.nn.Module, cfg=None) -> LayerKernels:
        # Eager: the routing may be read on the host.
        return LayerKernels() if self.graphs_enabled else LayerKernels(experts=grouped_experts)

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).pin_memory()  # copies to and from it are DMA, asynchronous

    def graph_stats(self) -> dict:
        return {n: {"graphs": len(r.graphs), "captures": r.captures, "replays": r.replays}
                for n, r in self._runners.items()}
