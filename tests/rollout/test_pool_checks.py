"""A partial-rollout pool read back from a checkpoint (``--partial-rollouts`` with ``--load``) is
checked against the pool's invariants before any rank continues it: one ``error:`` line naming
the group and sample (issue 40 items 7 and 5c). Before, a pool whose samples only had to build
loaded tokens and log-probs of different lengths, groups of the wrong size and token ids outside
the vocabulary (a traceback on a rank later, or silent training on them), and policy versions
from the future (10^6: never stale, defeating --max-staleness, a lag of -564,704 in the log)."""

import copy
from types import SimpleNamespace

import pytest

from emapg_megatron.errors import ConfigError
from emapg_megatron.rollout.collect import PartialRollouts, StepShape
from emapg_megatron.rollout.partial import InFlight

VOCAB, SEQ = 50, 16
ENGINE = SimpleNamespace(vocab_size=VOCAB, seq_length=SEQ, pad_id=0)


def collector() -> PartialRollouts:
    pool = InFlight(n=2, batch_size=1, pool_size=2, max_staleness=1)
    return PartialRollouts(ENGINE, None, None, None, StepShape(1, 2, 2), None, pool)


def saved_at_step_2() -> dict:
    """A real pool's checkpoint state after two steps: group 1 (position 1) carries unfinished
    samples with tokens of versions 0 and 1."""
    flight = InFlight(n=2, batch_size=1, pool_size=2, max_staleness=1)
    flight.begin_step(1)
    flight.record(flight.pending(lambda pos: [1]), [[5]] * 4, [[-1.0]] * 4, ["stop", "stop", "", ""], version=0)
    flight.take()
    flight.begin_step(2)
    flight.record(flight.pending(lambda pos: [1]), [[5, 6]] * 2 + [[9]] * 2, [[-1.0, -2.0]] * 2 + [[-3.0]] * 2,
                  ["", "", "stop", "stop"], version=1)
    flight.take()
    return {"iteration": 2, "in_flight": flight.state_dict()}


def test_a_real_pool_loads():
    c = collector()
    c.load_state_dict(saved_at_step_2())
    assert [g.pos for g in c.pool.groups] == [1] and c.pool.groups[0].samples[0].versions == [0, 1]


def first_sample(state):
    return state["in_flight"]["groups"][0]["samples"][0]


WHERE = "corrupt checkpoint: its partial-rollout pool: group 0 (data position 1), sample 0: "


@pytest.mark.parametrize("corrupt, message", [
    (lambda s: first_sample(s)["logprobs"].pop(), WHERE + "2 tokens, 1 log-probs and 2 versions (one of each per token)"),
    (lambda s: s["in_flight"]["groups"][0]["samples"].pop(),
     "corrupt checkpoint: its partial-rollout pool: group 0 (data position 1) holds 1 samples, not "
     "--num-samples-per-prompt 2"),
    (lambda s: first_sample(s)["tokens"].__setitem__(1, VOCAB), WHERE + f"token {VOCAB} is not an id of the vocabulary (0 to {VOCAB - 1})"),
    (lambda s: first_sample(s)["tokens"].__setitem__(0, -3), WHERE + "token -3 is not an id of the vocabulary"),
    (lambda s: first_sample(s)["tokens"].__setitem__(0, 2.0), WHERE + "token 2.0 is not an id of the vocabulary"),
    (lambda s: first_sample(s)["versions"].__setitem__(1, 10**6),
     WHERE + "its policy versions [0, 1000000] are not in order from 0 (its start step - 1) to 1 (the checkpoint's step - 1)"),
    (lambda s: first_sample(s)["versions"].__setitem__(0, -1), WHERE + "its policy versions [-1, 1] are not in order"),
    (lambda s: first_sample(s)["logprobs"].__setitem__(0, float("nan")), WHERE + "a log-prob is not a finite number <= 0"),
    (lambda s: first_sample(s)["logprobs"].__setitem__(0, 3.0), WHERE + "a log-prob is not a finite number <= 0"),
    (lambda s: first_sample(s).update(tokens=[1] * SEQ, logprobs=[-1.0] * SEQ, versions=[1] * SEQ),
     WHERE + f"{SEQ} tokens, more than --seq-length allows ({SEQ - 1})"),
    (lambda s: first_sample(s).update(start_step=9), WHERE + "its start step is 9, not an integer from 1 to 2"),
    (lambda s: first_sample(s).update(finish_reason="eos"), WHERE + "finish reason 'eos' is not one of"),
    (lambda s: first_sample(s).update(extra=1), WHERE[:-2] + " is {'start_step': 1"),
    (lambda s: s["in_flight"]["groups"][0].update(pos=7),
     "corrupt checkpoint: its partial-rollout pool: group 0: its data position is 7, not an integer from 0 to 2"),
    (lambda s: s["in_flight"]["groups"].extend(copy.deepcopy(s["in_flight"]["groups"])),
     "corrupt checkpoint: its partial-rollout pool: group 1: data position 1 is in flight twice"),
    (lambda s: s["in_flight"]["groups"].extend([s["in_flight"]["groups"][0]] * 2),
     "corrupt checkpoint: its partial-rollout pool: 3 groups, more than the pool's 2"),
    (lambda s: s["in_flight"].update(cursor="3"), "corrupt checkpoint: its partial-rollout pool: its cursor is '3'"),
    (lambda s: s.update(in_flight=[1, 2]), "corrupt checkpoint: its partial-rollout pool: it is [1, 2], not a cursor"),
])
def test_a_pool_that_breaks_an_invariant_is_one_line_naming_the_sample(corrupt, message):
    state = saved_at_step_2()
    corrupt(state)
    c = collector()
    with pytest.raises(ConfigError) as e:
        c.load_state_dict(state)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert c.pool.groups == []  # nothing of it was taken


def test_future_versions_would_have_defeated_max_staleness():
    """What the refused pool of item 5c would have done: never stale, a negative lag."""
    from emapg_megatron.rollout.partial import is_stale, lag_stats

    state = saved_at_step_2()
    first_sample(state)["versions"] = [10**6, 10**6]
    flight = InFlight(n=2, batch_size=1, pool_size=2, max_staleness=1)
    flight.load_state_dict(state["in_flight"])  # the unchecked load
    assert not is_stale(flight.groups[0].samples[0].versions, 50, 1)
    assert lag_stats(flight.groups, 2)[0] < 0  # the mean lag
    with pytest.raises(ValueError, match="policy versions"):
        flight.check_state(state["in_flight"], iteration=2, vocab_size=VOCAB, max_tokens=SEQ - 1)
