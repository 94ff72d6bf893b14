"""A built-in verifiable task for CPU runs: copy a digit string.

The prompt is ``L`` random digits followed by ``=``; the correct response repeats them.
The reward (``--copy-reward``) is by default the fraction of the ``L`` positions answered
correctly (0..1), so a uniform random policy scores about 0.1 and a policy that learned to copy
scores 1.0; ``exact`` is all or nothing (1 when every position is right, about 10^-L at random),
a sparse reward. Learning it needs attention to the prompt, so the reward curve shows real
policy improvement, and it needs no data files, tokenizer downloads or verifier.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from emapg_megatron.tasks.base import Task
from emapg_megatron.tasks.config import COPY_REWARDS

DIGITS = "0123456789"


class CharTokenizer:
    """One token per character over a fixed alphabet, plus pad and eos."""

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self, alphabet: str = DIGITS + "="):
        self.alphabet = alphabet
        self._ids = {c: i + 2 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 2

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer alphabet") from None

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i - 2] for i in ids if 2 <= i < self.vocab_size)


class CopyTask(Task):
    name = "synthetic-copy"
    required_fields = ("digits",)

    def __init__(self, length: int = 3, num_rows: int = 4096, seed: int = 0, reward: str = "fraction"):
        if reward not in COPY_REWARDS:
            raise ValueError(f"reward must be one of {COPY_REWARDS}, not {reward!r}")
        self.length = length
        self.exact = reward == "exact"
        rng = random.Random(seed)
        self.rows = [{"digits": "".join(rng.choice(DIGITS) for _ in range(length))}
                     for _ in range(num_rows)]

    def builtin_rows(self) -> list:
        return self.rows

    def prompt(self, row: Mapping[str, Any], tokenizer: Any = None) -> str:
        return row["digits"] + "="

    def reward(self, response: str, row: Mapping[str, Any]) -> float:
        target = row["digits"]
        if self.exact:
            return float(self.correct(response, row))
        return sum(a == b for a, b in zip(response, target)) / len(target)

    def correct(self, response: str, row: Mapping[str, Any]) -> bool:
        return response[: len(row["digits"])] == row["digits"]
