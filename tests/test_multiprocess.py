"""``run_distributed``: ranks forked from a preloaded forkserver on CPU behave as spawned ones.

The forkserver's own environment, ``sys.path`` and working directory are those of its start; a
rank must see the caller's at the call (tests set variables, change directory and put helper
folders on the path after the server is up: multiprocessing passes the path and directory, we
pass the environment). Failures come back as errors naming the rank, with its traceback.
"""

import os
import sys

import pytest
import torch.distributed as dist

from emapg_megatron.multiprocess import RankError, run_distributed

LATE_MODULE = '''
import os
import torch.distributed as dist

def where():
    return os.environ.get("EMAPG_TEST_MARK"), os.getcwd(), dist.get_rank()
'''


def _rank():
    return dist.get_rank()


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    return 0


def _die():
    os._exit(3)


def _hang():
    import time

    time.sleep(60)


def test_ranks_take_the_callers_environment_path_and_directory_at_the_call(tmp_path, monkeypatch):
    assert run_distributed(_rank, 2) == [0, 1]  # the forkserver is up before anything changes
    (tmp_path / "modules").mkdir()
    (tmp_path / "work").mkdir()  # not the module's folder: '' on sys.path must not find it
    (tmp_path / "modules" / "late_rank_module.py").write_text(LATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    monkeypatch.setenv("EMAPG_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path / "work")
    import late_rank_module

    got = run_distributed(late_rank_module.where, 2)
    assert got == [("set after the server started", str(tmp_path / "work"), r) for r in (0, 1)]
    sys.modules.pop("late_rank_module", None)


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RankError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 refuses"):
        run_distributed(_fail_on_rank_1, 2)


def test_a_function_the_ranks_cannot_import_is_reported_not_hung(tmp_path, monkeypatch):
    """The call is unpickled inside the rank's error handling: an import failure is a RankError."""
    (tmp_path / "parent_only_module.py").write_text(
        "import os\nif 'RANK' in os.environ:\n    raise ImportError('not in a rank')\n"
        "def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    import parent_only_module

    with pytest.raises(RankError, match="ImportError: not in a rank"):
        run_distributed(parent_only_module.f, 1, timeout=60)
    sys.modules.pop("parent_only_module", None)


def test_a_rank_that_dies_or_hangs_fails_the_run():
    with pytest.raises(RankError, match="exit code 3"):
        run_distributed(_die, 2, timeout=60)
    with pytest.raises(TimeoutError, match="timed out"):
        run_distributed(_hang, 1, timeout=3)
