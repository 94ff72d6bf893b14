"""The loop's failure paths without a process group: putting a written checkpoint in place
(rank 0's part of ``checkpointing.save``), the final save of a run with nothing left to do, and
stop requests by signal."""

import os

import pytest

from emapg_megatron.checkpoint import training as checkpointing
from emapg_megatron.run import loop
from emapg_megatron.run.config import CheckpointConfig, LoopConfig


def _written(path, text: str) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "shard"), "w") as f:
        f.write(text)
    return path


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    root = str(tmp_path)
    final = checkpointing.iteration_dir(root, 3)
    _written(final, "first")
    checkpointing._install(root, _written(final + ".tmp", "second"), final, 3)
    assert open(os.path.join(final, "shard")).read() == "second"
    assert sorted(os.listdir(root)) == sorted([os.path.basename(final), checkpointing.TRACKER])
    assert checkpointing.latest_iteration(root) == 3


def test_a_failed_install_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    final = checkpointing.iteration_dir(root, 3)
    _written(final, "first")
    with pytest.raises(OSError):
        checkpointing._install(root, final + ".tmp", final, 3)  # nothing was written there
    assert open(os.path.join(final, "shard")).read() == "first"  # put back, not deleted
    assert os.listdir(root) == [os.path.basename(final)]  # nothing left aside


def test_a_resume_at_the_last_step_saves_nothing(monkeypatch):
    """--load X --save X at --train-iters: no step runs, and the final save must not rewrite
    (first deleting) the checkpoint it resumed from."""
    saved = []
    monkeypatch.setattr(loop, "save", lambda trainer, root, it, flags=None: saved.append(it))
    assert loop.run_steps(LoopConfig(train_iters=3, max_skipped_steps=0), CheckpointConfig(save="ckpt"),
                          trainer=None, logger=None, start=3) == 3
    assert saved == []


def test_a_stop_request_survives_a_long_step_and_a_repeated_delivery(monkeypatch):
    """No timer runs out on a long step or save; the same Ctrl-C delivered twice (terminal and
    torchrun) is one request; a second signal later exits at once."""
    import signal

    clock, exits = [100.0], []
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(loop.os, "_exit", exits.append)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = loop.StopFlag()
        stop._handle(signal.SIGINT, None)
        clock[0] += 1.0
        stop._handle(signal.SIGTERM, None)  # torchrun forwarding the same Ctrl-C
        clock[0] += 3600.0  # an hour-long step and save: still a request, no exit
        assert stop.requested_at == 100.0 and exits == []
        stop._handle(signal.SIGTERM, None)
        assert exits == [1]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _tracker_as_each_rank_reads_it(root: str):
    """Rank r reads step 5 + r (a directory another run is writing): every rank must take rank
    0's; a corrupt tracker (an empty ``root``) must raise on every rank."""
    import torch.distributed as dist

    from emapg_megatron.errors import ConfigError

    real = checkpointing.latest_iteration
    checkpointing.latest_iteration = lambda r: 5 + dist.get_rank()
    try:
        step = checkpointing.agreed_latest_iteration(root)
    finally:
        checkpointing.latest_iteration = real
    try:
        checkpointing.agreed_latest_iteration(root)
    except ConfigError as e:
        return step, str(e)
    return step, None


def test_ranks_resume_from_the_step_rank_0_read(tmp_path):
    from emapg_megatron.multiprocess import run_distributed

    got = run_distributed(_tracker_as_each_rank_reads_it, 2, args=(str(tmp_path),))
    assert [step for step, _ in got] == [5, 5]
    assert all(err is not None and "not a checkpoint directory" in err for _, err in got)


def test_a_resume_names_the_flags_that_change_its_trajectory():
    """The checkpoint keeps its run's flags (as JSON); a resume with another seed or data says so."""
    import json

    from emapg_megatron.arguments import RunConfig, parse_args
    from emapg_megatron.configurable import trajectory_dests

    trajectory = trajectory_dests(RunConfig)  # declared on the options (trajectory=True)
    assert set(trajectory) == {"seed", "task", "copy_reward", "data_path", "long_prompts", "rollout_batch_size",
                               "num_samples_per_prompt", "max_new_tokens", "temperature", "top_p",
                               "partial_rollouts", "partial_rollout_oversample", "max_staleness"}
    saved = json.loads(json.dumps(parse_args(["--preset", "tiny-cpu"]).flags(), default=str))
    same = parse_args(["--preset", "tiny-cpu", "--train-iters", "300", "--lr", "0.01"]).flags()  # free to change
    assert loop.changed_trajectory_flags(saved, same, trajectory) == []
    other = parse_args(["--preset", "tiny-cpu", "--seed", "7", "--top-p", "0.9"]).flags()
    assert loop.changed_trajectory_flags(saved, other, trajectory) == ["--seed 1234 -> 7", "--top-p 1.0 -> 0.9"]


class _WriteFailed(BaseException):  # as torch's CheckpointException: not an Exception
    pass


def _save_that_fails(root: str):
    from megatron.core import dist_checkpointing

    from emapg_megatron.errors import CheckpointWriteError

    def refuse(state, path):
        raise _WriteFailed("disk full\nsecond line of a long report")

    real, dist_checkpointing.save = dist_checkpointing.save, refuse
    try:
        checkpointing.save(root, 1, {}, {})
    except CheckpointWriteError as e:
        return str(e)
    finally:
        dist_checkpointing.save = real


def test_a_failed_write_is_one_line_and_names_no_new_step(tmp_path):
    from emapg_megatron.multiprocess import run_distributed

    (err,) = run_distributed(_save_that_fails, 1, args=(str(tmp_path),))
    assert err == f"--save {tmp_path}: could not write step 1 (the previous checkpoint is kept): disk full"
    assert not (tmp_path / checkpointing.TRACKER).exists()


def test_a_step_without_reward_variance_is_said_once_a_run_and_rollouts_are_dumped():
    from trainer_workers import loop_with_fixed_metrics

    from emapg_megatron.multiprocess import run_distributed

    (out,) = run_distributed(loop_with_fixed_metrics, 1, args=([0.5, 1.0, 1.0, 0.0, 1.0],))
    # the first step where every group had one reward, once a run (issue 39: it was once a streak,
    # 20 lines in the distillation demo); zero_std_group_frac says the rest
    assert out["warned_at"] == [2]
    assert out["dumps"] == [(2, [("p2", "r2", 1.0)]), (4, [("p4", "r4", 1.0)])]


def test_a_log_dir_that_fills_up_stops_every_rank_in_one_line_and_keeps_whole_lines(tmp_path, monkeypatch):
    from trainer_workers import loop_with_fixed_metrics

    from emapg_megatron.multiprocess import run_distributed
    from emapg_megatron.run.metrics import MetricsLogger

    (out,) = run_distributed(loop_with_fixed_metrics, 1, args=([0.0, 0.0, 0.0], 2))
    assert out["error"] == ("--log-dir x: cannot write the metrics of step 2 (No space left on device)", True)
    # the logger itself: a write cut short by a full disk leaves no half line behind
    log = MetricsLogger(str(tmp_path), total_steps=3)
    log.log(1, {"kl": 0.1})
    real_write = log.jsonl.write

    def full_disk(text):
        real_write(text[:7])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(log.jsonl, "write", full_disk)
    log.log(2, {"kl": 0.2})
    assert log.failure == (f"--log-dir {tmp_path}: cannot write the metrics of step 2 (No space left on "
                           "device); metrics.jsonl keeps the steps before it")
    monkeypatch.undo()
    log.jsonl.flush()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "kl": 0.1}\n'


def test_held_out_pass_at_k_is_the_mean_over_every_dp_ranks_prompts():
    from trainer_workers import evaluate_with_known_answers

    from emapg_megatron.multiprocess import run_distributed
    from emapg_megatron.tasks.passk import pass_at_k

    counts = (0, 1, 3, 4, 2)  # correct samples of each of 5 prompts, 4 samples each
    expected = {f"eval/pass@{k}": sum(pass_at_k(4, c, k) for c in counts) / 5 for k in (1, 2, 4)}
    for out in run_distributed(evaluate_with_known_answers, 2, args=(4,)):  # 3 prompts on rank 0, 2 on 1
        assert out.keys() == expected.keys()
        for k, v in expected.items():
            assert abs(out[k] - v) < 1e-12, (k, out[k], v)
