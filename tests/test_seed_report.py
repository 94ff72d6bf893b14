"""tools/seed_report.py: figures over seeds (median, min, max), the machine, and the main job's
last JSON line, on hand-made metrics."""
import json
import os
import sys

import pytest
from reward_logs import write_rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import seed_report  # noqa: E402

_log = write_rewards


def test_median_and_spread_odd_and_even():
    assert seed_report.distribution([0.5, 0.1, 0.3]) == {"per_seed": [0.5, 0.1, 0.3], "median": 0.3,
                                                         "min": 0.1, "max": 0.5}
    assert seed_report.distribution([4, 1, 3, 2]) == {"per_seed": [4, 1, 3, 2], "median": 2.5, "min": 1, "max": 4}
    assert seed_report.distribution([7]) == {"per_seed": [7], "median": 7, "min": 7, "max": 7}
    assert seed_report.distribution([1 / 3, 2 / 3])["median"] == 0.5 and \
        seed_report.distribution([1 / 3])["per_seed"] == [0.3333]


def test_a_figure_never_reached_ranks_above_every_number():
    # steps to a target: None is "not within the run"
    assert seed_report.distribution([90, None, 60, 120, None]) == {
        "per_seed": [90, None, 60, 120, None], "median": 120, "min": 60, "max": None}
    assert seed_report.distribution([90, None, None, None, 60])["median"] is None
    assert seed_report.distribution([None, None]) == {"per_seed": [None, None], "median": None,
                                                      "min": None, "max": None}
    assert seed_report.distribution([10, None])["median"] is None  # the middle pair holds a None


def test_the_machine_names_a_cpu():
    name = seed_report.machine()
    assert name.endswith(f", {os.cpu_count()} CPUs") and len(name) > len(f", {os.cpu_count()} CPUs")


def test_the_main_jobs_last_line_and_its_png(tmp_path, capsys):
    _log(tmp_path / "seed-1", [0.1] * 10 + [0.5] * 20)
    _log(tmp_path / "seed-2", [0.2] * 10 + [0.3] * 10 + [0.7] * 10)
    _log(tmp_path / "seed-3", [0.0] * 20 + [0.6] * 10)
    _log(tmp_path / "seed-9", [1.0] * 30)  # not asked for
    seed_report.main([str(tmp_path), "--seeds", "1", "2", "3"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out) == ["out", "seeds", "steps", "reward_first_10", "reward_last_10", "machine"]
    assert (out["out"], out["seeds"], out["steps"]) == (str(tmp_path), [1, 2, 3], 30)
    assert out["reward_first_10"] == {"per_seed": [0.1, 0.2, 0.0], "median": 0.1, "min": 0.0, "max": 0.2}
    assert out["reward_last_10"] == {"per_seed": [0.5, 0.7, 0.6], "median": 0.6, "min": 0.5, "max": 0.7}
    assert out["machine"] == seed_report.machine()
    assert (tmp_path / "reward_seeds.png").stat().st_size > 1000


def test_a_missing_or_empty_seed_is_one_line(tmp_path):
    _log(tmp_path / "seed-1", [0.1] * 10)
    with pytest.raises(SystemExit, match="seed-2/metrics.jsonl does not exist"):
        seed_report.main([str(tmp_path), "--seeds", "1", "2"])
    (tmp_path / "seed-2").mkdir()
    (tmp_path / "seed-2" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="has no logged steps"):
        seed_report.main([str(tmp_path), "--seeds", "1", "2"])
