"""load_training_prompts: every data problem is one ConfigError line before any work starts."""
import json

import pytest

from emapg_megatron.errors import ConfigError
from emapg_megatron.tasks import Task, encode_text, get_task
from emapg_megatron.tasks.base import encode_many
from emapg_megatron.tasks.synthetic import CharTokenizer, CopyTask
from emapg_megatron.training.prompt_data import (
    LONG_PROMPT_MODES,
    PromptSchedule,
    load_training_prompts,
    response_budget,
)


class OrdTokenizer:
    """One token per character."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class EchoTask(Task):
    """Single turn; the prompt is "Q: <question>" (3 + len(question) tokens with OrdTokenizer)."""

    name = "echo"
    required_fields = ("question", "answer")

    def prompt(self, row, tokenizer=None):
        return "Q: " + row["question"]

    def reward(self, response, row):
        return 0.0

    def correct(self, response, row):
        return False


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _parquet(path, table):
    import pyarrow.parquet as pq

    pq.write_table(table, str(path))
    return str(path)


def _err(task, path, **kw):
    kw.setdefault("seq_length", 64)
    kw.setdefault("max_new_tokens", 16)
    with pytest.raises(ConfigError) as e:
        load_training_prompts(task, path, OrdTokenizer(), **kw)
    msg = str(e.value)
    assert "\n" not in msg  # one line
    return msg


def _rows(*lengths):
    return [{"question": "x" * n, "answer": "a"} for n in lengths]


# --- the data file ------------------------------------------------------------------------
def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    assert _err(EchoTask(), path) == f"--data-path {path}: no such file"


def test_empty_jsonl(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert _err(EchoTask(), str(path)) == f"--data-path {path} has no rows"


def test_empty_parquet(tmp_path):
    import pyarrow as pa

    path = _parquet(tmp_path / "empty.parquet",
                    pa.table({"question": pa.array([], pa.string()),
                              "answer": pa.array([], pa.string())}))
    assert _err(EchoTask(), path) == f"--data-path {path} has no rows"


def test_zero_byte_parquet(tmp_path):
    path = tmp_path / "zero.parquet"
    path.write_bytes(b"")
    msg = _err(EchoTask(), str(path))
    assert msg.startswith(f"--data-path {path}: ") and "0 bytes" in msg


def test_all_rows_malformed_jsonl(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", ["not json", "[1, 2]", {"question": "", "answer": "1"},
                                          {"question": "q"}])
    msg = _err(EchoTask(), path)
    assert msg.startswith(f"--data-path {path}: none of its 4 rows is usable "
                          f"(each needs non-empty 'question' and 'answer'): ")
    assert ("row 0: invalid JSON" in msg and "row 1: not a JSON object" in msg
            and "row 2: empty 'question'" in msg and "1 more" in msg)


def test_parquet_with_wrong_columns(tmp_path):
    import pyarrow as pa

    path = _parquet(tmp_path / "wrong.parquet", pa.table({"q": ["what?"], "a": ["1"]}))
    msg = _err(EchoTask(), path)
    assert msg == (f"--data-path {path}: missing columns 'question', 'answer' (columns found: "
                   f"['q', 'a']; expected: ['question', 'answer']); rename the file's columns to "
                   f"the expected names")
    assert "--field" not in msg


def test_empty_parquet_with_wrong_columns_names_them(tmp_path):
    import pyarrow as pa

    path = _parquet(tmp_path / "wrong.parquet", pa.table({"q": pa.array([], pa.string())}))
    assert "columns found: ['q']" in _err(EchoTask(), path)


def test_jsonl_with_wrong_columns_names_the_task_field(tmp_path):
    task = get_task("search", retriever="unused")  # question / golden_answers
    path = _jsonl(tmp_path / "qa.jsonl", [{"query": "who?", "answers": ["Bob"]}])
    msg = _err(task, path, seq_length=1024)
    assert "missing columns 'question', 'golden_answers'" in msg
    assert "columns found: ['query', 'answers']" in msg


def test_some_malformed_rows_are_skipped_and_counted(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [_rows(2)[0], "oops", _rows(3)[0]])
    notes = []
    out = load_training_prompts(EchoTask(), path, OrdTokenizer(), seq_length=64, max_new_tokens=16,
                                log=notes.append)
    assert [r["_index"] for r in out.rows] == [0, 2] and out.skipped_bad == 1
    assert notes == [f"--data-path {path}: skipped 1 of 3 malformed rows "
                     f"(row 1: invalid JSON: Expecting value)"]


# --- prompt length ------------------------------------------------------------------------
def test_prompt_lengths_match_the_trainers_encoding(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(1, 5, 9))
    out = load_training_prompts(EchoTask(), path, OrdTokenizer(), seq_length=64, max_new_tokens=16)
    assert out.prompt_lengths == [4, 8, 12] and out.max_prompt_tokens == 48 and out.total == 3
    assert out.prompt_lengths == [len(encode_text(OrdTokenizer(), EchoTask().prompt(r, None)))
                                  for r in out.rows]
    assert out.dropped == [] and len(PromptSchedule(out.rows, 0).rows_for_step(0, 2)) == 2


def test_over_long_prompt_names_the_count_and_first_row(tmp_path):
    # limit 64 - 16 = 48 tokens; prompts are 3 + len(question) tokens
    path = _jsonl(tmp_path / "d.jsonl", _rows(45, 46, 10, 60))
    msg = _err(EchoTask(), path)
    assert msg == (f"2 of 4 prompts in {path} are longer than --seq-length 64 - --max-new-tokens 16 "
                   f"= 48 tokens (first: 0-based row 1, 49 tokens); --seq-length 79 or --max-new-tokens 1 "
                   f"fits them all (the longest is 63 tokens), or pass --long-prompts drop to drop them")


def test_row_index_counts_skipped_lines(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ["garbage", _rows(1)[0], _rows(50)[0]])
    assert "(first: 0-based row 2, 53 tokens)" in _err(EchoTask(), path, log=lambda m: None)


def test_drop_mode_drops_and_logs_the_count(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(45, 46, 10, 60))
    notes = []
    out = load_training_prompts(EchoTask(), path, OrdTokenizer(), seq_length=64, max_new_tokens=16,
                                long_prompts="drop", log=notes.append)
    assert [r["_index"] for r in out.rows] == [0, 2] and out.prompt_lengths == [48, 13]
    assert out.dropped == [1, 3] and out.total == 4
    assert notes == [f"--long-prompts drop: dropped 2 of 4 prompts in {path} longer than "
                     f"--seq-length 64 - --max-new-tokens 16 = 48 tokens (first: 0-based row 1, "
                     f"49 tokens); training on 2"]


@pytest.mark.parametrize("mode", LONG_PROMPT_MODES)
def test_all_prompts_too_long_is_an_error_in_every_mode(tmp_path, mode):
    path = _jsonl(tmp_path / "d.jsonl", _rows(50, 46, 70))
    msg = _err(EchoTask(), path, long_prompts=mode)
    assert msg == (f"all 3 prompts in {path} are longer than --seq-length 64 - --max-new-tokens 16 "
                   f"= 48 tokens (shortest: 0-based row 1, 49 tokens); --seq-length 89 fits them all "
                   f"(the longest is 73 tokens)")


def test_bad_mode_and_no_room(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(1))
    assert _err(EchoTask(), path, long_prompts="truncate") == (
        "--long-prompts must be one of error, drop (got 'truncate')")
    assert _err(EchoTask(), path, max_new_tokens=64) == (
        "--max-new-tokens 64 leaves no room for a prompt in --seq-length 64")


def test_multi_turn_budget_is_the_first_turn(tmp_path):
    """Search: the prompt must leave one full first turn (--max-turn-tokens); later turns and
    observations are cut at --seq-length by the episode."""
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "x" * n, "golden_answers": ["a"]}
                                          for n in (10, 2000)])
    task = get_task("search", retriever="unused", chat_template="never", max_turn_tokens=100)
    assert response_budget(task, 16) == (100, "--max-turn-tokens")
    lengths = [len(encode_text(OrdTokenizer(), task.prompt({"question": "x" * n}, None)))
               for n in (10, 2000)]
    msg = _err(task, path, seq_length=1200, max_new_tokens=16)
    assert msg.startswith(f"1 of 2 prompts in {path} are longer than --seq-length 1200 - "
                          f"--max-turn-tokens 100 = 1100 tokens (first: 0-based row 1, "
                          f"{lengths[1]} tokens)")
    # without a per-turn budget the sampler gives each turn --max-new-tokens
    task = get_task("search", retriever="unused", chat_template="never", max_turn_tokens=None)
    assert response_budget(task, 16) == (16, "--max-new-tokens")
    out = load_training_prompts(task, path, OrdTokenizer(), seq_length=lengths[1] + 16,
                                max_new_tokens=16)
    assert out.prompt_lengths == lengths


def test_boundary_prompt_exactly_fits(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _rows(45))  # 48 tokens
    out = load_training_prompts(EchoTask(), path, OrdTokenizer(), seq_length=64, max_new_tokens=16)
    assert out.prompt_lengths == [48]
    assert "= 47 tokens (shortest: 0-based row 0, 48 tokens)" in _err(EchoTask(), path, seq_length=63)


# --- the built-in synthetic task --------------------------------------------------------------
def test_synthetic_task_goes_through_the_same_path():
    task = CopyTask(length=3, num_rows=16, seed=0)
    out = load_training_prompts(task, None, CharTokenizer(), seq_length=8, max_new_tokens=4)
    assert out.rows == task.rows and out.prompt_lengths == [4] * 16
    with pytest.raises(ConfigError) as e:
        load_training_prompts(task, None, CharTokenizer(), seq_length=8, max_new_tokens=5)
    assert str(e.value) == ("all 16 prompts in the built-in synthetic-copy data are longer than "
                            "--seq-length 8 - --max-new-tokens 5 = 3 tokens (shortest: 0-based row 0, "
                            "4 tokens); --seq-length 9 or --max-new-tokens 4 fits them all (the longest "
                            "is 4 tokens)")


def test_file_task_without_data_path():
    assert _err(EchoTask(), None) == "--task echo needs --data-path"


def test_untokenizable_prompt_names_the_row():
    class Odd(CopyTask):
        def prompt(self, row, tokenizer=None):
            return row["digits"] + ("x" if row is self.rows[2] else "=")

    task = Odd(num_rows=4)
    with pytest.raises(ConfigError, match=r"cannot tokenize the prompt of row 2 of the built-in "
                                          r"synthetic-copy data: character 'x' is not in"):
        load_training_prompts(task, None, CharTokenizer(), seq_length=8, max_new_tokens=4)


# --- batch tokenization --------------------------------------------------------------------
@pytest.fixture(scope="module")
def fast_tokenizer():
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is two plus two", "the answer is four", "Question: who?"] * 20,
                            trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")


def test_batch_encoding_equals_encode_text(fast_tokenizer):
    assert fast_tokenizer.is_fast
    texts = ["", "what is two plus two?", "  spaces  ", "unicode é 步", "\n\nQuestion: who?\n"] * 3
    assert encode_many(fast_tokenizer, texts, batch_size=4) == [encode_text(fast_tokenizer, t)
                                                                for t in texts]


def test_lengths_with_a_chat_template_match_the_trainer(tmp_path, fast_tokenizer):
    fast_tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n"
                                    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    try:
        task = get_task("search", retriever="unused", max_turn_tokens=8)
        path = _jsonl(tmp_path / "qa.jsonl", [{"question": q, "golden_answers": ["4"]}
                                              for q in ("what is two plus two", "who?", "é")])
        out = load_training_prompts(task, path, fast_tokenizer, seq_length=4096, max_new_tokens=8)
        expected = [len(encode_text(fast_tokenizer, task.prompt(r, fast_tokenizer))) for r in out.rows]
        assert out.prompt_lengths == expected
        assert "<|assistant|>" in task.prompt(out.rows[0], fast_tokenizer)
    finally:
        fast_tokenizer.chat_template = None
