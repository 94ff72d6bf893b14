"""Rank function of the THD packing test: Megatron's own THD path (``PackedSeqParams``,
``cu_seqlens``, RoPE restarted per segment by Megatron) on a CPU, with a stand-in for Transformer
Engine's attention kernel (``te_like_attention``)."""

from packing_workers import packed_vs_padded
from te_like_attention import TELikeAttention, use_te_like_attention


def thd_packed_vs_padded(*args) -> dict:
    """``packing_workers.packed_vs_padded`` on a TE-like model, and how many THD forwards ran."""
    use_te_like_attention()
    out = packed_vs_padded(*args)
    out["thd_calls"] = TELikeAttention.calls["thd"]
    return out
