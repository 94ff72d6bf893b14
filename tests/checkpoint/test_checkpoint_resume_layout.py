"""Resuming at another layout: what megatron can reshard is resharded (model, optimizer, EMA;
the data position follows the step), the per-rank RNG is reseeded with a warning, the rest is
refused in one line. Also: metrics.jsonl after a resume, and --train-iters below the step."""

import json
import shutil

import pytest

from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.errors import ConfigError
from emapg_megatron.run.metrics import MetricsLogger, read_jsonl

LOCAL = {"world_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
         "data_parallel_size": 1, "optimizer": "local"}
DIST = dict(LOCAL, optimizer="distributed:dp_reshardable")


def layout(base, **changes):
    out = dict(base, **changes)
    out["data_parallel_size"] = out["world_size"] // (out["tensor_model_parallel_size"]
                                                      * out["pipeline_model_parallel_size"])
    return out


@pytest.mark.parametrize("now", [
    layout(LOCAL, world_size=1, tensor_model_parallel_size=1),
    layout(LOCAL, world_size=4),
    layout(LOCAL, world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=2),
], ids=["tp1", "tp2xdp2", "pp2xdp2"])
def test_the_local_optimizer_reshards_anywhere(now):
    checkpointing.check_layout(LOCAL, now, "CKPT")


def test_the_distributed_optimizer_reshards_over_dp_only():
    checkpointing.check_layout(DIST, layout(DIST, world_size=8), "CKPT")
    with pytest.raises(ConfigError) as e:
        checkpointing.check_layout(DIST, layout(DIST, world_size=1, tensor_model_parallel_size=1), "CKPT")
    assert str(e.value) == ("--load CKPT: the distributed optimizer's state was saved at tensor "
                            "model parallel size 2 and can only be resharded over data-parallel "
                            "ranks: resume with --tensor-model-parallel-size 2 (any DP size)")
    with pytest.raises(ConfigError, match="pipeline model parallel size 1 .* --pipeline-model"):
        checkpointing.check_layout(DIST, layout(DIST, world_size=4, pipeline_model_parallel_size=2), "C")
    with pytest.raises(ConfigError, match="saved with --use-distributed-optimizer and this run is "
                                          "without it.*resume with --use-distributed-optimizer"):
        checkpointing.check_layout(DIST, LOCAL, "CKPT")
    with pytest.raises(ConfigError, match="'dp_reshardable' format, this run's in 'fully_reshardable'"):
        checkpointing.check_layout(DIST, dict(DIST, optimizer="distributed:fully_reshardable"), "C")


def test_a_checkpoint_without_a_recorded_layout_is_inferred():
    from types import SimpleNamespace

    old = SimpleNamespace(common={"optimizer": {"param_state_sharding_type": "dp_reshardable"},
                                  "common": {"iteration": 2}},
                          metadata=SimpleNamespace(state_dict_metadata={"a": 0, "rng_state/shard_1_4": 0}))
    assert checkpointing.saved_layout(old) == {
        "world_size": 4, "tensor_model_parallel_size": None, "pipeline_model_parallel_size": None,
        "data_parallel_size": None, "optimizer": "distributed:dp_reshardable"}
    checkpointing.check_layout(checkpointing.saved_layout(old), DIST, "CKPT")  # unknown TP: let it try


def test_train_iters_below_the_checkpoint_step_is_refused(tmp_path):
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / checkpointing.TRACKER).write_text("5")
    assert checkpointing.check_train_iters(5, str(tmp_path)) == 5
    with pytest.raises(ConfigError) as e:
        checkpointing.check_train_iters(4, str(tmp_path))
    assert str(e.value) == f"--train-iters 4 is below the checkpoint's step 5 in {tmp_path}"


def test_metrics_jsonl_is_trimmed_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "kl": 0.1 * s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "kl"')  # killed mid-write
    log = MetricsLogger(str(tmp_path), total_steps=5, start_step=3)
    log.log(4, {"kl": 1.0})
    log.close()
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2, 3, 4]
    assert read_jsonl(str(path))[3]["kl"] == 1.0
    MetricsLogger(str(tmp_path), total_steps=5, start_step=1, enabled=False)  # other ranks: untouched
    assert [r["step"] for r in read_jsonl(str(path))] == [1, 2, 3, 4]


# --- end to end: the real trainer, saved at TP=2 on 2 processes ---------------------------------
from trainer_launch import COMPARED, metrics, torchrun  # noqa: E402  (the trainer-test helpers)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """3 steps at TP=2, checkpoints at steps 2 and 3; the tracker is pointed back at step 2 so
    that this run's step 3 is the reference for every resumed layout."""
    root = tmp_path_factory.mktemp("tp2")
    r = torchrun(2, ["--train-iters", "3", "--save-interval", "2", "--save", str(root / "ckpt"),
                     "--tensor-model-parallel-size", "2"], root / "log")
    assert r.returncode == 0, r.stdout + r.stderr
    (root / "ckpt" / checkpointing.TRACKER).write_text("2")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("nproc, tp", [(1, 1), (4, 2)], ids=["world1-tp1", "world4-tp2xdp2"])
def test_resume_at_another_world_size(nproc, tp, tp2_run, tmp_path):
    r = torchrun(nproc, ["--train-iters", "3", "--load", str(tp2_run / "ckpt"),
                         "--tensor-model-parallel-size", str(tp)], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "resumed from" in out and "per-rank RNG state is not restored but reseeded" in out
    (resumed,), reference = metrics(tmp_path), metrics(tp2_run / "log")[2]
    assert resumed["step"] == 3 and resumed["reward_mean"] == reference["reward_mean"]  # same data
    for k in COMPARED:  # weights, Adam state and EMA carried over
        assert resumed[k] == pytest.approx(reference[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow
def test_load_of_a_tampered_checkpoint_runs_nothing(tp2_run, tmp_path):
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tp2_run / "ckpt", ckpt)
    (ckpt / "iter_0000002" / ".metadata").write_bytes(pickle.dumps(Payload()))
    r = torchrun(1, ["--train-iters", "3", "--load", str(ckpt), "--tensor-model-parallel-size", "1"],
                 tmp_path / "log")
    assert r.returncode != 0
    assert f"error: refusing to load {ckpt / 'iter_0000002' / '.metadata'}: it references " \
           f"posix.system" in r.stdout + r.stderr
    assert not (tmp_path / "pwned").exists()


def test_the_distributed_optimizer_does_not_reshard_experts_over_ep():
    """Its expert state is sharded over the expert data-parallel ranks, which EP changes; a
    checkpoint from before EP was recorded is let through."""
    saved = dict(DIST, expert_model_parallel_size=2)
    with pytest.raises(ConfigError, match="expert model parallel size 2 .* --expert-model-parallel-size 2"):
        checkpointing.check_layout(saved, dict(DIST, expert_model_parallel_size=1), "CKPT")
    checkpointing.check_layout(saved, dict(DIST, expert_model_parallel_size=2, world_size=4), "CKPT")
    checkpointing.check_layout(DIST, dict(DIST, expert_model_parallel_size=2), "CKPT")
    checkpointing.check_layout(dict(LOCAL, expert_model_parallel_size=2),
                               dict(LOCAL, expert_model_parallel_size=1), "CKPT")  # the local one reshards
