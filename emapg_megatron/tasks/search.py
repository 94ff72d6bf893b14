"""Search-agent task (Search-R1 protocol): multi-turn environment and QA reward.

Protocol. The model reasons and, to search, writes ``<search> query </search>``; the
environment appends ``\\n\\n<information>Doc 1(Title: ..) ..\\nDoc 2 ..</information>\\n\\n`` with
the top-k passages; the model finishes with ``<answer> ... </answer>``. The sampler stops each
turn at ``</search>`` or ``</answer>`` (:attr:`SearchTask.stop_strings`).

Rules of :meth:`SearchEnv.step` (one call per model turn):

* The turn is cut after the **earliest** closing tag (``</search>`` or ``</answer>``): anything
  the model wrote after it is dropped (the stop strings would have stopped it there anyway).
  So when a turn holds both a search and an answer, whichever closes first is the action.
* The action's content is the text between that closing tag and the nearest preceding opening
  tag of the same kind. The turn is **invalid** when there is no closing tag (unclosed or no
  tag, e.g. the turn hit its token budget), a closing tag has no opening tag, another opening
  tag is left open before the action (nested tags), or a search query is empty. An invalid turn
  gets Search-R1's "My previous action is invalid ..." observation and costs a turn.
* ``<answer>`` ends the episode (an empty answer is an answer, it just scores 0).
* At most ``max_turns`` model turns: after the last one the episode ends without an
  observation, whatever the model wrote (so at most ``max_turns - 1`` searches).
* Per-turn token budget ``max_turn_tokens``: pass it to the sampler as ``max_new_tokens``; when
  the env has a tokenizer it also cuts a longer turn to the budget. Observations are cut to
  ``max_obs_tokens`` inside the ``<information>`` tags (tags kept) when a tokenizer is given.
* Observation tokens are not the model's: :func:`~emapg_megatron.tasks.base.build_token_ids_and_mask`
  on ``env.segments`` gives loss_mask 0 exactly on them.

Reward: exact match (SQuAD normalisation: lower case, drop punctuation and articles, squeeze
white space) of the text inside the **last** ``<answer>...</answer>`` against any golden answer;
``metric="f1"`` gives the best token F1 instead. No answer scores 0.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import string
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence, Union

from .base import (
    ROLE_MODEL,
    ROLE_OBSERVATION,
    Environment,
    Segment,
    StepResult,
    Task,
    encode_text,
    prompt_value,
    render_prompt,
)
from .config import SEARCH_R1_INSTRUCTION, SearchConfig
from .retriever import Retriever, format_passages, make_retriever

logger = logging.getLogger(__name__)

__all__ = [
    "normalize_answer",
    "exact_match",
    "f1_score",
    "extract_final_answer",
    "reward",
    "parse_action",
    "Action",
    "SearchConfig",
    "SearchEnv",
    "SearchTask",
    "INVALID_ACTION_MESSAGE",
    "SEARCH_R1_INSTRUCTION",
]

# ----------------------------------------------------------------------------------------------
# answer normalisation and reward


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower, strip punctuation, drop a/an/the, squeeze white space."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golden_answers: Union[str, Sequence[str]]) -> bool:
    golds = [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)
    p = normalize_answer(prediction)
    return any(p == normalize_answer(g) for g in golds if g is not None)


def f1_score(prediction: str, golden_answers: Union[str, Sequence[str]]) -> float:
    golds = [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)
    p_toks = normalize_answer(prediction).split()
    best = 0.0
    for g in golds:
        if g is None:
            continue
        g_toks = normalize_answer(g).split()
        if not p_toks or not g_toks:
            best = max(best, float(p_toks == g_toks))
            continue
        common = collections.Counter(p_toks) & collections.Counter(g_toks)
        same = sum(common.values())
        if same == 0:
            continue
        prec, rec = same / len(p_toks), same / len(g_toks)
        best = max(best, 2 * prec * rec / (prec + rec))
    return best


def extract_final_answer(response: str) -> Optional[str]:
    """Text between the last ``</answer>`` and the nearest ``<answer>`` before it (stripped),
    or None. Linear time even for degenerate responses."""
    if not isinstance(response, str):
        return None
    close = response.rfind("</answer>")
    if close < 0:
        return None
    open_ = response.rfind("<answer>", 0, close)
    if open_ < 0:
        return None
    return response[open_ + len("<answer>") : close].strip()


def reward(response: str, golden_answers: list[str], *, metric: str = "em") -> float:
    """1.0 / 0.0 exact match (``metric="em"``) or best token F1 (``metric="f1"``) of the final
    ``<answer>`` against the golden answers. Never raises for any input."""
    try:
        ans = extract_final_answer(response)
        if ans is None:
            return 0.0
        if isinstance(golden_answers, str):
            golden_answers = [golden_answers]
        golds = [str(g) for g in (golden_answers or []) if g is not None]
        if not golds:
            return 0.0
        if metric == "f1":
            return float(f1_score(ans, golds))
        if metric != "em":
            raise ValueError(f"metric must be 'em' or 'f1', got {metric!r}")
        return 1.0 if exact_match(ans, golds) else 0.0
    except ValueError:
        raise
    except Exception:
        return 0.0


# ----------------------------------------------------------------------------------------------
# action parsing

INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer between "
    "<answer> and </answer>. Let me try again.\n"
)

_TAG_RE = re.compile(r"<(/?)(search|answer)>")


@dataclass
class Action:
    kind: str  # "search" | "answer" | "invalid"
    content: str = ""
    reason: str = ""
    end: int = -1  # index just after the closing tag in the text (-1: no cut)


def parse_action(text: str) -> Action:
    """Parse one model turn (see the module docstring for the rules)."""
    tags = list(_TAG_RE.finditer(text))
    close = next((m for m in tags if m.group(1) == "/"), None)
    if close is None:
        if any(m.group(1) == "" for m in tags):
            return Action("invalid", reason="unclosed tag")
        return Action("invalid", reason="no action tag")
    kind = close.group(2)
    before = [m for m in tags if m.start() < close.start()]
    opens = [m for m in before if m.group(1) == "" and m.group(2) == kind]
    if not opens:
        return Action("invalid", reason=f"</{kind}> without <{kind}>", end=close.end())
    op = opens[-1]
    if any(m.start() != op.start() for m in before):
        return Action("invalid", reason="nested or unclosed tags", end=close.end())
    content = text[op.end() : close.start()]
    if "<information>" in content or "</information>" in content:
        return Action("invalid", reason="nested tags", end=close.end())
    content = content.strip()
    if kind == "search" and not content:
        return Action("invalid", reason="empty query", end=close.end())
    return Action(kind, content=content, end=close.end())


# ----------------------------------------------------------------------------------------------
# environment


def _information(passages: Sequence[dict]) -> str:
    body = format_passages(passages) if passages else "No results found."
    return body


class SearchEnv(Environment):
    """One Search-R1 episode. ``segments`` holds the model and observation segments in order."""

    def __init__(self, retriever: Retriever, config: Optional[SearchConfig] = None,
                 tokenizer: Any = None) -> None:
        super().__init__()
        self.config = config or SearchConfig()
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.max_turns = int(self.config.max_turns)
        self.max_turn_tokens = self.config.max_turn_tokens
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.turn = 0
        self.answer: Optional[str] = None
        self.queries: list[str] = []
        self.invalid_turns = 0

    def counts(self) -> dict[str, float]:
        return {"search/turns": float(self.turn), "search/calls": float(len(self.queries)),
                "search/invalid_turns": float(self.invalid_turns),
                "search/answered": float(self.answer is not None)}

    # -- helpers -------------------------------------------------------------------------------
    def _apply_budget(self, text: str, ids: Optional[list[int]]) -> tuple[str, Optional[list[int]]]:
        """Cut a turn to ``max_turn_tokens`` (needs a tokenizer; a no-op without one, and for a
        budget of None or 0, which leave the turn to the sampler's ``max_new_tokens``)."""
        budget, tok = self.max_turn_tokens, self.tokenizer
        if tok is None or not budget:
            return text, ids
        if ids is None:
            enc = encode_text(tok, text)
            if len(enc) > budget:
                ids = enc[:budget]
                text = tok.decode(ids)
            return text, ids
        if len(ids) > budget:
            ids = ids[:budget]
            text = tok.decode(ids)
        return text, ids

    def _apply_cut(self, text: str, ids: Optional[list[int]], cut: int) -> tuple[str, Optional[list[int]]]:
        """Drop what follows the action's closing tag.

        With sampled ids and a tokenizer the cut lands on a token boundary: the shortest prefix
        of the sampled ids whose decoding starts with the kept text; the segment keeps exactly
        those ids (and their decoding), so the trained tokens are the sampled ones.
        """
        if cut < 0 or cut >= len(text):
            return text, ids
        target = text[:cut]
        if ids is None or self.tokenizer is None:
            return target, None
        for m in range(1, len(ids) + 1):
            dec = self.tokenizer.decode(ids[:m])
            if dec.startswith(target):
                return dec, ids[:m]
        return target, None

    def _observation(self, inner: str) -> str:
        obs = f"\n\n<information>{inner.strip()}</information>\n\n"
        budget = self.config.max_obs_tokens
        if self.tokenizer is None or budget is None:
            return obs
        ids = encode_text(self.tokenizer, obs)
        if len(ids) <= budget:
            return obs
        wrapper = len(encode_text(self.tokenizer, "\n\n<information></information>\n\n"))
        room = max(0, budget - wrapper - 2)
        inner_ids = encode_text(self.tokenizer, inner.strip())[:room]
        obs = f"\n\n<information>{self.tokenizer.decode(inner_ids)}</information>\n\n"
        # decoding/re-encoding can shift by a token or two; trim until it fits
        while room > 0 and len(encode_text(self.tokenizer, obs)) > budget:
            room -= 1
            obs = f"\n\n<information>{self.tokenizer.decode(inner_ids[:room])}</information>\n\n"
        return obs

    def _retrieve(self, query: str) -> list[dict]:
        try:
            return self.retriever.search(query, self.config.topk)
        except Exception as e:
            logger.warning("retrieval failed for %r: %s", query[:200], e)
            return []

    # -- the step --------------------------------------------------------------------------
    def step(self, model_text: str, token_ids: Optional[Sequence[int]] = None) -> StepResult:
        if self.done:
            raise RuntimeError("episode is over; create a new environment")
        if not isinstance(model_text, str):
            model_text = "" if model_text is None else str(model_text)
        self.turn += 1
        ids = [int(i) for i in token_ids] if token_ids is not None else None
        text, ids = self._apply_budget(model_text, ids)
        action = parse_action(text)
        text, ids = self._apply_cut(text, ids, action.end)
        self.segments.append(Segment(text, ROLE_MODEL, ids))
        info: dict[str, Any] = {"turn": self.turn, "action": action.kind}

        if action.kind == "answer":
            self.answer = action.content
            self.done = True
            info.update(answer=action.content, reason="answer")
            return StepResult(text, None, True, info)
        if self.turn >= self.max_turns:
            self.done = True
            info.update(reason="max_turns")
            if action.kind == "invalid":
                info["invalid_reason"] = action.reason
            return StepResult(text, None, True, info)
        if action.kind == "search":
            self.queries.append(action.content)
            passages = self._retrieve(action.content)
            obs = self._observation(_information(passages))
            info.update(query=action.content, passage_ids=[p.get("id") for p in passages])
        else:
            self.invalid_turns += 1
            obs = INVALID_ACTION_MESSAGE
            info.update(invalid_reason=action.reason)
        seg = Segment(obs, ROLE_OBSERVATION)
        if self.tokenizer is not None:
            seg.token_ids = encode_text(self.tokenizer, obs)
            info["observation_ids"] = seg.token_ids
        self.segments.append(seg)
        return StepResult(text, obs, False, info)


# ----------------------------------------------------------------------------------------------
# the task


class SearchTask(Task):
    """Multi-turn QA with a search engine (Search-R1)."""

    name = "search"
    multi_turn = True
    required_fields = ("question", "golden_answers")

    def __init__(self, config: Optional[SearchConfig] = None, *, retriever: Union[None, str, Retriever] = None,
                 **overrides: Any) -> None:
        cfg = config or SearchConfig()
        if overrides:
            cfg = replace(cfg, **overrides)
        if cfg.metric not in ("em", "f1"):
            raise ValueError(f"metric must be 'em' or 'f1', got {cfg.metric!r}")
        self.config = cfg
        self.default_fields = dict(cfg.fields)
        self._retriever_spec = retriever if retriever is not None else cfg.retriever
        self._retriever: Optional[Retriever] = None

    @property
    def retriever(self) -> Retriever:
        if self._retriever is None:
            if self._retriever_spec is None:
                raise ValueError("SearchTask needs a retriever: a corpus path, an http:// URL or an object")
            self._retriever = make_retriever(self._retriever_spec)
        return self._retriever

    @property
    def stop_strings(self) -> list[str]:
        return ["</search>", "</answer>"]

    @property
    def max_turn_tokens(self) -> Optional[int]:
        """The per-turn budget (``SearchEnv.max_turn_tokens``): a prompt must leave room for it."""
        return self.config.max_turn_tokens

    def normalize_row(self, row: dict) -> dict:
        ga = row.get("golden_answers")
        if isinstance(ga, str):
            ga = [ga]
        elif hasattr(ga, "tolist"):
            ga = ga.tolist()
        if not isinstance(ga, (list, tuple)):
            raise ValueError(f"golden_answers has type {type(ga).__name__}")
        ga = [str(g) for g in ga if g is not None and str(g).strip()]
        if not ga:
            raise ValueError("empty 'golden_answers'")
        row["golden_answers"] = ga
        row["question"] = prompt_value(row["question"], messages=False)
        if not row.get("data_source"):
            row["data_source"] = os.path.splitext(row.get("_file") or "search")[0]
        return row

    def prompt(self, row: Mapping[str, Any], tokenizer: Any = None) -> str:
        q = str(row["question"]).strip()
        if q and q[-1] not in "?.!":
            q += "?"
        user = self.config.instruction.format(question=q)
        return render_prompt(user, tokenizer, chat_template=self.config.chat_template,
                             system=self.config.system, plain_template=self.config.plain_template)

    def reward(self, response: str, row: Mapping[str, Any]) -> float:
        return reward(response, list(row["golden_answers"]), metric=self.config.metric)

    def correct(self, response: str, row: Mapping[str, Any]) -> bool:
        return reward(response, list(row["golden_answers"]), metric="em") >= 1.0

    def make_env(self, row: Mapping[str, Any], tokenizer: Any = None) -> SearchEnv:
        return SearchEnv(self.retriever, self.config, tokenizer)
