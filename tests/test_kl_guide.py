"""docs/choosing_kl.md, the guide to --kl-loss-type, --kl-topk-tokens and --kl-tail, names every
choice the CLI has, states the CLI's defaults, and its table agrees with the KL registry
(issue 39, item 12)."""

import os
import re

from emapg_megatron.arguments import build_parser
from emapg_megatron.kl.registry import LOSS_TYPE_NAMES, SAMPLED, loss_type
from emapg_megatron.kl.topk import TOPK_TAILS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "docs", "choosing_kl.md"), encoding="utf-8") as f:
    PAGE = f.read()


def defaults() -> dict:
    return {a.option_strings[0]: a.default for a in build_parser()._actions if a.option_strings}


def test_the_page_names_every_kl_loss_type_and_tail():
    names = set(re.findall(r"`([\w+-]+)`", PAGE))
    assert not set(LOSS_TYPE_NAMES) - names, sorted(set(LOSS_TYPE_NAMES) - names)
    assert not set(TOPK_TAILS) - names, sorted(set(TOPK_TAILS) - names)


def test_the_stated_defaults_are_the_clis():
    line = next(ln for ln in PAGE.splitlines() if ln.startswith("Defaults:"))
    stated = dict(re.findall(r"(--[\w-]+) ([^\s`]+)", line))
    d = defaults()
    assert stated == {"--kl-loss-type": d["--kl-loss-type"], "--kl-topk-tokens": str(d["--kl-topk-tokens"]),
                      "--kl-tail": d["--kl-tail"], "--kl-coef": str(d["--kl-coef"])}


def test_the_table_of_every_value_follows_the_registry():
    """One row per --kl-loss-type, in the registry's order; its family and q column are the
    registry's (where the top-k ids come from decides which pass computes them)."""
    section = PAGE.split("## Every value", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines()
            if ln.startswith("| `") and not ln.startswith("| `--")]
    assert [r[0].strip("`") for r in rows] == list(LOSS_TYPE_NAMES)
    for r in rows:
        t = loss_type(r[0].strip("`"))
        assert r[1].startswith("sampled") == (t.family == SAMPLED)
        q = r[-1]
        if t.family == SAMPLED:
            assert q == "-"
        elif t.needs_alpha:
            assert t.q_source(0.75) == "old" and t.q_source(0.25) == "anchor" and "α > ½" in q
        else:
            assert q == {"old": "the old policy's top-k", "anchor": "the anchor's top-k"}[t.q_source()]


def test_every_flag_the_page_names_exists():
    flags = set(re.findall(r"(?<![\w-])(--[a-z][\w-]+)", PAGE))
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert flags and not flags - known, sorted(flags - known)
