"""Math reasoning task: prompt, and the equivalence-checked reward.

Reward pipeline for one response:

1. **Extract** the final answer (:func:`~.math_answers.extract_answer`: the last complete
   ``\\boxed{...}``, else the last number only with ``last_number_fallback``; with
   ``think_end_tag``, only after that tag).
2. **Fast path** (:func:`~.math_answers.fast_check`, in process, no worker): plain strings and
   rationals.
3. Otherwise **math-verify** (``parse`` + ``verify``) decides, in a worker process of a
   :class:`~.math_verifier.MathVerifierPool` with a hard timeout. A check that exceeds it is
   killed, counts as wrong (0.0) and the worker is replaced; the run goes on.

``reward = 1.0 if correct else 0.0``, plus ``format_bonus`` when the response is well formatted
(a complete, non-empty ``\\boxed{}`` in the searched region). ``format_bonus`` is 0 by default.

The functions take the pool to check on (``pool=``); without one, a call that needs math-verify
starts a pool for itself and closes it after (start-up costs about a second: pass a pool, or use
:class:`MathTask`, which owns one, for more than a few calls).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

from .base import Task, _iter_rows, as_messages, render_messages, render_prompt
from .config import MathConfig
from .math_answers import (
    GroundTruth,
    extract_answer,
    fast_check,
    gold_answers,
    is_well_formatted,
    last_boxed,
    last_number,
)
from .math_verifier import (
    MathVerifierPool,
    default_num_workers,
    require_math_verify,
)

logger = logging.getLogger(__name__)

__all__ = [
    "reward",
    "rewards",
    "is_correct",
    "correct_many",
    "extract_answer",
    "last_boxed",
    "last_number",
    "fast_check",
    "MathVerifierPool",
    "MathConfig",
    "MathTask",
    "require_math_verify",
]

MAX_ANSWER_CHARS = 4000
"""A longer extracted answer scores 0 without a check."""


# --- the reward ----------------------------------------------------------------------------------
def _prepare(response: Any, ground_truth: GroundTruth, think_end_tag: Optional[str], last_number_fallback: bool):
    """(decided result or None, job or None)."""
    if not isinstance(response, str):
        return False, None
    golds = gold_answers(ground_truth)
    if not golds:
        return False, None
    ans = extract_answer(response, think_end_tag, last_number_fallback)
    if not ans or len(ans) > MAX_ANSWER_CHARS:
        return False, None
    fast = fast_check(golds, ans)
    if fast is not None:
        return fast, None
    return None, ([f"\\boxed{{{g}}}" for g in golds], f"\\boxed{{{ans}}}")


def correct_many(
    responses: Sequence[str],
    ground_truths: Sequence[GroundTruth],
    *,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
    last_number_fallback: bool = False,
) -> list[bool]:
    """Correctness of each response. The checks the fast path leaves to math-verify run in
    parallel over ``pool``; without one, over a pool started for them and closed after."""
    require_math_verify()
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses for {len(ground_truths)} ground truths")
    out: list[bool] = [False] * len(responses)
    todo: list[int] = []
    jobs: list[tuple[list[str], str]] = []
    for i, (resp, gt) in enumerate(zip(responses, ground_truths)):
        try:
            decided, job = _prepare(resp, gt, think_end_tag, last_number_fallback)
        except Exception:  # extraction must never take the run down
            decided, job = False, None
        if job is None:
            out[i] = bool(decided)
        else:
            todo.append(i)
            jobs.append(job)
    if jobs:
        for i, r in zip(todo, _verify(jobs, timeout, pool)):
            out[i] = r
    return out


def _verify(jobs: list, timeout: Optional[float], pool: Optional[MathVerifierPool]) -> list[bool]:
    """math-verify's verdict on each job, over ``pool`` or a pool of this call's own."""
    try:
        if pool is not None:
            return pool.verify_many(jobs, timeout=timeout)
        with MathVerifierPool(min(len(jobs), default_num_workers())) as own:
            return own.verify_many(jobs, timeout=timeout)
    except Exception:  # e.g. workers cannot start (fd/memory exhaustion): zero, don't crash
        logger.exception("math-verify pool failed; scoring %d pending checks as 0", len(jobs))
        return [False] * len(jobs)


def is_correct(
    response: str,
    ground_truth: GroundTruth,
    *,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
    last_number_fallback: bool = False,
) -> bool:
    return correct_many([response], [ground_truth], think_end_tag=think_end_tag, timeout=timeout, pool=pool,
                        last_number_fallback=last_number_fallback)[0]


def rewards(
    responses: Sequence[str],
    ground_truths: Sequence[GroundTruth],
    *,
    format_bonus: float = 0.0,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
    last_number_fallback: bool = False,
) -> list[float]:
    """Batch version of :func:`reward` (parallel over the worker pool)."""
    ok = correct_many(responses, ground_truths, think_end_tag=think_end_tag, timeout=timeout, pool=pool,
                      last_number_fallback=last_number_fallback)
    out = []
    for resp, c in zip(responses, ok):
        r = 1.0 if c else 0.0
        if format_bonus:
            try:
                if isinstance(resp, str) and is_well_formatted(resp, think_end_tag):
                    r += float(format_bonus)
            except Exception:
                pass
        out.append(r)
    return out


def reward(
    response: str,
    ground_truth: str,
    *,
    format_bonus: float = 0.0,
    think_end_tag: Optional[str] = None,
    timeout: Optional[float] = None,
    pool: Optional[MathVerifierPool] = None,
    last_number_fallback: bool = False,
) -> float:
    """1.0 if the final answer of ``response`` is equivalent to ``ground_truth`` else 0.0,
    plus ``format_bonus`` when the response has a complete non-empty ``\\boxed{}``.

    Never raises for any input and never blocks longer than ``timeout`` (default 5 s) on the
    equivalence check; raises ImportError only when math-verify is not installed.
    """
    return rewards(
        [response], [ground_truth], format_bonus=format_bonus, think_end_tag=think_end_tag,
        timeout=timeout, pool=pool, last_number_fallback=last_number_fallback,
    )[0]


# --- the task ----------------------------------------------------------------------------------
class MathTask(Task):
    """Single-turn math: prompt = question + instruction, reward = :func:`reward`."""

    name = "math"
    multi_turn = False
    required_fields = ("question", "ground_truth")
    #: verl's layout (DeepScaleR, GSM8K as verl and the paper's reference code ship them)
    alternative_fields = {"question": "prompt", "ground_truth": "reward_model.ground_truth",
                          "data_source": "data_source"}

    def __init__(self, config: Optional[MathConfig] = None, **overrides: Any) -> None:
        require_math_verify()
        cfg = config or MathConfig()
        if overrides:
            cfg = replace(cfg, **overrides)
        self.config = cfg
        self.default_fields = dict(cfg.fields)
        self._pool: Optional[MathVerifierPool] = None

    @property
    def pool(self) -> MathVerifierPool:
        """The task's own verifier pool, started on first use (again in a forked child)."""
        if self._pool is None or not self._pool.usable:
            self._pool = MathVerifierPool(num_workers=self.config.num_workers, timeout=self.config.timeout)
        return self._pool

    def normalize_row(self, row: dict) -> dict:
        gt = row.get("ground_truth")
        if isinstance(gt, (list, tuple)):
            gt = [str(g) for g in gt if g is not None]
            if not gt:
                raise ValueError("empty 'ground_truth'")
            row["ground_truth"] = gt[0] if len(gt) == 1 else json.dumps(gt)
        elif isinstance(gt, (int, float)):
            row["ground_truth"] = str(gt)
        elif not isinstance(gt, str):
            raise ValueError(f"ground_truth has type {type(gt).__name__}")
        row["question"] = as_messages(row["question"]) or str(row["question"])
        if not row.get("data_source"):
            row["data_source"] = os.path.splitext(row.get("_file") or "math")[0]
        return row

    @staticmethod
    def _gt(row: Mapping[str, Any]) -> GroundTruth:
        gt = row["ground_truth"]
        if isinstance(gt, str) and gt.startswith("[") and gt.endswith("]"):
            try:
                val = json.loads(gt)
                if isinstance(val, list):
                    return [str(v) for v in val]
            except json.JSONDecodeError:
                pass
        return gt

    def prompt(self, row: Mapping[str, Any], tokenizer: Any = None) -> str:
        messages = as_messages(row["question"])
        if messages is not None:  # verl-style chat prompt: it carries its own instruction
            return render_messages(messages, tokenizer, chat_template=self.config.chat_template)
        user = str(row["question"]).strip()
        if self.config.instruction:
            user = f"{user} {self.config.instruction}"
        return render_prompt(
            user, tokenizer, chat_template=self.config.chat_template, system=self.config.system,
            plain_template=self.config.plain_template,
        )

    def reward(self, response: str, row: Mapping[str, Any]) -> float:
        return self.rewards([response], [row])[0]

    def rewards(self, responses, rows) -> list[float]:
        rows = list(_iter_rows(rows))
        return rewards(
            responses, [self._gt(r) for r in rows], format_bonus=self.config.format_bonus,
            think_end_tag=self.config.think_end_tag, timeout=self.config.timeout, pool=self.pool,
            last_number_fallback=self.config.last_number_fallback,
        )

    def correct(self, response: str, row: Mapping[str, Any]) -> bool:
        return self.correct_many([response], [row])[0]

    def correct_many(self, responses, rows) -> list[bool]:
        rows = list(_iter_rows(rows))
        return correct_many(
            responses, [self._gt(r) for r in rows], think_end_tag=self.config.think_end_tag,
            timeout=self.config.timeout, pool=self.pool, last_number_fallback=self.config.last_number_fallback,
        )

    def close(self) -> None:
        """Stop the verifier's workers (a dropped task's pool stops them too)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
