"""verl-format math data (DeepScaleR, GSM8K as verl ships them: ``prompt`` chat messages,
``reward_model.ground_truth``, ``data_source``) loads as is; chat prompts go through the
tokenizer's chat template (their contents, without one); --prompt-key/--answer-key map columns."""

import contextlib
import io
import os

import pytest
from tiny_hf import SAMPLES

from emapg_megatron import train
from emapg_megatron.tasks import get_task

pytest.importorskip("math_verify")
FILES = {"gsm8k": "verl_gsm8k.parquet", "deepscaler": "verl_deepscaler.parquet"}


class ChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.mark.parametrize("name", list(FILES))
def test_verl_files_load_as_is_and_render_their_messages(name):
    task = get_task("math")
    rows = task.load(os.path.join(SAMPLES, FILES[name]))
    assert len(rows) == 6 and rows[0]["ground_truth"] and rows[0]["data_source"]
    content = rows[0]["question"][0]["content"]
    assert task.prompt(rows[0], None) == content  # no chat template: the message's text
    assert task.prompt(rows[0], ChatTokenizer()) == f"<user>{content}<assistant>"
    assert task.reward(f"\\boxed{{{rows[0]['ground_truth']}}}", rows[0]) == 1.0


def _dry_run(*argv):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny-cpu", "--dry-run=json", "--world-size", "2", "--task", "math",
                    "--load-hf", HF, "--seq-length", "256", "--max-new-tokens", "16", *argv])
    return e.value.code, out.getvalue(), err.getvalue().strip()


@pytest.fixture(scope="module", autouse=True)
def tiny_hf(tiny_hf_model):
    global HF
    HF = tiny_hf_model  # conftest.py's, shared with other modules


def test_the_trainer_takes_verl_files_and_column_flags():
    path = os.path.join(SAMPLES, FILES["gsm8k"])
    code, out, err = _dry_run("--data-path", path)
    assert code == 0 and '"prompts": 6' in out, err
    code, out, err = _dry_run("--data-path", path, "--prompt-key", "extra_info.question",
                              "--answer-key", "extra_info.answer")
    assert code == 0 and '"prompts": 6' in out, err
    code, _, err = _dry_run("--data-path", path, "--answer-key", "reward_model.answer")
    assert code == 2 and len(err.splitlines()) == 1 and "reward_model.answer" in err, err
