"""Data loading: field mapping, bad-row reporting (skip vs error), parquet/jsonl, prompts."""
import json
import logging
import os

import pytest

from emapg_megatron.tasks import Task, get_task, render_prompt
from emapg_megatron.tasks.data import (
    BadRowError,
    DataFileError,
    MissingColumnError,
    load_rows,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "data", "samples")


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


ROWS = [
    json.dumps({"q": "ok 0", "a": "1"}),
    json.dumps({"q": "missing answer"}),
    "this is not json",
    json.dumps({"q": "ok 3", "a": "4"}),
    json.dumps({"q": "", "a": "5"}),
    json.dumps({"q": "null answer", "a": None}),
    json.dumps(["a", "list"]),
    json.dumps({"q": "ok 7", "a": "8"}),
]


def test_skip_reports_indices(tmp_path, caplog):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger="emapg_megatron.tasks.data"):
        ds, reports = load_rows(path, fields={"question": "q", "ground_truth": "a"},
                                required=("question", "ground_truth"), return_report=True)
    assert ds["question"] == ["ok 0", "ok 3", "ok 7"]
    assert ds["_index"] == [0, 3, 7]
    assert reports[0].skipped_indices == [1, 2, 4, 5, 6]
    assert reports[0].total == 8 and reports[0].loaded == 3
    msg = caplog.text
    assert "skipped 5 of 8 rows" in msg
    for idx in (1, 2, 4, 5, 6):
        assert f"index {idx} (" in msg
    assert "missing 'a'" in msg and "invalid JSON" in msg and "empty 'q'" in msg


def test_error_mode_raises_with_indices(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(BadRowError) as e:
        load_rows(path, fields={"question": "q", "ground_truth": "a"},
                  required=("question", "ground_truth"), on_bad_row="error")
    assert [i for i, _ in e.value.bad] == [1, 2, 4, 5, 6]
    assert "index 1 (missing 'a')" in str(e.value)


def test_clean_file_loads_without_warning(tmp_path, caplog):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x", "a": "1"})])
    with caplog.at_level(logging.WARNING):
        ds = load_rows(path, fields={"question": "q"}, required=("question",), on_bad_row="error")
    assert len(ds) == 1 and not caplog.records


def test_missing_column_everywhere_is_a_config_error(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x", "a": "1"})] * 3)
    with pytest.raises(KeyError) as e:  # MissingColumnError is a KeyError
        load_rows(path, fields={"question": "question"}, required=("question",))
    assert isinstance(e.value, MissingColumnError)
    msg = str(e.value)
    assert msg == (f"{path}: missing column 'question' (columns found: ['q', 'a']; expected: "
                   f"['question']); rename the file's columns to the expected names")
    assert "--field" not in msg  # no such training flag; callers with one pass map_hint
    with pytest.raises(MissingColumnError, match=r"or map them: --field question=<column>$"):
        load_rows(path, fields={"question": "question"}, required=("question",),
                  map_hint="--field {field}=<column>")


def test_missing_column_names_the_mapped_field(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x"})])
    with pytest.raises(MissingColumnError) as e:
        load_rows(path, fields={"question": "q", "ground_truth": "answer"},
                  required=("question", "ground_truth"))
    assert e.value.missing == [("ground_truth", "answer")]
    assert "missing column 'answer' (for field 'ground_truth')" in str(e.value)
    assert "expected: ['q', 'answer']" in str(e.value)


def test_parquet_columns_checked_from_the_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "e.parquet")
    pq.write_table(pa.table({"q": pa.array([], pa.string())}), path)  # no rows at all
    with pytest.raises(MissingColumnError, match=r"columns found: \['q'\]"):
        load_rows(path, fields={"question": "question"}, required=("question",))
    nested = str(tmp_path / "n.parquet")
    pq.write_table(pa.Table.from_pylist([{"rm": {"gt": "1"}, "p": "x"}]), nested)
    ds = load_rows(nested, fields={"question": "p", "ground_truth": "rm.gt"},
                   required=("question", "ground_truth"))
    assert ds["ground_truth"] == ["1"]
    with pytest.raises(MissingColumnError, match="'rm.style'"):
        load_rows(nested, fields={"question": "p", "ground_truth": "rm.style"},
                  required=("question", "ground_truth"))


@pytest.mark.parametrize("name,content,reason", [
    ("zero.parquet", b"", "Parquet file size is 0 bytes"),
    ("d.txt", b"x", "unsupported file type"),
    ("d.json", b"{\"a\": 1, \"b\": 2}", "expected a JSON list of objects"),
    ("d.json", b"[1, ", "cannot read"),
    ("d.jsonl", b"\xff\xfe\n", "cannot read"),
])
def test_unreadable_files_raise_data_file_error(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFileError) as e:
        load_rows(str(path), fields={"question": "q"}, required=("question",))
    assert reason in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_empty_json_and_jsonl_have_no_rows(tmp_path):
    for name in ("e.jsonl", "e.json"):
        path = tmp_path / name
        path.write_text("\n" if name.endswith("l") else "")
        ds, rep = load_rows(str(path), fields={"question": "q"}, required=("question",),
                            return_report=True)
        assert len(ds) == 0 and rep[0].total == 0


def test_bad_on_bad_row_value(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x"})])
    with pytest.raises(ValueError):
        load_rows(path, fields={"question": "q"}, on_bad_row="ignore")


def test_nested_fields_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "p0", "reward_model": {"ground_truth": "1", "style": "rule"}, "data_source": "a"},
        {"prompt": "p1", "reward_model": {"ground_truth": None, "style": "rule"}, "data_source": "a"},
        {"prompt": "p2", "reward_model": {"ground_truth": "3", "style": "rule"}, "data_source": "b"},
    ]
    path = str(tmp_path / "verl.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds, rep = load_rows(path, fields={"question": "prompt", "ground_truth": "reward_model.ground_truth",
                                      "data_source": "data_source"},
                        required=("question", "ground_truth"), return_report=True)
    assert ds["ground_truth"] == ["1", "3"] and ds["_index"] == [0, 2]
    assert rep[0].bad == [(1, "empty 'reward_model.ground_truth'")]


def test_sample_files_load_identically():
    pytest.importorskip("math_verify")
    task = get_task("math", num_workers=1)
    try:
        a = task.load(os.path.join(SAMPLES, "math.jsonl"), on_bad_row="error")
        b = task.load(os.path.join(SAMPLES, "math.parquet"), on_bad_row="error")
    finally:
        task.close()
    assert len(a) == 36
    assert a["question"] == b["question"] and a["ground_truth"] == b["ground_truth"]
    assert set(a["data_source"]) == {"gsm_style", "math_style", "competition_style"}


def test_task_field_mapping_override(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"query": "who?", "answers": "Bob"}),
                                         json.dumps({"query": "none", "answers": []})])
    task = get_task("search", retriever="unused")
    ds = task.load(path, fields={"question": "query", "golden_answers": "answers"})
    assert ds["golden_answers"] == [["Bob"]]  # a bare string becomes a one-element list
    with pytest.raises(BadRowError):
        task.load(path, fields={"question": "query", "golden_answers": "answers"}, on_bad_row="error")


def test_prompt_rendering_with_and_without_chat_template():
    class Plain:
        def encode(self, s):
            return [ord(c) for c in s]

        def decode(self, ids):
            return "".join(map(chr, ids))

    class Chat(Plain):
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return "".join(f"[{m['role']}]{m['content']}" for m in messages) + ("[assistant]" if add_generation_prompt else "")

    class NoTemplate(Chat):
        chat_template = None

    assert render_prompt("hi", None) == "hi"
    assert render_prompt("hi", Plain(), plain_template="Q: {content}\nA:") == "Q: hi\nA:"
    assert render_prompt("hi", Chat(), system="sys") == "[system]sys[user]hi[assistant]"
    assert render_prompt("hi", NoTemplate()) == "hi"
    assert render_prompt("hi", Chat(), chat_template="never") == "hi"
    with pytest.raises(ValueError):
        render_prompt("hi", Plain(), chat_template="always")


def test_registry():
    with pytest.raises(ValueError, match="unknown task"):
        get_task("nope")
    assert issubclass(type(get_task("search", retriever="x")), Task)
