"""Hostile Hugging Face folders (what ``emapg-convert hf-to-mcore`` and the trainer's --load-hf
read) fail in one line naming the file, in bounded memory and time, before anything is built:
config.json of the wrong shape or with absurd sizes, shards outside the folder, named pipes,
safetensors headers that lie about their file.

Each case corrupts a copy of a tiny real HF model (``tiny_hf.build_tiny_hf``).
"""

import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from emapg_megatron import train
from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
from emapg_megatron.checkpoint.hf_io import INDEX, SINGLE, SafetensorsReader
from emapg_megatron.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tiny_hf_model):
    return tiny_hf_model  # conftest.py's, shared with other modules: never changed, see hf


@pytest.fixture
def hf(tiny, tmp_path):
    """A private copy to corrupt."""
    return shutil.copytree(tiny, tmp_path / "hf")


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def edit_config(hf, **changes):
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (hf / "config.json").write_text(json.dumps(config))


def test_the_tiny_model_passes(hf):
    cfg, arch = model_config_from_hf(read_hf_config(hf))
    assert arch == "Qwen2ForCausalLM" and cfg.num_layers == 2
    assert "model.embed_tokens.weight" in SafetensorsReader(hf).names()


# --- config.json ---------------------------------------------------------------------------
NOT_AN_OBJECT = {
    "not JSON": (b"{not json", "invalid JSON in {}: JSONDecodeError: Expecting property name"),
    "a list": (b"[1, 2]", "{} holds a JSON list, not an object"),
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000,
                           "invalid JSON in {}: RecursionError: maximum recursion depth exceeded"),
    "not UTF-8": (b'{"a": "\xff"}', "invalid JSON in {}: UnicodeDecodeError"),
}


@pytest.mark.parametrize("case", NOT_AN_OBJECT)
def test_a_config_json_that_is_no_object_is_one_line(case, hf):
    content, message = NOT_AN_OBJECT[case]
    (hf / "config.json").write_bytes(content)
    with pytest.raises(ConfigError) as e:
        read_hf_config(hf)
    assert one_line(e).startswith(message.format(hf / "config.json"))


BAD_ENTRIES = {
    "layers 1e9": (dict(num_hidden_layers=1e9),
                   "num_hidden_layers must be an integer from 1 to 1024 (got 1000000000.0)"),
    "layers 2e5": (dict(num_hidden_layers=200_000),
                   "num_hidden_layers must be an integer from 1 to 1024 (got 200000)"),
    "vocabulary 1e12": (dict(vocab_size=10**12),
                        "vocab_size must be an integer from 1 to 2097152 (got 1000000000000)"),
    "no heads": (dict(num_attention_heads=0),
                 "num_attention_heads must be an integer from 1 to 1024 (got 0)"),
    "no hidden_size": (dict(hidden_size=None), "no hidden_size (an integer from 1 to 65536)"),
    "width as text": (dict(hidden_size="64"), "hidden_size must be an integer from 1 to 65536 (got '64')"),
    "heads as bool": (dict(num_attention_heads=True),
                      "num_attention_heads must be an integer from 1 to 1024 (got True)"),
    "rope_theta text": (dict(rope_theta="abc"), "rope_theta must be a positive number (got 'abc')"),
    "rope_theta inside": (dict(rope_parameters={"rope_theta": "abc", "rope_type": "default"}),
                          "rope_parameters.rope_theta must be a positive number (got 'abc')"),
    "rope_theta infinite": (dict(rope_theta=float("inf")),
                            "rope_theta must be a positive number (got inf)"),
    "rope_parameters list": (dict(rope_parameters=[1]), "rope_parameters must be a dict (got [1])"),
    "epsilon zero": (dict(rms_norm_eps=0), "rms_norm_eps must be a positive number (got 0)"),
    "tie as text": (dict(tie_word_embeddings="false"),
                    "tie_word_embeddings must be a bool (got 'false')"),
    "layer_types number": (dict(layer_types=5), "layer_types must be a list (got 5)"),
    "architectures text": (dict(architectures="Qwen2ForCausalLM"),
                           "architectures must be a list (got 'Qwen2ForCausalLM')"),
    "long value": (dict(num_hidden_layers="x" * 10_000),
                   f"num_hidden_layers must be an integer from 1 to 1024 (got '{'x' * 59}...)"),
}


@pytest.mark.parametrize("case", BAD_ENTRIES)
def test_bad_architecture_entries_are_one_line_naming_the_file(case, hf):
    """Checked before anything is sized by them: a per-layer table for 1e9 layers, a 256 TB
    embedding."""
    changes, message = BAD_ENTRIES[case]
    edit_config(hf, **changes)
    with pytest.raises(ConfigError) as e:
        read_hf_config(hf)
    assert one_line(e).startswith(f"{hf / 'config.json'}: {message}")


def test_model_config_from_hf_checks_a_dict_too(tiny):
    config = read_hf_config(tiny)
    with pytest.raises(ConfigError, match=r"^config.json: num_hidden_layers must be an integer"):
        model_config_from_hf({**config, "num_hidden_layers": 1e9})
    with pytest.raises(ConfigError, match="unsupported architecture \\[\\['x'\\]\\]"):
        model_config_from_hf({**config, "architectures": [["x"]]})


# --- shards --------------------------------------------------------------------------------
def write_index(hf, weight_map):
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def all_tensors_in(hf, shard: str) -> dict:
    return {name: shard for name in SafetensorsReader(hf).names()}


@pytest.mark.parametrize("where", ["../outside/x.safetensors", "absolute", "link"])
def test_shards_outside_the_folder_are_refused_before_opening(where, hf, tmp_path):
    """The index may name any path; a link may point anywhere."""
    weight_map = all_tensors_in(hf, SINGLE)
    (tmp_path / "outside").mkdir()
    outside = tmp_path / "outside" / "x.safetensors"
    shutil.move(hf / SINGLE, outside)
    shard = {"../outside/x.safetensors": "../outside/x.safetensors", "absolute": str(outside),
             "link": "model-00001-of-00001.safetensors"}[where]
    if where == "link":
        os.symlink(outside, hf / shard)
    write_index(hf, {name: shard for name in weight_map})
    with pytest.raises(ConfigError) as e:
        SafetensorsReader(hf)
    assert one_line(e) == (f"refusing to read {hf / shard}: it resolves to {outside}, "
                           f"outside {hf}")


def test_etc_passwd_is_not_opened(hf):
    write_index(hf, {"model.embed_tokens.weight": "/etc/passwd"})
    with pytest.raises(ConfigError, match="^refusing to read /etc/passwd: it resolves to "):
        SafetensorsReader(hf)


def test_a_link_inside_the_folder_is_read(hf):
    weight_map = all_tensors_in(hf, SINGLE)
    (hf / "weights").mkdir()
    shutil.move(hf / SINGLE, hf / "weights" / "real.safetensors")
    os.symlink(hf / "weights" / "real.safetensors", hf / "model-00001-of-00001.safetensors")
    write_index(hf, {name: "model-00001-of-00001.safetensors" for name in weight_map})
    assert SafetensorsReader(hf).names() == list(weight_map)


@pytest.mark.parametrize("index,message", [
    ({"weight_map": ["model.safetensors"]}, "its weight_map must map tensor names to file names"),
    ({"weight_map": {"a": 1}}, "its weight_map must map tensor names to file names"),
    ([1], "its weight_map must map tensor names to file names"),
    ("{not json", "JSONDecodeError"),
])
def test_a_malformed_index_is_one_line(index, message, hf):
    (hf / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(ConfigError) as e:
        SafetensorsReader(hf)
    assert str(hf / INDEX) in one_line(e) and message in str(e.value)


def rewrite_header(path, edit=None, length=None):
    """Rewrite a safetensors file's JSON header (``edit(header)``) or its header length."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    if edit is not None:
        edit({k: v for k, v in header.items() if k != "__metadata__"})
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", length if length is not None else len(text)) + text + data)


def _first(header):
    return header[min(header)]


LYING_HEADERS = {
    "length beyond the file": dict(length=1 << 20),
    "length of 2**62": dict(length=1 << 62),
    "offsets beyond the file": dict(edit=lambda h: _first(h).update(data_offsets=[0, 1 << 40])),
    "overlapping offsets": dict(edit=lambda h: [t.update(data_offsets=_first(h)["data_offsets"])
                                                for t in h.values()]),
    "shape larger than its bytes": dict(edit=lambda h: _first(h).update(shape=[100_000, 100_000])),
    "dtype wider than its bytes": dict(edit=lambda h: _first(h).update(dtype="F64")),
}


@pytest.mark.parametrize("case", LYING_HEADERS)
def test_a_lying_safetensors_header_is_one_line(case, hf):
    rewrite_header(hf / SINGLE, **LYING_HEADERS[case])
    with pytest.raises(ConfigError) as e:
        SafetensorsReader(hf)
    assert one_line(e).startswith(f"corrupt safetensors file {hf / SINGLE}: SafetensorError: ")


# --- named pipes -----------------------------------------------------------------------------
FIFO_SCRIPT = """
import sys
from emapg_megatron.checkpoint.hf_config import read_hf_config
from emapg_megatron.checkpoint.hf_io import SafetensorsReader
from emapg_megatron.errors import ConfigError
for path in sys.argv[1:]:
    try:
        read_hf_config(path)
        SafetensorsReader(path)
        print("read")
    except ConfigError as e:
        print(e)
"""


def test_a_named_pipe_in_an_hf_folder_is_refused_without_blocking(tiny, tmp_path):
    """Opening a FIFO blocks until a writer comes. In a subprocess: a regression fails here
    instead of hanging."""
    cases = {}
    for name in ("config.json", SINGLE, INDEX):
        hf = shutil.copytree(tiny, tmp_path / name)
        if (hf / name).exists():
            (hf / name).unlink()
        os.mkfifo(hf / name)
        cases[hf / name] = hf
    r = subprocess.run([sys.executable, "-c", FIFO_SCRIPT, *map(str, cases.values())],
                       capture_output=True, text=True, timeout=120, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(cases), r.stderr[-2000:]
    for path, line in zip(cases, lines):
        assert line == f"refusing to read {path}: it is a named pipe (FIFO), not a regular file"


# --- through the command lines ---------------------------------------------------------------
def test_hf_to_mcore_refuses_a_shard_outside_the_folder(hf, tmp_path):
    weight_map = all_tensors_in(hf, SINGLE)
    (tmp_path / "outside").mkdir()
    shutil.move(hf / SINGLE, tmp_path / "outside" / "x.safetensors")
    write_index(hf, {name: "../outside/x.safetensors" for name in weight_map})
    cmd = [sys.executable, "-m", "emapg_megatron.checkpoint.cli", "hf-to-mcore", "--hf-dir",
           str(hf), "--out", str(tmp_path / "out"), "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       check=False)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: refusing to read {hf / '../outside/x.safetensors'}: it resolves to ")
    assert not (tmp_path / "out").exists()


def dry_run(hf):
    """The trainer's ``--dry-run --load-hf hf`` in this process: (exit code, stderr)."""
    argv = ["--preset", "tiny-cpu", "--dry-run", "--world-size", "2", "--load-hf", str(hf),
            "--task", "math", "--data-path", os.path.join(REPO, "data", "samples", "math.jsonl"),
            "--seq-length", "256", "--max-new-tokens", "16"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            pytest.raises(SystemExit) as e:
        train.main(argv)
    return e.value.code, err.getvalue()


@pytest.mark.parametrize("changes,message", [
    (dict(num_hidden_layers=1e9), "num_hidden_layers must be an integer from 1 to 1024"),
    (dict(vocab_size=10**12), "vocab_size must be an integer from 1 to 2097152"),
])
def test_the_trainer_dry_run_refuses_absurd_sizes(changes, message, hf):
    assert dry_run(hf)[0] == 0
    edit_config(hf, **changes)
    code, err = dry_run(hf)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"error: {hf / 'config.json'}: {message}")


def test_a_hub_cache_snapshot_reads_its_blobs_but_nothing_else(tmp_path):
    """``~/.cache/huggingface/hub/models--X/snapshots/REV`` holds links into ``../../blobs``: those
    are inside; a link anywhere else is not."""
    import json

    from emapg_megatron.checkpoint.hf_config import read_hf_config
    from emapg_megatron.errors import ConfigError

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64,
              "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}
    (repo / "blobs" / "f00d").write_text(json.dumps(config))
    (snap / "config.json").symlink_to(os.path.join("..", "..", "blobs", "f00d"))
    assert read_hf_config(str(snap))["architectures"] == ["Qwen2ForCausalLM"]
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(outside)
    with pytest.raises(ConfigError, match="outside"):
        read_hf_config(str(snap))
