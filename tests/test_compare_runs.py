"""tools/compare_runs.py: each config's figures per seed with their median and min-max, and the
machine, read from hand-made runs (--read-only: nothing is launched)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import compare_runs  # noqa: E402


def _run(folder, rewards, kl):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "reward_mean": r, "kl": k, "entropy": 1.0, "ema_lag": 0.1}) + "\n"
        for i, (r, k) in enumerate(zip(rewards, kl))))


def test_figures_per_seed_with_median_and_spread(tmp_path, capsys):
    steps = 20  # --train-iters below: a run is complete with 20 logged steps
    finals = {"a": [0.2, 0.6, 0.4], "b": [0.5, 0.3, 0.9]}
    for name, values in finals.items():
        for seed, final in zip((1, 2, 3), values):
            _run(tmp_path / name / f"seed{seed}", [0.1] * 10 + [final] * 10, [seed] * steps)
    _run(tmp_path / "a" / "seed4", [0.1] * 5, [0.0] * 5)  # incomplete: left out, not launched
    compare_runs.main(["--out", str(tmp_path), "--read-only", "--seeds", "1", "2", "3", "4",
                       "--config", "a=--kl-coef 0.1", "--config", "b=--kl-coef 0.2",
                       "--", "--preset", "tiny-cpu", "--train-iters", str(steps)])
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    a, b = last["summary"]["a"], last["summary"]["b"]
    assert a["seeds"] == b["seeds"] == [1, 2, 3]
    assert a["reward_last"] == {"per_seed": [0.2, 0.6, 0.4], "median": 0.4, "min": 0.2, "max": 0.6}
    assert b["reward_last"]["median"] == 0.5 and a["reward_first"]["median"] == 0.1
    assert a["kl_last"] == {"per_seed": [1.0, 2.0, 3.0], "median": 2.0, "min": 1.0, "max": 3.0}
    assert last["machine"] and last["machine"] in out.splitlines()[0]
    assert "| a | 3 | 0.100 (0.100–0.100) | 0.400 (0.200–0.600) | 2.000 (1.000–3.000) |" in out
    assert "| b | 3 | 0.100 | 0.900 | 3.000 |" in out  # b's third seed, in the per-seed table
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["summary"] == last["summary"]
