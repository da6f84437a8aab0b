"""Fake habana_frameworks.torch: records what the runtime asks of the HPU bridge.

Like the bridge, loading it registers Habana's torch ops: here ``torch.ops.hpu.block_softmax_adjustment``
and ``torch.ops.hpu.mixture_of_experts``, on CPU."""

import sys

import torch

# `events`: mark_steps and graph runs in the order they happened, so a test can see what the host did
# between launching a step on the device and waiting for it (filling a grammar's token mask).
# `block_softmax_adjustment`: each call of the op, as {"block_max": shape, "block_sums": shape,
# "block_groups": shape, "batch_size": int}.
# `mixture_of_experts`: each call of the op, as {"hidden_states": shape, "experts": (min, max), "activation": str}.
RECORD = {"mark_step": 0, "captures": [], "replays": [], "wrapped": 0, "synchronize": 0, "recipe_compiles": 0,
          "recipe_hits": 0, "events": [], "block_softmax_adjustment": [], "mixture_of_experts": []}


def reset() -> None:
    RECORD.update(mark_step=0, captures=[], replays=[], wrapped=0, synchronize=0, recipe_compiles=0, recipe_hits=0,
                  events=[], block_softmax_adjustment=[], mixture_of_experts=[])


def block_softmax_adjustment(block_max: torch.Tensor, block_sums: torch.Tensor, block_groups: torch.Tensor,
                             batch_size: int) -> torch.Tensor:
    """Per block (dimension 0): exp(block_max - its group's max) / the group's sum of block_sums rescaled
    alike, elementwise over the other dimensions. Groups run from 0 to batch_size (padding blocks' group)."""
    fake = sys.modules.get("habana_frameworks.torch")  # the fake imported last: tests import it afresh
    if fake is not None:
        fake.RECORD["block_softmax_adjustment"].append(
            {"block_max": tuple(block_max.shape), "block_sums": tuple(block_sums.shape),
             "block_groups": tuple(block_groups.shape), "batch_size": batch_size})
    if block_groups.numel() and not 0 <= int(block_groups.min()) <= int(block_groups.max()) <= batch_size:
        raise RuntimeError(f"block_groups outside [0, {batch_size}]")
    t = block_max.shape[0]
    maxes, sums = block_max.reshape(t, -1).float(), block_sums.reshape(t, -1).float()
    same_group = (block_groups[:, None] == block_groups[None, :])[:, :, None]  # [T, T, 1]
    group_max = torch.where(same_group, maxes[None], float("-inf")).amax(1)  # [T, F]
    adjustment = (maxes - group_max).exp()
    group_sum = torch.where(same_group, (sums * adjustment)[None], 0.0).sum(1)
    return (adjustment / group_sum).to(block_max.dtype).view(block_max.shape)


def mixture_of_experts(hidden_states: torch.Tensor, expert_routing_table: torch.Tensor, router_weights: torch.Tensor,
                       w12: list[torch.Tensor], w3: list[torch.Tensor], permuted_weights: bool, activation: str,
                       experts_min: int, experts_max: int) -> torch.Tensor:
    """Habana's fused MoE on static shapes: every expert in [experts_min, experts_max] on every token, weighted by
    the token's router weight for it (0 when not routed); w12 rows are gate then up ([out, in]: permuted)."""
    fake = sys.modules.get("habana_frameworks.torch")
    if fake is not None:
        fake.RECORD["mixture_of_experts"].append({"hidden_states": tuple(hidden_states.shape),
                                                  "experts": (experts_min, experts_max), "activation": activation})
    if not permuted_weights or activation != "silu" or expert_routing_table.dtype != torch.int64:
        raise RuntimeError("the fake takes permuted weights, silu and int64 routing only")
    out = torch.zeros_like(hidden_states)
    for e in range(experts_min, experts_max + 1):
        weight = (router_weights * (expert_routing_table == e)).sum(-1, keepdim=True)
        gate, up = torch.nn.functional.linear(hidden_states, w12[e - experts_min]).chunk(2, dim=-1)
        out = out + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w3[e - experts_min]) * weight
    return out


# Once per process: the ops outlive this module, which tests import afresh.
if not hasattr(torch.ops.hpu, "mixture_of_experts"):
    torch.library.define("hpu::mixture_of_experts",
                         "(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, "
                         "Tensor[] w3, bool permuted_weights, str activation, int experts_min, int experts_max) "
                         "-> Tensor")
    torch.library.impl("hpu::mixture_of_experts", "CPU", mixture_of_experts)
if not hasattr(torch.ops.hpu, "block_softmax_adjustment"):
    torch.library.define("hpu::block_softmax_adjustment",
                         "(Tensor block_max, Tensor block_sums, Tensor block_groups, int batch_size) -> Tensor")
    torch.library.impl("hpu::block_softmax_adjustment", "CPU", block_softmax_adjustment)
