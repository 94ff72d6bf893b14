"""LoRA adapters on the GPTModel (emapg_megatron.lora): exact at B = 0, TP = 2 with and without
sequence parallelism equal to one rank, merge/unmerge, and the refusals that need a model.

One forked 2-rank job (``lora_workers.lora_job``, shared by the tests below through a module
fixture) runs a Qwen2.5-like and a Qwen3-like model at one rank and at TP = 2 (see its
docstring). Tolerance (fp32): 1e-5 relative to each tensor's largest entry (``close``): the layouts
compute the same sums, split and reduced in another order.
"""

import pytest
import torch
from lora_workers import ARCHS

from emapg_megatron.lora.adapters import Sharding
from emapg_megatron.multiprocess import run_distributed

RTOL = 1e-5
LAYOUTS = ("tp2", "tp2-sp")


@pytest.fixture(scope="module")
def ranks():
    from lora_workers import lora_job

    return run_distributed(lora_job, 2, timeout=240)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to rtol 1e-5 of the tensor's largest entry (a gradient entry near zero is a
    cancellation whose rounding is that of its terms, not of its own size)."""
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def full_of(shards: list[torch.Tensor], sharding) -> torch.Tensor:
    return Sharding(*sharding).full(shards)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_b_zero_keeps_the_base_logits(ranks, arch):
    one = ranks[0][arch]
    assert torch.equal(one["b0"], one["base"])
    assert {name.rsplit(".", 1)[1] for name in one["adapted"]} == {
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert len(one["adapted"]) == 4 * ARCHS[arch]["num_layers"]
    assert not one["frozen"] and not one["base_with_grad"]  # only the adapters train
    assert not torch.equal(one["logits"], one["base"])  # the random B does change the model


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_matches_one_rank(ranks, arch, layout):
    one, runs = ranks[0][arch], [r[arch][layout] for r in ranks]
    shardings = runs[0]["shardings"]
    assert set(shardings) == set(one["grads"]) and len(shardings) == 8 * ARCHS[arch]["num_layers"]
    for name, sharding in shardings.items():
        init = full_of([r["init"][name] for r in runs], sharding)
        if name.endswith(".A"):  # the TP shards of A are slices of the one-rank A, bit for bit
            assert torch.equal(init, one["init_A"][name]), name
        else:
            assert not init.any(), name
        grads = [r["grads"][name] for r in runs]
        if sharding[0] is None:  # replicated: whole and equal on both TP ranks
            assert torch.equal(grads[0], grads[1]), name
        close(full_of(grads, sharding), one["grads"][name], f"{layout}: gradient of {name}")
    for r in runs:
        assert not r["base_with_grad"]
    logits = torch.cat([r["logits"] for r in runs], dim=-1)
    close(logits, one["logits"], f"{layout}: logits")
    close(torch.cat([r["merged"] for r in runs], dim=-1), one["logits"], f"{layout}: merged logits")


@pytest.mark.slow
def test_pipeline_stages_name_and_draw_adapters_globally(ranks):
    """At PP = 2 each stage holds its own layers' adapters under their global names, and A is
    the one-rank A of that name (the draw is seeded by the global name)."""
    stages = [r["pp2_init"] for r in ranks]
    assert not set(stages[0]) & set(stages[1])
    one = ranks[0]["qwen3"]["init_A"]
    assert {n for s in stages for n in s if n.endswith(".A")} == set(one)
    for stage in stages:
        for name, value in stage.items():
            assert torch.equal(value, one[name]) if name.endswith(".A") else not value.any(), name


@pytest.mark.slow
def test_dropout_keeps_replicated_matrices_replicated(ranks):
    """With dropout, TP rank r's column-side A and row-side B get the same gradient as the other
    rank's: the input every rank holds whole is dropped with the same mask everywhere."""
    runs = [r["dropout"] for r in ranks]
    replicated = [n for n, (dim, _) in runs[0]["shardings"].items() if dim is None]
    assert len(replicated) == 4 * ARCHS["qwen2.5"]["num_layers"]
    for name in replicated:
        assert torch.equal(runs[0]["grads"][name], runs[1]["grads"][name]), name
    ref = ranks[0]["qwen2.5"]["tp2"]["grads"]  # the dropout did drop something
    assert any(not torch.equal(runs[0]["grads"][n], ref[n]) for n in replicated)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_merge_and_unmerge(ranks, arch):
    one = ranks[0][arch]
    close(one["merged"], one["logits"], "merged logits")
    close(one["unmerged"], one["logits"], "unmerged logits")
    assert one["unmerge_weight_error"] < 1e-6  # W + d - d: fp32 rounding only


@pytest.mark.slow
def test_refusals_that_need_a_model(ranks):
    refused = ranks[0]["refused"]
    assert refused["rank_above_width"] == ("--lora-rank 65 exceeds the width of linear_proj (128 in, "
                                           "64 out): use at most 64")
    assert refused["twice"] == "this model has LoRA adapters already: apply_lora runs once per model"
    assert refused["rank_0"] == "--lora-rank 0 means no LoRA: there is nothing to apply"
    assert refused["experts"].startswith("LoRA on mixture-of-experts experts is not supported yet")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_transformer_engine_like_linears_match_local_one_rank(ranks, arch, layout):
    """On linears with Transformer Engine's contract (``te_like``: the layer norms fused into
    ``linear_qkv`` and ``linear_fc1``, whose adapters read the norm's output, computed again),
    at TP = 2 with and without SP: B = 0 and adapters off give the base model exactly, and the
    logits and adapter gradients equal the local layers' at one rank."""
    one, runs = ranks[0][arch], [r[arch][f"te-like-{layout}"] for r in ranks]
    for r in runs:
        assert r["fused_norm_layers"] == 2 * ARCHS[arch]["num_layers"]
        assert torch.equal(r["b0"], r["base"]) and torch.equal(r["off"], r["base"])
        assert not r["base_with_grad"]
    close(torch.cat([r["base"] for r in runs], dim=-1), one["base"], f"te-like {layout}: base logits")
    close(torch.cat([r["logits"] for r in runs], dim=-1), one["logits"], f"te-like {layout}: logits")
    close(torch.cat([r["merged"] for r in runs], dim=-1), one["logits"], f"te-like {layout}: merged")
    shardings = runs[0]["shardings"]
    assert set(shardings) == set(one["grads"])
    for name, sharding in shardings.items():
        grads = [r["grads"][name] for r in runs]
        if sharding[0] is None:
            assert torch.equal(grads[0], grads[1]), name
        close(full_of(grads, sharding), one["grads"][name], f"te-like {layout}: gradient of {name}")


class _Stub(torch.nn.Module):
    """A layer with some of a TE linear's attributes, for the refusals."""

    def __init__(self, **attrs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        self.__dict__.update(attrs)


@pytest.mark.parametrize("module, line", [
    (torch.nn.Linear(2, 2), "LoRA adapts Megatron's ColumnParallelLinear or Transformer Engine's "
                            "linears; decoder.layers.0.self_attention.linear_qkv is a Linear"),
    (_Stub(parallel_mode=None), "LoRA needs decoder.layers.0.self_attention.linear_qkv to be "
                                "column-parallel as in Megatron's GPT layers; this _Stub is replicated over TP"),
    (_Stub(parallel_mode="row"), "LoRA needs decoder.layers.0.self_attention.linear_qkv to be "
                                 "column-parallel as in Megatron's GPT layers; this _Stub is row over TP"),
    (_Stub(parallel_mode="column", is_expert=True), "LoRA on mixture-of-experts experts is not supported "
                                                    "yet (decoder.layers.0.self_attention.linear_qkv)"),
])
def test_layers_an_adapter_cannot_wrap_are_refused(module, line):
    from emapg_megatron.errors import ConfigError
    from emapg_megatron.lora.apply import describe_base

    with pytest.raises(ConfigError) as e:
        describe_base("decoder.layers.0.self_attention.linear_qkv", module, "column")
    assert str(e.value) == line


def test_grouped_expert_linears_are_refused_by_name():
    from emapg_megatron.errors import ConfigError
    from emapg_megatron.lora.apply import describe_base

    grouped = _Stub(parallel_mode="column")  # TE's GroupedLinear holds weight0, weight1, ...
    with pytest.raises(ConfigError, match=r"^LoRA on mixture-of-experts experts is not supported yet"):
        describe_base("decoder.layers.1.mlp.experts.linear_fc1", grouped, "column")


@pytest.mark.parametrize("normalization", ("RMSNorm", "LayerNorm"))
@pytest.mark.parametrize("zero_centered_gamma", (False, True))
def test_the_fused_norm_output_is_the_norm_transformer_engine_applies(normalization, zero_centered_gamma):
    """What a TE LayerNormLinear's adapter reads: TE's norm from TE's attributes (a zero-centred
    gamma stores weight - 1), against torch's own norms, in bf16 through fp32."""
    from emapg_megatron.lora.adapters import fused_norm_output

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 16, generator=g).to(torch.bfloat16)
    gamma, beta = 1 + 0.1 * torch.randn(16, generator=g), 0.1 * torch.randn(16, generator=g)
    layer = _Stub(normalization=normalization, eps=1e-5, zero_centered_gamma=zero_centered_gamma,
                  layer_norm_weight=(gamma - float(zero_centered_gamma)).to(torch.bfloat16),
                  layer_norm_bias=beta.to(torch.bfloat16))
    ref = (torch.nn.RMSNorm(16, eps=1e-5) if normalization == "RMSNorm" else torch.nn.LayerNorm(16, eps=1e-5))
    with torch.no_grad():
        ref.weight.copy_(layer.layer_norm_weight.float() + float(zero_centered_gamma))
        if normalization == "LayerNorm":
            ref.bias.copy_(layer.layer_norm_bias.float())
        expected = ref(x.float()).to(torch.bfloat16)
    out = fused_norm_output(layer, x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


@pytest.mark.parametrize("blocks", (1, 2))
def test_sharding_round_trip(blocks):
    full = torch.arange(24.0).reshape(12, 2)
    rows = Sharding(0, blocks)
    shards = [rows.local(full, r, 3) for r in range(3)]
    assert torch.equal(rows.full(shards), full)
    if blocks == 2:  # [gate; up] -> rank r holds [gate_r; up_r]
        assert torch.equal(shards[1], full[[2, 3, 8, 9]])
    cols = Sharding(1)
    assert torch.equal(cols.full([cols.local(full, r, 2) for r in range(2)]), full)
    assert Sharding(None).local(full, 1, 2) is full
