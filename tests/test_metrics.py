"""The training log: progress line (ETA, weight-sync time), JSONL, curves.png."""

import json

import pytest

from emapg_megatron.rollout.weight_sync import SyncStats
from emapg_megatron.run.metrics import MetricsLogger


def test_progress_line_jsonl_and_curves(tmp_path, capsys):
    log = MetricsLogger(str(tmp_path), total_steps=4)
    sync = SyncStats(seconds=1.25, load_seconds=0.5, bytes=int(2.5e9), tensors=3, buckets=2).metrics()
    assert sync["weight_sync_gbps"] == pytest.approx(2.0)
    for step in (1, 2):
        log.log(step, {"reward_mean": 0.1 * step, "kl": 0.01, "tokens_per_s": 10.0, **sync})
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("step     2/4") and "reward_mean 0.2000" in line
    assert "sync 1.25s" in line and "eta " in line
    assert "sync" not in log.progress_line(3, {"step": 3, "tokens_per_s": 1.0})
    png = log.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["weight_sync_s"] == 1.25
    assert png == str(tmp_path / "curves.png") and (tmp_path / "curves.png").stat().st_size > 0


def test_close_before_any_step_writes_no_plot(tmp_path):
    # e.g. --load of a run that already reached --train-iters, into a fresh --log-dir
    log = MetricsLogger(str(tmp_path), total_steps=2)
    assert log.close() is None
    assert not (tmp_path / "curves.png").exists()


def test_tensorboard_holds_every_logged_step_before_close(tmp_path):
    """A run that stops with an error (or os._exit on a signal) never closes the writer: each
    step's scalars must already be on disk."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(str(tmp_path), total_steps=3)
    for step in (1, 2):
        log.log(step, {"reward_mean": 0.5 * step})
    events = EventAccumulator(log.tb_dir)  # this run's folder
    events.Reload()
    assert [e.value for e in events.Scalars("reward_mean")] == [0.5, 1.0]
    log.close()


def test_each_run_gets_its_own_tensorboard_folder(tmp_path):
    first = MetricsLogger(str(tmp_path), total_steps=4)
    first.log(1, {"kl": 0.1})
    first.close()
    resumed = MetricsLogger(str(tmp_path), total_steps=4, start_step=1)
    resumed.log(2, {"kl": 0.2})
    resumed.close()
    runs = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    assert len(runs) == 2 and runs[1].endswith("-from-step-1") and "-from-step" not in runs[0]


def test_wandb_logs_offline_and_rollouts_are_dumped(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLogger(str(tmp_path), total_steps=2, wandb_project="emapg-test", wandb_name="t",
                        run_config={"lr": 1e-6})
    log.log(1, {"reward_mean": 0.5})
    log.dump_rollouts(1, [("3+4=", "7", 1.0), ("2+2=", "5", 0.0)])
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    dumped = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert dumped == [{"step": 1, "prompt": "3+4=", "response": "7", "reward": 1.0},
                      {"step": 1, "prompt": "2+2=", "response": "5", "reward": 0.0}]


def test_wandb_missing_is_one_line_before_any_work(monkeypatch):
    import importlib.util

    from emapg_megatron.errors import ConfigError
    from emapg_megatron.run.config import LogConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"--wandb-project needs wandb, which is not installed"):
        LogConfig(wandb_project="p").validate()
