"""The training log: progress line (ETA, weight-sync time), JSONL, curves.png."""

import json

import pytest

from emapg_megatron.metrics import MetricsLogger
from emapg_megatron.rollout.weight_sync import SyncStats


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
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward_mean")] == [0.5, 1.0]
    log.close()
