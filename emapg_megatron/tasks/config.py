"""The tasks' configs: which task, its data, and each task's own settings.

One declaration per setting: :class:`MathConfig` and :class:`SearchConfig` are what the tasks
run on and what ``emapg-train`` (through :class:`TaskConfig`) and ``emapg-evaluate`` generate
their flags from (``emapg_megatron.configurable``). Fields declared without ``option`` are set by
code (a prompt template, the verifier's timeout, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from emapg_megatron.configurable import ANY_NUMBER, at_least, check_fields, components, option
from emapg_megatron.errors import ConfigError

from .math_verifier import DEFAULT_TIMEOUT

TASKS = ("synthetic-copy", "math", "search")
LONG_PROMPT_MODES = ("error", "drop")
CHAT_TEMPLATE_MODES = ("auto", "always", "never")
COPY_REWARDS = ("fraction", "exact")

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
"""Appended to a math question (DeepScaleR style)."""
SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can "
    "call a search engine by <search> query </search> and it will return the top searched results "
    "between <information> and </information>. You can search as many times as your want. If you "
    "find no further external knowledge needed, you can directly provide the answer inside "
    "<answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Question: {question}\n"
)


@dataclass
class PromptConfig:
    """How a task renders its prompts (the base of every task's config: its --chat-template is
    one flag for all of them)."""

    chat_template: str = option("auto", choices=CHAT_TEMPLATE_MODES)
    """Wrap prompts in the tokenizer's chat template (auto: when it has one)."""
    system: Optional[str] = None
    """A system message for the chat template."""


@dataclass
class MathConfig(PromptConfig):
    """math: the prompt, and the reward (math-verify equivalence plus a format bonus)."""

    format_bonus: float = option(0.0, flag="--math-format-bonus", range=ANY_NUMBER)
    """math: reward bonus for a boxed answer."""
    last_number_fallback: bool = option(False, flag="--math-last-number-fallback")
    """math: without a \\boxed{} answer, grade the last number in the response (off: such a
    response scores 0; a policy can learn to end any text with likely numbers)."""
    instruction: str = MATH_INSTRUCTION
    """Appended to the question."""
    plain_template: str = "{content}\n"
    """The prompt when no chat template is used."""
    think_end_tag: Optional[str] = None
    """Grade only the text after the last such tag (a response without it has no answer)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds one math-verify check may take (then it scores 0)."""
    num_workers: Optional[int] = None
    """math-verify worker processes (None: $EMAPG_MATH_WORKERS, else min(4, CPUs))."""
    fields: dict = field(default_factory=lambda: {
        "question": "problem", "ground_truth": "answer", "data_source": "data_source"})
    """The canonical fields and their default columns."""


@dataclass
class SearchConfig(PromptConfig):
    """search: the Search-R1 episode and its retriever."""

    max_turns: int = option(4, range=at_least(1))
    """search: model turns per episode."""
    max_turn_tokens: Optional[int] = option(500, range=at_least(0))
    """search: token budget of one model turn (0: --max-new-tokens)."""
    max_obs_tokens: Optional[int] = option(500, range=at_least(1))
    """search: token budget of one observation."""
    retriever: Optional[str] = option(None)
    """search: corpus jsonl (in-process BM25) or http:// URL of a retriever service."""
    topk: int = option(3, flag="--retriever-topk", range=at_least(1))
    """search: passages per search."""
    metric: str = "em"
    """The reward: exact match ("em") or token F1 ("f1") of the final answer."""
    instruction: str = SEARCH_R1_INSTRUCTION
    """The prompt, with the question in {question}."""
    plain_template: str = "{content}"
    """The prompt when no chat template is used."""
    fields: dict = field(default_factory=lambda: {
        "question": "question", "golden_answers": "golden_answers", "data_source": "data_source"})
    """The canonical fields and their default columns."""

    def check_retriever(self) -> None:
        """A corpus file named by --retriever exists (a URL is checked when it is used)."""
        if self.retriever and not self.retriever.startswith(("http://", "https://")) \
                and not os.path.isfile(self.retriever):
            raise ConfigError(f"--retriever {self.retriever}: no such corpus file (give a jsonl "
                              "corpus or the http:// URL of a retriever service)")


@dataclass
class CopyConfig:
    """synthetic-copy: the built-in task's reward."""

    reward: str = option("fraction", flag="--copy-reward", choices=COPY_REWARDS, trajectory=True)
    """synthetic-copy: fraction scores the share of the digits copied right (a uniform random
    policy gets about 0.1); exact scores 1 when all of them are, else 0 (a sparse reward: about
    0.001 at random)."""


@dataclass
class DataColumns:
    """Which columns of the data hold the prompt and the reference answer."""

    prompt_key: Optional[str] = option(None)
    """Column of the prompt (default: math's problem, or verl's prompt when the file has no
    problem column; search's question). It may hold text or chat messages (a list of
    {role, content}, rendered with the tokenizer's chat template); a dotted name reaches into a
    nested field."""
    answer_key: Optional[str] = option(None)
    """Column of the reference answer (default: math's answer, or verl's
    reward_model.ground_truth; search's golden_answers); dotted for a nested field."""

    def fields(self, task: str) -> dict[str, str]:
        """The canonical fields of ``task`` mapped to the columns --prompt-key / --answer-key name."""
        answer = {"math": "ground_truth", "search": "golden_answers"}.get(task)
        keys = {"question": self.prompt_key, answer: self.answer_key}
        return {name: column for name, column in keys.items() if name and column}


@dataclass
class TaskConfig:
    """The RL task providing prompts and rewards, and its data."""

    name: str = option("synthetic-copy", flag="--task", choices=TASKS, trajectory=True)
    """RL task providing prompts and rewards."""
    data_path: str | None = option(None, path="exists", trajectory=True)
    """Local parquet/jsonl training data (math and search tasks)."""
    long_prompts: str = option("error", choices=LONG_PROMPT_MODES, trajectory=True)
    """Prompts longer than --seq-length minus --max-new-tokens (search: --max-turn-tokens): error
    stops before training with their count and first row; drop leaves them out and logs the count."""
    columns: DataColumns = field(default_factory=DataColumns)
    copy: CopyConfig = field(default_factory=CopyConfig)
    math: MathConfig = field(default_factory=MathConfig)
    search: SearchConfig = field(default_factory=SearchConfig)

    def fields(self) -> dict[str, str]:
        """The task's canonical fields mapped to the columns --prompt-key / --answer-key name."""
        return self.columns.fields(self.name)

    @property
    def built_in(self) -> bool:
        """The synthetic copy task: its own tokenizer and data, no --load-hf or --data-path."""
        return self.name == "synthetic-copy"

    def task_config(self) -> MathConfig | SearchConfig:
        """The config the task named by --task runs on (not the built-in one's)."""
        return {"math": self.math, "search": self.search}[self.name]

    def validate(self, load_hf: str | None) -> None:
        """The task's flags; ``load_hf`` is the model a real task takes its tokenizer from."""
        for part in components(self):
            check_fields(part)
        if not self.built_in and self.copy.reward != "fraction":
            raise ConfigError(f"--copy-reward is the built-in synthetic-copy task's, not --task {self.name}'s")
        if not self.built_in and load_hf is None:
            raise ConfigError(f"--task {self.name} needs --load-hf (for the tokenizer and weights)")
        if not self.built_in and self.data_path is None:
            raise ConfigError(f"--task {self.name} needs --data-path")
        if self.name == "search" and self.search.retriever is None:
            raise ConfigError("--task search needs --retriever")
        self.search.check_retriever()
