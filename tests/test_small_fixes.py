"""Issue 39, item 11: the smaller things a new user tripped on."""


import pytest

from emapg_megatron.arguments import parse_args
from emapg_megatron.errors import ConfigError


def test_a_yaml_may_name_the_preset_and_the_command_line_still_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: tiny-cpu\ntrain-iters: 7\n")
    run = parse_args(["--config", str(cfg)])
    tiny = parse_args(["--preset", "tiny-cpu"])
    assert run.loop.train_iters == 7 and run.model == tiny.model and run.kl == tiny.kl
    assert parse_args(["--config", str(cfg), "--train-iters", "9"]).loop.train_iters == 9


def test_every_unknown_yaml_key_is_named_in_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kl-cof: 0.1\nlrr: 1\nbogus: 2\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(cfg)])
    msg = str(e.value)
    assert "\n" not in msg and "unknown options 'kl-cof' (did you mean 'kl-coef'?), 'lrr'" in msg and "'bogus'" in msg


def test_curves_have_y_labels_and_the_runs_title(tmp_path):
    from emapg_megatron.run.metrics import PLOT_KEYS, curves_figure

    records = [{"step": i, "reward_mean": 0.1 * i, "kl": 0.01, "entropy": 2.0} for i in range(1, 4)]
    fig = curves_figure(records, PLOT_KEYS, "tiny-cpu")
    assert fig._suptitle.get_text() == "tiny-cpu: 3 steps"
    assert [ax.get_ylabel() for ax in fig.axes] == ["mean reward", "KL to the anchor (per token)", "entropy (nats)"]


def test_overwrite_says_what_it_deleted(tmp_path):
    from emapg_megatron.run.config import CheckpointConfig, LogConfig
    from emapg_megatron.run.outputs import clear_earlier_run

    log = tmp_path / "log"
    log.mkdir()
    (log / "metrics.jsonl").write_text('{"step": 1}\n')
    (log / "curves.png").write_text("png")
    (log / "tensorboard").mkdir()
    cleared = clear_earlier_run(CheckpointConfig(save=str(tmp_path / "ckpt"), overwrite=True), LogConfig(log_dir=str(log)))
    assert str(cleared) == "3 log files"  # it said "3 checkpoint and log files" with no checkpoint
    save = tmp_path / "ckpt"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    (log / "metrics.jsonl").write_text('{"step": 1}\n')
    cleared = clear_earlier_run(CheckpointConfig(save=str(save), overwrite=True), LogConfig(log_dir=str(log)))
    assert str(cleared) == "1 checkpoint and 1 log file"


def test_top_p_below_one_is_said_by_the_trainer_not_by_the_sampler(monkeypatch):
    """The KL estimators' caveat belongs to training; evaluation samples with any top-p silently."""
    from emapg_megatron import build

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.warns(UserWarning, match="--top-p < 1"):
        build.prepare(["--preset", "tiny-cpu", "--dry-run", "--world-size", "2", "--top-p", "0.9"])
    import emapg_megatron.rollout.engine as engine
    import emapg_megatron.rollout.megatron_sampler as sampler

    assert not hasattr(engine, "warn_if_truncated_sampling") and "warn" not in vars(sampler)


def test_a_resume_reads_no_initial_weights(monkeypatch):
    """--load replaces every weight: --load-hf's (or --pretrained-checkpoint's) are not read first."""
    from emapg_megatron import build

    def refuse(*_, **__):
        raise AssertionError("initial weights read before a resume")

    monkeypatch.setattr(build, "load_hf_weights", refuse)
    monkeypatch.setattr(build, "load_pretrained", refuse)
    cfg = parse_args(["--preset", "tiny-cpu", "--load-hf", "/m", "--load", "/ckpt"])
    build.load_initial_weights(None, None, cfg, None)  # returns at once


def test_a_lone_process_does_not_take_the_default_port(monkeypatch):
    """Two single-process runs on one machine (no torchrun, no MASTER_PORT) both took 29500 and
    the second failed with EADDRINUSE (seen when the CI's two suites ran such tests at once): a
    lone process now binds a free port; a launched one keeps torchrun's."""
    import os

    from emapg_megatron.runtime import distributed
    from emapg_megatron.runtime.config import ParallelConfig

    seen = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.append(os.environ["MASTER_PORT"]))
    monkeypatch.setattr(distributed.parallel_state, "initialize_model_parallel", lambda **kw: None)
    monkeypatch.setattr(distributed, "model_parallel_cuda_manual_seed", lambda seed: None)
    monkeypatch.setattr(distributed.cpu_device, "install", lambda: None)  # no CPU mapping in pytest's process
    for env in ({"WORLD_SIZE": "1"}, {"WORLD_SIZE": "1", "MASTER_PORT": "31234"}):
        monkeypatch.delenv("MASTER_PORT", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        distributed.initialize(ParallelConfig(tensor_model_parallel_size=1, device="cpu"))
    assert seen[0] != "29500" and int(seen[0]) > 0 and seen[1] == "31234"
