"""The evaluate CLI on the sample files (no model needed)."""
import contextlib
import io
import json
import os
import re
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
    rc = evaluate.main(["--task", "math", "--data-path", os.path.join(S, "math.jsonl"),
                        "--responses", os.path.join(S, "math_responses.jsonl"),
                        "--num-samples-per-prompt", "4", "--out", str(out), "--workers", "2"])
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
        [sys.executable, "-m", "emapg_megatron.evaluate", "--task", "search", "--data-path", os.path.join(S, "qa.jsonl"),
         "--responses", os.path.join(S, "search_responses.jsonl"), "--num-samples-per-prompt", "2", "--k", "1,2",
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
    pytest.importorskip("bm25s")
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--load", "/no/ckpt",
                        "--retriever", os.path.join(S, "corpus.jsonl"), "--num-samples-per-prompt", "2", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not a Hugging Face directory" in err and "\n" not in err


def test_too_few_responses_is_reported(tmp_path, capsys):
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"),
                        "--responses", os.path.join(S, "search_responses.jsonl"),
                        "--num-samples-per-prompt", "8", "--out", str(tmp_path)])
    assert rc == 2
    assert "fewer than --num-samples-per-prompt 8" in capsys.readouterr().err


def test_responses_flat_format_and_missing_field(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question": "q0", "golden_answers": ["a"]}, {"question": "q1"}, {"question": "q2", "golden_answers": "b"}]) + "\n")
    resp = tmp_path / "r.jsonl"
    resp.write_text("\n".join(json.dumps(r) for r in [
        {"index": 0, "response": "<answer>a</answer>"}, {"index": 0, "response": "<answer>x</answer>"},
        {"index": 2, "response": "<answer>b</answer>"}, {"index": 2, "response": "<answer>b</answer>"}]) + "\n")
    out = tmp_path / "o"
    rc = evaluate.main(["--task", "search", "--data-path", str(data), "--responses", str(resp),
                        "--num-samples-per-prompt", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["overall"]["n_problems"] == 2  # row 1 skipped (reported), rows 0 and 2 scored
    assert res["overall"]["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    rc = evaluate.main(["--task", "search", "--data-path", str(data), "--responses", str(resp),
                        "--num-samples-per-prompt", "2", "--out", str(out), "--on-bad-row", "error"])
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


# ----------------------------------------------------------------------------------------------
# one `error:` line for bad input (issues 27 and 28)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("content,message", [
    (b'{"index": 0, "responses": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n", "line 0 is nested deeper than"),
    (b'{"index": 0, "responses": ["ok"]}\n{"index": 1, "responses": ["\xff\xfe"]}\n',
     "line 1 is not UTF-8 text (invalid start byte at byte 28)"),
    (b'{"index": "zero", "responses": ["x"]}\n', "line 0: 'index' must be an integer, got 'zero'"),
    (b'{"index": 0, "file": ["a"], "responses": ["x"]}\n', "line 0: 'file' must be a string"),
], ids=["deep", "not-utf8", "index", "file"])
def test_hostile_responses_file_is_one_error_line(tmp_path, capsys, content, message):
    resp = tmp_path / "r.jsonl"
    resp.write_bytes(content)
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--responses", str(resp),
                        "--num-samples-per-prompt", "1", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert f"{resp}: {message}" in _one_error_line(capsys)


@pytest.mark.parametrize("extra,message", [
    ([], "--task search --load needs --retriever (a corpus jsonl or the http:// URL"),
    (["--retriever", "/no/corpus.jsonl"], "--retriever /no/corpus.jsonl: no such corpus file"),
    (["--retriever", os.path.join(S, "qa.jsonl")], "has no usable passages"),
    (["--retriever", os.path.join(S, "corpus.jsonl"), "--max-turn-tokens", "-1"], "--max-turn-tokens must be >= 0"),
], ids=["no-retriever", "missing-corpus", "bad-corpus", "negative-turn-budget"])
def test_search_load_flags_are_checked_before_the_model(tmp_path, capsys, monkeypatch, extra, message):
    """Checked before the model loads (the checkpoint here does not even exist)."""
    pytest.importorskip("bm25s")
    monkeypatch.setattr(evaluate, "load_backend", lambda *a, **k: pytest.fail("model loaded first"))
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--load", "/no/ckpt",
                        "--num-samples-per-prompt", "1", "--out", str(tmp_path), *extra])
    assert rc == 2 and message in _one_error_line(capsys)


class FakeBackend:
    """Answers every turn at once; records the per-call budgets."""

    tokenizer = None

    def __init__(self, fail_on_call=None, **load_kwargs):
        self.load_kwargs, self.budgets, self.calls, self.fail_on_call = load_kwargs, [], 0, fail_on_call

    def __call__(self, prompts, n, stop=None, max_new_tokens=None):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("device lost")
        self.budgets.append(max_new_tokens)
        return [["<answer> Paris </answer>"] * n for _ in prompts]


def _load_fake(monkeypatch, **fake_kwargs):
    made = []

    def load(ckpt, **kw):
        made.append(FakeBackend(**fake_kwargs, **kw))
        return made[-1]

    monkeypatch.setattr(evaluate, "load_backend", load)
    return made


@pytest.mark.parametrize("flags,load_budget,turn_budget", [
    ([], 1024, 500),  # the search task's own per-turn default
    (["--max-turn-tokens", "7"], 1024, 7),
    (["--max-turn-tokens", "0", "--max-new-tokens", "33"], 33, None),  # None: the backend's 33
])
def test_search_turn_budget_flags(tmp_path, monkeypatch, capsys, flags, load_budget, turn_budget):
    pytest.importorskip("bm25s")
    made = _load_fake(monkeypatch)
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--load", "ckpt",
                        "--retriever", os.path.join(S, "corpus.jsonl"), "--limit", "2", "--num-samples-per-prompt", "2",
                        "--out", str(tmp_path), *flags])
    assert rc == 0
    assert made[0].load_kwargs["max_new_tokens"] == load_budget
    assert made[0].budgets == [turn_budget]
    assert "generated 4/4 responses (100%)" in capsys.readouterr().err  # the progress line
    lines = (tmp_path / "responses.jsonl").read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1]


def test_turn_budget_zero_leaves_the_turn_to_the_sampler():
    """--max-turn-tokens 0 (evaluate's and the trainer's: use --max-new-tokens) must not make an
    environment with a tokenizer cut every turn to zero tokens."""
    from emapg_megatron.tasks.search import SearchConfig, SearchEnv

    class Chars:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids, **_):
            return "".join(map(chr, ids))

    for budget, kept in ((0, "<answer> Paris </answer>"), (8, "<answer>")):
        env = SearchEnv(retriever=None, config=SearchConfig(max_turn_tokens=budget), tokenizer=Chars())
        assert env.step("<answer> Paris </answer>").model_text == kept


def test_unused_max_new_tokens_is_named(tmp_path, monkeypatch, caplog):
    pytest.importorskip("bm25s")
    _load_fake(monkeypatch)
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--load", "ckpt",
                        "--retriever", os.path.join(S, "corpus.jsonl"), "--limit", "1", "--num-samples-per-prompt", "1",
                        "--max-new-tokens", "2048", "--out", str(tmp_path)])
    assert rc == 0
    assert "--max-new-tokens 2048 is not used by --task search: each model turn gets " \
           "--max-turn-tokens 500" in caplog.text


def test_generation_failure_is_one_line_and_keeps_finished_rows(tmp_path, monkeypatch, capsys):
    pytest.importorskip("bm25s")
    monkeypatch.setattr(evaluate, "_GEN_CHUNK", 4)  # 2 rows x 2 samples a call
    _load_fake(monkeypatch, fail_on_call=2)
    rc = evaluate.main(["--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--load", "ckpt",
                        "--num-samples-per-prompt", "2", "--limit", "4", "--out", str(tmp_path),
                        "--retriever", os.path.join(S, "corpus.jsonl")])
    assert rc == 2
    out = tmp_path / "responses.jsonl"
    assert _one_error_line(capsys) == (f"error: generation failed (RuntimeError: device lost); the 2 rows "
                                       f"done are in {out}")
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0, 1]


def test_progress_line_redraws_on_a_terminal_and_is_throttled_in_a_log():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    log, tty = io.StringIO(), Tty()
    for stream in (log, tty):
        bar = evaluate._Progress(10, stream=stream, every=3600.0)
        bar.update(5)  # within `every` of the start: nothing in a log
        bar.update(10)
    assert log.getvalue().count("\n") == 1 and log.getvalue().startswith("generated 10/10 responses (100%), ")
    assert tty.getvalue().startswith("\rgenerated ") and tty.getvalue().endswith("\n")


@pytest.fixture(scope="module")
def tiny_hf(tiny_hf_model):
    return tiny_hf_model  # conftest.py's, shared with other modules (the broken model is a copy)


def _evaluate_subprocess(*argv):
    return subprocess.run([sys.executable, "-m", "emapg_megatron.evaluate", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_load_errors_on_the_cpu_megatron_backend_are_one_line(tiny_hf, tmp_path):
    """No `[rank0]:` traceback from the in-process Megatron sampler: a checkpoint that does not
    load and a generation the model cannot hold each end in one `error:` line, exit 2."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_hf, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 16)
    common = ["--task", "math", "--data-path", os.path.join(S, "math.jsonl"), "--limit", "1", "--num-samples-per-prompt", "1"]
    for ckpt, flags, message in [
        (str(broken), [], f"error: corrupt safetensors file {broken}"),
        (tiny_hf, ["--max-new-tokens", "5000"], "error: generation failed (prompt + 5000 new tokens = "),
    ]:
        r = _evaluate_subprocess(*common, "--load", ckpt, "--out", str(tmp_path / "o"), *flags)
        err = r.stderr.strip()
        assert r.returncode == 2 and err.startswith(message) and "\n" not in err, err


@pytest.mark.slow
def test_search_load_on_the_cpu_megatron_backend(tiny_hf, tmp_path):
    r = _evaluate_subprocess("--task", "search", "--data-path", os.path.join(S, "qa.jsonl"), "--load", tiny_hf,
                             "--retriever", os.path.join(S, "corpus.jsonl"), "--limit", "2", "--num-samples-per-prompt", "2",
                             "--max-turns", "2", "--max-turn-tokens", "4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "generated 4/4 responses (100%)" in r.stderr
    lines = [json.loads(x) for x in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(len(x["responses"]) == 2 for x in lines)


# ----------------------------------------------------------------------------------------------
# the command line: generated from the configs the trainer's flags come from

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate_flags_at_27093d3.json")
# settings only an evaluation has (they keep their names)
EVALUATE_ONLY = {"--out", "--k", "--responses", "--load", "--on-bad-row", "--limit", "--workers", "--timeout",
                 "--think-end-tag", "-v", "--verbose", "-h", "--help"}
# settings both have, which must read alike in both --help texts
SHARED = {"--task", "--data-path", "--prompt-key", "--answer-key", "--chat-template", "--num-samples-per-prompt",
          "--temperature", "--top-p", "--max-new-tokens", "--seed", "--max-turns", "--max-turn-tokens",
          "--max-obs-tokens", "--retriever", "--retriever-topk"}


def _help_flags(parser) -> dict:
    """``{flag: dest}`` of the flags ``--help`` shows (each option's line starts with two spaces)."""
    shown = {s for line in parser.format_help().splitlines() if line.startswith("  -")
             for s in re.findall(r"(?:^|, )(--?[\w-]+)", line.strip())}
    return {s: a.dest for a in parser._actions for s in a.option_strings if s in shown}


def _parse_quietly(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        cfg = evaluate.parse_args(argv)
    return cfg, err.getvalue()


def test_evaluate_and_train_help_name_a_setting_alike():
    from emapg_megatron.arguments import build_parser as train_parser

    ev, tr = _help_flags(evaluate.build_parser()), _help_flags(train_parser())
    assert set(ev) - set(tr) <= EVALUATE_ONLY, set(ev) - set(tr) - EVALUATE_ONLY  # no other name of its own
    assert SHARED <= set(ev) & set(tr)
    assert all(ev[flag] == tr[flag] for flag in SHARED)  # and parsed into the same name
    golden = json.load(open(GOLDEN))
    assert not set(golden["renamed"]) & set(ev)  # the old spellings are not offered


def test_every_old_evaluate_flag_still_parses():
    golden = json.load(open(GOLDEN))
    accepted = {s for a in evaluate.build_parser()._actions for s in a.option_strings}
    old = {name for names in golden["flags"] for name in names.split(",")}
    assert old <= accepted, old - accepted
    used = {a for line in golden["command_lines"] for a in line["old"] if a.startswith("-")}
    assert used == old  # the command lines below use every old spelling


@pytest.mark.parametrize("line", range(2))
def test_old_spellings_build_the_same_config_with_one_warning_each(line):
    golden = json.load(open(GOLDEN))
    old, new = golden["command_lines"][line]["old"], golden["command_lines"][line]["new"]
    old_cfg, warnings = _parse_quietly(old)
    new_cfg, none = _parse_quietly(new)
    assert old_cfg == new_cfg and none == ""
    used = [flag for flag in golden["renamed"] if flag in old]
    assert warnings.splitlines() == [f"warning: {flag} is deprecated: use {golden['renamed'][flag]}" for flag in used]


@pytest.mark.parametrize("argv,message", [
    ([], "--out needs a value"),
    (["--out", "o"], "--task needs a value"),
    (["--out", "o", "--task", "math", "--data-path", "d"], "--num-samples-per-prompt needs a value"),
    (["--out", "o", "--task", "math", "--data-path", "d", "--num-samples-per-prompt", "1"],
     "give one of --responses FILE or --load CKPT"),
    (["--out", "o", "--task", "math", "--data-path", "d", "--num-samples-per-prompt", "0", "--responses", "r"],
     "--num-samples-per-prompt must be >= 1 (got 0)"),
    (["--out", "o", "--task", "math", "--data-path", "d", "--num-samples-per-prompt", "1", "--responses", "r",
      "--load", "c"], "give one of --responses FILE or --load CKPT"),
    (["--out", "o", "--task", "math", "--data-path", "d", "--num-samples-per-prompt", "1", "--load", "c",
      "--top-p", "0"], "--top-p must be in (0, 1] (got 0.0)"),
    (["--out", "o", "--task", "math", "--data-path", "d", "--num-samples-per-prompt", "1", "--responses", "r",
      "--field", "data_source=src"], "--field expects question=COLUMN"),
], ids=["out", "task", "samples", "no-source", "zero-samples", "two-sources", "top-p", "field"])
def test_bad_flags_are_one_error_line_before_any_work(capsys, argv, message):
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {message}"), err
