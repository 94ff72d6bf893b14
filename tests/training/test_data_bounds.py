"""The training data is read in bounded memory and time, and what cannot be trained on is refused
in one line naming its row, before any work (issue 40 items 4, 5, 5b, 6):

* ``--data-path`` must be a regular file (links resolved): a named pipe hung validation for ever,
  a link to ``/dev/zero`` grew memory to the limit;
* a row longer than any prompt that fits ``--seq-length`` can be is never parsed nor tokenised (a
  1 GB row took 8.6 GB and then aborted the tokenizer natively);
* verl chat messages that are not ``{role, content}`` text are refused (never trained on as their
  Python ``repr``); the list-of-text-parts content is read as its text;
* a prompt that encodes to no tokens, and a ``--load-hf`` folder without a tokenizer (which
  encodes every prompt to nothing), are refused at validation, not at the first rollout.

The trainer's checks run as ``emapg-train --dry-run`` in a child process capped at 4 GiB of address
space (a regression must not take the machine's memory) and a timeout (nor hang the suite).
"""

import json
import os
import resource
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_hf import build_tiny_hf

from emapg_megatron.errors import ConfigError
from emapg_megatron.tasks import get_task
from emapg_megatron.training.prompt_data import load_training_prompts

pytest.importorskip("math_verify")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATH = os.path.join(REPO, "data", "samples", "math.jsonl")
PROMPT_TOKENS = 88  # --seq-length 104 - --max-new-tokens 16

# emapg-train in a child: its one line, exit code and peak memory
TRAIN = """
import atexit, resource, sys
atexit.register(lambda: print(f"maxrss_kb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr))
from emapg_megatron import train
train.main(sys.argv[1:])
"""


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def dry_run(hf, data, *flags, timeout=120):
    """(exit code, the error lines, peak RSS in MB) of ``emapg-train --dry-run`` on ``data``."""
    argv = ["--preset", "tiny-cpu", "--dry-run", "--tensor-model-parallel-size", "1", "--task", "math",
            "--load-hf", str(hf), "--data-path", str(data), "--seq-length", "104", "--max-new-tokens", "16",
            "--max-position-embeddings", "128", "--chat-template", "never", *flags]
    r = subprocess.run([sys.executable, "-c", TRAIN, *argv], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO, preexec_fn=_cap_memory)
    lines = r.stderr.splitlines()
    rss = next(int(line.split()[1]) for line in lines if line.startswith("maxrss_kb")) / 1024
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, [line for line in lines if line.startswith("error:")], rss


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_tiny_hf(str(tmp_path_factory.mktemp("tiny_hf")))


@pytest.fixture(scope="module")
def tokenizer(hf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf, local_files_only=True)


def math_task():
    return get_task("math", chat_template="never")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def good_row(i=0):
    return {"problem": f"What is {i} + 1?", "answer": str(i + 1)}


# --- item 4: only a regular file is read ------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_data_path_must_be_a_regular_file(kind, hf, tmp_path):
    data = tmp_path / "data.jsonl"
    if kind == "fifo":
        os.mkfifo(data)
    elif kind == "dev_zero":
        data.symlink_to("/dev/zero")
    else:
        data.mkdir()
    code, errors, _ = dry_run(hf, data, timeout=90)
    what = {"fifo": "a named pipe (FIFO)", "dev_zero": "a device or socket", "directory": "a directory"}[kind]
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: --data-path {data}: ") and what in errors[0], errors


# --- item 5: a row too long for any fitting prompt is neither parsed nor tokenised ------------
def test_a_huge_row_is_refused_in_bounded_memory_naming_it(hf, tmp_path):
    small = write_jsonl(tmp_path / "small.jsonl", [good_row(i) for i in range(3)])
    _, _, baseline = dry_run(hf, small)
    huge = write_jsonl(tmp_path / "huge.jsonl", [good_row(0), {"problem": "x " * (40 << 20), "answer": "1"},
                                                 good_row(2)])  # an 80 MB row
    code, errors, rss = dry_run(hf, huge)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: 1 of 3 prompts in {huge} are longer than --seq-length 104 - "
                                "--max-new-tokens 16 = 88 tokens (first: 0-based row 1, a row of 83886"), errors
    assert rss - baseline < 150, f"{rss - baseline:.0f} MB more than for a small file"
    code, errors, _ = dry_run(hf, huge, "--long-prompts", "drop")
    assert code == 0 and not errors


def test_a_prompt_too_long_to_fit_is_not_tokenised(tokenizer, tmp_path, monkeypatch):
    """A long prompt in a parquet file (read whole, as parquet is) is too long by its length."""
    from emapg_megatron.tasks import base

    path = tmp_path / "long.parquet"
    pq.write_table(pa.table({"problem": ["short one?", "y" * 5_000_000], "answer": ["1", "2"]}), path)
    seen = []
    encode = base.encode_many
    monkeypatch.setattr("emapg_megatron.training.prompt_data.encode_many",
                        lambda tok, texts: seen.extend(map(len, texts)) or encode(tok, texts))
    with pytest.raises(ConfigError) as e:
        load_training_prompts(math_task(), str(path), tokenizer, seq_length=104, max_new_tokens=16)
    assert "(first: 0-based row 1, more than " in str(e.value) and " characters)" in str(e.value)
    assert max(seen) < 1000  # the long one never reached the tokenizer


# --- item 5b: chat messages are {role, content} text ------------------------------------------
def verl_row(prompt):
    return {"prompt": prompt, "reward_model": {"ground_truth": "4"}, "data_source": "verl"}


def test_malformed_chat_messages_are_refused_naming_the_row(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "verl.jsonl", [
        verl_row([{"role": "user", "content": 0}]),
        verl_row([{"content": "What is 2+2?"}]),
        verl_row([{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"},
                                               {"type": "text", "text": "Answer in a box."}]}]),
        verl_row([{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]}]),
        verl_row(["What is 2+2?"]),
        verl_row([{"role": "user", "content": ""}]),
        verl_row([{"role": "user", "content": "What is 2+2?"}]),
    ])
    notes = []
    prompts = load_training_prompts(math_task(), path, tokenizer, seq_length=104, max_new_tokens=16,
                                    log=notes.append)
    assert [r["_index"] for r in prompts.rows] == [2, 6]
    texts = [math_task().prompt(r, tokenizer) for r in prompts.rows]
    assert texts == ["What is 2+2?\nAnswer in a box.", "What is 2+2?"]
    assert len(notes) == 1 and notes[0].startswith(f"--data-path {path}: skipped 5 of 7 malformed rows (")
    assert "row 0: message 0: its content is 0, not text" in notes[0]
    assert "row 1: message 0 has no role (got None)" in notes[0]
    assert "row 3: message 0: its content is [{'type': 'image_url'" in notes[0]
    assert "... 2 more" in notes[0]  # row 4 (not an object) and row 5 (no text)


def test_a_binary_prompt_column_is_refused(tokenizer, tmp_path):
    path = tmp_path / "binary.parquet"
    pq.write_table(pa.table({"problem": pa.array([b"What is 2+2?", b"\x00\xff"], pa.binary()),
                             "answer": ["4", "1"]}), path)
    with pytest.raises(ConfigError) as e:
        load_training_prompts(math_task(), str(path), tokenizer, seq_length=104, max_new_tokens=16)
    assert "none of its 2 rows is usable" in str(e.value)
    assert "row 0: the prompt is binary data, not text" in str(e.value)


def test_search_questions_must_be_text(tmp_path):
    task = get_task("search")
    rows = [{"question": [{"role": "user", "content": "who?"}], "golden_answers": ["x"]},
            {"question": "who?", "golden_answers": ["x"]}]
    ds, (report,) = task.load(write_jsonl(tmp_path / "s.jsonl", rows), return_report=True, warn=False)
    assert [r["question"] for r in ds] == ["who?"]
    assert report.bad == [(0, "the prompt is chat messages: this task takes its question as text")]


# --- item 6: a prompt must encode to a token --------------------------------------------------
class NothingTokenizer:
    """What transformers builds from a folder without tokenizer files: every text encodes to nothing."""

    def get_vocab(self):
        return {"<unk>": 0}

    def encode(self, text, add_special_tokens=False):
        return []

    def decode(self, ids):
        return ""


def test_a_prompt_of_no_tokens_is_refused_naming_the_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [good_row(0), good_row(1)])
    with pytest.raises(ConfigError) as e:
        load_training_prompts(math_task(), path, NothingTokenizer(), seq_length=104, max_new_tokens=16)
    assert str(e.value).startswith(f"the prompt of row 0 of {path} encodes to no tokens")


def test_load_hf_without_a_tokenizer_is_refused(hf, tmp_path):
    from emapg_megatron import build

    bare = shutil.copytree(hf, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()

    def prepare(model, *flags):
        return build.prepare(["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", "--task", "math",
                              "--load-hf", str(model), "--data-path", MATH, "--seq-length", "256",
                              "--max-position-embeddings", "256", "--chat-template", "never", "--long-prompts",
                              "drop", "--log-dir", str(tmp_path / "log"), *flags])

    with pytest.raises(ConfigError) as e:
        prepare(bare)
    assert str(e.value) == (f"--load-hf {bare} has no tokenizer (none of tokenizer.json, tokenizer.model, "
                            "vocab.json, vocab.txt): the prompts cannot be encoded; copy the model's tokenizer "
                            "files there")
    assert len(prepare(hf).prompts.rows) > 0
    # --dry-run on a stand-in folder (config.json only, the real model being on the target machine)
    # checks the flags and the shapes; it says the prompts were not checked
    dry = prepare(bare, "--dry-run")
    assert dry.prompts is None and '"prompts": "not checked: --load-hf has no tokenizer"' in build.describe(dry)
