"""The trainer launched as torchrun does (ranks forked with torchrun's environment, see
trainer_launch.py): layouts agree with one rank, resume is bit-exact, NaN steps are skipped and
counted; under a real torchrun (marked ``launch``): SIGTERM checkpoints (also the smoke run of a
real ``torchrun -m emapg_megatron.train``: steps, a checkpoint, exit 0), a dead peer ends the run."""

import signal
import time

import pytest
from train_run_workers import refused_update_changes_nothing
from trainer_launch import BASE, COMPARED, metrics, torchrun
from trainer_workers import save_initial_weights

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("init")
    run_distributed(save_initial_weights, 1, args=(str(path), BASE))
    return str(path)


@pytest.fixture(scope="module")
def reference(init_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("ref")
    r = torchrun(1, ["--train-iters", "3", "--pretrained-checkpoint", init_ckpt], log)
    assert r.returncode == 0, r.stdout + r.stderr
    return metrics(log)


def test_anchor_starts_at_the_policy_and_rollout_logprobs_match(init_ckpt, reference, tmp_path):
    # One mini-batch per step: the first loss sees pi_theta == pi_ema exactly.
    # The cache in waves of 5 of the 16 sequences, its prefill (5 rows x 5 prompt tokens) in row
    # micro-batches: the sampler's log-probs must still be the trainer's.
    r = torchrun(1, ["--train-iters", "1", "--global-batch-size", "16", "--ema-stability-interval", "1",
                     "--inference-max-requests", "5", "--inference-batch-times-seqlen-threshold", "8",
                     "--pretrained-checkpoint", init_ckpt], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (first,) = metrics(tmp_path)
    assert abs(first["kl"]) < 1e-6
    # The stability monitor (eq. 28) is wired with this run's eta, lr and beta.
    assert first["ema/fisher_trace"] > 0
    expected = 1 + 0.5 - first["lr"] * 0.001 * first["ema/fisher_trace"]
    assert first["ema/stability_margin"] == pytest.approx(expected, rel=1e-9)
    assert first["rollout_logprob_diff"] < 1e-5  # sampler and trainer agree (padding excluded)
    assert first["rollout_cache_waves"] == 4
    assert 0 < first["rollout_time_s"] < first["step_time_s"]
    assert first["rollout_tokens_per_s"] > first["tokens_per_s"] > 0
    assert reference[-1]["kl"] > 1e-5  # later the policy moves away from the anchor


@pytest.mark.parametrize("nproc, layout", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--pipeline-model-parallel-size", "2"]),
    (2, ["--use-distributed-optimizer"]),  # DP=2
    (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),  # TP=2 x DP=2
], ids=["tp2", "pp2", "dp2", "tp2xdp2"])
def test_layouts_match_single_rank(nproc, layout, init_ckpt, reference, tmp_path):
    r = torchrun(nproc, ["--train-iters", "3", "--pretrained-checkpoint", init_ckpt, *layout], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    got = metrics(tmp_path)
    assert [m["step"] for m in got] == [1, 2, 3]
    for ref_m, m in zip(reference, got):
        assert m["reward_mean"] == ref_m["reward_mean"]  # identical samples
        for k in COMPARED:
            assert m[k] == pytest.approx(ref_m[k], rel=1e-4, abs=1e-6), (k, m["step"])
    assert any(m["ema_lag"] > 0 for m in got)  # the policy moved away from the anchor


@pytest.mark.parametrize("nproc, layout", [
    (1, []),
    (2, ["--use-distributed-optimizer"]),  # DP=2, sharded optimizer state, fp32 main params
])
def test_resume_is_bit_exact_and_continues_to_the_total(nproc, layout, init_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--pretrained-checkpoint", init_ckpt, *layout]
    r = torchrun(nproc, ["--train-iters", "3", *common], tmp_path / "full")
    assert r.returncode == 0, r.stdout + r.stderr
    r = torchrun(nproc, ["--train-iters", "2", "--save", str(ckpt), *common], tmp_path / "a")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    r = torchrun(nproc, ["--train-iters", "3", "--load", str(ckpt), *common], tmp_path / "b")
    assert r.returncode == 0, r.stdout + r.stderr
    resumed, full = metrics(tmp_path / "b"), metrics(tmp_path / "full")
    assert [m["step"] for m in resumed] == [3]
    for k in COMPARED:
        assert resumed[0][k] == full[2][k], k  # bit for bit: weights, Adam state, EMA, data, RNG
    assert not any(p.name.endswith(".tmp") for p in ckpt.iterdir())


def test_corrupt_checkpoint_tracker_is_a_clear_error(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    r = torchrun(1, ["--train-iters", "1", "--load", str(tmp_path)], tmp_path / "log")
    assert r.returncode != 0
    assert "corrupt latest_checkpointed_iteration.txt" in r.stdout + r.stderr


def test_non_finite_initial_weights_are_refused_before_training(tmp_path):
    poisoned = tmp_path / "poisoned"
    run_distributed(save_initial_weights, 1, args=(str(poisoned), BASE, True))
    r = torchrun(1, ["--train-iters", "5", "--pretrained-checkpoint", str(poisoned)], tmp_path / "log")
    assert r.returncode != 0  # torchrun reports a rank's exit code 2 as 1
    assert f"error: --pretrained-checkpoint {poisoned} holds non-finite weights" in r.stdout + r.stderr
    assert not (tmp_path / "log" / "metrics.jsonl").exists() or not metrics(tmp_path / "log")


def test_a_refused_update_changes_no_weight():
    for out in run_distributed(refused_update_changes_nothing, 2):  # the NaN is on rank 0 only
        assert out["refused"] and out["unchanged"] and out["adam_untouched"]
        assert out["applied"] and out["moved"] and out["scheduler_steps"] == 1
        assert out["grad_norm"] == pytest.approx(out["expected_grad_norm"], rel=1e-5)  # every grad 1e-3


def test_exploding_weights_stop_the_run_before_the_ema_and_any_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = torchrun(1, ["--train-iters", "4", "--lr", "1e30", "--clip-grad", "0", "--save", str(ckpt),
                     "--save-interval", "1"], tmp_path / "log")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "error: stopping after step 1: the weights are exploded" in r.stdout + r.stderr
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()  # nothing was saved
    assert not (tmp_path / "log" / "metrics.jsonl").exists() or not metrics(tmp_path / "log")


@pytest.mark.launch
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(init_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = torchrun(2, ["--train-iters", "200", "--tensor-model-parallel-size", "2",
                        "--pretrained-checkpoint", init_ckpt, "--save", str(ckpt)],
                    tmp_path / "log", wait=False)
    deadline = time.time() + 240
    log = tmp_path / "log" / "metrics.jsonl"
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 2):
        time.sleep(0.5)
    import psutil

    for worker in psutil.Process(proc.pid).children():  # the training ranks, as a scheduler would
        worker.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "signal received" in out
    step = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= step < 200


@pytest.mark.launch
def test_a_dead_peer_ends_the_run_with_one_line(init_ckpt, tmp_path):
    proc = torchrun(2, ["--train-iters", "200", "--tensor-model-parallel-size", "2",
                        "--pretrained-checkpoint", init_ckpt], tmp_path / "log", wait=False)
    deadline = time.time() + 240
    log = tmp_path / "log" / "metrics.jsonl"
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 2):
        time.sleep(0.5)
    import psutil

    ranks = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
    ranks[-1].kill()  # SIGKILL: the peer dies without a word
    out, _ = proc.communicate(timeout=180)  # a hang guard: the survivor must not wait forever
    assert proc.returncode != 0
    assert "error: a collective failed" in out or "error: stopped by signal" in out, out


def test_rollout_dumps_hold_every_sequence_of_every_dp_rank(tmp_path):
    """--rollout-dump-interval at DP=2: each dumped step has all B x N sequences, their rewards
    averaging to the step's logged reward_mean; steps off the interval are not dumped."""
    import json

    r = torchrun(2, ["--train-iters", "3", "--rollout-dump-interval", "2"], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    dumped = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert {d["step"] for d in dumped} == {2} and len(dumped) == 4 * 4
    step2 = metrics(tmp_path)[1]
    assert abs(sum(d["reward"] for d in dumped) / len(dumped) - step2["reward_mean"]) < 1e-6
    assert all(isinstance(d["prompt"], str) and isinstance(d["response"], str) for d in dumped)
