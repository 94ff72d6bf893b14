"""How many sequences share one KV cache (``kv_cache_decoding.rows_per_cache``): the flag, the
free-memory fit, and the error when not even one sequence fits."""

import pytest

from emapg_megatron.rollout import kv_cache_decoding as kv
from emapg_megatron.runtime import ConfigError

GIB = 2**30


def test_the_flag_sets_the_wave_size_and_never_exceeds_the_sequences():
    assert kv.rows_per_cache(10, GIB, max_requests=4) == 4
    assert kv.rows_per_cache(3, GIB, max_requests=4) == 3
    assert kv.rows_per_cache(10, GIB, max_requests=4, free_bytes=1) == 4  # the flag wins


def test_without_a_flag_all_sequences_on_cpu_and_what_fits_on_a_gpu():
    assert kv.rows_per_cache(64, GIB) == 64
    # 10 GiB free, 80% for the cache, 1 GiB per sequence: 8 at a time
    assert kv.rows_per_cache(64, GIB, free_bytes=10 * GIB) == 8
    assert kv.rows_per_cache(5, GIB, free_bytes=10 * GIB) == 5
    assert kv.rows_per_cache(0, GIB) == 1  # an empty call still sizes a (skipped) cache


def test_a_sequence_that_cannot_fit_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"KV cache of one sequence \(2.00 GiB.*--seq-length"):
        kv.rows_per_cache(8, 2 * GIB, free_bytes=2 * GIB)


def test_free_memory_is_none_on_cpu():
    assert kv.free_device_bytes() is None
