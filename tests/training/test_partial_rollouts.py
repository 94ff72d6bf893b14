"""--partial-rollouts end to end: refused in one line where it does not apply yet; a run carries
unfinished sequences between steps, logs its counts, and a resume from a checkpoint taken while
sequences are in flight continues exactly as the uninterrupted run."""

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
    (["--tensor-model-parallel-size", "1", "--rollout-batch-size", "16"], 2, "needs data-parallel size 1"),
    (["--task", "search", "--load-hf", "/tmp", "--data-path", "/tmp", "--retriever", "http://x"], 2,
     "does not support multi-turn tasks"),
])
def test_what_partial_rollouts_do_not_support_is_one_line(argv, world, message):
    r = run_cli("--partial-rollouts", *argv, env_world=world)
    assert r.returncode == 2 and r.stderr.startswith("error: --partial-rollouts ") and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.slow
def test_in_flight_sequences_survive_a_resume_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = torchrun(1, ["--train-iters", "3", *PARTIAL], tmp_path / "full")
    assert r.returncode == 0, r.stdout + r.stderr
    full = metrics(tmp_path / "full")
    assert full[1]["partial/carried"] > 0  # the checkpoint of step 2 holds sequences in flight
    assert sum(m["partial/dropped_stale"] for m in full[2:]) > 0
    assert max(m["partial/policy_lag_max"] for m in full) == 1  # --max-staleness 1
    r = torchrun(1, ["--train-iters", "2", "--save", str(ckpt), *PARTIAL], tmp_path / "a")
    assert r.returncode == 0, r.stdout + r.stderr
    r = torchrun(1, ["--train-iters", "3", "--load", str(ckpt), *PARTIAL], tmp_path / "b")
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = metrics(tmp_path / "b")
    assert [m["step"] for m in resumed] == [3]
    for got, want in zip(resumed, full[2:]):
        for k in (*COMPARED, *KEYS, "response_len"):
            assert got[k] == want[k], (k, got["step"])  # bit for bit: weights, data, the pool
