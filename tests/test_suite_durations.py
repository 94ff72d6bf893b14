"""tools/suite_durations.py: a suite's tests and seconds per folder, from a hand-made junit XML."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import suite_durations  # noqa: E402

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.training.test_trainer" name="a" time="10.5"/>
<testcase classname="tests.training.test_trainer.TestResume" name="b" time="2.0"><skipped/></testcase>
<testcase classname="tests.test_launch" name="c" time="3.25"><failure message="x"/></testcase>
<testcase classname="tests.kl.test_kl_fdiv" name="d" time="0.25"/>
</testsuite></testsuites>"""


def test_seconds_and_counts_per_folder(tmp_path, capsys):
    (tmp_path / "s.xml").write_text(XML)
    suite_durations.main([str(tmp_path / "s.xml")])
    d = json.loads(capsys.readouterr().out)["s.xml"]
    assert (d["tests"], d["skipped"], d["failed"], d["seconds"]) == (4, 1, 1, 16.0)
    assert list(d["folders"]) == ["tests/training", "tests", "tests/kl"]  # largest first
    assert d["folders"]["tests/training"] == {"tests": 2, "seconds": 12.5}
    assert d["folders"]["tests"] == {"tests": 1, "seconds": 3.2}


def test_a_missing_file_is_one_line(tmp_path):
    import pytest

    with pytest.raises(SystemExit) as e:
        suite_durations.main([str(tmp_path / "nothing.xml")])
    assert str(e.value) == f"error: {tmp_path / 'nothing.xml'} is not a file"
