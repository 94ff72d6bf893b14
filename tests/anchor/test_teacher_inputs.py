"""``--teacher-load-hf`` on a folder without tokenizer files (weights and config only, which the
docs allow) is checked by its vocabulary size: it was refused with a false "its tokenizer differs
from the student's (1 and 320 tokens)", transformers having built a one-token tokenizer from its
config.json (issue 40 item 9). A folder with another tokenizer is still refused."""

import json
import os
import shutil

import pytest
from tiny_hf import build_tiny_hf

from emapg_megatron import build
from emapg_megatron.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return build_tiny_hf(str(tmp_path_factory.mktemp("student")))


def prepare(student, teacher):
    return build.prepare(["--preset", "tiny-cpu", "--task", "math", "--load-hf", student, "--data-path",
                          os.path.join(REPO, "data", "samples", "math.jsonl"), "--seq-length", "256",
                          "--max-position-embeddings", "256", "--chat-template", "never",
                          "--tensor-model-parallel-size", "1", "--dry-run", "--teacher-load-hf", str(teacher)])


def test_a_teacher_folder_without_tokenizer_files_is_checked_by_its_vocabulary(student, tmp_path):
    teacher = shutil.copytree(student, tmp_path / "teacher")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (teacher / name).unlink()
    inputs = prepare(student, teacher)
    assert inputs.teacher_cfg.vocab_size == inputs.model_cfg.vocab_size


def test_a_teacher_with_another_tokenizer_is_still_refused(student, tmp_path):
    teacher = shutil.copytree(student, tmp_path / "teacher")
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[5:7]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="its tokenizer differs from the student's"):
        prepare(student, teacher)
