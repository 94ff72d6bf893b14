"""Inputs the built-in sampler and the evaluation backend refuse (or answer) before any forward:
empty prompts, an empty prompt list, sampling settings outside their range."""

from types import SimpleNamespace

import pytest

from emapg_megatron.errors import ConfigError
from emapg_megatron.rollout.config import SamplerConfig
from emapg_megatron.rollout.episodes import start_episodes
from emapg_megatron.rollout.megatron_backend import MegatronGenerationBackend
from emapg_megatron.rollout.megatron_sampler import MegatronSampler


class _Tokenizer:
    eos_token_id, pad_token_id = 1, 0


class _Model:
    max_position_embeddings, vocab_size = 32, 16


class _Chunk:  # a placeholder model: never run, only its config is read
    config = SimpleNamespace(sequence_parallel=False)


def _sampler(kv_cache: bool) -> MegatronSampler:
    return MegatronSampler([_Chunk()], SamplerConfig(kv_cache=kv_cache).resolved(False), vocab_size=16,
                           eos_id=1, pad_id=0, seq_length=32, micro_batch_size=2, seed=0)


def test_an_empty_prompt_is_refused_before_a_forward():
    """The cached path would run a zero-width forward; the reference would sample from a pad."""
    for kv_cache in (True, False):
        sampler = _sampler(kv_cache)
        assert sampler.decoder.name == ("lockstep" if kv_cache else "recompute")
        with pytest.raises(ValueError, match="an empty prompt"):
            sampler.generate([[], [5, 6]], 1, 1.0, 1.0, 4)
    with pytest.raises(ValueError, match="an empty prompt"):
        start_episodes([[3], []], 1, [None, None], tokenizer=None, top_p=1.0, seq_length=32)


def test_evaluation_backend_checks_its_settings_and_takes_an_empty_list():
    for bad in (dict(temperature=-0.5), dict(top_p=0.0), dict(max_new_tokens=0)):
        kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0) | bad
        with pytest.raises(ConfigError, match="--temperature >= 0"):
            MegatronGenerationBackend([object()], _Tokenizer(), _Model(), **kw)
    greedy = MegatronGenerationBackend([object()], _Tokenizer(), _Model(), temperature=0.0, top_p=1.0,
                                       max_new_tokens=8, seed=0)
    assert greedy([], 4) == []
