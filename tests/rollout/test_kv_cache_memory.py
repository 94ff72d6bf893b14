"""KV-cache bookkeeping on the host (``kv_cache_decoding``): how many sequences share one cache
(the flag, the free-memory fit) and when a row must restart in a fresh cache.
The fit agreed over a model-parallel group, and the error every rank raises when not even one
sequence fits, are tested at TP=2 and PP=2 in ``test_kv_cache_sampler.py``."""

from emapg_megatron.rollout import kv_cache_decoding as kv

GIB = 2**30


def test_the_flag_sets_the_wave_size_and_never_exceeds_the_sequences():
    assert kv.rows_per_cache(10, max_requests=4) == 4
    assert kv.rows_per_cache(3, max_requests=4) == 3
    assert kv.rows_per_cache(10, max_requests=4, fit=1) == 4  # the flag wins


def test_without_a_flag_all_sequences_on_cpu_and_what_fits_on_a_gpu():
    assert kv.rows_per_cache(64) == 64
    assert kv.rows_per_cache(64, fit=8) == 8
    assert kv.rows_per_cache(5, fit=8) == 5
    assert kv.rows_per_cache(0) == 1  # an empty call still sizes a (skipped) cache


def test_fit_is_eighty_percent_of_free_memory():
    assert kv.rows_that_fit(GIB, 10 * GIB) == 8
    assert kv.rows_that_fit(GIB, GIB) == 0


def test_free_memory_is_none_on_cpu():
    assert kv.free_device_bytes() is None


def test_a_row_restarts_when_its_history_rewrites_the_cache_or_has_nothing_to_feed():
    known = [1, 2, 3, 4]  # 3 tokens cached, then the sampled 4 appended in place: continue
    assert not kv._needs_restart(known, known, 3)
    assert not kv._needs_restart([1, 2, 3, 4], [1, 2, 3, 4, 9, 9], 3)  # a turn ended, an observation
    assert kv._needs_restart([1, 2, 3, 4], [1, 2, 7, 9], 3)  # the environment rewrote a cached token
    assert kv._needs_restart([1, 2, 3, 4], [1, 2, 3], 3)  # it dropped the sampled token, added nothing
    assert kv._needs_restart(known, known[:3], 3)
