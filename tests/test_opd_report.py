"""tools/opd_report.py: the distillation demo's steps-to-90% and its last JSON line."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import opd_report  # noqa: E402


def _log(folder, values):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": v}) + "\n"
                                                  for i, v in enumerate(values)))


def test_moving_mean_and_the_first_step_at_the_target():
    assert opd_report.moving_mean([1, 2, 3, 4], window=2) == [1, 1.5, 2.5, 3.5]
    values = [0.0] * 10 + [1.0] * 10
    # the 10-step mean reaches 0.5 when five of the last ten are 1: step 15
    assert opd_report.steps_to(values, 0.5) == 15
    assert opd_report.steps_to(values, 1.01) is None
    assert opd_report.steps_to([1.0] * 9, 0.5) is None  # fewer steps than the window


def test_the_report_is_the_last_line_and_writes_the_curves(tmp_path, capsys):
    _log(tmp_path / "teacher", [0.5] * 30 + [0.8] * 20)
    _log(tmp_path / "opd", [0.2] * 5 + [0.9] * 40)
    _log(tmp_path / "opd-renorm", [0.2] * 20 + [0.9] * 20)
    _log(tmp_path / "rl", [0.2] * 40)
    opd_report.main([str(tmp_path)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"teacher_reward": 0.8, "opd_steps_to_90pct": 13, "opd_renorm_steps_to_90pct": 28,
                   "rl_steps_to_90pct": None}
    assert (tmp_path / "opd_curves.png").stat().st_size > 1000


def test_a_run_without_steps_is_one_line(tmp_path):
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="has no logged steps"):
        opd_report.main([str(tmp_path)])
