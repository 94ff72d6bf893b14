"""tools/moe_report.py: the MoE demo's last JSON line and plot, on hand-made metrics."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import moe_report  # noqa: E402


def _write(folder, steps: int, reward_end: float, load: float):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            r = 0.1 + (reward_end - 0.1) * s / steps
            f.write(json.dumps({"step": s, "reward_mean": r, "moe_load_max_over_mean": load,
                                "moe_load_max_over_mean/layer0": load - 0.1,
                                "moe_load_max_over_mean/layer1": load + 0.1, "moe_aux_loss": 1.0 + s / 1000,
                                "rollout_logprob_diff": 1e-7}) + "\n")


def test_the_report_gives_each_figure_over_seeds_and_plots(tmp_path, capsys):
    for seed, (end, load) in {1: (0.5, 1.2), 2: (0.3, 1.4), 3: (0.4, 1.3)}.items():
        _write(tmp_path / f"seed-{seed}", 30, end, load)
    moe_report.main([str(tmp_path), "--seeds", "1", "2", "3"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 30 and out["seeds"] == [1, 2, 3]
    assert out["expert_load_last_10"] == {"per_seed": [1.2, 1.4, 1.3], "median": 1.3, "min": 1.2, "max": 1.4}
    assert out["reward_last_10"]["median"] > out["reward_first_10"]["median"]
    assert out["moe_aux_loss_last_10"]["median"] == pytest.approx(1.0255)
    assert out["rollout_route_agreement"] is None and "moe_route_agreement" in out["rollout_route_agreement_missing"]
    assert (tmp_path / "moe_seeds.png").stat().st_size > 10_000 and out["machine"]


def test_a_dense_run_or_a_missing_seed_is_one_line(tmp_path):
    (tmp_path / "seed-1").mkdir()
    (tmp_path / "seed-1" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    with pytest.raises(SystemExit, match="no logged steps of a MoE run"):
        moe_report.main([str(tmp_path), "--seeds", "1"])
    with pytest.raises(SystemExit, match="seed-2/metrics.jsonl does not exist"):
        moe_report.main([str(tmp_path), "--seeds", "2"])


def test_the_route_agreement_is_reported_where_the_runs_logged_it(tmp_path, capsys):
    for seed, agreement in {1: 0.9, 2: 1.0}.items():
        _write(tmp_path / f"seed-{seed}", 12, 0.5, 1.2)
        path = tmp_path / f"seed-{seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "moe_route_agreement": agreement}) + "\n" for r in rows))
    moe_report.main([str(tmp_path), "--seeds", "1", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["rollout_route_agreement"]["per_seed"] == [0.9, 1.0]
    assert "rollout_route_agreement_missing" not in out
