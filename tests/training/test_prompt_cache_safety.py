"""The node's prompt cache (training/prompt_cache.py) never turns a temp-folder problem into a
traceback and leaves nothing behind (issue 40 item 10c): a lock that cannot be taken (no free
inodes: ENOSPC; a link planted at its path: ELOOP) means loading without the cache; a built-in-task
run leaves no ``<key>.arrow.lock`` in the shared temp folder; emapg-train's private folder is
removed by the ranks once they have read it (a launcher killed later could not)."""

import errno
import os
import tempfile

import pytest

from emapg_megatron.training import prompt_cache


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A run under plain torchrun, with this test's temp folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    monkeypatch.delenv(prompt_cache.CACHE_DIR_ENV, raising=False)
    return tmp_path


def loaded(value="the prompts"):
    calls = []

    def load():
        calls.append(1)
        return value

    return load, calls


def test_a_link_at_the_lock_path_loads_without_the_cache(shared_tmp, tmp_path):
    folder = prompt_cache.cache_dir()
    target = tmp_path / "elsewhere"
    os.symlink(target, os.path.join(folder, "k.arrow.lock"))
    load, calls = loaded()
    assert prompt_cache.once_per_node("k", load) == "the prompts" and calls == [1]
    assert not target.exists()  # the link was not followed


def test_no_free_inodes_loads_without_the_cache(shared_tmp, monkeypatch):
    real_open = os.open

    def full(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    load, calls = loaded()
    assert prompt_cache.once_per_node("k", load) == "the prompts" and calls == [1]


def test_a_built_in_task_leaves_nothing_in_the_temp_folder(shared_tmp):
    from emapg_megatron import build

    inputs = build.prepare(["--preset", "tiny-cpu", "--dry-run", "--world-size", "2"])
    assert len(inputs.prompts.rows) > 0
    folder = shared_tmp / f"emapg-prompts-{os.getuid()}"
    assert not folder.exists() or os.listdir(folder) == []


def test_the_ranks_remove_emapg_trains_folder_once_they_have_read_it(tmp_path, monkeypatch):
    """The launcher's validation wrote the file; a rank read it; once its process group exists the
    rank deletes the file, its lock and the folder."""
    import pyarrow as pa

    from emapg_megatron.tasks.data import TableRows
    from emapg_megatron.training.prompt_data import TrainingPrompts

    folder = tmp_path / "emapg-prompts-launcher"
    folder.mkdir()
    monkeypatch.setenv(prompt_cache.CACHE_DIR_ENV, str(folder))
    prompts = TrainingPrompts(TableRows(pa.table({"question": ["a", "b"]})), [1, 1], 8, 2)
    prompt_cache.once_per_node("k", lambda: prompts)  # the launcher: writes k.arrow
    assert sorted(os.listdir(folder)) == ["k.arrow", "k.arrow.lock"]
    prompt_cache._used.clear()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    got = prompt_cache.once_per_node("k", lambda: pytest.fail("loaded again"))  # a rank reads it
    assert list(got.rows) == [{"question": "a"}, {"question": "b"}]
    prompt_cache.release()
    assert not folder.exists()
    assert list(got.rows) == [{"question": "a"}, {"question": "b"}]  # still mapped


def test_release_keeps_a_folder_that_holds_more_than_the_runs_files(tmp_path, monkeypatch):
    folder = tmp_path / "given"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    monkeypatch.setenv(prompt_cache.CACHE_DIR_ENV, str(folder))
    prompt_cache.release()
    assert (folder / "notes.txt").read_text() == "mine"
