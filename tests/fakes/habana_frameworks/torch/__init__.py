"""Fake habana_frameworks.torch: records what the runtime asks of the HPU bridge.

Like the bridge, loading it registers Habana's torch ops: here ``torch.ops.hpu.block_softmax_adjustment``
and ``torch.ops.hpu.mixture_of_experts``, on CPU."""

import sys

import torch

# `events`: mark_steps and graph runs in the order they happened, so a test can see what the host did
# between launching a step on the device and waiting for it (filling a grammar's token mask).
# `block_softmax_adjustment`: each call of the op, as {"block_max": shape, "block_sums": shape,
# "block_groups": shape, "batch_size": int}.
# `mixture_of_experts`: each call of the op, as {"hidden_states": shape, "experts": (min, max), "activation": str};
# `mixture_of_experts_fp8`: each call of its blockwise float8 variant (weights' dtype and shape, scales' shapes).
RECORD = {"mark_step": 0, "captures": [], "replays": [], "wrapped": 0, "synchronize": 0, "recipe_compiles": 0,
          "recipe_hits": 0, "events": [], "block_softmax_adjustment": [], "mixture_of_experts": []}


def reset() -> None:
    RECORD.update(mark_step=0, captures=[], replays=[], wrapped=0, synchronize=0, recipe_compiles=0, recipe_hits=0,
                  events=[], block_softmax_adjustment=[], mixture_of_experts=[],
                  fp8_gemm_v2=[], mixture_of_experts_fp8=[])


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
    return _experts(hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights, activation,
                    experts_min, experts_max)


def _experts(hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights, activation, experts_min,
             experts_max) -> torch.Tensor:
    if not permuted_weights or activation != "silu" or expert_routing_table.dtype != torch.int64:
        raise RuntimeError("the fake takes permuted weights, silu and int64 routing only")
    out = torch.zeros_like(hidden_states)
    for e in range(experts_min, experts_max + 1):
        weight = (router_weights * (expert_routing_table == e)).sum(-1, keepdim=True)
        gate, up = torch.nn.functional.linear(hidden_states, w12[e - experts_min]).chunk(2, dim=-1)
        out = out + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w3[e - experts_min]) * weight
    return out


def mixture_of_experts_fp8_blockwise(hidden_states, expert_routing_table, router_weights, w12, w3, d_scale_w12,
                                     d_scale_w3, block_size, permuted_weights, activation, experts_min, experts_max):
    """The fused MoE's float8 variant (``mixture_of_experts.fp8_fused_weights_blockwise``): each expert's float8
    weights times its ``[ceil(out / block), ceil(in / block)]`` scales, then the op above. Like the card,
    refuses float8 weights beyond its E4M3 range (FP8_LIMIT)."""
    fake = sys.modules.get("habana_frameworks.torch")
    limit = fake.FP8_LIMIT if fake is not None else 448.0

    def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if q.dtype != torch.float8_e4m3fn or q.float().abs().max() > limit:
            raise RuntimeError(f"mixture_of_experts fp8: weights must be float8 within this card's range {limit}")
        full = scale.float().repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
        return q.float() * full[:q.shape[0], :q.shape[1]]

    if fake is not None:
        fake.RECORD["mixture_of_experts_fp8"].append({
            "hidden_states": tuple(hidden_states.shape), "experts": (experts_min, experts_max),
            "w12": (w12[0].dtype, tuple(w12[0].shape)), "d_scale_w12": tuple(d_scale_w12[0].shape),
            "d_scale_w3": tuple(d_scale_w3[0].shape), "block_size": block_size})
    return _experts(hidden_states.float(), expert_routing_table, router_weights.float(),
                              [dequantized(q, s) for q, s in zip(w12, d_scale_w12)],
                              [dequantized(q, s) for q, s in zip(w3, d_scale_w3)], permuted_weights, activation,
                              experts_min, experts_max).to(torch.bfloat16)


# Once per process: the ops outlive this module, which tests import afresh.
if not hasattr(torch.ops.hpu, "mixture_of_experts"):
    torch.library.define("hpu::mixture_of_experts",
                         "(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, "
                         "Tensor[] w3, bool permuted_weights, str activation, int experts_min, int experts_max) "
                         "-> Tensor")
    torch.library.impl("hpu::mixture_of_experts", "CPU", mixture_of_experts)
if "fp8_fused_weights_blockwise" not in torch.ops.hpu.mixture_of_experts.overloads():
    torch.library.define("hpu::mixture_of_experts.fp8_fused_weights_blockwise",
                         "(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, "
                         "Tensor[] w3, Tensor[] d_scale_w12, Tensor[] d_scale_w3, int block_size, "
                         "bool permuted_weights, str activation, int experts_min, int experts_max) -> Tensor")
    torch.library.impl("hpu::mixture_of_experts.fp8_fused_weights_blockwise", "CPU",
                       lambda *a: mixture_of_experts_fp8_blockwise(*a))
if not hasattr(torch.ops.hpu, "block_softmax_adjustment"):
    torch.library.define("hpu::block_softmax_adjustment",
                         "(Tensor block_max, Tensor block_sums, Tensor block_groups, int batch_size) -> Tensor")
    torch.library.impl("hpu::block_softmax_adjustment", "CPU", block_softmax_adjustment)
if not hasattr(torch.ops.hpu, "fp8_gemm_v2"):  # Habana's FP8 cast and matmul, on CPU
    torch.library.define("hpu::cast_to_fp8_v2", "(Tensor x, Tensor? scale, bool stochastic, bool is_amax, "
                         "ScalarType dtype) -> (Tensor, Tensor)")
    torch.library.impl("hpu::cast_to_fp8_v2", "CPU", lambda *a: cast_to_fp8_v2(*a))
    torch.library.define("hpu::fp8_gemm_v2", "(Tensor a, bool trans_a, Tensor b, bool trans_b, Tensor? d, "
                         "ScalarType out_dtype, Tensor? a_scale_inv, Tensor? b_scale_inv, Tensor? bias, "
                         "bool accumulate) -> Tensor")
    torch.library.impl("hpu::fp8_gemm_v2", "CPU", lambda *a: fp8_gemm_v2(*a))


def cast_to_fp8_v2(x: torch.Tensor, scale: torch.Tensor | None = None, stochastic: bool = False,
                   is_amax: bool = False, dtype: torch.dtype = torch.float8_e4m3fn):
    """``x * scale`` cast to float8, saturating as the card does; (the float8 tensor, amax)."""
    scaled = x.float() * (1.0 if scale is None else scale.float())
    fake = sys.modules.get("habana_frameworks.torch")
    limit = fake.FP8_LIMIT if fake is not None else 448.0
    return scaled.clamp(-limit, limit).to(dtype), scaled.abs().amax()


def fp8_gemm_v2(a, trans_a, b, trans_b, d, out_dtype, a_scale_inv=None, b_scale_inv=None, bias=None,
                accumulate=False):
    """``(a * a_scale_inv) @ (b * b_scale_inv)`` (transposed as asked), in `out_dtype`; records the call.
    Like Gaudi 2, refuses a float8 operand beyond the card's range (FP8_LIMIT)."""
    fake = sys.modules.get("habana_frameworks.torch")
    limit = fake.FP8_LIMIT if fake is not None else 448.0
    for name, t in (("a", a), ("b", b)):
        if t.float().abs().max() > limit:
            raise RuntimeError(f"fp8_gemm_v2: operand {name} exceeds this card's E4M3 range {limit}")
    if fake is not None:
        fake.RECORD["fp8_gemm_v2"].append({"a": tuple(a.shape), "b": tuple(b.shape), "trans_b": trans_b,
                                           "b_scale": tuple(b_scale_inv.shape), "out_dtype": out_dtype})
    af = a.float() * a_scale_inv.float()
    bf = b.float() * (b_scale_inv.float().reshape(-1, 1) if b_scale_inv.numel() > 1 else b_scale_inv.float())
    y = (af.t() if trans_a else af) @ (bf.t() if trans_b else bf)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


FP8_LIMIT = 448.0  # the card's E4M3 range: tests set 240 to stand for Gaudi 2
RECORD["fp8_gemm_v2"] = []
RECORD["mixture_of_experts_fp8"] = []
