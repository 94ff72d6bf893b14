"""Rank functions for the fixed-shape decoding tests (spawned, so module level).

Each layout samples the KV-cache tests' prompts (``kv_cache_workers``) with today's cached path
(Megatron's static context, lockstep) and with the fixed-shape decode step, continuously batched
and in waves over fewer slots than sequences: tokens, log-probs and the scheduler's counters.
"""

from kv_cache_workers import (
    EOS,
    PROMPTS,
    WAVE,
    _episodes,
    _generate,
    _model,
    _sampler,
    _share,
)


def _fixed(model, schedule: str, slots=None, eos=True):
    return _sampler(model, True, max_requests=slots, fixed_shape=True, schedule=schedule,
                    eos_id=EOS if eos else None)


def _counted(out: dict) -> dict:
    """A generate's samples with the fixed-shape scheduler's counters and metrics."""
    schedule = out["schedule"]
    return {**out, "decode_forwards": schedule["decode_forwards"],
            "prefill_forwards": schedule["prefill_forwards"], "prefilled": schedule["prefilled"]}


def sample_fixed_shape(ckpt: str, save: bool, shape: dict | None = None):
    """Today's cached samples and the fixed-shape ones, single-turn (plain and top-p) and
    multi-turn (with and without rewrites of cached tokens)."""
    model = _model(ckpt, save, shape)
    prompts, seq_index = _share(1, 0)
    out = {}
    for name, make in (("cached", lambda **kw: _sampler(model, True, **({} if kw.get("eos", True) else {"eos_id": None}))),
                       ("continuous", lambda **kw: _fixed(model, "continuous", WAVE, **kw)),
                       ("waves", lambda **kw: _fixed(model, "waves", WAVE, **kw)),
                       ("one_cache", lambda **kw: _fixed(model, "continuous", None, **kw))):
        sampler = make()
        out[name] = _generate(sampler, prompts, seq_index)
        out[name + "_top_p"] = _generate(sampler, prompts, seq_index, temperature=0.7, top_p=0.9)
        if name != "cached":
            out[name] = _counted(_generate(sampler, prompts, seq_index))
        sampler = make(eos=False)
        out[name + "_episodes"] = _episodes(sampler, prompts, seq_index, cut=False)
        out[name + "_episodes_cut"] = _episodes(sampler, prompts, seq_index, cut=True)
    out["training_mode_kept"] = model.training
    out["sequences"] = len(PROMPTS)
    return out


def sample_fixed_shape_te_like(ckpt: str, shape: dict | None = None):
    """:func:`sample_fixed_shape` on a model whose core attention is Transformer Engine's stand-in
    (``te_like_attention``): the fixed-shape step runs the TE spec's modules, not its kernel."""
    from te_like_attention import TELikeAttention, use_te_like_attention

    use_te_like_attention()
    out = sample_fixed_shape(ckpt, False, shape)
    out["attention_calls"] = dict(TELikeAttention.calls)
    return out


def graphs_against_eager():
    """On a GPU: the same slots fed the same prompts, then decoded eagerly and by replaying the
    captured graphs (buckets 1, 2, 4: three live slots of four run in bucket 4); then the weights
    change in place (as the optimizer and the EMA swap change them), the graphed decoder is reset
    and replays again, against a fresh eager decoder on the new weights."""
    import torch
    from kv_cache_workers import TINY

    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.rollout.static_decode import StaticDecoder

    torch.manual_seed(0)
    model = build_for_this_rank(ModelConfig(**TINY, tie_word_embeddings=True, qk_layernorm=True,
                                            add_qkv_bias=True))
    model.eval()

    def decoder(graphs):
        return StaticDecoder(model, 4, TINY["max_position_embeddings"], TINY["vocab_size"], 1.0, 1.0,
                             cuda_graphs=graphs)

    def sample(dec):
        first = dec.extend([0, 1, 2], [PROMPTS[s] for s in range(3)], [0] * 3, [0.3 + 0.1 * s for s in range(3)])
        steps = [dec.step([0, 1, 2], [((7 * t + s) % 10) / 10 + 0.05 for s in range(3)]) for t in range(12)]
        return {"first": first, "steps": steps}

    out = {}
    with torch.no_grad():
        out["eager"] = sample(decoder(False))
        graphed = decoder(True)
        out["graphs"] = sample(graphed)
        out["buckets"], out["memory"] = sorted(graphed.graphs.graphs), graphed.graphs.memory_bytes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        graphed.reset()
        out["graphs_after_update"] = sample(graphed)
        out["eager_after_update"] = sample(decoder(False))
    return out
