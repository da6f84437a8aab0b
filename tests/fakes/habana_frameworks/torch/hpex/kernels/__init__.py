"""Fake FusedSDPA: records each call's recompute mode and causality, computes with torch SDPA."""

import torch.nn.functional as F

from habana_frameworks.torch import RECORD


class FusedSDPA:
    @staticmethod
    def apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode="None",
              recompute_mode=None, *args):
        RECORD.setdefault("fused_sdpa", []).append({"is_causal": is_causal, "recompute": recompute_mode,
                                                    "softmax_mode": softmax_mode})
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale)
