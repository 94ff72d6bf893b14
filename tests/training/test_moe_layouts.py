"""Mixture-of-experts layouts beyond EP=2 on two ranks: every one trains like one rank.

The tiny Qwen3-MoE (qk-layernorm, renormalised top-k) and Mixtral (Llama attention) models of
``moe_checkpoint_workers`` (4 experts, top-2, every layer MoE) are loaded through the HF converter
(``--load-hf``), so every layout starts from the same weights, and train three trainer steps (two
optimizer updates each) on four ranks: EP=2 x TP=2 with sequence parallelism (experts split by TP
too, or whole with --expert-tensor-parallel-size 1), EP=2 x PP=2, and EP=2 x DP=2 (four data
ranks, experts split over two of them: expert-data-parallel 2) with the distributed optimizer.
The metrics, the gradient norm included (Megatron's, over every model-parallel and expert group),
match the one-rank run (rel <= 1e-4), and so does every weight afterwards (the HF export stream
gathers each layout's shards into whole tensors). EP=2 x TP=2 without sequence parallelism does
not exist: megatron-core refuses expert and tensor parallelism without it (docs/moe.md).
"""

import pytest
import torch
from test_equivalence_matrix import BASE, STEPS  # the dense matrix's run, its model aside
from trainer_launch import COMPARED as DENSE_COMPARED

pytestmark = pytest.mark.slow

COMPARED = (*DENSE_COMPARED, "grad_norm", "moe_load_max_over_mean")
# four data ranks hold whole prompt groups of two samples; two updates per step as above
DP4_BATCHES = ["--rollout-batch-size", "8", "--num-samples-per-prompt", "2", "--micro-batch-size", "2"]
SP = ["--sequence-parallel"]
LAYOUTS = {  # nproc, TP, PP, EP, flags
    "ep2xtp2-sp": (4, 2, 1, 2, SP),
    "ep2xtp2-sp-etp1": (4, 2, 1, 2, [*SP, "--expert-tensor-parallel-size", "1"]),
    "ep2xpp2": (4, 1, 2, 2, []),
    "ep2xdp2-distopt": (4, 1, 1, 2, [*DP4_BATCHES, "--use-distributed-optimizer"]),
    "ep2": (2, 1, 1, 2, []),
}
# four processes per case on the two-core CI machine: the experts split by TP on Qwen3-MoE and
# whole on Mixtral, PP on both, expert-data-parallel on Qwen3-MoE
CASES = [("qwen3_moe", "ep2xtp2-sp"), ("qwen3_moe", "ep2xpp2"), ("qwen3_moe", "ep2xdp2-distopt"),
         ("mixtral", "ep2xtp2-sp-etp1"), ("mixtral", "ep2xpp2"),
         # a dense first layer (decoder_sparse_step 2)
         ("qwen3_moe_mixed", "ep2")]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """The two architectures with the copy task's vocabulary (13 tokens, 16 with padding): a
    random policy then earns rewards, so the steps have gradients to compare."""
    from moe_checkpoint_workers import MODELS, build_hf_model

    root = tmp_path_factory.mktemp("moe_hf")
    dirs = {}
    for seed, arch in enumerate(("qwen3_moe", "mixtral", "qwen3_moe_mixed")):
        family, overrides, _ = MODELS[arch]
        build_hf_model(family, {**overrides, "vocab_size": 16}, seed).save_pretrained(root / arch)
        dirs[arch] = str(root / arch)
    return dirs


def _argv(hf_dir: str, layout: str, one_rank: bool = False) -> list:
    _, tp, pp, ep, flags = LAYOUTS[layout]
    batches = DP4_BATCHES if layout.startswith("ep2xdp2") else []
    if one_rank:
        return [*BASE, "--load-hf", hf_dir, *batches]
    return [*BASE, "--load-hf", hf_dir, "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep), *flags]


@pytest.mark.parametrize("arch, layout", CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_moe_layout_trains_like_one_rank(arch, layout, hf_dirs, trainer_steps):
    nproc, tp, pp, ep, flags = LAYOUTS[layout]
    routes_recorded = pp == 1  # per padded sequence on one stage; under SP gathered over TP
    (ref,) = trainer_steps(1, _argv(hf_dirs[arch], layout, one_rank=True), STEPS, export_hf=True)
    outs = trainer_steps(nproc, _argv(hf_dirs[arch], layout), STEPS, tp=tp, pp=pp, ep=ep, export_hf=True)
    for rank, out in enumerate(outs):
        for step, (m, r) in enumerate(zip(out["metrics"], ref["metrics"], strict=True), start=1):
            assert m["reward_mean"] == r["reward_mean"], (rank, step)  # identical samples
            for k in COMPARED:
                if k == "moe_load_max_over_mean" and not routes_recorded:
                    assert k not in m  # the expert load comes from recorded routes (docs/moe.md)
                    continue
                assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, rank, step)
            if routes_recorded:  # the sampler's routes (gathered whole under SP) are the old pass's
                assert m["moe_route_agreement"] == r["moe_route_agreement"] == 1.0, (rank, step)
    last = ref["metrics"][-1]
    assert last["ema_lag"] > 0 and last["kl"] != 0 and last["grad_norm"] > 0  # the policy really moved
    got, want = outs[0]["hf"], ref["hf"]
    assert sorted(got) == sorted(want)
    routers = [n for n in want if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]
    experts = [n for n in want if ".experts." in n]
    assert routers and experts
    # Adam divides each gradient entry by its own running RMS: on entries whose gradient is nearly
    # zero, the float-order noise of split reductions moves the weight by a share of the learning
    # rate (0.002). Measured: 4e-8 at EP x PP, 1.2e-5 at EP x TP x SP; allowed: 2.5% of one step.
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=5e-5, msg=name)


# --- distillation: a MoE teacher, and a dense teacher for a MoE student -----------------------
TEACHERS = {"moe-teacher": "mixtral", "dense-teacher": "qwen3-tied-qknorm"}


@pytest.mark.parametrize("teacher", list(TEACHERS))
def test_moe_distillation_at_ep2_matches_one_rank(teacher, hf_dirs, hf_models, trainer_steps):
    """The Qwen3-MoE student distilled from the Mixtral teacher (its experts split by EP like the
    student's) or from a dense Qwen3 (conftest.py's hf_models) at EP=2 on two ranks: the one-rank
    metrics, the KL to the teacher included."""
    from test_distillation import without_ema

    source = {**hf_dirs, **hf_models}[TEACHERS[teacher]]
    argv = [*without_ema(_argv(hf_dirs["qwen3_moe"], "ep2xpp2", one_rank=True)), "--teacher-load-hf", source,
            "--kl-coef", "0.5"]
    (ref,) = trainer_steps(1, argv, STEPS)
    outs = trainer_steps(2, [*argv, "--expert-model-parallel-size", "2"], STEPS, ep=2)
    assert ref["metrics"][0]["kl"] != 0 and "ema_lag" not in ref["metrics"][0]  # the teacher is the anchor
    for rank, out in enumerate(outs):
        for step, (m, r) in enumerate(zip(out["metrics"], ref["metrics"], strict=True), start=1):
            assert m["reward_mean"] == r["reward_mean"], (rank, step)
            for k in ("kl", "pg_loss", "entropy", "grad_norm", "moe_load_max_over_mean"):
                assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, rank, step)


def test_a_moe_teacher_the_expert_layout_cannot_split_is_refused_in_one_line(hf_dirs):
    """Checked before any process group (build.teacher_architecture), as the student's layout is;
    a dense teacher has no experts, so any EP suits it."""
    from emapg_megatron.anchor.config import TeacherConfig
    from emapg_megatron.anchor.teacher import teacher_model_config
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.errors import ConfigError

    student, _ = model_config_from_hf(read_hf_config(hf_dirs["qwen3_moe"]))
    teacher = TeacherConfig(load_hf=hf_dirs["mixtral"])
    assert teacher_model_config(teacher, student, tp=1, pp=1, ep=2, seq_length=8).num_experts == 4
    with pytest.raises(ConfigError, match=r"teacher cannot be split like the student: "
                                          r"--expert-model-parallel-size 8 does not divide the 4 experts"):
        teacher_model_config(teacher, student, tp=1, pp=1, ep=8, seq_length=8)


@pytest.mark.parametrize("freq, dense", [("1", []), ("2", [1, 3]), ("[0,1,1,1]", [0]), ("0, 1, 0, 1", [0, 2])])
def test_moe_layer_freq_reads_as_megatron_lm_does(freq, dense):
    """--moe-layer-freq N: layers 0, N, 2N... route to experts; a pattern: 1 per MoE layer."""
    from emapg_megatron.arguments import parse_args

    argv = ["--preset", "tiny-cpu", "--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", freq]
    cfg = parse_args(argv).model.architecture(8)
    assert cfg.dense_mlp_layers == dense and cfg.moe_layer_pattern() == (
        None if not dense else [int(i not in dense) for i in range(4)])


@pytest.mark.parametrize("flags, message", [
    (["--moe-layer-freq", "2"], "--moe-layer-freq needs a mixture-of-experts model (--num-experts)"),
    (["--num-experts", "4", "--moe-layer-freq", "[0,1]"], "one 0 (dense) or 1 (MoE) per layer (4 of them"),
    (["--num-experts", "4", "--moe-layer-freq", "[0,0,0,0]"], "no MoE layer (1) in the pattern"),
    (["--num-experts", "4", "--moe-layer-freq", "9"], "a layer interval from 1 to the 4 layers"),
    (["--num-experts", "4", "--moe-layer-freq", "([0]*3+[1])"], "an interval N, or one 0 (dense)"),
])
def test_a_bad_moe_layer_freq_is_one_line(flags, message):
    from emapg_megatron.arguments import parse_args, validate
    from emapg_megatron.errors import ConfigError

    with pytest.raises(ConfigError) as e:  # the checks that need no process group
        validate(parse_args(["--preset", "tiny-cpu", "--num-layers", "4", *flags]), world_size=2)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_pipeline_stage_without_a_moe_layer_is_refused_in_one_line(hf_dirs):
    """Megatron builds no expert optimizer on such a stage while the others reduce their experts'
    statistics over groups that span it: the run would hang. Refused before any process group."""
    from emapg_megatron.arguments import parse_args, validate_architecture
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.errors import ConfigError

    model_cfg, _ = model_config_from_hf(read_hf_config(hf_dirs["qwen3_moe_mixed"]))
    cfg = parse_args(_argv(hf_dirs["qwen3_moe_mixed"], "ep2xpp2"))
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size 2 gives stage 0 only dense-MLP "
                                          r"layers \(0-0\): every stage of a MoE model needs a MoE layer"):
        validate_architecture(cfg, model_cfg)
