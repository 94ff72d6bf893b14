"""docs/peer_names.md, the verl / NeMo-RL name table: every flag it names in our column is one
``emapg-train`` takes (the trainer's parser or the launcher's torchrun options), and every row
names the setting in both frameworks, or says there is none (issue 39, item 12)."""

import os
import re

from emapg_megatron.arguments import build_parser
from emapg_megatron.launch import LAUNCHER_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "docs", "peer_names.md"), encoding="utf-8") as f:
    PAGE = f.read()


def rows() -> list[list[str]]:
    out = []
    for line in PAGE.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `--"):
            out.append(cells)
    return out


def known_flags() -> set[str]:
    return {s for a in build_parser()._actions for s in a.option_strings} | {f"--{f}" for f in LAUNCHER_FLAGS}


def test_every_flag_of_our_column_exists():
    table = rows()
    assert len(table) >= 40
    ours = {f for r in table for f in re.findall(r"--[a-z][\w-]*", r[0])}
    assert not ours - known_flags(), sorted(ours - known_flags())


def test_every_flag_the_page_names_exists():
    named = set(re.findall(r"(?<![\w-])(--[a-z][\w-]+)", PAGE))
    assert not named - known_flags(), sorted(named - known_flags())


def test_every_row_names_both_frameworks():
    for r in rows():
        assert len(r) == 4 and r[1] and r[2], r
        for cell in r[1:3]:
            assert cell.startswith("none") or "`" in cell, r


def test_the_common_settings_are_there():
    """The settings the issue lists: batch sizes, group size, clip eps, KL coefficient and type,
    entropy coefficient, lr, response length, temperature / top-p, TP / PP, micro-batch, PPO
    epochs, loss aggregation, rollout importance sampling."""
    ours = " ".join(r[0] for r in rows())
    for flag in ("--rollout-batch-size", "--global-batch-size", "--num-samples-per-prompt", "--clip-eps-low",
                 "--clip-eps-high", "--kl-coef", "--kl-loss-type", "--entropy-coef", "--lr", "--max-new-tokens",
                 "--temperature", "--top-p", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--micro-batch-size", "--ppo-epochs", "--loss-agg-mode", "--rollout-is"):
        assert re.search(re.escape(flag) + r"(?![\w-])", ours), flag
