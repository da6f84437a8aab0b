"""Float8 (E4M3) weights for the tensor-parallel linear layers, the LM head and the embedding.

A layer keeps its weight as ``qweight`` (``torch.float8_e4m3fn``) with one
float32 scale per output channel (``weight_scale``, max-abs / 448), so each
rank quantizes its own slice and sharded layers need nothing else. Inputs are
scaled per tensor: statically from measured statistics (``input_scale``) when
given, else from each call's max-abs (dynamic).

The product runs as ``torch._scaled_mm`` on CUDA with compute capability
>= 8.9 (untested here: no such GPU in CI). Elsewhere it is emulated: the
quantized input and this one layer's weight are cast up to the activation
dtype for the matmul and the scales applied to the result, so no full-model
copy of the weights ever exists in bf16.

Layers are converted in place by swapping their class for a float8 subclass
(``to_fp8``): they keep every attribute the model reads (``tp``, head sizes,
``bias``), and ``weight`` still reads as the dequantized tensor for code that
uses it directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gaudi_runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gaudi_runtime.layers.linear import LinearBase, RowParallelLinear

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero channel still gets a finite scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` -> (float8 ``[out, in]``, float32 scales ``[out]``) with ``w ~= q * scale[:, None]``."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_to(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast float8 E4M3 up, exactly. On CPU torch's cast is scalar code, slower than a bf16 matmul of the
    same weight; moving the bits into a bfloat16 (same layout, exponent bias 127 vs 7) is vectorized."""
    if not q.is_cpu:
        return q.to(dtype)
    v = q.view(torch.int8).to(torch.int16)  # sign-extended, so after the shift bit 15 is the sign
    # Keep the sign and the 7 exponent/mantissa bits (mask 0x87F0); rescale by the bias difference 2^(127-7).
    bf16 = ((v << 4) & -0x7810).view(torch.bfloat16) * 2.0**120  # exact, subnormals included
    return bf16 if dtype == torch.bfloat16 else bf16.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return fp8_to(q, dtype) * scale[:, None].to(dtype)


def quantize_input(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor float8 input: static ``scale`` if given, else max-abs of ``x`` (dynamic)."""
    if scale is None:
        scale = (x.detach().abs().max().float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _scaled_mm_usable(x: torch.Tensor, q: torch.Tensor) -> bool:
    if not (x.is_cuda and hasattr(torch, "_scaled_mm")):
        return False
    # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards; _scaled_mm wants dims divisible by 16.
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, in_scale: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * w_scale)^T`` with ``x`` quantized per tensor; result in ``x.dtype``, no bias."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, xs = quantize_input(x2, in_scale)
    if _scaled_mm_usable(x2, q) and x2.shape[0] % 16 == 0:  # pragma: no cover - needs an FP8 GPU
        y = torch._scaled_mm(xq, q.t(), scale_a=xs.reshape(1, 1).expand(x2.shape[0], 1).contiguous(),
                             scale_b=w_scale.reshape(1, -1).contiguous(), out_dtype=torch.bfloat16)
        return y.to(x.dtype).reshape(*shape[:-1], q.shape[0])
    dt = x.dtype
    y = F.linear(fp8_to(xq, dt), fp8_to(q, dt)) * (w_scale.to(dt) * xs.to(dt))
    return y.reshape(*shape[:-1], q.shape[0])


class _Fp8Weights:
    """Mixin state shared by the float8 layers (set up by ``to_fp8``)."""

    qweight: nn.Parameter
    weight_scale: nn.Parameter
    input_scale: torch.Tensor | None
    act_dtype: torch.dtype

    @property
    def weight(self) -> torch.Tensor:  # the dequantized weight, for code that reads it directly
        return dequantize(self.qweight, self.weight_scale, self.act_dtype)

    def extra_repr(self) -> str:
        static = "dynamic" if self.input_scale is None else f"static {float(self.input_scale):.3g}"
        return f"fp8 weight {tuple(self.qweight.shape)}, per-channel scales, input scale {static}"


class Fp8LinearMixin(_Fp8Weights):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_matmul(x, self.qweight, self.weight_scale, self.input_scale)
        if isinstance(self, RowParallelLinear):
            if self.bias is not None and self.tp.rank == 0:
                y = y + self.bias
            return self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class Fp8LMHeadMixin(_Fp8Weights):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = fp8_matmul(hidden, self.qweight, self.weight_scale, self.input_scale)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        if self.padded_num_embeddings != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits.float()


class Fp8EmbeddingMixin(_Fp8Weights):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        in_range = None
        if self.tp.size > 1:
            in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            input_ids = (input_ids - self.vocab_start) * in_range
        # Only the looked-up rows are cast up (uint8 view: indexing float8 is not implemented everywhere).
        rows = fp8_to(self.qweight.view(torch.uint8)[input_ids].view(FP8), self.act_dtype)
        y = rows * self.weight_scale[input_ids].unsqueeze(-1).to(self.act_dtype)
        if in_range is None:
            return y
        return self.tp.all_reduce(y * in_range.unsqueeze(-1).to(y.dtype))


_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if cls not in _CLASSES:
        if issubclass(cls, ParallelLMHead):
            mixin = Fp8LMHeadMixin
        elif issubclass(cls, VocabParallelEmbedding):
            mixin = Fp8EmbeddingMixin
        elif issubclass(cls, LinearBase):
            mixin = Fp8LinearMixin
        else:
            raise TypeError(f"no float8 version of {cls.__name__}")
        _CLASSES[cls] = type(f"Fp8{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def is_fp8(module: nn.Module) -> bool:
    return isinstance(module, _Fp8Weights)


def to_fp8(module: nn.Module, act_dtype: torch.dtype, input_scale: float | None = None,
           shared: tuple[nn.Parameter, nn.Parameter] | None = None) -> tuple[nn.Parameter, nn.Parameter]:
    """Convert ``module`` in place; return its (qweight, weight_scale) so a tied layer can share them."""
    weight = module._parameters.pop("weight")
    if shared is None:
        q, scale = quantize_per_channel(weight.data)
        shared = (nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False))
    del weight
    module.__class__ = _fp8_class(type(module))
    module.qweight, module.weight_scale = shared
    module.act_dtype = act_dtype
    module.input_scale = None if input_scale is None else torch.tensor(float(input_scale), dtype=torch.float32,
                                                                       device=shared[1].device)
    return shared
