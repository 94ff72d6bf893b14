"""Cross-DP sequence balancing (training/sequence_balance): the assignment by hand and on a
long-tailed mix, and the exchange at DP=3 against the sequences it was told to move."""

import math
import random

import pytest
import torch

from emapg_megatron.multiprocess import run_distributed
from emapg_megatron.training.sequence_balance import assign, imbalance, received


def loads(lengths_by_rank, dest, group):
    out = [0] * len(dest)
    for r, ls in enumerate(lengths_by_rank):
        for i in group:
            out[dest[r][i]] += ls[i]
    return out


def test_one_short_sequence_moves_to_the_light_rank():
    assert assign([[5, 1, 1, 1], [1, 1, 1, 1]], [[0, 1], [2, 3]]) == [[0, 1, 0, 0], [1, 1, 1, 1]]


def test_a_swap_evens_ranks_that_no_single_move_can():
    lengths = [[12, 12, 10, 10], [10, 10, 9, 9]]  # 44 vs 38: every sequence is longer than the gap
    dest = assign(lengths, [[0, 1, 2, 3]])
    assert loads(lengths, dest, [0, 1, 2, 3]) == [41, 41]
    assert dest == [[1, 0, 0, 0], [1, 1, 0, 1]]  # 12 for 9, the lowest indices


def test_balanced_or_indivisible_input_moves_nothing():
    assert assign([[3, 3], [3, 3]], [[0, 1]]) == [[0, 0], [1, 1]]
    assert assign([[100, 1], [1, 1]], [[0, 1]]) == [[0, 1], [1, 1]]  # the 100 stays; the 1 helps


def test_each_mini_batch_is_evened_not_only_the_batch():
    lengths = [[50, 50, 1, 1], [1, 1, 50, 50]]  # the batch is even, each mini-batch is not
    dest = assign(lengths, [[0, 1], [2, 3]])
    assert loads(lengths, dest, [0, 1]) == loads(lengths, dest, [2, 3]) == [51, 51]


def test_long_tailed_mix_is_evened_by_moving_few_sequences():
    rng = random.Random(0)
    lengths = [[max(1, int(math.exp(rng.gauss(5, 1)))) for _ in range(64)] for _ in range(4)]
    groups = [list(range(m, m + 16)) for m in range(0, 64, 16)]
    stay = [[r] * 64 for r in range(4)]
    dest = assign(lengths, groups)
    assert imbalance(lengths, stay, groups) > 1.2
    assert imbalance(lengths, dest, groups) < 1.01
    moved = sum(d != r for r, ds in enumerate(dest) for d in ds)
    assert 0 < moved < 64  # a quarter of the 256 sequences at most
    assert assign(lengths, groups) == dest  # deterministic: every rank computes the same


def test_imbalance_is_the_worst_mini_batch():
    lengths = [[3, 1], [1, 1]]
    assert imbalance(lengths, [[0, 0], [1, 1]], [[0], [1]]) == pytest.approx(1.5)
    assert imbalance([[0], [0]], [[0], [1]], [[0]]) == 1.0


# --- the exchange, at DP=3 -------------------------------------------------------------------
LENGTHS = [[5, 2, 7, 1], [3, 6, 2, 4], [1, 1, 8, 3]]
DEST = [[0, 2, 1, 0], [1, 1, 0, 2], [2, 0, 2, 1]]
WIDTH = 9


def source_batch(r: int) -> dict:
    """Rank ``r``'s padded batch: tokens ``100 r + 10 i + p`` up to each length, junk beyond."""
    tokens = torch.full((4, WIDTH), -7, dtype=torch.long)
    for i, n in enumerate(LENGTHS[r]):
        tokens[i, :n] = 100 * r + 10 * i + torch.arange(n)
    return {"tokens": tokens, "mask": (tokens >= 0).float() * 0.5,
            "topk": tokens.unsqueeze(-1).repeat(1, 1, 2),
            "reward": torch.tensor([r + i / 10 for i in range(4)]),
            "seq_pos": torch.arange(4 * r, 4 * r + 4)}


def exchange_worker():
    from megatron.core import parallel_state as ps

    from emapg_megatron.training.sequence_balance import exchange

    r = ps.get_data_parallel_rank()
    out = exchange(source_batch(r), LENGTHS, DEST, rank=r, group=ps.get_data_parallel_group(),
                   width_multiple=4)
    return {k: v.cpu() for k, v in out.items()}


@pytest.mark.slow
def test_exchange_delivers_each_sequence_to_its_rank_and_nothing_else():
    results = run_distributed(exchange_worker, 3)
    for rank, got in enumerate(results):
        rows = received(DEST, rank)
        longest = max(LENGTHS[r][i] for r, i in rows)
        assert got["tokens"].shape == (len(rows), -(-longest // 4) * 4)
        assert got["topk"].shape == (*got["tokens"].shape, 2)
        for k, (r, i) in enumerate(rows):
            n, src = LENGTHS[r][i], source_batch(r)
            assert torch.equal(got["tokens"][k, :n], src["tokens"][i, :n])
            assert torch.equal(got["topk"][k, :n], src["topk"][i, :n])
            assert torch.equal(got["mask"][k, :n], src["mask"][i, :n])
            assert not got["tokens"][k, n:].any() and not got["mask"][k, n:].any()  # no junk
            assert got["reward"][k] == src["reward"][i] and got["seq_pos"][k] == src["seq_pos"][i]
    assert sorted(int(p) for g in results for p in g["seq_pos"]) == list(range(12))


def test_bench_dp_balance_prints_one_even_line_per_dp_size(capsys):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    import bench_dp_balance

    bench_dp_balance.main(["--json", "--dp", "2,4", "--seqs-per-rank", "32"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["dp"] for r in rows] == [2, 4]
    for r in rows:
        assert r["imbalance_after"] < r["imbalance_before"] and r["imbalance_after"] < 1.05
        assert 0 < r["exchange_bytes"] < r["all_gather_padded_bytes"]
