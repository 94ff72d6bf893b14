"""Rank functions for the KV-cached sampler tests (spawned, so module level).

One run per layout samples the same prompts on both paths (cached, cache-free) and returns
what the tests compare: tokens, sampler log-probs, rows fed per cached forward, and
multi-turn episodes. Weights come from one checkpoint written at TP=PP=1, so every layout
holds the same model.
"""

import os

from emapg_megatron.models.config import ModelConfig
from emapg_megatron.tasks.base import Segment

TINY = dict(vocab_size=40, make_vocab_size_divisible_by=8, hidden_size=64, ffn_hidden_size=128,
            num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)
# Variable lengths: the first forward prefills 3 tokens, the longer prompts feed the rest.
PROMPTS = [[5, 9, 2], [7, 1, 1, 4, 8, 3, 6], [11, 12, 13, 14, 15], [2, 3, 4, 5]]
N, MAX_NEW, EOS = 2, 16, 3
WAVE = 3  # sequences per cache in the wave runs: 8 sequences go in waves of 3, 3, 2
SPLIT = 6  # tokens per cached forward above which rows go in micro-batches (the 8 x 3 prefill)


class CountingEnv:
    """A scripted multi-turn environment: turns of at most ``3 + row % 3`` tokens, then an
    observation of 1-4 tokens, done after three turns. With ``cut`` it keeps only the first
    two tokens of each turn, rewriting tokens the cache already holds (a restart)."""

    def __init__(self, row: int, cut: bool = False):
        self.row, self.cut, self.turns = row, cut, 0
        self.segments: list[Segment] = []
        self.done = False
        self.max_turn_tokens = 3 + row % 3
        self.response_text = ""

    def step(self, text, token_ids=None):
        ids = list(token_ids)[:2] if self.cut else list(token_ids)
        self.segments.append(Segment(text, "model", ids))
        self.turns += 1
        if self.turns >= 3:
            self.done = True
            return
        obs = [(self.row * 7 + self.turns * 3 + j) % 30 + 1 for j in range(1 + (self.row + self.turns) % 4)]
        self.segments.append(Segment("", "observation", obs))


class FlakyEnv(CountingEnv):
    """:class:`CountingEnv` whose copies on ranks other than 0 would lose some observations (a
    retriever failing there): only rank 0 may step them, and every rank takes its answers.
    ``steps`` counts the steps this process made."""

    steps = 0

    def step(self, text, token_ids=None):
        import torch.distributed as dist

        FlakyEnv.steps += 1
        super().step(text, token_ids)
        if dist.get_rank() != 0 and self.row % 2 == 0 and self.segments[-1].role == "observation":
            self.segments[-1] = Segment("", "observation", [])


def _model(ckpt: str, save: bool, shape: dict | None = None):
    from megatron.core import dist_checkpointing

    from emapg_megatron.models.gpt import build_for_this_rank

    model = build_for_this_rank(ModelConfig(**{**TINY, **(shape or {})}))
    if save:
        os.makedirs(ckpt, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
    return model


def _sampler(model, kv_cache: bool, eos_id=EOS, max_requests=None, max_forward_tokens=None,
             fixed_shape=False, schedule="continuous"):
    from emapg_megatron.rollout.config import SamplerConfig
    from emapg_megatron.rollout.megatron_sampler import MegatronSampler

    cfg = SamplerConfig(kv_cache=kv_cache, max_requests=max_requests, fixed_shape=fixed_shape,
                        max_forward_tokens=-1 if max_forward_tokens is None else max_forward_tokens,
                        continuous_batching=schedule == "continuous")
    return MegatronSampler([model], cfg.resolved(partial_rollouts=False), vocab_size=TINY["vocab_size"],
                           eos_id=eos_id, pad_id=0, seq_length=TINY["max_position_embeddings"],
                           micro_batch_size=3, seed=7)


def _share(dp: int, rank: int):
    """DP rank ``rank``'s prompts and their global sequence indices (``N`` samples each)."""
    mine = list(range(rank, len(PROMPTS), dp))
    return [PROMPTS[i] for i in mine], [i * N + k for i in mine for k in range(N)]


def _generate(sampler, prompts, seq_index, temperature=1.0, top_p=1.0):
    batch = sampler.generate(prompts, N, temperature, top_p, MAX_NEW, rng_step=3, seq_index=seq_index)
    return {"responses": batch.responses, "logprobs": batch.sampling_logprobs,
            "rows_fed": batch.stats.rows_fed, "waves": batch.stats.cache_waves,
            "schedule": vars(batch.stats.schedule) if batch.stats.schedule else None,
            "metrics": batch.stats.metrics()}


def _episodes(sampler, prompts, seq_index, cut: bool, n: int = N, env=CountingEnv):
    """Multi-turn samples; ``answers``: the turns each environment agreement of the cached path
    covered (the reference agrees in its own rounds)."""
    from emapg_megatron.rollout import megatron_sampler

    envs = [env(i, cut=cut and i % 3 == 1) for i in seq_index]
    real, answers = megatron_sampler.answer, []

    def counted(episodes, turns, group=None):
        answers.append(len(turns))
        return real(episodes, turns, group)

    megatron_sampler.answer = counted
    try:
        batch, _ = sampler.generate_episodes(prompts, n, envs, tokenizer=None, temperature=1.0,
                                             top_p=1.0, max_new_tokens=MAX_NEW, rng_step=5,
                                             seq_index=seq_index)
    finally:
        megatron_sampler.answer = real
    return {"tokens": batch.tokens, "loss_mask": batch.loss_mask, "logprobs": batch.sampling_logprobs,
            "rows_fed": batch.stats.rows_fed, "waves": batch.stats.cache_waves, "answers": answers,
            "turns": sum(e.turns for e in envs)}


def sample_both_paths(ckpt: str, save: bool, shape: dict | None = None):
    """Cached and cache-free samples of the whole batch, single- and multi-turn; with ``save``
    (the TP=PP=1 run) also the cached samples of each rank's share at DP=2, as a DP rank
    samples them (sampling involves no data-parallel communication)."""
    model = _model(ckpt, save, shape)
    prompts, seq_index = _share(1, 0)
    out = {}
    for name, kv_cache in (("cached", True), ("reference", False)):
        sampler = _sampler(model, kv_cache)
        out[name] = _generate(sampler, prompts, seq_index)
        out[name + "_top_p"] = _generate(sampler, prompts, seq_index, temperature=0.7, top_p=0.9)
        sampler.eos_id = None
        out[name + "_episodes"] = _episodes(sampler, prompts, seq_index, cut=False)
        out[name + "_episodes_cut"] = _episodes(sampler, prompts, seq_index, cut=True)
        out[name + "_flaky"] = _episodes(sampler, prompts, seq_index, cut=False, env=FlakyEnv)
        # one sequence: each observation (with the turn's last token) is a chunk of history
        out[name + "_one_episode"] = _episodes(sampler, prompts[1:2], seq_index[2:3], cut=False, n=1)
    if save:
        out["dp2"] = [_generate(_sampler(model, True), *_share(2, r)) for r in range(2)]
    out["flaky_env_steps"] = FlakyEnv.steps
    out.update(_waves(model, prompts, seq_index))
    out.update(_split_forwards(model, prompts, seq_index))
    out["training_mode_kept"] = model.training
    return out


def _split_forwards(model, prompts, seq_index):
    """Cached samples with forwards of more than ``SPLIT`` tokens (the prefill, history chunks)
    run in micro-batches of rows (``CachedForward.forward_in_row_batches``)."""
    from emapg_megatron.rollout import kv_cache_decoding as kv

    forward = kv.CachedForward
    real, real_part, calls, parts = forward.forward_in_row_batches, forward._last_logits, [], []

    inside = []

    def counted(self, inputs, *args, **kwargs):
        calls.append(tuple(inputs["tokens"].shape))
        parts.append([])
        inside.append(True)
        try:
            return real(self, inputs, *args, **kwargs)
        finally:
            inside.pop()

    def part(self, inputs):  # one micro-batch, or a whole forward outside ``counted``
        if inside:
            parts[-1].append(tuple(inputs["tokens"].shape))
        return real_part(self, inputs)

    forward.forward_in_row_batches, forward._last_logits = counted, part
    try:
        out = {"cached_split": _generate(_sampler(model, True, max_forward_tokens=SPLIT), prompts, seq_index)}
        sampler = _sampler(model, True, max_forward_tokens=SPLIT)
        sampler.eos_id = None
        out["cached_split_episodes"] = _episodes(sampler, prompts, seq_index, cut=True)
    finally:
        forward.forward_in_row_batches, forward._last_logits = real, real_part
    out["split_calls"], out["split_parts"] = calls, parts
    return out


def _waves(model, prompts, seq_index):
    """Cached samples with at most ``WAVE`` sequences per cache: set by --inference-max-requests,
    and sized by free memory that differs across ranks (each rank's fit is ``WAVE`` + its rank:
    the model-parallel group must agree on the smallest)."""
    import torch.distributed as dist

    from emapg_megatron.errors import ConfigError
    from emapg_megatron.rollout import kv_cache_decoding as kv

    contexts = []

    class Recorded(kv.StaticInferenceContext):  # Megatron's context, kept to weigh its cache
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            contexts.append(self)

    kv.StaticInferenceContext, real = Recorded, kv.StaticInferenceContext
    try:
        out = {"cached_waves": _generate(_sampler(model, True, max_requests=WAVE), prompts, seq_index)}
    finally:
        kv.StaticInferenceContext = real
    out["cache_bytes"] = [(sum(t.numel() * t.element_size() for kv_ in c.key_value_memory_dict.values()
                                for t in kv_), c.max_batch_size) for c in contexts]
    sampler = _sampler(model, True, max_requests=WAVE)
    sampler.eos_id = None
    out["cached_waves_episodes"] = _episodes(sampler, prompts, seq_index, cut=True)
    per_row = kv.cache_bytes_per_row(model, TINY["max_position_embeddings"])
    out["cache_bytes_per_row"] = per_row
    fit = (WAVE + dist.get_rank()) * per_row / kv.CACHE_MEMORY_FRACTION
    free, kv.free_device_bytes = kv.free_device_bytes, lambda: int(fit) + 1
    try:
        out["cached_fit"] = _generate(_sampler(model, True), prompts, seq_index)
        kv.free_device_bytes = lambda: 1 if dist.get_rank() == dist.get_world_size() - 1 else 2**40
        try:  # the last rank has no room: every rank must raise, none wait in a collective
            _generate(_sampler(model, True), prompts, seq_index)
        except ConfigError as e:
            out["no_room"] = str(e)
    finally:
        kv.free_device_bytes = free
    return out


def sample_both_paths_te_like(ckpt: str):
    """:func:`sample_both_paths` on a model whose core attention behaves as Transformer Engine's
    (``te_like_attention``): the cached path then feeds history one token at a time after the
    prefill, as it does under TE."""
    from te_like_attention import TELikeAttention, use_te_like_attention

    use_te_like_attention()
    out = sample_both_paths(ckpt, False)
    out["attention_calls"] = dict(TELikeAttention.calls)
    return out


def split_one_token_prefill_te_like(ckpt: str):
    """Under TE-like attention, sampling whose prefill is one position per row (a one-token
    prompt is the shortest) with forwards over ``SPLIT // 4`` tokens split into row micro-batches:
    the samples of the unsplit run (TE refuses a one-position cache slice at a row offset, so
    that forward runs whole)."""
    from te_like_attention import use_te_like_attention

    use_te_like_attention()
    model = _model(ckpt, False)
    prompts, seq_index = [[5], *PROMPTS[1:]], list(range(len(PROMPTS) * N))
    return {"split": _generate(_sampler(model, True, max_forward_tokens=SPLIT // 4), prompts, seq_index),
            "whole": _generate(_sampler(model, True), prompts, seq_index)}


def assert_same_samples(a: dict, b: dict, atol: float) -> None:
    """Two sampling runs drew the same tokens (responses, or tokens and loss masks) with the same
    log-probs within ``atol``."""
    import torch

    if "responses" in a:
        assert a["responses"] == b["responses"]
    else:
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=atol, rtol=0)
