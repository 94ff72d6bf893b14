"""RL tasks: prompts, rewards, environments and data loading (no Megatron, no torch).

* :mod:`.base` - the :class:`Task` / :class:`Environment` interface and trajectory masks.
* :mod:`.config` - the tasks' configs (:class:`TaskConfig` for the trainer, :class:`MathConfig`,
  :class:`SearchConfig`): the one declaration of every task flag.
* :mod:`.data` - loading local parquet/jsonl into ``datasets.Dataset`` with bad-row reporting.
* :mod:`.math` - math reward and :class:`MathTask`; :mod:`.math_answers` extracts and compares
  answers as text, :mod:`.math_verifier` runs ``math-verify`` in a timed worker pool.
* :mod:`.search` - Search-R1 environment, QA reward and :class:`SearchTask`.
* :mod:`.retriever` - BM25 (``bm25s``) retriever, its loopback HTTP service and client
  (:mod:`.retrieval`, a module per concern).
* :mod:`.passk` - the unbiased pass@k estimator.

Heavy modules (``math``, ``search``, ``retriever``) are imported on first use.
``get_task(name, config=...)`` builds a task on its config (or ``**overrides`` of its fields).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Dict

if TYPE_CHECKING:
    from .base import Task

# ``base`` reads data files (``datasets``): loaded on first use, so the configs stay light.
_BASE_NAMES = ("ROLE_MODEL", "ROLE_OBSERVATION", "ROLE_PROMPT", "Environment", "Segment", "StepResult",
               "Task", "TokenizerLike", "build_token_ids_and_mask", "encode_text", "render_prompt")


def __getattr__(name: str):
    if name in _BASE_NAMES:
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Task",
    "Environment",
    "Segment",
    "StepResult",
    "TokenizerLike",
    "build_token_ids_and_mask",
    "encode_text",
    "render_prompt",
    "ROLE_MODEL",
    "ROLE_OBSERVATION",
    "ROLE_PROMPT",
    "get_task",
    "register_task",
    "available_tasks",
]


def _math(**kw: Any) -> "Task":
    from .math import MathTask

    return MathTask(**kw)


def _search(**kw: Any) -> "Task":
    from .search import SearchTask

    return SearchTask(**kw)


_REGISTRY: Dict[str, Callable[..., "Task"]] = {"math": _math, "search": _search}


def register_task(name: str, factory: Callable[..., "Task"]) -> None:
    """Make ``get_task(name, **kw)`` call ``factory(**kw)``."""
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs: Any) -> "Task":
    """Build a task by name (``math``, ``search``, or a registered one): ``config=`` its config,
    and/or overrides of the config's fields."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {available_tasks()}") from None
    return factory(**kwargs)
