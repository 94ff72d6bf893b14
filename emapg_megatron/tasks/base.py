"""The task interface used by the trainer and by ``evaluate``.

A task owns everything about one RL problem family that is *not* the model: how a data row
becomes a prompt string, how a response is scored, and, for multi-turn tasks, the environment
that answers the model between turns. It knows nothing about Megatron or torch.

Tokenizers are duck-typed (:class:`TokenizerLike`): anything with ``encode(str) -> list[int]``
and ``decode(list[int]) -> str``; ``apply_chat_template`` is used when present and the tokenizer
actually carries a template. Hugging Face tokenizers fit, and so does a ten-line toy tokenizer.

How a trainer uses a task (single turn)::

    prompts = task.prompts(rows, tokenizer)            # list[str], one per row
    responses = engine.generate(prompts, stop=task.stop_strings)
    rewards = task.rewards(responses, rows)            # list[float]
    # loss mask: 1 on every response token, prompt tokens are not part of the response

Multi turn (``task.multi_turn`` is True)::

    env = task.make_env(row)
    text = prompt
    for _ in range(env.max_turns):
        out = engine.generate([text], stop=task.stop_strings,
                              max_new_tokens=env.max_turn_tokens)[0]
        res = env.step(out)                  # the text the model produced in *this* turn
        text += res.model_text               # the env may cut text after the closing tag
        if res.done:
            break
        text += res.observation              # observation tokens get loss_mask 0
    ids, mask = build_token_ids_and_mask(env.segments, tokenizer)
    reward = task.reward(env.response_text, row)
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import (
    Any,
    Iterable,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    runtime_checkable,
)

from ..errors import shown
from .data import MissingColumnError, load_rows

__all__ = [
    "TokenizerLike",
    "Segment",
    "StepResult",
    "Environment",
    "Task",
    "encode_text",
    "encode_many",
    "build_token_ids_and_mask",
    "render_prompt",
    "ROLE_PROMPT",
    "ROLE_MODEL",
    "ROLE_OBSERVATION",
]

ROLE_PROMPT = "prompt"
ROLE_MODEL = "model"
ROLE_OBSERVATION = "observation"
_ROLES = (ROLE_PROMPT, ROLE_MODEL, ROLE_OBSERVATION)


@runtime_checkable
class TokenizerLike(Protocol):
    """The minimum a task needs from a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Encode ``text`` without adding special tokens (BOS/EOS).

    Hugging Face tokenizers add BOS by default, which would corrupt a trajectory built from
    segments, so ``add_special_tokens=False`` is passed when the tokenizer accepts it.
    """
    if text == "":
        return []
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return [int(i) for i in ids]


def encode_many(tokenizer: Any, texts: Sequence[str], *, batch_size: int = 1024) -> list[list[int]]:
    """``[encode_text(tokenizer, t) for t in texts]``, batched when the tokenizer allows it.

    A Hugging Face *fast* tokenizer encodes a list in one call (``tokenizer(batch,
    add_special_tokens=False)``: the same ids as ``encode(text, add_special_tokens=False)``);
    any other tokenizer is called once per text through :func:`encode_text`. Batches run with
    the ``tokenizers`` thread pool off unless ``TOKENIZERS_PARALLELISM`` is set, so that a later
    fork (worker pools, ``subprocess``) prints no "process just got forked" warning.
    """
    texts = list(texts)
    if not (getattr(tokenizer, "is_fast", False) is True and callable(tokenizer)):
        return [encode_text(tokenizer, t) for t in texts]
    out: list[list[int]] = []
    unset = "TOKENIZERS_PARALLELISM" not in os.environ
    if unset:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            ids = tokenizer(chunk, add_special_tokens=False, return_attention_mask=False,
                            return_token_type_ids=False)["input_ids"]
            out.extend([int(i) for i in row] if text else [] for row, text in zip(ids, chunk))
    finally:
        if unset:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
    return out


def _has_chat_template(tokenizer: Any) -> bool:
    if tokenizer is None or not callable(getattr(tokenizer, "apply_chat_template", None)):
        return False
    # HF tokenizers always have the method but raise when no template is configured.
    if hasattr(tokenizer, "chat_template"):
        return bool(getattr(tokenizer, "chat_template"))
    return True


def as_messages(value: Any) -> Optional[list[dict]]:
    """``value`` as chat messages when it is a list (verl's ``prompt`` column: ``{"role",
    "content"}`` objects; a content may also be given as a list of text parts, ``[{"type":
    "text", "text": ...}]``, whose texts are joined by newlines), None when it is not a list.
    A list that is not such messages is a ValueError naming the message and what is wrong."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not hasattr(value, "__iter__"):
        return None
    messages = [_message(m, i) for i, m in enumerate(value)]
    if not any(m["content"].strip() for m in messages):
        raise ValueError("its chat messages hold no text")
    return messages


def _message(message: Any, i: int) -> dict:
    if not isinstance(message, Mapping):
        raise ValueError(f"message {i} is {shown(message)}, not a {{role, content}} object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"message {i} has no role (got {shown(role)})")
    return {"role": role, "content": _content_text(message.get("content"), i)}


def _content_text(content: Any, i: int) -> str:
    """A message's content as text: a string, or the texts of a list of text parts."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) and content else None
    if parts and all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                     for p in parts):
        return "\n".join(p["text"] for p in parts)
    raise ValueError(f"message {i}: its content is {shown(content)}, not text or a list of "
                     '{"type": "text", "text": ...} parts')


def prompt_value(value: Any, *, messages: bool = True) -> Any:
    """A prompt column's value as a task uses it: text (a number becomes its text) or, with
    ``messages``, chat messages (:func:`as_messages`). ValueError for anything else: binary data,
    an object, a list that is not chat messages (never its Python ``repr`` as a prompt)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        raise ValueError("the prompt is binary data, not text")
    chat = as_messages(value)
    if chat is None:
        raise ValueError(f"the prompt is a {type(value).__name__}, not text or chat messages")
    if not messages:
        raise ValueError("the prompt is chat messages: this task takes its question as text")
    return chat


def render_messages(messages: list[dict], tokenizer: Any = None, *, chat_template: str = "auto") -> str:
    """Chat messages as the prompt string: through the tokenizer's chat template (``auto``: when
    it has one; ``always``: required), else their contents joined by blank lines (documented in
    docs/tasks.md: a base model without a template sees the text only)."""
    use_chat = chat_template == "always" or (chat_template == "auto" and _has_chat_template(tokenizer))
    if not use_chat:
        return "\n\n".join(m["content"] for m in messages)
    if not _has_chat_template(tokenizer):
        raise ValueError("chat_template='always' but the tokenizer has no chat template")
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return out if isinstance(out, str) else tokenizer.decode(list(out))


def render_prompt(
    user_text: str,
    tokenizer: Any = None,
    *,
    chat_template: str = "auto",
    system: Optional[str] = None,
    plain_template: str = "{content}",
) -> str:
    """Turn the user message into the prompt string given to the sampler.

    ``chat_template``: ``"auto"`` uses the tokenizer's chat template when it has one,
    ``"always"`` requires one (ValueError otherwise), ``"never"`` uses ``plain_template``
    (a ``str.format`` template with ``{content}``; ``system`` is prepended with a blank line).
    """
    if chat_template not in ("auto", "always", "never"):
        raise ValueError(f"chat_template must be auto|always|never, got {chat_template!r}")
    use_chat = chat_template == "always" or (chat_template == "auto" and _has_chat_template(tokenizer))
    if use_chat:
        if not _has_chat_template(tokenizer):
            raise ValueError("chat_template='always' but the tokenizer has no chat template")
        messages = []
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": user_text})
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(out, str):  # some implementations ignore tokenize=False
            out = tokenizer.decode(list(out))
        return out
    text = plain_template.format(content=user_text)
    if system:
        text = system + "\n\n" + text
    return text


@dataclass
class Segment:
    """One contiguous piece of a trajectory.

    ``role`` is ``"model"`` (sampled by the policy: loss_mask 1), ``"observation"``
    (written by the environment: loss_mask 0) or ``"prompt"`` (loss_mask 0).
    ``token_ids``, when given, are used as they are instead of re-encoding ``text``: pass the
    ids the sampler actually produced so that the trained tokens are exactly the sampled ones.
    """

    text: str
    role: str
    token_ids: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if self.role not in _ROLES:
            raise ValueError(f"segment role must be one of {_ROLES}, got {self.role!r}")


def build_token_ids_and_mask(
    segments: Iterable[Segment], tokenizer: Any
) -> tuple[list[int], list[int]]:
    """Token ids of a trajectory and its loss mask (1 = model token, 0 = anything else).

    Each segment is encoded on its own (no special tokens) and the pieces are concatenated,
    which is exactly how a trainer that appends observation tokens after sampled tokens builds
    the sequence the policy conditions on. ``len(ids) == len(mask)`` always holds, and the
    mask is 0 on exactly the tokens that came from prompt/observation segments.
    """
    ids: list[int] = []
    mask: list[int] = []
    for seg in segments:
        seg_ids = list(seg.token_ids) if seg.token_ids is not None else encode_text(tokenizer, seg.text)
        ids.extend(int(i) for i in seg_ids)
        mask.extend([1 if seg.role == ROLE_MODEL else 0] * len(seg_ids))
    return ids, mask


@dataclass
class StepResult:
    """What :meth:`Environment.step` returns.

    ``model_text``: the model's turn as the environment accepted it (cut after the first
    closing action tag; equal to the input when nothing was cut). ``observation``: text to
    append after it with loss_mask 0, or ``None`` when ``done``. ``info``: diagnostics
    (``action``, ``query``, ``answer``, ``reason``, ``turn``, ...).
    """

    model_text: str
    observation: Optional[str]
    done: bool
    info: dict = field(default_factory=dict)


class Environment(abc.ABC):
    """A multi-turn environment for one episode (one prompt, one sample)."""

    #: maximum number of model turns in one episode
    max_turns: int = 1
    #: per-turn token budget for the sampler (``max_new_tokens`` of each turn); None = no limit
    max_turn_tokens: Optional[int] = None

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.done: bool = False

    @abc.abstractmethod
    def step(self, model_text: str, token_ids: Optional[Sequence[int]] = None) -> StepResult:
        """Consume the text the model produced in this turn; return the observation or done."""

    @property
    def response_text(self) -> str:
        """All model and observation text after the prompt, in order."""
        return "".join(s.text for s in self.segments if s.role != ROLE_PROMPT)

    def counts(self) -> dict[str, float]:
        """What the trainer sums over a step's episodes and logs per episode (turns, tool calls)."""
        return {}


class Task(abc.ABC):
    """A family of RL problems: prompts, rewards, optional environment, data fields."""

    #: registry name (``math``, ``search``, ...)
    name: str = ""
    #: whether :meth:`make_env` returns an environment
    multi_turn: bool = False
    #: canonical field names every row must carry after loading
    required_fields: tuple[str, ...] = ()
    #: default mapping canonical field -> column in the files (dotted paths reach nested fields)
    default_fields: Mapping[str, str] = {}
    #: multi-turn tasks: token budget of one model turn (``Environment.max_turn_tokens``); the
    #: sampler falls back to ``max_new_tokens`` when it is None. A prompt must leave room for one
    #: full first turn within the sequence length.
    max_turn_tokens: Optional[int] = None

    #: another layout of the same fields, used when a file has none of the default columns it
    #: needs and no ``fields`` were given (verl's: ``prompt`` messages, ``reward_model.ground_truth``)
    alternative_fields: Optional[Mapping[str, str]] = None

    # ----- data -----------------------------------------------------------------------------
    def load(self, path: str, *, fields: Optional[Mapping[str, str]] = None,
             on_bad_row: str = "skip", limit: Optional[int] = None, **load_kwargs: Any):
        """Load a local parquet/jsonl file into a ``datasets.Dataset`` with canonical fields.

        ``load_kwargs`` go to :func:`.data.load_rows` (``return_report``, ``map_hint``, ``warn``).
        """
        try:
            return self._load(path, {**self.default_fields, **(fields or {})}, on_bad_row, limit, load_kwargs)
        except MissingColumnError as e:
            alternative = self.alternative_fields
            if fields or alternative is None or not self._has_columns(alternative, e.found):
                raise
            return self._load(path, dict(alternative), on_bad_row, limit, load_kwargs)

    def _has_columns(self, mapping: Mapping[str, str], found) -> bool:
        """Whether a file with columns ``found`` has the top-level column of every required field."""
        return {mapping[f].split(".")[0] for f in self.required_fields} <= set(found)

    def _load(self, path: str, mapping: dict, on_bad_row: str, limit, load_kwargs: dict):
        return load_rows(
            path,
            fields=mapping,
            required=self.required_fields,
            on_bad_row=on_bad_row,
            normalize=self.normalize_row,
            limit=limit,
            **load_kwargs,
        )

    def normalize_row(self, row: dict) -> dict:
        """Coerce the canonical fields of one row (raise ValueError for a bad row)."""
        return row

    def builtin_rows(self) -> Optional[list]:
        """Rows the task carries itself (no data file), or None when it reads ``--data-path``."""
        return None

    # ----- prompts ----------------------------------------------------------------------------
    @abc.abstractmethod
    def prompt(self, row: Mapping[str, Any], tokenizer: Any = None) -> str:
        """The prompt string for one row."""

    def prompts(self, rows: Iterable[Mapping[str, Any]], tokenizer: Any = None) -> list[str]:
        """Prompt strings for a batch of rows (a list of dicts or a ``datasets`` batch)."""
        return [self.prompt(r, tokenizer) for r in _iter_rows(rows)]

    #: strings at which the sampler should stop a turn (kept in the output)
    @property
    def stop_strings(self) -> list[str]:
        return []

    # ----- rewards ----------------------------------------------------------------------------
    @abc.abstractmethod
    def reward(self, response: str, row: Mapping[str, Any]) -> float:
        """Training reward of one response (correctness plus any shaping)."""

    @abc.abstractmethod
    def correct(self, response: str, row: Mapping[str, Any]) -> bool:
        """Whether the response is correct (no shaping); used by evaluation."""

    def rewards(self, responses: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> list[float]:
        rows = list(_iter_rows(rows))
        if len(rows) != len(responses):
            raise ValueError(f"{len(responses)} responses for {len(rows)} rows")
        return [self.reward(resp, row) for resp, row in zip(responses, rows)]

    def correct_many(self, responses: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> list[bool]:
        rows = list(_iter_rows(rows))
        if len(rows) != len(responses):
            raise ValueError(f"{len(responses)} responses for {len(rows)} rows")
        return [self.correct(resp, row) for resp, row in zip(responses, rows)]

    # ----- environment ------------------------------------------------------------------------
    def make_env(self, row: Mapping[str, Any], tokenizer: Any = None) -> Optional[Environment]:
        """A fresh environment for one episode, or None for single-turn tasks."""
        return None

    def close(self) -> None:
        """Release worker processes / connections held by the task."""


def _iter_rows(rows: Any) -> Iterable[Mapping[str, Any]]:
    """Accept a list of dicts, a ``datasets.Dataset`` or a column batch (dict of lists)."""
    if isinstance(rows, Mapping):
        cols = list(rows.values())
        lengths = {len(c) for c in cols if isinstance(c, (list, tuple))}
        if len(lengths) != 1 or not all(isinstance(c, (list, tuple)) for c in cols):
            raise TypeError("pass a sequence of rows or a column batch (dict of equal-length lists)")
        n = lengths.pop()
        return [{k: rows[k][i] for k in rows} for i in range(n)]
    return rows
