"""tools/prepare_data.py on tiny hand-made files in each public format (DeepScaleR's json list,
GSM8K's parquet and jsonl, MATH-500's jsonl): the rows it writes, and that the math task loads
them with its default columns (issue 39, item 12)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "prepare_data.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import prepare_data  # noqa: E402

DEEPSCALER = [  # deepscaler.json: a JSON list of {problem, solution, answer}
    {"problem": "Compute $\\binom{6}{2}$.", "solution": "$\\binom{6}{2} = 15$.", "answer": "15"},
    {"problem": "Simplify $\\frac{6}{8}$.", "solution": "Divide by 2.", "answer": "\\frac{3}{4}"},
]
GSM8K = [  # openai/gsm8k: {question, answer} with a worked solution ending in "#### N"
    {"question": "Tom has 3 boxes of 12 apples. How many apples?", "answer": "3*12=<<3*12=36>>36\n#### 36"},
    {"question": "A car costs $1,200 more than a bike of $300. Price of the car?",
     "answer": "300+1200=<<300+1200=1500>>1500\n#### 1,500"},
    {"question": "It is 2 degrees and drops 5. Temperature?", "answer": "2-5=-3\n#### -3"},
]
MATH500 = [  # HuggingFaceH4/MATH-500 test.jsonl
    {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2", "subject": "Prealgebra",
     "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Solve $x^2=4$ for $x>0$.", "solution": "$x=\\boxed{2}$", "answer": "2", "subject": "Algebra",
     "level": 2, "unique_id": "test/algebra/7.json"},
]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture
def run(capsys):
    """The tool's main() in this process: (returncode, stderr)."""
    def call(*args):
        code = prepare_data.main([str(a) for a in args])
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)
    return call


def read_out(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def public(tmp_path):
    ds = tmp_path / "deepscaler.json"
    ds.write_text(json.dumps(DEEPSCALER))
    gsm_parquet = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), gsm_parquet)
    gsm_jsonl = write_jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K)
    math500 = write_jsonl(tmp_path / "test.jsonl", MATH500)
    return {"deepscaler": str(ds), "gsm8k_parquet": str(gsm_parquet), "gsm8k_jsonl": gsm_jsonl,
            "math500": math500}


def test_each_public_format_becomes_the_math_tasks_rows(run, public, tmp_path):
    expected = {
        "deepscaler": [{"problem": r["problem"], "answer": r["answer"], "data_source": "deepscaler"}
                       for r in DEEPSCALER],
        "gsm8k_parquet": [{"problem": r["question"], "answer": a, "data_source": "gsm8k"}
                          for r, a in zip(GSM8K, ["36", "1500", "-3"])],
        "math500": [{"problem": r["problem"], "answer": r["answer"], "data_source": "math500",
                     "subject": r["subject"], "level": r["level"], "unique_id": r["unique_id"]} for r in MATH500],
    }
    expected["gsm8k_jsonl"] = expected["gsm8k_parquet"]
    for name, rows in expected.items():
        out = tmp_path / f"{name}.jsonl"
        res = run(public[name], "--out", out)
        assert res.returncode == 0, res.stderr
        assert read_out(out) == rows, name
        assert f"wrote {len(rows)} rows" in res.stderr


def test_the_math_task_loads_the_output(run, public, tmp_path):
    from emapg_megatron.tasks import get_task

    out = tmp_path / "all.jsonl"
    res = run(public["deepscaler"], public["gsm8k_parquet"], public["math500"], "--out", out)
    assert res.returncode == 0, res.stderr
    task = get_task("math")
    try:
        ds = task.load(str(out), on_bad_row="error")
        assert len(ds) == len(DEEPSCALER) + len(GSM8K) + len(MATH500)
        assert [ds[i]["ground_truth"] for i in range(len(ds))][2:5] == ["36", "1500", "-3"]
        assert sorted(set(ds["data_source"])) == ["deepscaler", "gsm8k", "math500"]
        assert task.correct("so the answer is \\boxed{1500}", ds[3])
    finally:
        task.close()


def test_format_can_be_named_and_data_source_set(run, public, tmp_path):
    out = tmp_path / "x.jsonl"
    res = run(public["math500"], "--format", "deepscaler", "--data-source", "math500_test", "--out", out)
    assert res.returncode == 0, res.stderr
    assert [r["data_source"] for r in read_out(out)] == ["math500_test", "math500_test"]
    assert "subject" not in read_out(out)[0]  # read as DeepScaleR: problem and answer only


def test_bad_rows_stop_the_conversion_unless_skipped(run, tmp_path):
    src = write_jsonl(tmp_path / "gsm.jsonl", GSM8K + [{"question": "No final answer?", "answer": "I think 4."},
                                                       {"question": "", "answer": "#### 1"}])
    out = tmp_path / "out.jsonl"
    res = run(src, "--out", out)
    assert res.returncode == 2 and not out.exists()
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "2 of 5 rows" in lines[0]
    assert "row 3 (answer has no '#### <number>')" in lines[0] and "row 4 ('question' empty)" in lines[0]
    res = run(src, "--out", out, "--skip-bad")
    assert res.returncode == 0, res.stderr
    assert len(read_out(out)) == 3 and "2 skipped" in res.stderr


def test_refusals(run, public, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("keep me\n")
    res = run(public["deepscaler"], "--out", out)
    assert res.returncode == 2 and "--overwrite" in res.stderr and out.read_text() == "keep me\n"
    assert run(public["deepscaler"], "--out", out, "--overwrite").returncode == 0
    res = run(tmp_path / "missing.json", "--out", tmp_path / "o.jsonl")
    assert res.returncode == 2 and "download it first" in res.stderr
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"text": "hello"}])
    res = run(odd, "--out", tmp_path / "o.jsonl")
    assert res.returncode == 2 and "unrecognised columns ['text']" in res.stderr


def test_the_command_line(public, tmp_path):
    out = tmp_path / "cli.jsonl"
    res = subprocess.run([sys.executable, TOOL, public["math500"], "--out", str(out)], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 0 and len(read_out(out)) == len(MATH500), res.stderr
    res = subprocess.run([sys.executable, TOOL, public["math500"], "--out", str(out)], capture_output=True,
                         text=True, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.startswith("error: ")
