"""Checked prompts are loaded and tokenised once per node (training/prompt_cache.py): the node's
other processes read the same rows, lengths and notes from one memory-mapped arrow file."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from emapg_megatron.tasks.data import TableRows
from emapg_megatron.training import prompt_cache
from emapg_megatron.training.prompt_data import TrainingPrompts, load_training_prompts
from tests.training.test_data_validation import EchoTask, OrdTokenizer, _jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def node_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir()
    monkeypatch.setenv(prompt_cache.CACHE_DIR_ENV, str(d))
    return d


def _prompts(path, **kw):
    kw.setdefault("seq_length", 12)
    kw.setdefault("max_new_tokens", 4)
    return load_training_prompts(EchoTask(), path, OrdTokenizer(), log=lambda m: None, **kw)


def _data(tmp_path):
    rows = [{"question": "x" * n, "answer": str(n), "extra": {"n": n, "tags": ["a"] * n}}
            for n in (1, 9, 2, 3, 7)]
    return _jsonl(tmp_path / "d.jsonl", rows + ["{not json"])


def _counted(path, counter, **kw):
    def load():
        counter.append(1)
        return _prompts(path, **kw)
    return load


def _same(a: TrainingPrompts, b: TrainingPrompts):
    assert list(a.rows) == list(b.rows)
    assert (a.prompt_lengths, a.max_prompt_tokens, a.total, a.dropped, a.skipped_bad) == \
        (b.prompt_lengths, b.max_prompt_tokens, b.total, b.dropped, b.skipped_bad)


def test_table_rows_read_like_a_list():
    rows = [{"a": i, "b": [i] * i, "c": None if i % 2 else {"x": str(i)}} for i in range(7)]
    t = TableRows(pa.Table.from_pylist(rows))
    assert len(t) == 7 and list(t) == rows
    assert t[3] == rows[3] and t[-1] == rows[-1]
    assert t[2:5] == rows[2:5] and t[5:50] == rows[5:] and t[::3] == rows[::3] and t[4:2] == []
    assert list(t.select([6, 0, 3])) == [rows[6], rows[0], rows[3]]
    with pytest.raises(IndexError):
        t[7]


def test_the_first_process_loads_the_others_read(tmp_path, node_dir):
    path, calls = _data(tmp_path), []
    key = prompt_cache.key({"seq_length": 12}, path, None)
    first = prompt_cache.once_per_node(key, _counted(path, calls, long_prompts="drop"))
    again = prompt_cache.once_per_node(key, _counted(path, calls, long_prompts="drop"))
    assert calls == [1]  # the second one tokenised nothing
    assert isinstance(again.rows, TableRows) and first.dropped == [1, 4] and first.skipped_bad == 1
    _same(first, again)
    _same(again, _prompts(path, long_prompts="drop"))  # exactly what loading gives


def test_the_key_follows_the_flags_the_file_and_the_tokenizer(tmp_path, node_dir):
    path = _data(tmp_path)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    base = prompt_cache.key({"seq_length": 12}, path, str(tok))
    assert base == prompt_cache.key({"seq_length": 12}, path, str(tok))
    assert base != prompt_cache.key({"seq_length": 13}, path, str(tok))
    (tok / "tokenizer.json").write_text('{"changed": 1}')
    assert base != prompt_cache.key({"seq_length": 12}, path, str(tok))
    before = prompt_cache.key({}, path, None)
    with open(path, "a") as f:
        f.write(json.dumps({"question": "y", "answer": "1"}) + "\n")
    assert prompt_cache.key({}, path, None) != before


def test_a_foreign_or_broken_file_is_rebuilt(tmp_path, node_dir):
    path, calls = _data(tmp_path), []
    key = prompt_cache.key({}, path, None)
    (node_dir / f"{key}.arrow").write_bytes(b"ARROW1 but not really")
    prompt_cache.once_per_node(key, _counted(path, calls, long_prompts="drop"))
    other = prompt_cache.key({"x": 1}, path, None)
    os.replace(node_dir / f"{key}.arrow", node_dir / f"{other}.arrow")  # another key's table
    _same(prompt_cache.once_per_node(other, _counted(path, calls, long_prompts="drop")),
          _prompts(path, long_prompts="drop"))
    assert calls == [1, 1]


def test_a_bad_input_error_leaves_no_file(tmp_path, node_dir):
    path = _data(tmp_path)
    with pytest.raises(Exception, match="longer than"):
        prompt_cache.once_per_node("k", lambda: _prompts(path))  # long_prompts="error"
    assert not list(node_dir.glob("*.arrow"))


def test_built_in_rows_are_not_cached(node_dir):
    from emapg_megatron.tasks.synthetic import CharTokenizer, CopyTask

    prompts = prompt_cache.once_per_node("k", lambda: load_training_prompts(
        CopyTask(num_rows=8), None, CharTokenizer(), seq_length=8, max_new_tokens=3))
    assert len(prompts.rows) == 8 and not list(node_dir.glob("*.arrow"))


def test_processes_of_a_node_load_once(tmp_path, node_dir):
    """Four processes start together: exactly one loads, every one gets the same rows."""
    path, log = _data(tmp_path), tmp_path / "loads"
    script = f"""
import json, sys
sys.path.insert(0, {REPO!r})
from emapg_megatron.training import prompt_cache
from tests.training.test_data_validation import EchoTask, OrdTokenizer
from emapg_megatron.training.prompt_data import load_training_prompts
def load():
    with open({str(log)!r}, "a") as f:
        f.write("x")
    return load_training_prompts(EchoTask(), {path!r}, OrdTokenizer(), seq_length=12,
                                 max_new_tokens=4, long_prompts="drop", log=lambda m: None)
p = prompt_cache.once_per_node(prompt_cache.key({{}}, {path!r}, None), load)
print(json.dumps([list(p.rows), p.prompt_lengths]))
"""
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO}) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert log.read_text() == "x" and len(set(outs)) == 1


def test_plain_torchrun_uses_a_private_folder_and_release_deletes(tmp_path, monkeypatch):
    monkeypatch.delenv(prompt_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    monkeypatch.setattr(prompt_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    path, calls = _data(tmp_path), []
    key = prompt_cache.key({}, path, None)
    assert key != (monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-2") or prompt_cache.key({}, path, None))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    prompt_cache.once_per_node(key, _counted(path, calls, long_prompts="drop"))
    prompt_cache.once_per_node(key, _counted(path, calls, long_prompts="drop"))
    folder = tmp_path / f"emapg-prompts-{os.getuid()}"
    assert calls == [1] and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in folder.iterdir() if p.suffix == ".arrow"] == [f"{key}.arrow"]
    prompt_cache.release()
    assert list(folder.iterdir()) == []


def test_a_folder_others_can_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.delenv(prompt_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    monkeypatch.setattr(prompt_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    folder = tmp_path / f"emapg-prompts-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    assert prompt_cache.cache_dir() is None
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    assert prompt_cache.cache_dir() is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert prompt_cache.cache_dir() is None  # one process: nothing to share


def test_the_launchers_validation_fills_the_cache_the_ranks_read(tmp_path, node_dir, monkeypatch, tiny_hf_model):
    """emapg-train validates (loading the prompts once); a rank's prepare() then tokenises
    nothing and gets the same prompts."""
    from emapg_megatron import build, launch
    from emapg_megatron.training import prompt_data

    hf = tiny_hf_model  # conftest.py's, shared with other modules
    data = _jsonl(tmp_path / "m.jsonl", [{"problem": f"What is {i} + 1?", "answer": str(i + 1)}
                                         for i in range(40)])
    argv = ["--preset", "tiny-cpu", "--task", "math", "--load-hf", hf, "--data-path", data,
            "--seq-length", "64", "--max-new-tokens", "8", "--max-position-embeddings", "72",
            "--chat-template", "never", "--log-dir", str(tmp_path / "log")]
    launch.validate(argv, 2)
    assert len(list(node_dir.glob("*.arrow"))) == 1
    monkeypatch.setattr(prompt_data, "encode_many", lambda *a, **k: pytest.fail("tokenised again"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "given-by-torchrun")
    monkeypatch.setenv("WORLD_SIZE", "2")
    inputs = build.prepare(argv)
    assert isinstance(inputs.prompts.rows, TableRows) and len(inputs.prompts.rows) == 40
    assert inputs.prompts.rows[3]["ground_truth"] == "4"
