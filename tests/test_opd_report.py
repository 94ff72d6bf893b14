"""tools/opd_report.py: the distillation demo's steps-to-90% per seed, their median and spread,
and its last JSON line, on hand-made metrics."""
import json
import os
import sys

import pytest
from reward_logs import write_rewards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import opd_report  # noqa: E402

_log = write_rewards


def test_the_first_step_at_the_target():
    values = [0.0] * 10 + [1.0] * 10
    # the 10-step mean reaches 0.5 when five of the last ten are 1: step 15
    assert opd_report.steps_to(values, 0.5) == 15
    assert opd_report.steps_to(values, 1.01) is None
    assert opd_report.steps_to([1.0] * 9, 0.5) is None  # fewer steps than the window


def test_the_report_over_seeds_is_the_last_line_and_writes_the_curves(tmp_path, capsys):
    _log(tmp_path / "teacher", [0.8] * 20)  # a frozen teacher's 20 steps
    for seed, (opd, renorm, rl) in {1: (5, 20, None), 2: (7, 30, 30), 3: (3, None, 25)}.items():
        for name, start in (("opd", opd), ("opd-renorm", renorm), ("rl", rl)):
            # 0.2 for ``start`` steps, then 0.9: the 10-step mean reaches 0.72 (8 of the last 10 at 0.9)
            # at step start + 8
            _log(tmp_path / f"seed-{seed}" / name, [0.2] * (start or 40) + [0.9] * (40 - (start or 40)))
    opd_report.main([str(tmp_path), "--seeds", "1", "2", "3"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out) == ["out", "seeds", "steps", "teacher_reward", "target",
                         "opd_steps_to_90pct", "opd_reward_last_10", "opd_renorm_steps_to_90pct",
                         "opd_renorm_reward_last_10", "rl_steps_to_90pct", "rl_reward_last_10", "machine"]
    assert (out["out"], out["seeds"], out["steps"]) == (str(tmp_path), [1, 2, 3], 40)
    assert (out["teacher_reward"], out["target"]) == (0.8, 0.72)
    assert out["opd_steps_to_90pct"] == {"per_seed": [13, 15, 11], "median": 13, "min": 11, "max": 15}
    # a run that never gets there ranks above every step: it is the max, and the median moves up
    assert out["opd_renorm_steps_to_90pct"] == {"per_seed": [28, 38, None], "median": 38, "min": 28, "max": None}
    assert out["rl_steps_to_90pct"] == {"per_seed": [None, 38, 33], "median": 38, "min": 33, "max": None}
    assert out["rl_reward_last_10"] == {"per_seed": [0.2, 0.9, 0.9], "median": 0.9, "min": 0.2, "max": 0.9}
    assert out["machine"]
    assert (tmp_path / "opd_curves.png").stat().st_size > 1000


def test_the_teacher_folder_can_be_named(tmp_path, capsys):
    _log(tmp_path / "elsewhere", [0.0] * 30 + [0.5] * 20)  # the last 20 steps count
    _log(tmp_path / "seed-4" / "rl", [0.5] * 12)
    opd_report.main([str(tmp_path), "--seeds", "4", "--teacher", str(tmp_path / "elsewhere"), "--run", "rl"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["teacher_reward"] == 0.5 and out["rl_steps_to_90pct"]["per_seed"] == [10]


def test_a_run_without_steps_is_one_line(tmp_path):
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="has no logged steps"):
        opd_report.main([str(tmp_path), "--seeds", "1"])
