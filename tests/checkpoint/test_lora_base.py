"""The base record of an adapters-only LoRA checkpoint (checkpoint/lora_base.py): which files are
a base's weights, their sha256, the record's checks on read, and the one-line refusals of another
base (docs/lora.md, "Checkpoints")."""

import hashlib
import json
import os

import pytest

from emapg_megatron.checkpoint.lora_base import BaseRecord, check_same_base
from emapg_megatron.errors import ConfigError


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def sharded_hf(tmp_path):
    """An HF folder with an index naming two shards, and files that are not weights."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "a.safetensors").write_bytes(b"first shard")
    (hf / "b.safetensors").write_bytes(b"second shard")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"}}))
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    return hf


def test_an_hf_base_is_its_indexed_shards(sharded_hf):
    record = BaseRecord.of("--load-hf", str(sharded_hf))
    assert record.files == {"a.safetensors": _sha(b"first shard"), "b.safetensors": _sha(b"second shard")}
    assert record.path == os.path.abspath(sharded_hf)
    lines = f"a.safetensors\0{_sha(b'first shard')}\nb.safetensors\0{_sha(b'second shard')}\n"
    assert record.sha256 == _sha(lines.encode())
    assert BaseRecord.from_dict(json.loads(json.dumps(record.to_dict())), "w") == record
    (sharded_hf / "tokenizer.json").write_text('{"changed": 1}')  # not a weight: the same base
    assert BaseRecord.of("--load-hf", str(sharded_hf)) == record


def test_a_torch_dist_base_is_every_file_of_its_folder(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"m")
    (ckpt / "__0_0.distcp").write_bytes(b"d")
    (ckpt / "sub" / "ignored").write_bytes(b"x")
    assert BaseRecord.of("--pretrained-checkpoint", str(ckpt)).files == {".metadata": _sha(b"m"),
                                                                         "__0_0.distcp": _sha(b"d")}


def test_a_weight_file_outside_the_folder_or_not_a_file_is_refused(sharded_hf, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"secret")
    os.remove(sharded_hf / "b.safetensors")
    os.symlink(outside, sharded_hf / "b.safetensors")
    with pytest.raises(ConfigError, match=r"^refusing to read .*b.safetensors: it resolves to .*, outside "):
        BaseRecord.of("--load-hf", str(sharded_hf))
    os.remove(sharded_hf / "b.safetensors")
    os.mkfifo(sharded_hf / "b.safetensors")  # would block a plain open forever
    with pytest.raises(ConfigError, match=r"b.safetensors: it is a named pipe \(FIFO\), not a regular file$"):
        BaseRecord.of("--load-hf", str(sharded_hf))


@pytest.mark.parametrize("entry, why", [
    ("text", "is 'text', not a dict"),
    ({"flag": "--load", "path": "/m", "files": {"a": "0" * 64}}, "names '--load' '/m', not one of"),
    ({"flag": "--load-hf", "path": "", "files": {"a": "0" * 64}}, "names '--load-hf' '', not one of"),
    ({"flag": "--load-hf", "path": "/m", "files": {}}, "has no valid sha256 per weight file"),
    ({"flag": "--load-hf", "path": "/m", "files": {"a": "xyz"}}, "has no valid sha256 per weight file"),
    ({"flag": "--load-hf", "path": "/m", "files": ["a"]}, "has no valid sha256 per weight file"),
])
def test_a_corrupt_record_is_one_line(entry, why):
    with pytest.raises(ConfigError) as e:
        BaseRecord.from_dict(entry, "ckpt/common.pt")
    assert str(e.value).startswith("corrupt checkpoint file ckpt/common.pt: its LoRA base record ")
    assert why in str(e.value) and "\n" not in str(e.value)


def test_another_base_is_refused_naming_what_differs():
    saved = BaseRecord("--load-hf", "/models/a", {f"s{i}": str(i) * 64 for i in range(5)})
    same_elsewhere = BaseRecord("--load-hf", "/moved/a", dict(saved.files))
    check_same_base(saved, same_elsewhere, "--load C", "hint")  # moved: the same files
    with pytest.raises(ConfigError) as e:
        check_same_base(saved, BaseRecord("--load-hf", "/m/b", {**saved.files, "s1": "f" * 64}), "--load C", "hint")
    assert str(e.value) == (f"--load C: its adapters were trained on the base of --load-hf /models/a (sha256 "
                            f"{saved.sha256[:12]}); --load-hf /m/b (sha256 "
                            f"{BaseRecord('--load-hf', '/m/b', {**saved.files, 's1': 'f' * 64}).sha256[:12]}) "
                            "differs from it (s1): hint")
    other = BaseRecord("--load-hf", "/m/c", {"t": "e" * 64})
    with pytest.raises(ConfigError, match=r"differs from it \(s0, s1, s2 and 3 more\): hint$"):
        check_same_base(saved, other, "--load C", "hint")
    with pytest.raises(ConfigError, match=r"this run's base comes from --pretrained-checkpoint /p: drop "
                                          r"--pretrained-checkpoint$"):
        check_same_base(saved, BaseRecord("--pretrained-checkpoint", "/p", dict(saved.files)), "--load C", "hint")
    on_checkpoint = BaseRecord("--pretrained-checkpoint", "/ckpt", dict(saved.files))
    with pytest.raises(ConfigError, match=r"this run's base comes from --load-hf /models/a: pass "
                                          r"--pretrained-checkpoint /ckpt$"):
        check_same_base(on_checkpoint, saved, "--load C", "hint")


@pytest.mark.parametrize("save, resume, hashed", [(None, None, False), ("out", None, True), (None, "ckpt", True)])
def test_the_base_is_hashed_only_when_a_checkpoint_records_or_checks_it(sharded_hf, monkeypatch, save, resume,
                                                                        hashed):
    """Hashing a 70B base takes minutes on rank 0: a run that neither saves nor resumes skips it."""
    from types import SimpleNamespace

    from emapg_megatron import build

    cfg = SimpleNamespace(lora=SimpleNamespace(enabled=True), checkpoint=SimpleNamespace(save=save),
                          model=SimpleNamespace(pretrained_checkpoint=None, load_hf=str(sharded_hf)))
    # the resumed checkpoint is an adapters-only one (it holds no base weights)
    monkeypatch.setattr(build.checkpointing, "holds_base_weights", lambda path: False)
    record = build.lora_base(cfg, resume)
    assert (record == BaseRecord.of("--load-hf", str(sharded_hf))) if hashed else record is None
