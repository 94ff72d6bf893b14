"""``episodes.answer`` over a model-parallel group (TP=2): only its first rank steps the
environments, every rank holds that rank's outcome, and an environment that raises there stops
every rank instead of leaving the others in a collective."""

import pytest
from episode_workers import answer_two_turns_both_ways

from emapg_megatron.multiprocess import run_distributed


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(answer_two_turns_both_ways, 2, tp=2, timeout=120)


def test_every_rank_holds_the_first_ranks_answers_and_only_it_steps(ranks):
    first, other = (r["ok"] for r in ranks)
    assert first["ids"] == [[3, 4, 7, 0, 4, 4, 7, 0]] * 2  # rank 0's observation [7, 0]
    for key in ("ids", "mask", "logprobs", "done", "text"):
        assert other[key] == first[key], key
    assert first["mask"] == [[1, 1, 0, 0] * 2] * 2 and first["done"] == [True, True]
    assert first["text"] == ["turn0turn1"] * 2
    assert first["steps"] == [2, 2] and other["steps"] == [0, 0]


def test_an_environment_error_on_the_first_rank_stops_every_rank(ranks):
    first, other = (r["failed"] for r in ranks)
    assert first["error"] == "ValueError: retriever returned malformed JSON"
    assert other["error"].startswith("RuntimeError: an environment failed on rank 0")
    assert "malformed JSON" in other["error"]
