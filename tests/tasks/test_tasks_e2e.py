"""Each task trains for 2 steps through the trainer at TP=2 on CPU, from a tiny HF checkpoint."""

import json
import os

import pytest
from tiny_hf import SAMPLES
from trainer_launch import metrics, torchrun  # the shared launcher (tests/training)

pytestmark = pytest.mark.slow

COMMON = ["--tensor-model-parallel-size", "2", "--train-iters", "2", "--rollout-batch-size", "2",
          "--num-samples-per-prompt", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--chat-template", "never", "--kl-topk-tokens", "8", "--lr", "1e-4",
          "--make-vocab-size-divisible-by", "16", "--temperature", "1.0"]


@pytest.fixture(scope="module")
def tiny_hf(tiny_hf_model):
    pytest.importorskip("math_verify")
    pytest.importorskip("bm25s")
    return tiny_hf_model  # conftest.py's, shared with other modules


def run_task(tmp_path, argv):
    # The preset's synthetic-task model flags do not apply: --load-hf supplies the shape.
    cmd = ["--task", *argv, *COMMON, "--log-dir", str(tmp_path)]
    r = torchrun(2, cmd, tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return metrics(tmp_path)


def test_math_task_trains_two_steps_at_tp2(tiny_hf, tmp_path):
    ms = run_task(tmp_path, ["math", "--load-hf", tiny_hf, "--data-path",
                             os.path.join(SAMPLES, "math.jsonl"), "--seq-length", "192",
                             "--max-new-tokens", "8"])
    assert [m["step"] for m in ms] == [1, 2]
    assert all(0.0 <= m["reward_mean"] <= 1.1 for m in ms)
    assert ms[0]["rollout_logprob_diff"] < 1e-4


def test_search_task_trains_two_steps_at_tp2(tiny_hf, tmp_path):
    ms = run_task(tmp_path, ["search", "--load-hf", tiny_hf, "--data-path",
                             os.path.join(SAMPLES, "qa.jsonl"), "--retriever",
                             os.path.join(SAMPLES, "corpus.jsonl"), "--seq-length", "768",
                             "--max-turns", "2", "--max-turn-tokens", "8", "--max-obs-tokens", "64",
                             "--max-new-tokens", "8"])
    assert [m["step"] for m in ms] == [1, 2]
    assert all(m["response_len"] > 0 for m in ms)
    for m in ms:  # per episode, counted once per model-parallel group (TP=2 here)
        assert 1.0 <= m["search/turns"] <= 2.0 and 0.0 <= m["search/calls"] <= 1.0
        assert 0.0 <= m["search/valid_action_rate"] <= 1.0 and 0.0 <= m["search/answered"] <= 1.0


def test_evaluate_load_runs_on_cpu_with_the_megatron_sampler(tiny_hf, tmp_path):
    """Without vLLM or a GPU, `evaluate --load HF_DIR` generates with the built-in sampler."""
    import subprocess
    import sys

    out = tmp_path / "eval"
    r = subprocess.run([sys.executable, "-m", "emapg_megatron.evaluate", "--task", "math",
                        "--data-path", os.path.join(SAMPLES, "math.jsonl"), "--load", tiny_hf,
                        "--num-samples-per-prompt", "2", "--max-new-tokens", "6", "--out", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    lines = (out / "responses.jsonl").read_text().splitlines()
    assert len(lines) == 36 and all(len(json.loads(x)["responses"]) == 2 for x in lines)
    assert "pass@1" in json.dumps(results).lower()
    assert (out / "passk.png").is_file()


def test_math_task_trains_on_a_verl_format_file(tiny_hf, tmp_path):
    ms = run_task(tmp_path, ["math", "--load-hf", tiny_hf, "--data-path",
                             os.path.join(SAMPLES, "verl_deepscaler.parquet"), "--seq-length", "192",
                             "--max-new-tokens", "8"])
    assert [m["step"] for m in ms] == [1, 2]
