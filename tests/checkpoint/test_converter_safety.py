"""``emapg-convert`` never destroys what it reads, and every bad input is one ``error:`` line with
exit code 2, before anything is built (issue 40 items 1, 8, 10; issue 39 item 7):

* an ``--out`` that is, contains or lies inside an input (links resolved) is refused, also with
  ``--overwrite`` (it deleted the checkpoints being exported);
* a checkpoint's ``emapg_model_config.json`` is held to the HF config's types and bounds and to the
  tensors the checkpoint stores, wherever it is read (``mcore-to-hf``, ``verify``,
  ``--teacher-checkpoint``, ``--pretrained-checkpoint``);
* bad option values, a ``verify`` too large to compute, a path that does not exist;
* ``verify`` takes a trainer's ``--save`` folder as ``mcore-to-hf`` does; every option has help.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny_hf import build_tiny_hf

from emapg_megatron.checkpoint import cli
from emapg_megatron.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATH = os.path.join(REPO, "data", "samples", "math.jsonl")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny HF model and its Megatron checkpoint (emapg-convert hf-to-mcore)."""
    root = tmp_path_factory.mktemp("convert")
    hf = build_tiny_hf(str(root / "hf"))
    r = subprocess.run([sys.executable, "-m", "emapg_megatron.checkpoint.cli", "hf-to-mcore", "--hf-dir", hf,
                        "--out", str(root / "mcore"), "--no-progress"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return {"hf": root / "hf", "mcore": root / "mcore"}


@pytest.fixture
def ckpt(made, tmp_path):
    """A private copy of the checkpoint."""
    return shutil.copytree(made["mcore"], tmp_path / "mcore")


def convert(*argv):
    """``emapg-convert ARGV`` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, err.getvalue()


def refused(*argv) -> str:
    """The one ``error:`` line of a refused command (exit code 2, no traceback)."""
    code, err = convert(*argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def files_of(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- item 1: an output never replaces an input ------------------------------------------------
def test_exporting_a_step_into_its_save_folder_deletes_nothing(ckpt, tmp_path):
    save = tmp_path / "save"
    step = save / "iter_0000007"
    shutil.copytree(ckpt, step)
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    before = files_of(save)
    line = refused("mcore-to-hf", "--load", step, "--out", save, "--overwrite", "--no-progress")
    assert line.startswith(f"error: --out {save} contains --load {step} (links resolved)")
    assert files_of(save) == before


@pytest.mark.parametrize("case", ["same", "link", "inside_template", "hf_to_mcore_same", "hf_to_mcore_inside"])
def test_an_output_that_is_holds_or_lies_in_an_input_is_refused(case, made, ckpt, tmp_path):
    hf = shutil.copytree(made["hf"], tmp_path / "hf")
    (tmp_path / "link").symlink_to(ckpt)
    argv, relation = {
        "same": (["mcore-to-hf", "--load", ckpt, "--out", ckpt], f"is --load {ckpt}"),
        "link": (["mcore-to-hf", "--load", ckpt, "--out", tmp_path / "link"], f"is --load {ckpt}"),
        "inside_template": (["mcore-to-hf", "--load", ckpt, "--hf-template", hf, "--out", hf / "export"],
                            f"is inside the tokenizer folder {hf}"),
        "hf_to_mcore_same": (["hf-to-mcore", "--hf-dir", hf, "--out", hf], f"is --hf-dir {hf}"),
        "hf_to_mcore_inside": (["hf-to-mcore", "--hf-dir", hf, "--out", hf / "mcore"], f"is inside --hf-dir {hf}"),
    }[case]
    before = files_of(tmp_path)
    assert relation in refused(*argv, "--overwrite", "--no-progress")
    assert files_of(tmp_path) == before


# --- item 8: the stored model config, checked before anything is built ------------------------
BAD_CONFIGS = [
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1 to 1024 (got 0)"),
    ({"num_layers": "2"}, "num_layers must be an integer from 1 to 1024 (got '2')"),
    ({"num_layers": 10**7}, "num_layers must be an integer from 1 to 1024 (got 10000000)"),
    ({"hidden_size": 2.5}, "hidden_size must be an integer"),
    ({"norm_epsilon": -1}, "norm_epsilon must be a positive number (got -1)"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"num_query_groups": 3}, "4 attention heads are not divisible into 3 groups"),
    ({"num_layers": 3}, "does not describe the tensors"),
    ({"ffn_hidden_size": 256}, "decoder.layers.mlp.linear_fc1.weight: stored (2, 256, 64), expected (2, 512, 64)"),
    ({"qk_layernorm": True}, "decoder.layers.self_attention.q_layernorm.weight is not stored"),
]


def edit_model_config(ckpt, **changes):
    path = ckpt / "emapg_model_config.json"
    meta = json.loads(path.read_text())
    meta["model_config"].update(changes)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("changes, message", BAD_CONFIGS)
def test_a_bad_stored_model_config_is_one_line(changes, message, made, ckpt, tmp_path):
    edit_model_config(ckpt, **changes)
    for argv in (["mcore-to-hf", "--load", ckpt, "--out", tmp_path / "out", "--no-progress"],
                 ["verify", "--hf-dir", made["hf"], "--load", ckpt]):
        line = refused(*argv)
        assert message in line and str(ckpt) in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("meta_changes, message", [
    ({"saved_tp": 10**9}, "saved_tp must be an integer from 1 to 1024"),
    ({"dtype": "fp8"}, "dtype 'fp8' must be one of bf16, fp32"),
    ({"hf_config": [1, 2]}, "hf_config must be a JSON object"),
    ({"architecture": None}, "records no architecture or dtype: it cannot be exported"),
])
def test_bad_metadata_entries_are_one_line(meta_changes, message, ckpt, tmp_path):
    path = ckpt / "emapg_model_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **meta_changes}))
    assert message in refused("mcore-to-hf", "--load", ckpt, "--out", tmp_path / "out", "--no-progress")


def prepare(made, *flags):
    """The trainer's checks (--dry-run) with the tiny model as the student."""
    from emapg_megatron import build

    return build.prepare(["--preset", "tiny-cpu", "--task", "math", "--load-hf", str(made["hf"]),
                          "--data-path", MATH, "--seq-length", "128", "--max-position-embeddings", "128",
                          "--chat-template", "never", "--tensor-model-parallel-size", "1", "--dry-run",
                          *map(str, flags)])


@pytest.mark.parametrize("flag", ["--teacher-checkpoint", "--pretrained-checkpoint"])
@pytest.mark.parametrize("changes, message", [BAD_CONFIGS[0], BAD_CONFIGS[1], BAD_CONFIGS[7]])
def test_the_trainer_checks_a_stored_model_config_too(flag, changes, message, made, ckpt):
    prepare(made, flag, ckpt)  # the untouched checkpoint passes
    edit_model_config(ckpt, **changes)
    with pytest.raises(ConfigError) as e:
        prepare(made, flag, ckpt)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_pretrained_checkpoint_without_a_model_config_is_checked_by_its_tensors(ckpt):
    """A checkpoint not written here (no emapg_model_config.json) is held to the run's own model."""
    from emapg_megatron import build

    (ckpt / "emapg_model_config.json").unlink()
    shape = ["--vocab-size", "320", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
             "4", "--num-query-groups", "2", "--add-qkv-bias"]

    def run(*flags):
        return build.prepare(["--preset", "tiny-cpu", "--dry-run", "--tensor-model-parallel-size", "1", *shape,
                              *flags, "--pretrained-checkpoint", str(ckpt)])

    run()
    with pytest.raises(ConfigError) as e:
        run("--num-layers", "3")
    assert str(e.value).startswith("this run's model (the model flags or --load-hf) does not describe the "
                                   f"tensors {ckpt} holds: decoder.layers.")
    with pytest.raises(ConfigError) as e:  # the tiny model ties its embeddings
        run("--untie-embeddings-and-output-weights")
    assert str(e.value).endswith("holds: output_layer.weight is not stored")


# --- item 10: option values -------------------------------------------------------------------
@pytest.mark.parametrize("argv, line", [
    (["hf-to-mcore", "--hf-dir", "HF", "--out", "OUT", "--tp", "0"], "--tp must be in [1, 1024] (got 0)"),
    (["hf-to-mcore", "--hf-dir", "HF", "--out", "OUT", "--pp", "-2"], "--pp must be in [1, 1024] (got -2)"),
    (["hf-to-mcore", "--hf-dir", "HF", "--out", "OUT", "--make-vocab-size-divisible-by", "0"],
     "--make-vocab-size-divisible-by must be in [1, 65536] (got 0)"),
    (["hf-to-mcore", "--hf-dir", "HF", "--out", "OUT", "--tp", "two"], "argument --tp: invalid int value: 'two'"),
    (["mcore-to-hf", "--load", "CKPT", "--out", "OUT", "--max-shard-size-gb", "nan"],
     "--max-shard-size-gb must be > 0 (got nan)"),
    (["mcore-to-hf", "--load", "CKPT", "--out", "OUT", "--max-shard-size-gb", "-1"],
     "--max-shard-size-gb must be > 0 (got -1.0)"),
    (["verify", "--hf-dir", "HF", "--load", "CKPT", "--seq-len", "-1"], "--seq-len must be >= 1 (got -1)"),
    (["verify", "--hf-dir", "HF", "--load", "CKPT", "--batch", "0"], "--batch must be >= 1 (got 0)"),
    (["verify", "--hf-dir", "HF", "--load", "CKPT", "--tp", "0"], "--tp must be in [1, 1024] (got 0)"),
    (["verify", "--hf-dir", "HF", "--load", "CKPT", "--seq-len", "10000000"],
     "--seq-len 10000000 exceeds the model's 1024 positions"),
    (["verify", "--hf-dir", "HF", "--load", "CKPT", "--batch", "100000000"],
     "--batch 100000000 x --seq-len 32 tokens need 4577.6 GiB of logits per side"),
    (["verify", "--hf-dir", "HF", "--load", "/nonexistent/ckpt"], "--load path does not exist: /nonexistent/ckpt"),
    (["mcore-to-hf", "--load", "/nonexistent/ckpt", "--out", "OUT"], "--load path does not exist: /nonexistent/ckpt"),
    (["verify", "--hf-dir", "HF"], "--load needs a value"),
])
def test_bad_option_values_are_one_line(argv, line, made, tmp_path):
    names = {"HF": made["hf"], "CKPT": made["mcore"], "OUT": tmp_path / "out"}
    assert refused(*[names.get(a, a) for a in argv]).startswith(f"error: {line}")
    assert not (tmp_path / "out").exists()


# --- issue 39 item 7: verify reads what mcore-to-hf reads; help -------------------------------
@pytest.mark.slow
def test_verify_takes_a_save_folder(made, ckpt, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(ckpt, save / "iter_0000003")
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["verify", "--hf-dir", str(made["hf"]), "--load", str(save), "--seq-len", "8"]) == 0
    result = json.loads(out.getvalue())
    assert result["max_abs_logit_diff"] < 1e-3 and result["top1_agreement"] == 1.0


def test_lora_to_peft_of_a_checkpoint_without_adapters_is_one_line(made, tmp_path):
    assert refused("lora-to-peft", "--load", made["mcore"], "--out", tmp_path / "adapter") == (
        f"error: {made['mcore']} is not a LoRA run's checkpoint (no adapters to export): emapg-convert "
        "mcore-to-hf exports its model")
    assert not (tmp_path / "adapter").exists()


def test_a_folder_that_is_no_checkpoint_is_said_so(tmp_path, made):
    (tmp_path / "empty").mkdir()
    assert refused("verify", "--hf-dir", made["hf"], "--load", tmp_path / "empty") == (
        f"error: {tmp_path / 'empty'} has no emapg_model_config.json: not a checkpoint written by emapg-megatron")


def test_every_option_has_help_and_the_help_is_plain_text():
    parser = cli._parser()
    top = parser.format_help()
    assert "``" not in top and "emapg-convert" in top
    commands = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    assert set(commands) == {"hf-to-mcore", "mcore-to-hf", "lora-to-peft", "verify"}
    for name, sub in commands.items():
        undocumented = [a.option_strings[0] for a in sub._actions
                        if a.option_strings and a.option_strings[0] != "-h" and not (a.help or "").strip()]
        assert not undocumented, f"{name}: {undocumented} have no help"
        assert "``" not in sub.format_help()
