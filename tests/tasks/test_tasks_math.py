"""Math task: answer extraction, the reward table, timeouts on adversarial inputs, the pool."""
import json
import os

import pytest

pytest.importorskip("math_verify")

from emapg_megatron.tasks import math as mt  # noqa: E402
from emapg_megatron.tasks import math_verifier as mv  # noqa: E402
from emapg_megatron.tasks.math import (  # noqa: E402
    MathTask,
    MathVerifierPool,
    extract_answer,
    fast_check,
    last_boxed,
    reward,
)

# (response, ground truth, expected reward)
CASES = [
    # equivalent forms
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\frac34}", "0.75", 1.0),
    ("\\boxed{-\\frac{2}{4}}", "-0.5", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{10\\text{ cm}}", "10", 1.0),
    ("\\boxed{150 \\text{ miles}}", "150", 1.0),
    ("\\boxed{\\$30}", "30", 1.0),
    ("\\boxed{720^\\circ}", "720", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{ \\frac { 1 } { 2 } }", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{\\sqrt{50}}", "5\\sqrt{2}", 1.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{x = 6}", "6", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{2{,}500}", "2500", 1.0),
    ("\\boxed{\\{3,2\\}}", "\\{2,3\\}", 1.0),
    ("\\boxed{(-1,4]}", "(-1, 4]", 1.0),
    ("$x = \\boxed{\\frac{1}{3}}$", "1/3", 1.0),
    ("\\fbox{7}", "7", 1.0),
    ("so it is \\boxed 5.", "5", 1.0),
    ("The solution is \\boxed{\\frac{1}{2}}", "$\\boxed{\\frac12}$", 1.0),
    # no boxed: no answer (the last number counts only with the opt-in fallback: FALLBACK_CASES)
    ("The answer is 42.", "42", 0.0),
    ("We get 3 apples, then 5 more, 8 in total", "8", 0.0),
    ("so the total is 1,250 dollars", "1250", 0.0),
    ("1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 41 42", "42", 0.0),  # a number-spraying policy
    # wrong answers
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("\\boxed{(-1,4)}", "(-1, 4]", 0.0),
    ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("\\boxed{7}", "8", 0.0),
    ("\\boxed{0.1667}", "\\frac{1}{6}", 0.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{-6}", "6", 0.0),
    ("The answer is 41.", "42", 0.0),
    ("\\boxed{\\text{B}}", "42", 0.0),
    # no answer
    ("I don't know.", "42", 0.0),
    ("", "42", 0.0),
    ("\\boxed{}", "42", 0.0),
    ("\\boxed{42}", "", 0.0),
    # several boxed answers: the last complete one counts
    ("\\boxed{41} no wait, \\boxed{42}", "42", 1.0),
    ("\\boxed{42} no wait, \\boxed{41}", "42", 0.0),
    ("\\boxed{41} hmm, actually \\boxed{42", "42", 0.0),
]


# --math-last-number-fallback (opt-in): without a box, the last number in the text counts
FALLBACK_CASES = [
    ("The answer is 42.", "42", 1.0),
    ("We get 3 apples, then 5 more, 8 in total", "8", 1.0),
    ("so the total is 1,250 dollars", "1250", 1.0),
    ("The answer is 41.", "42", 0.0),
    ("\\boxed{41} and then 42", "42", 0.0),  # a box wins over the fallback
]


@pytest.fixture(scope="module")
def pool():
    p = MathVerifierPool(num_workers=2, timeout=3.0)
    p.warmup()
    yield p
    p.close()


def test_case_table_is_large_enough():
    assert len(CASES) >= 40


def test_reward_table(pool):
    responses = [c[0] for c in CASES]
    gts = [c[1] for c in CASES]
    got = mt.rewards(responses, gts, pool=pool)
    wrong = [(c, g) for c, g in zip(CASES, got) if g != c[2]]
    assert not wrong, wrong


def test_the_last_number_fallback_is_opt_in(pool):
    responses, gts = [c[0] for c in FALLBACK_CASES], [c[1] for c in FALLBACK_CASES]
    got = mt.rewards(responses, gts, pool=pool, last_number_fallback=True)
    assert got == [c[2] for c in FALLBACK_CASES]
    task = MathTask(last_number_fallback=True)
    try:
        assert task.rewards(["The answer is 42."], [{"ground_truth": "42"}]) == [1.0]
    finally:
        task.close()


def test_public_reward_api_default_pool():
    # the documented entry point, with a pool of the call's own
    assert reward("so \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0
    assert reward("so \\boxed{3}", "4") == 0.0
    assert isinstance(reward("x", "1"), float)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("a \\boxed{1} b \\boxed{2}", "2"),
        ("\\boxed{5} then \\boxed{6", "5"),
        ("\\boxed{{{x}}}", "{{x}}"),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_extract_answer_fallbacks():
    assert extract_answer("the value is -3.5 and then 7") is None  # no box: no answer by default
    assert extract_answer("the value is -3.5 and then 7", last_number_fallback=True) == "7"
    assert extract_answer("x = -3.5", last_number_fallback=True) == "-3.5"
    assert extract_answer("ratio 3/4", last_number_fallback=True) == "3/4"
    assert extract_answer("nothing here", last_number_fallback=True) is None
    # think tag: only the text after the last </think> is graded
    assert extract_answer("<think>\\boxed{3}</think> so \\boxed{4}", "</think>") == "4"
    assert extract_answer("<think>\\boxed{3} ...", "</think>") is None


def test_think_end_tag(pool):
    r = "<think>maybe \\boxed{3}</think> The answer is \\boxed{4}."
    assert mt.reward(r, "4", think_end_tag="</think>", pool=pool) == 1.0
    assert mt.reward(r, "3", think_end_tag="</think>", pool=pool) == 0.0
    assert mt.reward("<think>\\boxed{4}", "4", think_end_tag="</think>", pool=pool) == 0.0


def test_format_bonus(pool):
    assert mt.reward("\\boxed{3}", "3", format_bonus=0.1, pool=pool) == pytest.approx(1.1)
    assert mt.reward("\\boxed{4}", "3", format_bonus=0.1, pool=pool) == pytest.approx(0.1)
    assert mt.reward("the answer is 3", "3", format_bonus=0.1, pool=pool) == 0.0  # no box, no answer
    assert mt.reward("the answer is 3", "3", format_bonus=0.1, pool=pool,
                     last_number_fallback=True) == pytest.approx(1.0)  # correct, and no bonus
    assert mt.reward("\\boxed{}", "3", format_bonus=0.1, pool=pool) == 0.0


def test_fast_path_agrees_with_verifier(pool):
    pairs = [("0.5", "\\frac{1}{2}"), ("3", "3.0"), ("-\\frac{2}{4}", "-0.5"), ("7", "8"),
             ("\\frac12", "1/2"), ("12", "12"), ("\\left(1,2\\right)", "(1,2)")]
    for pred, gold in pairs:
        fast = fast_check([gold], pred)
        assert fast is not None
        slow = pool.verify_many([([f"\\boxed{{{gold}}}"], f"\\boxed{{{pred}}}")])[0]
        assert fast == slow, (pred, gold)
    assert fast_check(["\\pi"], "3.14") is None  # undecided: goes to math-verify


ADVERSARIAL = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{10^{10^{10}}}",
    "\\boxed{(10^{1000000})!}",
    "\\boxed{9^{9^{9^{9}}}-9^{9^{9^{9}}}}",
]


@pytest.mark.parametrize("response", ADVERSARIAL)
def test_adversarial_inputs_score_zero_under_the_timeout(pool, response):
    before = pool.stats.timeouts + pool.stats.soft_timeouts
    r = mt.reward(response, "1", pool=pool, timeout=1.0)
    assert r == 0.0
    # the check ended by itself (wrong) or by the timeout (wrong too): either way it counted
    assert pool.stats.timeouts + pool.stats.soft_timeouts >= before


def test_hard_timeout_kills_and_restarts_worker():
    # soft_fraction=0 disables the in-worker alarm, so only the hard kill can end the check
    with MathVerifierPool(num_workers=1, timeout=1.0, soft_fraction=0.0) as p:
        p.warmup()
        out = p.verify_many([(["\\boxed{1}"], "\\boxed{9^{9^{9^{9}}}}")])
        assert out == [False]
        assert p.stats.timeouts == 1 and p.stats.restarts == 1
        # the replacement worker serves the next check
        assert p.verify_many([(["\\boxed{\\frac{1}{2}}"], "\\boxed{\\sqrt{1/4}}")]) == [True]


def test_batch_mixes_hung_and_normal_checks(pool):
    jobs = [(["\\boxed{x+1}"], "\\boxed{1+x}"), (["\\boxed{1}"], ADVERSARIAL[0]),
            (["\\boxed{\\sqrt{2}}"], "\\boxed{2^{1/2}}"), (["\\boxed{2}"], "\\boxed{3}")]
    assert pool.verify_many(jobs, timeout=1.0) == [True, False, True, False]


@pytest.mark.parametrize(
    "response, gt",
    [
        (None, "1"),
        (123, "1"),
        ("\\boxed{" + "{" * 3000 + "}" * 3000 + "}", "1"),
        ("\\boxed{" + "1+" * 5000 + "1}", "5001"),
        ("\\boxed{\\frac{1}{0}}", "1"),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("\\boxed{\\}", "1"),
        ("\\boxed{\u00e9\u00e8\\x\\y\\z}", "1"),
        ("\\boxed{1}", None),
        ("\\boxed{1}", ["2", "1"]),
    ],
)
def test_never_raises(pool, response, gt):
    r = mt.reward(response, gt, pool=pool, timeout=2.0)
    assert r in (0.0, 1.0)


def test_list_ground_truth_any_match(pool):
    assert mt.reward("\\boxed{1}", ["2", "1"], pool=pool) == 1.0


def test_fast_path_answers_without_a_worker(pool):
    """A plain numeric answer is decided in-process: no worker round trip (timing: tools/bench_math_reward.py)."""
    calls = []
    real = pool.verify_many
    pool.verify_many = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        assert mt.reward("so \\boxed{0.5}", "0.5", pool=pool) == 1.0
    finally:
        pool.verify_many = real
    assert calls == []


def test_math_task_end_to_end(tmp_path):
    rows = [{"problem": "1+1?", "answer": 2, "data_source": "toy"},
            {"problem": "half?", "answer": "\\frac{1}{2}"},
            {"problem": "no answer"}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = MathTask(timeout=3.0, num_workers=1, format_bonus=0.5, last_number_fallback=True)
    try:
        ds = task.load(str(path))
        assert len(ds) == 2 and ds[0]["ground_truth"] == "2"
        assert ds[1]["data_source"] == "m"  # defaults to the file stem
        prompts = task.prompts(ds)
        assert prompts[0].startswith("1+1? Let's think step by step") and "\\boxed{}" in prompts[0]
        rs = task.rewards(["\\boxed{2}", "it is 0.5"], ds)
        assert rs == [1.5, 1.0]
        assert task.correct_many(["\\boxed{2}", "\\boxed{1}"], ds) == [True, False]
        assert task.make_env(ds[0]) is None and not task.multi_turn
    finally:
        task.close()


def test_worker_does_not_import_trainer_main():
    # the worker runs by file path with -P: no package import, no __main__ re-execution
    src = open(mv._WORKER_PATH).read()
    assert "emapg_megatron" not in src.split('"""', 2)[2]
    assert os.path.exists(mv._WORKER_PATH)


@pytest.mark.parametrize(
    "response",
    ["\\boxed{" * 20000, "1" * 200000, ("12 " * 50000) + "\\boxed{3}", "{" * 100000 + "}" * 100000],
)
def test_degenerate_long_responses_finish_without_a_timeout(pool, response):
    """A quadratic scan of these 10^5-character responses would hit the 20 s limit; linear is ms."""
    before = (pool.stats.timeouts, pool.stats.soft_timeouts)
    mt.reward(response, "3", pool=pool, timeout=20.0)
    assert (pool.stats.timeouts, pool.stats.soft_timeouts) == before


def test_missing_math_verify_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    mt.require_math_verify.cache_clear()  # forget that it was found
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ImportError, match=r"emapg-megatron\[math\]"):
        mt.reward("\\boxed{1}", "1")
    with pytest.raises(ImportError, match=r"\[math\]"):
        MathTask()


def test_worker_start_failure_is_reported_not_fatal(tmp_path, monkeypatch):
    bad = tmp_path / "broken_worker.py"
    bad.write_text("import sys\nsys.stderr.write('boom: cannot start\\n')\nsys.exit(3)\n")
    monkeypatch.setattr(mv, "_WORKER_PATH", str(bad))
    with MathVerifierPool(num_workers=1, timeout=1.0) as p:
        with pytest.raises(RuntimeError, match="boom: cannot start"):
            p.verify_many([(["\\boxed{1}"], "\\boxed{x}")])
        # through the reward API the failure costs zero rewards, not the run
        assert mt.rewards(["\\boxed{x}"], ["1"], pool=p) == [0.0]


def test_thread_safe_shared_pool(pool):
    from concurrent.futures import ThreadPoolExecutor

    cases = [("\\boxed{x+1}", "1+x", 1.0), ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0), ("\\boxed{3}", "4", 0.0)] * 4
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda c: mt.reward(c[0], c[1], pool=pool), cases))
    assert got == [c[2] for c in cases]


def test_pool_created_in_a_thread():
    from concurrent.futures import ThreadPoolExecutor

    def work():
        with MathVerifierPool(num_workers=1, timeout=3.0) as p:
            return mt.reward("\\boxed{\\sqrt{4}}", "2", pool=p)

    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(work).result() == 1.0


def test_a_dropped_task_or_pool_leaves_no_worker_behind():
    """A pool belongs to whoever made it: dropping the task (or a pool) stops its workers."""
    import gc

    task = MathTask(timeout=3.0, num_workers=1)
    task.pool.warmup()
    task_workers = [w.proc for w in task.pool._workers]
    pool = MathVerifierPool(num_workers=1, timeout=3.0)
    pool_workers = [w.proc for w in pool._workers]
    del task, pool
    gc.collect()
    assert all(p.poll() is not None for p in task_workers + pool_workers)
