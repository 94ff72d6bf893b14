"""The partial-rollout pool (rollout/partial.py): staleness drops are exact, groups stay whole,
the stop predicate counts complete groups, and the state round-trips (host maths, no model)."""

from emapg_megatron.rollout.partial import InFlight, Sample, is_stale, lag_stats


def _flight(batch=2, pool=3, n=2, k=1):
    return InFlight(n=n, batch_size=batch, pool_size=pool, max_staleness=k)


def test_is_stale_is_exact_at_the_bound():
    assert not is_stale([], 10, 0)
    assert not is_stale([4, 5], 5, 1)  # lag 1 <= 1
    assert is_stale([3, 5], 5, 1)  # the oldest token lags 2
    assert not is_stale([5], 5, 0) and is_stale([4], 5, 0)


def test_the_pool_fills_in_data_order_and_keys_samples_by_position():
    flight = _flight()
    assert flight.begin_step(1) == 0
    pending = flight.pending(lambda pos: [pos + 1])
    assert [g.pos for g in flight.groups] == [0, 1, 2] and flight.cursor == 3
    assert [(p.row, p.rng_step, p.group, p.prompt) for p in pending][:3] == [(0, 1, 0, [1]), (1, 1, 0, [1]),
                                                                            (2, 1, 1, [2])]


def test_enough_counts_whole_groups_and_take_keeps_pool_order():
    flight = _flight()
    flight.begin_step(1)
    pending = flight.pending(lambda pos: [1])
    enough = flight.enough(pending)
    assert not enough([True, False, True, True, False, False])  # only group 1 complete
    assert enough([True, True, False, False, True, True])  # groups 0 and 2
    why = ["stop", "stop", "", "", "length", "stop"]
    assert flight.record(pending, [[7, 7]] * 6, [[-1.0, -1.0]] * 6, why, version=0) == 12
    assert [g.pos for g in flight.take()] == [0, 2]
    assert [g.pos for g in flight.groups] == [1] and flight.carried() == 2


def test_staleness_drops_exactly_the_samples_past_the_bound_and_they_restart():
    flight = _flight(batch=1, pool=2, k=1)
    flight.begin_step(1)
    pending = flight.pending(lambda pos: [1])
    # step 1 (version 0): group 0 finishes, group 1's samples stay unfinished with tokens
    flight.record(pending, [[5]] * 4, [[-1.0]] * 4, ["stop", "stop", "", ""], version=0)
    flight.take()
    assert flight.begin_step(2) == 0  # lag 1 at step 2: kept
    pending = flight.pending(lambda pos: [1])
    assert [p.tokens for p in pending][:2] == [[5], [5]]
    flight.record(pending, [[5, 6]] * 2 + [[9]] * 2, [[-1.0, -2.0]] * 2 + [[-3.0]] * 2,
                  ["", "", "stop", "stop"], version=1)
    flight.take()  # group 2 (fresh at step 2) trained; group 1 still unfinished, a token of version 0
    assert flight.groups[0].samples[0].versions == [0, 1]
    assert flight.begin_step(3) == 2  # lag 2 > 1: both samples of group 1 dropped
    s = flight.groups[0].samples[0]
    assert (s.tokens, s.versions, s.start_step, s.finish_reason) == ([], [], 3, "")
    assert len(flight.groups[0].samples) == 2  # the group stays whole


def test_lag_stats_over_the_trained_tokens():
    flight = _flight(batch=1, pool=1, n=2)
    flight.begin_step(1)
    flight.groups[0].samples = [Sample(1, [1, 2], [0.0, 0.0], [3, 4], "stop"), Sample(1, [1], [0.0], [4], "stop")]
    assert lag_stats(flight.groups, 4) == (1 / 3, 1)
    assert lag_stats([], 4) == (0.0, 0)


def test_state_round_trips():
    flight = _flight()
    flight.begin_step(1)
    pending = flight.pending(lambda pos: [1])
    flight.record(pending, [[3]] * 6, [[-0.25]] * 6, ["stop", "", "stop", "stop", "", ""], version=0)
    again = _flight()
    again.load_state_dict(flight.state_dict())
    assert again.state_dict() == flight.state_dict() and again.cursor == 3


def test_a_checkpoint_pool_is_checked_and_an_old_checkpoint_starts_at_its_data_position():
    import pytest

    from emapg_megatron.errors import ConfigError
    from emapg_megatron.rollout.collect import PartialRollouts, StepShape

    collector = PartialRollouts(None, None, None, None, StepShape(2, 2, 4), None, _flight(batch=2))
    with pytest.raises(ConfigError, match="corrupt checkpoint: its partial-rollout pool"):
        collector.load_state_dict({"in_flight": {"cursor": 1, "groups": [{"pos": 0, "samples": [{"x": 1}]}]}})
    collector.load_state_dict({"iteration": 3})  # saved without partial rollouts: step 4 takes rows 8, 9
    assert (collector.pool.cursor, collector.pool.groups) == (8, [])
