"""A stand-in for Transformer Engine's core attention on a CPU, for the tests of the TE-spec routes
(THD packing, KV-cached decoding) whose kernel needs a GPU.

:class:`TELikeAttention` takes the arguments Megatron gives ``TEDotProductAttention`` and does what
TE does with them: causal softmax attention per packed segment under THD ``packed_seq_params``,
causal attention for ``AttnMaskType.causal``, none for ``no_mask`` (Megatron's choice once a KV
cache holds earlier tokens), and, as TE under those mask types, it ignores an explicit
``attention_mask``. It also refuses what TE 2.11's ``get_qkv_layout`` refuses for separate q, k and v:
keys or values that still start past the beginning of their storage once made contiguous (a
contiguous slice of Megatron's static KV cache at a row offset: one position of rows ``a..b``). It is not Megatron's ``DotProductAttention``, so the project treats the model
as a TE model (``models.gpt.has_local_attention`` is False). Everything around it is production.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class TELikeAttention(MegatronModule):
    calls: dict = {"thd": 0, "causal": 0, "no_mask": 0}  # forwards of each kind, in this process

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **unused):
        super().__init__(config)
        self.attn_mask_type = attn_mask_type

    @staticmethod
    def _attend(q, k, v, causal: bool):  # [n, heads, dim]; kv heads repeated for GQA
        assert not causal or q.shape[0] == k.shape[0], "TE's causal mask with sq != sk is top-left"
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=causal)
        return out.transpose(0, 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd" and query.dim() == 3  # [T, heads, dim]
            cu = packed_seq_params.cu_seqlens_q.tolist()
            assert cu == packed_seq_params.cu_seqlens_kv.tolist() and cu[-1] == query.shape[0]
            TELikeAttention.calls["thd"] += 1
            out = torch.cat([self._attend(query[a:b], key[a:b], value[a:b], True) for a, b in zip(cu, cu[1:])])
            return out.reshape(out.shape[0], -1)
        if any(t.contiguous().storage_offset() for t in (key, value)):
            raise RuntimeError("The provided qkv memory layout is not supported!")  # TE's words
        kind = attn_mask_type or self.attn_mask_type
        assert kind in (AttnMaskType.causal, AttnMaskType.no_mask), kind
        # no mask over several new tokens lets each see the later ones: wrong under TE
        assert kind == AttnMaskType.causal or query.shape[0] == 1, "TE: unmasked chunk after a cached prefix"
        TELikeAttention.calls[kind.name] += 1
        out = torch.stack([self._attend(query[:, i], key[:, i], value[:, i], kind == AttnMaskType.causal)
                           for i in range(query.shape[1])], 1)
        return out.reshape(out.shape[0], out.shape[1], -1)  # [sq, b, heads * dim]


def use_te_like_attention() -> None:
    """Build every later model of this (spawned) process with :class:`TELikeAttention`."""
    from emapg_megatron.models import gpt

    local_spec = gpt.layer_spec

    def spec(*args, **kwargs):
        block = local_spec(*args, **kwargs)
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = TELikeAttention
        return block

    gpt.layer_spec = spec
