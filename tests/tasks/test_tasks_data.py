"""Data loading: field mapping, bad-row reporting (skip vs error), parquet/jsonl, prompts."""
import json
import logging
import os

import pytest

from emapg_megatron.tasks import Task, get_task, render_prompt
from emapg_megatron.tasks.data import (
    MAX_JSON_DEPTH,
    BadRowError,
    DataFileError,
    MissingColumnError,
    json_too_deep,
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


# ----------------------------------------------------------------------------------------------
# hostile rows (issue 28): one clear reason each, never a traceback

DEEP = 200_000


def _deep(lists=DEEP, field="q"):
    """A row whose ``field`` is ``lists`` nested lists: the row nests ``lists + 1`` deep."""
    return '{"%s": %s"x"%s, "a": "1"}' % (field, "[" * lists, "]" * lists)


def test_deeply_nested_jsonl_line_is_a_bad_row(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x", "a": "1"}), _deep(),
                                         _deep(MAX_JSON_DEPTH - 1, field="meta").replace('"a"', '"q": "y", "a"')])
    ds, rep = load_rows(path, fields={"question": "q", "ground_truth": "a"},
                        required=("question", "ground_truth"), return_report=True)
    assert ds["_index"] == [0, 2]
    assert rep[0].bad == [(1, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")]
    with pytest.raises(BadRowError, match="index 1 \\(JSON nested deeper"):
        load_rows(path, fields={"question": "q"}, required=("question",), on_bad_row="error")


def test_deeply_nested_json_file_is_a_data_file_error(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("[" + json.dumps({"q": "x"}) + ", " + _deep() + "]")
    with pytest.raises(DataFileError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        load_rows(str(path), fields={"question": "q"}, required=("question",))


def test_rows_at_the_depth_limit_load(tmp_path):
    """The limit leaves room for the loader: a mapped field nested up to it becomes a column."""
    row = _deep(MAX_JSON_DEPTH - 1)
    files = {"d.jsonl": f"{row}\n{row}\n", "d.json": f"[{row}, {row}]", "e.json": f'{{"data": [{row}]}}'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        ds = load_rows(str(tmp_path / name), fields={"question": "q"}, required=("question",),
                       on_bad_row="error")
        value = ds["question"][0]
        for _ in range(MAX_JSON_DEPTH - 1):
            value = value[0]
        assert value == "x"


@pytest.mark.parametrize("text,deep", [
    ("[" * 101 + "]" * 101, True),
    ("[" * 100 + "]" * 100, False),
    ('["' + "[" * 500 + '"]', False),  # brackets in a string do not nest
    ('["\\"' + "[" * 500 + '"]', False),  # nor after an escaped quote
    ("[" * 500 + '"unterminated', True),
    ('"' + '\\"' * 100_000 + "[" * 200, False),  # one unterminated string: linear, not quadratic
])
def test_json_too_deep(text, deep):
    assert json_too_deep(text, 100) is deep


def test_lone_surrogate_is_a_bad_row(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ['{"q": "a\\ud800b", "a": "1"}', '{"q": "ok \\ud83d\\ude00", "a": "1"}',
                                         '{"q": "x", "a": ["\\uDC00"]}', '{"q": "y", "a": "1", "z": "\\ud800"}'])
    ds, rep = load_rows(path, fields={"question": "q", "ground_truth": "a"},
                        required=("question", "ground_truth"), return_report=True)
    assert ds["question"] == ["ok \U0001F600", "y"]  # a surrogate pair is one character; 'z' is unused
    assert [i for i, _ in rep[0].bad] == [0, 2]
    assert "'q' holds a lone surrogate escape such as \\ud800" in rep[0].bad[0][1]
    with pytest.raises(BadRowError, match="index 0 .*lone surrogate"):
        load_rows(path, fields={"question": "q"}, required=("question",), on_bad_row="error")


def test_column_mixing_strings_and_numbers_loads_as_strings(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(pa.Table.from_pylist([{"q": "x", "data_source": "gsm"}]), a)
    pq.write_table(pa.Table.from_pylist([{"q": "y", "data_source": 3}]), b)
    ds = load_rows([a, b], fields={"question": "q", "data_source": "data_source"}, required=("question",))
    assert ds["data_source"] == ["gsm", "3"]
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x", "s": s}) for s in ("a", 2, 1.5, True, None)])
    ds = load_rows(path, fields={"question": "q", "data_source": "s"}, required=("question",))
    assert ds["data_source"] == ["a", "2", "1.5", "True", None]
    path = _jsonl(tmp_path / "n.jsonl", [json.dumps({"q": "x", "s": s}) for s in (1, 2.5)])
    assert load_rows(path, fields={"question": "q", "data_source": "s"})["data_source"] == [1.0, 2.5]


def test_column_mixing_lists_and_strings_is_a_data_file_error(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"q": "x", "s": s}) for s in ("a", ["b"])])
    with pytest.raises(DataFileError) as e:
        load_rows(path, fields={"question": "q", "data_source": "s"}, required=("question",))
    msg = str(e.value)
    assert "column 's' mixes values of types list, str" in msg and path in msg and "\n" not in msg


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tiny_hf import _texts, byte_level_bpe
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(_texts(), 320, ["<|endoftext|>"]),
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def test_hostile_rows_reach_the_trainer_as_notes_or_one_line(tmp_path, hf_tokenizer):
    """The trainer's loader (training/prompt_data.py) on the files above: skipped rows are
    counted in one note, an unusable file is one ConfigError line."""
    pytest.importorskip("math_verify")
    from emapg_megatron.errors import ConfigError
    from emapg_megatron.training.prompt_data import load_training_prompts

    good = json.dumps({"problem": "1+1?", "answer": "2", "data_source": "gsm"})
    rows = [good, _deep().replace('"q"', '"problem"'), '{"problem": "a\\ud800", "answer": "1"}',
            json.dumps({"problem": "2+2?", "answer": 4, "data_source": 7})]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    notes = []
    task = get_task("math", num_workers=1)
    try:
        out = load_training_prompts(task, path, hf_tokenizer, seq_length=512, max_new_tokens=8,
                                    log=notes.append)
        assert [r["data_source"] for r in out.rows] == ["gsm", "7"] and out.skipped_bad == 2
        assert len(notes) == 1 and "row 1: JSON nested deeper" in notes[0] and "row 2: 'problem' holds" in notes[0]
        deep = tmp_path / "d.json"
        deep.write_text("[" + good + ", " + _deep() + "]")
        with pytest.raises(ConfigError) as e:
            load_training_prompts(task, str(deep), hf_tokenizer, seq_length=512, max_new_tokens=8)
        assert str(e.value) == (f"--data-path {deep}: JSON nested deeper than {MAX_JSON_DEPTH} "
                                "levels in a row")
    finally:
        task.close()
