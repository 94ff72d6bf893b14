"""--partial-rollouts end to end: refused in one line where it does not apply yet; a run carries
unfinished sequences between steps, logs its counts, and a resume from a checkpoint taken while
sequences are in flight continues exactly as the uninterrupted run."""

import re
import shutil
import sys

import pytest
from trainer_launch import COMPARED, metrics, torchrun

sys.path.insert(0, __file__.rsplit("/training/", 1)[0])  # tests/: the CLI's in-process runner
from test_cli_validation import run_cli  # noqa: E402

# Groups of 2 with room for 32 tokens: some groups finish early, others are carried (and some go
# stale after two steps), so the checkpoint of step 2 holds sequences in flight.
PARTIAL = ["--partial-rollouts", "--max-new-tokens", "32", "--seq-length", "40",
           "--max-position-embeddings", "40", "--num-samples-per-prompt", "2", "--rollout-is", "tis"]
KEYS = ("partial/carried", "partial/dropped_stale", "partial/policy_lag_mean", "partial/policy_lag_max")


@pytest.mark.parametrize("argv, world, message", [
    (["--rollout-engine", "vllm"], 2, "needs the built-in sampler"),
    (["--no-rollout-kv-cache"], 2, "needs the KV-cached sampler"),
    (["--sequence-parallel"], 2, "does not support --sequence-parallel"),
    (["--tensor-model-parallel-size", "1", "--no-inference-fixed-shape-decode"], 2,
     "at data-parallel size 2 needs the fixed-shape decode step"),
    (["--task", "search", "--load-hf", "/tmp", "--data-path", "/tmp", "--retriever", "http://x"], 2,
     "does not support multi-turn tasks"),
])
def test_what_partial_rollouts_do_not_support_is_one_line(argv, world, message):
    r = run_cli("--partial-rollouts", *argv, env_world=world)
    assert r.returncode == 2 and r.stderr.startswith("error: --partial-rollouts ") and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


TP2 = ("2", ["--tensor-model-parallel-size", "2"])
PP2 = ("2", ["--pipeline-model-parallel-size", "2", "--max-staleness", "0"])  # resumes a drop too


def _back_to_step_2(ckpt) -> None:
    """The checkpoint as a run stopped after its step-2 save left it (the later save moved aside,
    to ``final``)."""
    shutil.move(ckpt / "iter_0000003", ckpt.parent / "final")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")


def _tensors(step_dir) -> dict:
    """Every tensor of a checkpoint (weights, Adam moments, EMA), read without unpickling its
    byte items."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(step_dir)), no_dist=True)
    return out


def _resumed_pool(stdout: str) -> tuple[int, int]:
    """(groups, sequences holding tokens) from the resume's log line."""
    found = re.search(r"resumed from .* at step 2, with (\d+) prompt groups in flight \((\d+) "
                      r"sequences holding tokens\)", stdout)
    assert found, stdout
    return int(found[1]), int(found[2])


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory):
    """A TP=2 run of 3 steps saving at steps 2 and 3, rewound to its step-2 checkpoint."""
    tmp = tmp_path_factory.mktemp("partial_tp2")
    return tmp, _uninterrupted(tmp, *TP2)


def _uninterrupted(tmp, nproc, layout):
    ckpt = tmp / "ckpt"
    r = torchrun(int(nproc), ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "2",
                              *layout, *PARTIAL], tmp / "full")
    assert r.returncode == 0, r.stdout + r.stderr
    _back_to_step_2(ckpt)
    full = metrics(tmp / "full")
    assert full[1]["partial/carried"] > 0  # the checkpoint of step 2 holds sequences in flight
    if "--max-staleness" in layout:  # 0: every sequence carried into step 3 restarts there, and
        # so does every finished one whose group was not complete
        assert full[2]["partial/dropped_stale"] >= full[1]["partial/carried"]
        assert max(m["partial/policy_lag_max"] for m in full) == 0
    else:
        assert max(m["partial/policy_lag_max"] for m in full) == 1  # --max-staleness 1
    return ckpt, full


def _resume(tmp, ckpt, nproc, layout, full, save=()):
    r = torchrun(int(nproc), ["--train-iters", "3", "--load", str(ckpt), *save, *layout, *PARTIAL], tmp / "b")
    assert r.returncode == 0, r.stdout + r.stderr
    groups, holding = _resumed_pool(r.stdout + r.stderr)
    assert holding == full[1]["partial/carried"] and groups > 0  # every sequence in flight came back
    return metrics(tmp / "b")


@pytest.mark.parametrize("argv, fixed_shape, graphs", [
    ([], False, None),  # off by default: the lockstep sampler, as before partial rollouts
    (["--partial-rollouts"], True, None),  # its decoder, graphs wherever it runs on a GPU at PP=1
    (["--partial-rollouts", "--no-inference-cuda-graphs"], True, False),
    (["--partial-rollouts", "--inference-cuda-graphs"], True, True),
    (["--partial-rollouts", "--no-inference-fixed-shape-decode"], False, None),
    (["--inference-fixed-shape-decode"], True, None),
])
def test_partial_rollouts_are_off_by_default_and_pick_the_fixed_shape_step(argv, fixed_shape, graphs):
    from emapg_megatron.arguments import parse_args

    cfg = parse_args(["--preset", "tiny-cpu", *argv])
    assert cfg.partial_rollouts.enabled == ("--partial-rollouts" in argv)
    sampler = cfg.sampler.resolved(cfg.partial_rollouts.enabled)
    assert sampler.fixed_shape is fixed_shape and sampler.cuda_graphs is graphs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_in_flight_sequences_survive_a_resume_exactly(saved_tp2, tmp_path, layout):
    """Stopped after the step-2 save and resumed at the same layout: step 3 is the uninterrupted
    run's, bit for bit (metrics, then every tensor of the step-3 checkpoint)."""
    if layout == "tp2":
        (tmp, (ckpt, full)), (nproc, argv) = saved_tp2, TP2
    else:
        (tmp, (nproc, argv)) = tmp_path, PP2
        ckpt, full = _uninterrupted(tmp, nproc, argv)
    resumed = _resume(tmp, ckpt, nproc, argv, full, save=("--save", str(tmp / "resumed")))
    assert [m["step"] for m in resumed] == [3]
    for k in (*COMPARED, *KEYS, "response_len"):
        assert resumed[0][k] == full[2][k], k
    want, got = _tensors(tmp / "final"), _tensors(tmp / "resumed" / "iter_0000003")
    assert sorted(got) == sorted(want) and any("exp_avg" in k for k in got)
    assert all(got[k].equal(want[k]) for k in want)


@pytest.mark.slow
def test_a_resume_at_another_layout_keeps_every_sequence_in_flight(saved_tp2, tmp_path):
    """The TP=2 checkpoint resumed on one process and at DP=2: the pool comes back whole (the log
    line's counts are the saved run's). The two DP layouts then sample the same step: the pool is
    shared, each DP rank continues its share and they agree after each decode step when to stop."""
    (_, (ckpt, full)) = saved_tp2
    one = _resume(tmp_path / "dp1", ckpt, "1", [], full)
    two = _resume(tmp_path / "dp2", ckpt, "2", [], full)
    assert [m["step"] for m in one] == [m["step"] for m in two] == [3]
    for k in (*KEYS, "reward_mean", "response_len"):
        assert two[0][k] == one[0][k], k
    for k in COMPARED:
        assert two[0][k] == pytest.approx(one[0][k], rel=1e-4, abs=1e-6), k
