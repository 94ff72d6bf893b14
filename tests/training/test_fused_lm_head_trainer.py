"""The trainer's default: the fused LM head (issue 19). Three trainer steps with it and with
``--no-fused-lm-head`` from the same weights give the same metrics and weights, on a tied
qk-layernorm model at TP=2 with sequence parallelism and an untied RoPE-scaled model at PP=2."""

import pytest
import torch
from test_equivalence_matrix import BASE, STEPS, argv_for
from trainer_launch import COMPARED

from emapg_megatron.arguments import parse_args

pytestmark = pytest.mark.slow

CASES = {"qwen3-tied-qknorm": "tp2-sp", "llama3-untied-ropescaling": "pp2"}


def test_fused_lm_head_is_the_default_and_has_an_off_switch():
    assert parse_args(BASE).step.fused_lm_head is True
    assert parse_args([*BASE, "--no-fused-lm-head"]).step.fused_lm_head is False


@pytest.mark.parametrize("arch", list(CASES))
def test_fused_and_unfused_trainers_agree(arch, hf_models, trainer_steps):
    """The fused run is the equivalence matrix's run of that layout (conftest.py's trainer_steps
    runs it once per session)."""
    layout = CASES[arch]
    argv = argv_for(hf_models[arch], layout)
    runs = {name: trainer_steps(2, argv + extra, STEPS, tp=2 if "tp2" in layout else 1,
                                pp=2 if layout == "pp2" else 1)
            for name, extra in (("fused", []), ("unfused", ["--no-fused-lm-head"]))}
    for fused, unfused in zip(runs["fused"], runs["unfused"]):
        for step, (m, r) in enumerate(zip(fused["metrics"], unfused["metrics"]), start=1):
            assert m["reward_mean"] == r["reward_mean"], step  # same rollouts: the sampler uses logits
            for k in COMPARED:  # fp32: the two paths differ only in summation order
                assert m[k] == pytest.approx(r[k], rel=1e-5, abs=1e-8), (k, step)
        for key, p in fused["params"].items():
            torch.testing.assert_close(p, unfused["params"][key], rtol=1e-5, atol=1e-7, msg=key)
    assert runs["fused"][0]["metrics"][-1]["ema_lag"] > 0  # the policy really moved
