"""The trainer's task config: which task, its data, and the task-specific settings."""

from __future__ import annotations

import os
from dataclasses import dataclass

from emapg_megatron.configurable import ANY_NUMBER, at_least, check_fields, option
from emapg_megatron.errors import ConfigError

TASKS = ("synthetic-copy", "math", "search")
LONG_PROMPT_MODES = ("error", "drop")
DEFAULT_MAX_TURNS = 4
"""Model turns of a search episode, for the trainer, ``evaluate`` and :class:`SearchConfig` alike."""


@dataclass
class TaskConfig:
    """The RL task providing prompts and rewards, and its data."""

    name: str = option("synthetic-copy", flag="--task", choices=TASKS, trajectory=True)
    """RL task providing prompts and rewards."""
    data_path: str | None = option(None, path="exists", trajectory=True)
    """Local parquet/jsonl training data (math and search tasks)."""
    prompt_key: str | None = option(None)
    """Column of the prompt (default: math's problem, or verl's prompt when the file has no
    problem column; search's question). It may hold text or chat messages (a list of
    {role, content}, rendered with the tokenizer's chat template); a dotted name reaches into a
    nested field."""
    answer_key: str | None = option(None)
    """Column of the reference answer (default: math's answer, or verl's
    reward_model.ground_truth; search's golden_answers); dotted for a nested field."""
    long_prompts: str = option("error", choices=LONG_PROMPT_MODES, trajectory=True)
    """Prompts longer than --seq-length minus --max-new-tokens (search: --max-turn-tokens): error
    stops before training with their count and first row; drop leaves them out and logs the count."""
    chat_template: str = option("auto", choices=("auto", "always", "never"))
    """Wrap prompts in the tokenizer's chat template (auto: when it has one)."""
    math_format_bonus: float = option(0.0, range=ANY_NUMBER)
    """math: reward bonus for a boxed answer."""
    max_turns: int = option(DEFAULT_MAX_TURNS, range=at_least(1))
    """search: model turns per episode."""
    max_turn_tokens: int = option(500, range=at_least(0))
    """search: token budget of one model turn (0: --max-new-tokens)."""
    max_obs_tokens: int = option(500, range=at_least(1))
    """search: token budget of one observation."""
    retriever: str | None = option(None)
    """search: corpus jsonl (in-process BM25) or http:// URL of a retriever service."""
    retriever_topk: int = option(3, range=at_least(1))
    """search: passages per search."""

    def fields(self) -> dict[str, str]:
        """The task's canonical fields mapped to the columns --prompt-key / --answer-key name."""
        answer = {"math": "ground_truth", "search": "golden_answers"}.get(self.name)
        keys = {"question": self.prompt_key, answer: self.answer_key}
        return {field: column for field, column in keys.items() if field and column}

    @property
    def built_in(self) -> bool:
        """The synthetic copy task: its own tokenizer and data, no --load-hf or --data-path."""
        return self.name == "synthetic-copy"

    def validate(self, load_hf: str | None) -> None:
        """The task's flags; ``load_hf`` is the model a real task takes its tokenizer from."""
        check_fields(self)
        if not self.built_in and load_hf is None:
            raise ConfigError(f"--task {self.name} needs --load-hf (for the tokenizer and weights)")
        if not self.built_in and self.data_path is None:
            raise ConfigError(f"--task {self.name} needs --data-path")
        if self.name == "search" and self.retriever is None:
            raise ConfigError("--task search needs --retriever")
        if self.retriever and not self.retriever.startswith(("http://", "https://")) \
                and not os.path.isfile(self.retriever):
            raise ConfigError(f"--retriever {self.retriever}: no such corpus file (give a jsonl "
                              "corpus or the http:// URL of a retriever service)")
