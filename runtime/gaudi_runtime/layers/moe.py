"""Mixture-of-experts MLP (Mixtral style): a softmax router picks the top-k experts of each token.

Sharding: tensor parallelism inside every expert, as TGI does. Each rank holds
all experts, each with its ``1 / tp`` slice of the intermediate dimension
(``w1``/``w3`` split by output rows, ``w2`` by input columns), so every rank
computes every token and one all-reduce per layer sums the partial outputs.
Unlike expert parallelism, no token has to move between ranks and the load
is even whatever the routing.

Compute: by default shapes depend only on the number of tokens ``T`` (a warmed
bucket), never on the routing, so HPU/CUDA graphs can capture the layer.

* ``T * top_k < num_experts`` (small decode batches): the routed experts'
  weights are gathered per token and applied with batched matmuls; only the
  experts in use are read.
* otherwise: a loop over the experts, each applied to every token and weighted
  by the token's routing weight for it (zero when not routed). This reads each
  expert once and needs no host sync to find which tokens go where.

Where nothing is captured as a graph (CPU, CUDA without graphs) the backend sets
``grouped_experts`` as the layer's ``kernel``: one host sync finds which tokens
each expert got, and each routed expert runs once on just those tokens, so the
cost follows the routed (token, expert) pairs, not ``T * num_experts`` (Qwen3-MoE:
8 of 128 experts per token). On Gaudi the backend sets Habana's fused MoE op
(``device/hpu.py``), whose shapes depend only on ``T`` too.

All add a token's experts to zero in ascending expert order, as
``transformers`` does, so fp32 results differ from it only by matmul rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ReplicatedLinear, TPContext, divide, materialize

# ``(x [T, H], weights [T, k] float32, ids [T, k], w13 [E, 2I, H], w2 [E, H, I]) -> [T, H]``: the experts'
# weighted sum for each token (this rank's partial sum under tensor parallelism). ``w13`` / ``w2`` are what
# ``ExpertWeights.experts`` gives: the stacked tensor, or for a float8 checkpoint a stack that dequantizes
# the experts it is indexed by (``quant/fp8_moe.py``), which a device kernel may read as stored.
ExpertsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (float32 weights ``[T, k]``, expert ids ``[T, k]``), ids ascending per token.

    Softmax over all experts in float32, then the top k; with ``renormalize``
    the k weights are divided by their sum (Mixtral).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def grouped_route(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                  topk_group: int, renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router: ``[T, E]`` logits -> (float32 weights ``[T, k]``, expert ids ``[T, k]``), ids
    ascending per token.

    Sigmoid scores; the experts are chosen by score + ``correction_bias`` (the load-balancing bias only
    chooses, it never weights) within the ``topk_group`` groups (of ``n_group`` equal groups) whose two
    best biased scores sum highest. A chosen expert's weight is its unbiased score, divided by the sum of
    the chosen ones' with ``renormalize``, times ``scaling_factor``.
    """
    t, e = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    group_scores = choice.view(t, n_group, e // n_group).topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)
    groups = group_scores.topk(topk_group, dim=-1)[1]
    in_group = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~in_group.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1].sort(dim=-1)[0]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def expert_params_mapping(num_experts: int, gate: str = "w1", up: str = "w3", down: str = "w2",
                          prefix: str = "experts") -> dict[str, tuple[str, tuple[int, str]]]:
    """Checkpoint name fragment -> (parameter name, shard id) for ``loading.load_checkpoint``.

    ``experts.{e}.w1`` / ``w3`` go to the fused ``w13`` and ``experts.{e}.w2``
    to ``w2`` of the ``FusedMoE`` module standing where the checkpoint's
    ``experts`` container is.
    """
    mapping: dict[str, tuple[str, tuple[int, str]]] = {}
    for e in range(num_experts):
        mapping[f"{prefix}.{e}.{gate}"] = ("w13", (e, "gate"))
        mapping[f"{prefix}.{e}.{up}"] = ("w13", (e, "up"))
        mapping[f"{prefix}.{e}.{down}"] = ("w2", (e, "down"))
    return mapping


class ExpertWeights(nn.Module):
    """One stacked weight ``[num_experts, out, in]`` whose loader takes one expert's checkpoint matrix."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, tp: TPContext, gate_up: bool):
        super().__init__()
        self.tp = tp
        self.gate_up = gate_up  # True: [gate_rank_slice; up_rank_slice] rows; False: down, columns split
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, which = shard_id
        dst = param.data[expert]
        if self.gate_up:
            size = dst.size(0) // 2
            dst = dst.narrow(0, 0 if which == "gate" else size, size)
            src = loaded.narrow(0, self.tp.rank * size, size)
        else:
            size = dst.size(1)
            src = loaded.narrow(1, self.tp.rank * size, size)
        if dst.shape != src.shape:
            raise ValueError(f"expert weight shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint "
                             f"{tuple(src.shape)}")
        dst.copy_(materialize(src))

    def experts(self, dtype: torch.dtype) -> torch.Tensor:
        """The stacked experts as the compute reads them (``[E, out, in]``, indexed by expert)."""
        return self.weight


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                    ) -> torch.Tensor:
    """The experts' weighted sum with each routed expert applied once, to the tokens routed to it, each
    token's experts added in ascending order; `linear(rows, weight)` multiplies (a device's own kernel).

    Reads the routing on the host (a sync), so its shapes depend on the routing: for eager devices only.
    """
    flat_ids = ids.reshape(-1)
    order = flat_ids.argsort(stable=True)  # pairs grouped by expert, ascending
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    tokens = order // ids.shape[1]
    pair_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate, up = linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w2[e])
        # `rows` holds each token once: an indexed add, which torch's CPU index_add_ runs ~100x slower in bf16.
        out[rows] += (y * pair_weights[start:start + n, None]).to(x.dtype)
        start += n
    return out


class FusedMoE(nn.Module):
    """Router (``gate``) + stacked experts (``w13``, ``w2``); SiLU-gated experts (``w2(silu(w1 x) * w3 x)``)."""

    # Set by the device backend after loading (``layers/kernels.install_kernels``); None: the static-shape torch paths.
    kernel: ExpertsKernel | None = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp: TPContext = TPContext(), renormalize: bool = True):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts {num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp = tp
        self.intermediate_per_rank = divide(intermediate_size, tp.size, "expert intermediate size")
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, tp=tp)
        self.w13 = ExpertWeights(num_experts, 2 * self.intermediate_per_rank, hidden_size, tp, gate_up=True)
        self.w2 = ExpertWeights(num_experts, hidden_size, self.intermediate_per_rank, tp, gate_up=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        if self.kernel is not None:
            out = self.kernel(x, weights, ids, self.w13.experts(x.dtype), self.w2.experts(x.dtype))
        elif x.shape[0] * self.top_k < self.num_experts:
            out = self._gathered(x, weights, ids)
        else:
            out = self._dense(x, weights, ids)
        return self.tp.all_reduce(out).reshape(shape)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, hidden]`` -> (float32 weights ``[T, k]``, expert ids ``[T, k]`` ascending)."""
        return route(self.gate(x), self.top_k, self.renormalize)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        combine.scatter_(1, ids, weights)  # [T, E]: a token's weight for each expert, 0 if not routed
        w13, w2 = self.w13.experts(x.dtype), self.w2.experts(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            out = out + (y * combine[:, e, None]).to(x.dtype)
        return out

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13 = self.w13.experts(x.dtype)[ids]  # [T, k, 2I, H]
        w2 = self.w2.experts(x.dtype)[ids]  # [T, k, H, I]
        gate_up = torch.matmul(w13, x[:, None, :, None]).squeeze(-1)  # [T, k, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.matmul(w2, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [T, k, H]
        y = (y * weights[..., None]).to(x.dtype)
        out = torch.zeros_like(x)
        for j in range(self.top_k):  # ascending expert order, like the dense path
            out = out + y[:, j]
        return out


class GroupedTopKGate(nn.Module):
    """DeepSeek-V3's router weight with its ``e_score_correction_bias`` (named as in the checkpoint),
    replicated. Not a linear layer: it runs in float32, and no backend may repack or release it."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        for p in (self.weight, self.e_score_correction_bias):
            p.weight_loader = _load_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def _load_whole(param: nn.Parameter, loaded) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"router shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


class GroupedFusedMoE(FusedMoE):
    """``FusedMoE`` routed by `grouped_route` (DeepSeek-V3): same experts, same compute paths."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, tp: TPContext,
                 n_group: int, topk_group: int, renormalize: bool, scaling_factor: float):
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, tp, renormalize)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"n_routed_experts {num_experts} in n_group {n_group} groups, topk_group {topk_group}: "
                             "the experts must split evenly into groups and topk_group be between 1 and n_group")
        self.n_group, self.topk_group, self.scaling_factor = n_group, topk_group, scaling_factor
        self.gate = GroupedTopKGate(hidden_size, num_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_route(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                             self.renormalize, self.scaling_factor)


__all__ = ["ExpertWeights", "ExpertsKernel", "FusedMoE", "GroupedFusedMoE", "GroupedTopKGate",
           "expert_params_mapping", "grouped_experts", "grouped_route", "route"]
