"""The evaluate CLI on the sample files (no model needed)."""
import json
import os
import subprocess
import sys

import pytest

from emapg_megatron import evaluate
from emapg_megatron.tasks.passk import pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S = os.path.join(ROOT, "data", "samples")


def test_math_sample_end_to_end(tmp_path):
    pytest.importorskip("math_verify")
    out = tmp_path / "math"
    rc = evaluate.main(["--task", "math", "--data", os.path.join(S, "math.jsonl"),
                        "--responses", os.path.join(S, "math_responses.jsonl"),
                        "--n-samples", "4", "--out", str(out), "--workers", "2"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["ks"] == [1, 2, 4]
    assert set(res["by_source"]) == {"gsm_style", "math_style", "competition_style"}
    assert res["overall"]["n_problems"] == 36
    # recompute from the per-row scores
    scores = [json.loads(line) for line in (out / "scores.jsonl").read_text().splitlines()]
    assert len(scores) == 36 and all(len(s["correct"]) == 4 for s in scores)
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(s["correct"]), k) for s in scores) / 36
        assert res["overall"]["pass@k"][str(k)] == pytest.approx(want)
    # pattern 0 of the sample responses is all-correct, pattern 3 all-wrong
    assert scores[0]["correct"] == [1, 1, 1, 1]
    assert scores[3]["correct"][0] == 0 and scores[3]["correct"][3] == 0
    md = (out / "results.md").read_text()
    assert "| gsm_style | 12 |" in md and "pass@4" in md
    png = (out / "passk.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_sample_subprocess(tmp_path):
    out = tmp_path / "search"
    proc = subprocess.run(
        [sys.executable, "-m", "emapg_megatron.evaluate", "--task", "search", "--data", os.path.join(S, "qa.jsonl"),
         "--responses", os.path.join(S, "search_responses.jsonl"), "--n-samples", "2", "--k", "1,2",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "nq_sample" in proc.stdout and "hotpotqa_sample" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["n_samples"] == 2 and res["by_source"]["nq_sample"]["n_problems"] == 10
    assert (out / "passk.png").exists() and (out / "results.md").exists()


def test_load_of_a_non_hf_directory_is_a_one_line_error(tmp_path, capsys):
    """Without vLLM (this CPU machine) --load uses the Megatron sampler, which needs an HF dir."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: --load goes to the vLLM backend")
    rc = evaluate.main(["--task", "search", "--data", os.path.join(S, "qa.jsonl"), "--load", "/no/ckpt",
                        "--n-samples", "2", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not a Hugging Face directory" in err and "\n" not in err


def test_too_few_responses_is_reported(tmp_path, capsys):
    rc = evaluate.main(["--task", "search", "--data", os.path.join(S, "qa.jsonl"),
                        "--responses", os.path.join(S, "search_responses.jsonl"),
                        "--n-samples", "8", "--out", str(tmp_path)])
    assert rc == 2
    assert "fewer than --n-samples 8" in capsys.readouterr().err


def test_responses_flat_format_and_missing_field(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question": "q0", "golden_answers": ["a"]}, {"question": "q1"}, {"question": "q2", "golden_answers": "b"}]) + "\n")
    resp = tmp_path / "r.jsonl"
    resp.write_text("\n".join(json.dumps(r) for r in [
        {"index": 0, "response": "<answer>a</answer>"}, {"index": 0, "response": "<answer>x</answer>"},
        {"index": 2, "response": "<answer>b</answer>"}, {"index": 2, "response": "<answer>b</answer>"}]) + "\n")
    out = tmp_path / "o"
    rc = evaluate.main(["--task", "search", "--data", str(data), "--responses", str(resp),
                        "--n-samples", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["overall"]["n_problems"] == 2  # row 1 skipped (reported), rows 0 and 2 scored
    assert res["overall"]["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    rc = evaluate.main(["--task", "search", "--data", str(data), "--responses", str(resp),
                        "--n-samples", "2", "--out", str(out), "--on-bad-row", "error"])
    assert rc == 2 and "index 1 (missing 'golden_answers')" in capsys.readouterr().err


def test_generate_responses_with_a_fake_backend():
    """The backend protocol, including the multi-turn loop for the search task."""
    pytest.importorskip("bm25s")
    from emapg_megatron.tasks import get_task

    task = get_task("search", retriever=os.path.join(S, "corpus.jsonl"), max_turns=3)
    rows = task.load(os.path.join(S, "qa.jsonl"), limit=2).to_list()
    calls = []

    def backend(prompts, n, **kw):
        calls.append(kw)
        outs = []
        for p in prompts:
            if not p.endswith("</information>\n\n"):  # the prompt itself mentions the tags
                outs.append(["<search> Eiffel Tower designed built </search>"] * n)
            else:
                outs.append(["<answer> Gustave Eiffel </answer>"] * n)
        return outs

    res = evaluate.generate_responses(task, rows, backend, n=2)
    assert len(res) == 2 and all(len(r) == 2 for r in res)
    assert "<information>" in res[0][0] and res[0][0].endswith("<answer> Gustave Eiffel </answer>")
    assert calls[0]["stop"] == ["</search>", "</answer>"] and len(calls) == 2
    correct = evaluate.score(task, rows, res)
    assert correct[0] == [True, True] and correct[1] == [False, False]
