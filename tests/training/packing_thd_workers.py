"""Rank functions for the THD packing test: Megatron's own THD path (``PackedSeqParams``,
``cu_seqlens``, RoPE restarted per segment by Megatron) on a CPU, with a reference core attention
in place of Transformer Engine's fused kernel, which needs a GPU."""

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from packing_workers import packed_vs_padded


class ThdReferenceAttention(MegatronModule):
    """Causal softmax attention, per packed segment when given THD ``packed_seq_params`` (what TE's
    fused attention computes with ``qkv_format="thd"``), else per sequence of an ``sbhd`` batch.
    Not ``DotProductAttention``, so the model counts as TE-like and packing picks THD."""

    thd_calls = 0  # forwards given THD params, in this rank's process

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **unused):
        super().__init__(config)

    @staticmethod
    def _causal(q, k, v):  # [n, heads, dim] each, kv heads repeated for GQA
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True)
        return out.transpose(0, 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd" and query.dim() == 3  # [T, heads, dim]
            ThdReferenceAttention.thd_calls += 1
            cu = packed_seq_params.cu_seqlens_q.tolist()
            assert cu == packed_seq_params.cu_seqlens_kv.tolist() and cu[-1] == query.shape[0]
            out = torch.cat([self._causal(query[a:b], key[a:b], value[a:b]) for a, b in zip(cu, cu[1:])])
            return out.reshape(out.shape[0], -1)
        out = torch.stack([self._causal(query[:, i], key[:, i], value[:, i]) for i in range(query.shape[1])], 1)
        return out.reshape(out.shape[0], out.shape[1], -1)  # [sq, b, heads * dim]


def thd_packed_vs_padded(*args) -> dict:
    """``packing_workers.packed_vs_padded`` on a model whose core attention is the THD reference."""
    from emapg_megatron.models import gpt

    local_spec = gpt.layer_spec

    def thd_spec(*a, **k):
        spec = local_spec(*a, **k)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = ThdReferenceAttention
        return spec

    gpt.layer_spec = thd_spec  # this spawned rank's own module
    out = packed_vs_padded(*args)
    out["thd_calls"] = ThdReferenceAttention.thd_calls
    return out
