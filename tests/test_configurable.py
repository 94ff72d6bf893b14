"""The component configs are the one source of truth of the command line and YAML
(``emapg_megatron.configurable``, ``emapg_megatron.arguments``): every flag of the hand-written
parser they replaced is still accepted with its default, every option declares its check and the
check runs before any work, YAML takes aliases, and the config layer imports no Megatron."""

import contextlib
import dataclasses
import io
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from emapg_megatron import configurable, train
from emapg_megatron.arguments import RunConfig, build_parser, parse_args
from emapg_megatron.configurable import ANY_NUMBER, Range, at_least, between, option
from emapg_megatron.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "cli_flags_at_375884d.json")  # the hand-written parser's flags and defaults
FREE_TEXT = {"--preset", "--config", "--retriever", "--wandb-project", "--wandb-exp-name", "--prompt-key",
             "--answer-key",
             "--moe-layer-freq", "--lora-target-modules"}
# free strings: --moe-layer-freq a pattern read by models.config.dense_mlp_layers; --lora-target-modules
# names checked by LoRAConfig.validate, which also takes comma-separated lists that choices would refuse
ADDED = {"--overwrite", "--kl-reference-clamps", "--rollout-dump-interval", "--wandb-project",
         "--wandb-exp-name", "--prompt-key", "--answer-key", "--eval-interval", "--eval-data-path",
         "--eval-samples", "--eval-max-prompts", "--teacher-load-hf", "--teacher-checkpoint",
         "--teacher-cpu-offload", "--task-reward",
         "--inference-fixed-shape-decode", "--inference-cuda-graphs",
         "--inference-continuous-batching", "--partial-rollouts", "--partial-rollout-oversample",
         "--max-staleness", "--math-last-number-fallback", "--kl-topk-source",
         "--copy-reward",
         # mixture of experts (issue 41): Megatron-LM's names
         "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq",
         "--expert-model-parallel-size",
         "--expert-tensor-parallel-size", "--moe-token-dispatcher-type", "--moe-router-load-balancing-type",
         "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-dtype", "--moe-grouped-gemm",
         "--moe-routing-replay",
         # LoRA (issue 42)
         "--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-target-modules", "--lora-peft-init"}  # flags added since, on purpose
ADDED_ALIASES = {"--rl-partial-rollouts"}  # other names of added flags
NEGATED = {"--no-task-reward", "--no-inference-fixed-shape-decode", "--no-inference-cuda-graphs",
           "--no-inference-continuous-batching"}  # the negations of added switches


def _options():
    return [(cls, f) for _, cls, f in configurable.walk(RunConfig)]


def test_every_flag_and_alias_of_the_old_parser_is_accepted_with_its_default():
    golden = json.load(open(GOLDEN))
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    for names, default in golden.items():
        for name in names.split(","):
            assert name in actions, f"{name} is no longer accepted"
            assert actions[name].default == default, (name, actions[name].default, default)
    assert {s for s in actions if s not in ("-h", "--help")} == \
        {s for names in golden for s in names.split(",")} | ADDED | ADDED_ALIASES | NEGATED  # no flag added by accident


def test_every_option_declares_its_check():
    for cls, f in _options():
        opt, flag = configurable.option_of(f), configurable.flag_of(f)
        scalar, _ = configurable.value_type(cls, f)
        if scalar in (int, float):
            assert opt.range is not None or opt.choices, f"{flag}: a number without a declared range"
        elif scalar is str:
            assert opt.choices or opt.path or flag in FREE_TEXT, f"{flag}: a string without a check"
        assert configurable.field_docs(cls).get(f.name), f"{flag}: no docstring (its --help text)"


def _run_cli(*argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            train.main(["--preset", "tiny-cpu", "--dry-run", "--world-size", "2", *argv])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue().strip()


def _out_of_range(rng: Range, scalar) -> list:
    step = 1 if scalar is int else 0.5
    values = []
    if rng.low is not None:
        values.append(rng.low if rng.low_open else rng.low - step)
    if rng.high is not None:
        values.append(rng.high if rng.high_open else rng.high + step)
    if scalar is float:
        values.append(math.nan)
    return [v for v in values if v not in rng.also]


@pytest.mark.parametrize("flag, value", [
    (configurable.flag_of(f), v) for cls, f in _options()
    for v in _out_of_range(configurable.option_of(f).range or ANY_NUMBER, configurable.value_type(cls, f)[0])
    if configurable.value_type(cls, f)[0] in (int, float) and configurable.value_type(cls, f)[1] is None])
def test_an_out_of_range_value_is_one_line_naming_its_flag_before_any_work(flag, value):
    code, err = _run_cli(flag, str(value))
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (flag, value, err)
    assert flag in err, err


def test_yaml_takes_aliases_and_suggests_close_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("grpo-kl-beta: 0.05\ngrpo_group_size: 4\nref-policy-ema-tau: 0.5\n")
    run = parse_args(["--config", str(cfg)])
    assert (run.loss.kl_coef, run.step.num_samples, run.ema.eta) == (0.05, 4, 0.5)
    cfg.write_text("kl-cof: 0.1\n")
    with pytest.raises(ConfigError, match="unknown option 'kl-cof' \\(did you mean 'kl-coef'\\?\\)"):
        parse_args(["--config", str(cfg)])


def test_a_yaml_null_where_a_value_is_needed_is_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train-iters: null\n")
    code, err = _run_cli("--config", str(cfg))
    assert code == 2 and err == "error: --train-iters needs a value"


def test_the_checkpoint_record_has_the_old_keys():
    """A checkpoint records ``RunConfig.flags()``, keyed as the old ``vars(args)`` was, so a resume
    compares its flags with checkpoints written before and after."""
    golden = json.load(open(GOLDEN))
    assert set(RunConfig().flags()) == {names.split(",")[0][2:].replace("-", "_") for names in golden} | \
        {name[2:].replace("-", "_") for name in ADDED}


def test_help_text_is_the_field_docstring():
    from emapg_megatron.kl.config import KLConfig

    (action,) = [a for a in build_parser()._actions if a.dest == "kl_topk_tokens"]
    assert action.help == configurable.field_docs(KLConfig)["k"] == "k of the Top-k estimators (>= 1 for topk-*)."


def test_the_config_layer_imports_no_megatron_trainer_or_engine():
    code = ("import sys, emapg_megatron.arguments; "
            "print([m for m in sys.modules if m.startswith(('megatron', 'transformers', 'emapg_megatron.trainer', "
            "'emapg_megatron.build', 'emapg_megatron.rollout.vllm_engine', 'emapg_megatron.runtime.distributed'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# --- the machinery on its own -----------------------------------------------------------------
@dataclass
class _Demo:
    """A demo component."""

    size: int = option(4, flag="--demo-size", aliases=("--size",), range=at_least(1))
    """How big."""
    ratio: float = option(0.5, range=between(0, 1, high_open=True))
    """A share in [0, 1)."""
    mode: str = option("a", choices=("a", "b", "c"))
    """Which one."""
    pair: tuple[float, float] | None = option(None, range=ANY_NUMBER)
    """Two numbers."""
    internal: int = 3
    """Set by code, no flag."""


def test_ranges_say_what_they_allow():
    assert str(at_least(1)) == ">= 1" and str(Range(low=0, low_open=True)) == "> 0"
    assert str(between(0, 1, low_open=True)) == "in (0, 1]" and str(at_least(1, also=(-1,))) == ">= 1 or -1"
    assert -1 in at_least(1, also=(-1,)) and 0 not in at_least(1, also=(-1,)) and math.nan not in ANY_NUMBER


def test_generated_parser_builds_and_checks_a_component():
    import argparse

    parser = argparse.ArgumentParser()
    configurable.add_arguments(parser, _Demo)
    values = vars(parser.parse_args(["--size", "7", "--pair", "1", "2", "--mode", "c"]))
    demo = configurable.build(_Demo, values)
    assert (demo.size, demo.ratio, demo.mode, demo.pair, demo.internal) == (7, 0.5, "c", (1.0, 2.0), 3)
    assert configurable.flat(demo) == {"demo_size": 7, "ratio": 0.5, "mode": "c", "pair": (1.0, 2.0)}
    assert "--internal" not in parser.format_help()
    for bad, message in [(dict(size=0), "--demo-size must be >= 1 (got 0)"),
                         (dict(ratio=1.0), "--ratio must be in [0, 1) (got 1.0)"),
                         (dict(mode="z"), "--mode must be one of a, b, c (got 'z')"),
                         (dict(pair=(1.0, math.inf)), "--pair must be a finite number (got inf)"),
                         (dict(size=2.5), "--demo-size must be an integer (got 2.5)")]:
        with pytest.raises(ConfigError) as e:
            configurable.check_fields(_Demo(**bad))
        assert str(e.value) == message


def test_a_flag_declared_twice_is_refused():
    @dataclass
    class Clash:
        a: int = option(1, flag="--same", range=ANY_NUMBER)
        b: int = option(2, flag="--same", range=ANY_NUMBER)

    import argparse

    with pytest.raises(TypeError, match="--same is declared twice"):
        configurable.add_arguments(argparse.ArgumentParser(), Clash)


def test_a_missing_retriever_corpus_is_refused_before_any_work(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "q", "golden_answers": ["a"]}\n')
    code, err = _run_cli("--task", "search", "--load-hf", str(tmp_path), "--data-path", str(data),
                         "--retriever", str(tmp_path / "missing.jsonl"))
    assert code == 2 and err == (f"error: --retriever {tmp_path / 'missing.jsonl'}: no such corpus file "
                                 "(give a jsonl corpus or the http:// URL of a retriever service)")


@dataclass
class _Shared:
    """A base whose option its components share."""

    style: str = option("x", choices=("x", "y"))
    """Which style."""


@dataclass
class _Left(_Shared):
    """The left component."""

    width: int = option(1, range=at_least(1))
    """How wide."""


@dataclass
class _Right(_Shared):
    """The right component."""

    files: tuple[str, ...] = option(("f",), deprecated=("--old-files",))
    """One file or more."""


@dataclass
class _Both:
    """Two components sharing --style."""

    left: _Left = dataclasses.field(default_factory=_Left)
    right: _Right = dataclasses.field(default_factory=_Right)


@dataclass
class _Required:
    """A component with a required option."""

    name: str = option()
    """No default: the flag is required."""


def _parser(tree):
    parser = configurable.ArgumentParser()
    configurable.add_arguments(parser, tree)
    return parser


def test_an_option_inherited_by_several_components_is_one_flag_they_all_get():
    parser = _parser(_Both)
    both = configurable.build(_Both, vars(parser.parse_args(["--style", "y", "--files", "a", "b"])))
    assert (both.left.style, both.right.style, both.right.files) == ("y", "y", ("a", "b"))
    assert [s for a in parser._actions for s in a.option_strings].count("--style") == 1
    (home,) = [g for g in parser._action_groups if any("--style" in a.option_strings for a in g._group_actions)]
    assert home.title == "run"  # the closest component holding both: here the root


def test_an_option_without_a_default_needs_a_value():
    cfg = configurable.build(_Required, vars(_parser(_Required).parse_args([])))
    with pytest.raises(ConfigError, match="^--name needs a value$"):
        configurable.check_fields(cfg)
    assert configurable.build(_Required, vars(_parser(_Required).parse_args(["--name", "a"]))).name == "a"


def test_a_deprecated_spelling_still_parses_and_says_once_what_replaces_it():
    parser = _parser(_Both)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        old = vars(parser.parse_args(["--old-files", "a", "--old-files", "b", "c"]))
    assert configurable.build(_Both, old) == configurable.build(_Both, vars(_parser(_Both).parse_args(
        ["--files", "b", "c"])))
    assert err.getvalue() == "warning: --old-files is deprecated: use --files\n"
    assert "--old-files" not in parser.format_help() and "--files" in parser.format_help()
