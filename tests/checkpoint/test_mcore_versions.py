"""Checkpoints across the supported megatron-core range: one written by 0.16.1 resumes under any
supported release and continues to the same step; one written by a later release than the
installed one is refused in one line that names it (0.16.1 cannot read 0.19's format)."""

import json
import shutil
from importlib.metadata import version

import pytest
import torch
from mcore_versions import ARGS, NPROC, fixture
from trainer_launch import COMPARED, metrics, torchrun

from emapg_megatron import mcore_compat
from emapg_megatron.checkpoint.safe_load import verify_checkpoint_metadata
from emapg_megatron.errors import ConfigError

INSTALLED = version("megatron-core")
WRITERS = ("0.16.1", "0.19.2")


def _newer(writer: str) -> bool:
    return mcore_compat.unreadable(writer, False) is not None


def _copy(writer: str, tmp_path):
    ckpt = tmp_path / f"mcore-{writer}"
    shutil.copytree(fixture(writer), ckpt)
    return ckpt


def test_the_fixtures_record_the_release_that_wrote_them():
    for writer in WRITERS:
        if _newer(writer):
            with pytest.raises(ConfigError, match=f"written by megatron-core {writer}, newer than"):
                verify_checkpoint_metadata(f"{fixture(writer)}/iter_0000002")
            continue
        ckpt = verify_checkpoint_metadata(f"{fixture(writer)}/iter_0000002")
        assert ckpt.common[mcore_compat.VERSION_KEY] == writer
        in_item = ckpt.common_where.endswith(f"(item {mcore_compat.COMMON_ITEM}/shard_0_1)")
        assert in_item == (writer != "0.16.1")  # 0.19 keeps it in the .distcp files


@pytest.mark.slow
@pytest.mark.parametrize("writer", WRITERS)
def test_a_checkpoint_resumes_under_the_installed_release_or_is_refused_in_one_line(writer, tmp_path):
    """Under a release at least as new as the writer: the resumed step 3 is the writer's own
    uninterrupted step 3 (0.16.1 on Python 3.11's CPU torch and 0.19.2 on 3.12's CUDA build compute
    the same floats on one CPU; the fixture was written on another, whose float order differs in
    the last digits, so to 1e-5 relative). Else exactly one ``error:`` line names both releases."""
    ckpt = _copy(writer, tmp_path)
    r = torchrun(NPROC, [*ARGS, "--load", str(ckpt)], tmp_path / "log")
    out = r.stdout + r.stderr
    if _newer(writer):
        assert r.returncode != 0
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert errors == [f"error: cannot load checkpoint {ckpt}/iter_0000002: it was written by "
                          f"megatron-core {writer}, newer than the installed megatron-core "
                          f"{INSTALLED}, which cannot read it; load it where megatron-core "
                          f"{writer} is installed (Python >= 3.12)"], out[-3000:]
        return
    assert r.returncode == 0, out[-3000:]
    (resumed,) = metrics(tmp_path / "log")
    expected = json.loads((ckpt / "expected.json").read_text())
    assert resumed["step"] == 3 and resumed["reward_mean"] == expected["reward_mean"]
    for k in COMPARED:
        assert resumed[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-9), k


def _with_common(ckpt, **entries):
    """Rewrite the 0.16.1 fixture's common.pt with ``entries`` (its format: a torch.save dict)."""
    path = ckpt / "iter_0000002" / mcore_compat.COMMON_FILE
    common = torch.load(path, weights_only=True)
    common.update(entries)
    torch.save(common, path)
    return f"{ckpt}/iter_0000002"


def test_a_later_release_is_refused_and_a_garbage_record_is_corrupt(tmp_path):
    path = _with_common(_copy("0.16.1", tmp_path), **{mcore_compat.VERSION_KEY: "0.99.0"})
    with pytest.raises(ConfigError) as e:
        verify_checkpoint_metadata(path)
    assert str(e.value) == (f"cannot load checkpoint {path}: it was written by megatron-core 0.99.0, "
                            f"newer than the installed megatron-core {INSTALLED}, which cannot read "
                            f"it; load it where megatron-core 0.99.0 is installed (Python >= 3.12)")
    path = _with_common(_copy("0.16.1", tmp_path / "b"), **{mcore_compat.VERSION_KEY: ["x"]})
    with pytest.raises(ConfigError, match=r"corrupt checkpoint file .*common.pt: 'megatron_core_version' "
                                          r"is \['x'\], not a version"):
        verify_checkpoint_metadata(path)


def test_a_checkpoint_without_the_record_is_read_as_before(tmp_path):
    """Checkpoints written before the release was recorded (all of them 0.16.1's) still load."""
    ckpt = _copy("0.16.1", tmp_path)
    path = ckpt / "iter_0000002" / mcore_compat.COMMON_FILE
    common = torch.load(path, weights_only=True)
    del common[mcore_compat.VERSION_KEY]
    torch.save(common, path)
    assert mcore_compat.VERSION_KEY not in verify_checkpoint_metadata(str(path.parent)).common


def test_megatron_core_019s_format_without_a_record_needs_a_release_that_reads_it():
    assert mcore_compat.unreadable(None, common_in_item=False) is None
    reason = mcore_compat.unreadable(None, common_in_item=True)
    assert (reason is None) == mcore_compat.READS_COMMON_ITEM
    if reason:
        assert "after 0.16 (its common state is inside the .distcp files)" in reason
