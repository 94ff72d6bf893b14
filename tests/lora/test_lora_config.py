"""LoRA's config (emapg_megatron.lora.config): its flags, the target names (Megatron's and Hugging
Face's, fused layers whole) and each refusal line. No torch model, no Megatron."""

import subprocess
import sys

import pytest

from emapg_megatron import configurable
from emapg_megatron.errors import ConfigError
from emapg_megatron.lora.config import LoRAConfig, megatron_targets


def parse(argv) -> LoRAConfig:
    parser = configurable.ArgumentParser()
    configurable.add_arguments(parser, LoRAConfig)
    return configurable.build(LoRAConfig, vars(parser.parse_args(argv)))


def test_flags_and_defaults():
    off = parse([])
    assert not off.enabled and off.targets() == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    off.validate()  # rank 0 is the default: nothing to check, nothing to do
    cfg = parse(["--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
                 "--lora-target-modules", "q_proj,k_proj,v_proj", "o_proj"])
    cfg.validate()
    assert (cfg.rank, cfg.scale, cfg.dropout) == (8, 2.0, 0.05)
    assert cfg.targets() == ("linear_qkv", "linear_proj")


@pytest.mark.parametrize("names, targets", [
    (("linear_fc2", "linear_qkv"), ("linear_qkv", "linear_fc2")),  # layer order
    (("gate_proj", "up_proj", "down_proj"), ("linear_fc1", "linear_fc2")),
    (("q_proj", "linear_qkv"), ("linear_qkv",)),  # the fused layer named: the subset is inside it
    (("linear_proj,o_proj",), ("linear_proj",)),
])
def test_target_names(names, targets):
    assert megatron_targets(names) == targets


@pytest.mark.parametrize("argv, line", [
    (["--lora-target-modules", "linear_foo"],
     "--lora-target-modules: unknown module 'linear_foo'; known: linear_qkv, linear_proj, linear_fc1, "
     "linear_fc2, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (["--lora-target-modules", "q_proj"],
     "--lora-target-modules q_proj: q_proj, k_proj, v_proj are one fused Megatron layer (linear_qkv) "
     "and its adapter covers all of them: name all of them or linear_qkv"),
    (["--lora-target-modules", "q_proj,v_proj"],
     "--lora-target-modules q_proj,v_proj: q_proj, k_proj, v_proj are one fused Megatron layer "
     "(linear_qkv) and its adapter covers all of them: name all of them or linear_qkv"),
    (["--lora-target-modules", "up_proj", "down_proj"],
     "--lora-target-modules up_proj: gate_proj, up_proj are one fused Megatron layer (linear_fc1) "
     "and its adapter covers all of them: name all of them or linear_fc1"),
    (["--lora-target-modules", ","], "--lora-target-modules needs at least one module"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0 (got -1)"),
    (["--lora-alpha", "-2"], "--lora-alpha must be > 0 (got -2.0)"),
    (["--lora-alpha", "0"], "--lora-alpha must be > 0 (got 0.0)"),
    (["--lora-dropout", "-0.1"], "--lora-dropout must be in [0, 1) (got -0.1)"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1) (got 1.0)"),
])
def test_refusals(argv, line):
    with pytest.raises(ConfigError) as e:
        parse(["--lora-rank", "4", *argv]).validate()
    assert str(e.value) == line


def test_the_config_imports_no_torch():
    code = ("import sys, emapg_megatron.lora, emapg_megatron.lora.config; "
            "print([m for m in sys.modules if m.startswith(('torch', 'megatron'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
