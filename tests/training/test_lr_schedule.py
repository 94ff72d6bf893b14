"""The LR schedule spans the flags' trainer steps, however many optimizer updates a step makes
(the scheduler steps once per update), and a resumed run takes the flags' schedule settings at
the checkpoint's position (Megatron's scheduler, with a plain torch optimizer under it)."""

import pytest
import torch

from emapg_megatron.arguments import parse_args
from emapg_megatron.build import lr_scheduler

FLAGS = ["--lr", "1.0", "--min-lr", "0.0", "--lr-decay-style", "linear", "--lr-warmup-iters", "1",
         "--weight-decay", "0"]


def _schedule(opt, cfg, updates: int):
    return lr_scheduler(opt, cfg.optim, cfg.loop.train_iters, updates)


def _run(cfg, updates: int, steps: int, sched=None, opt=None):
    """LR at the end of each trainer step of ``updates`` optimizer updates."""
    if sched is None:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        sched = _schedule(opt, cfg, updates)
    lrs = []
    for _ in range(steps):
        for _ in range(updates):
            sched.step(increment=1)
        lrs.append(opt.param_groups[0]["lr"])
    return lrs, sched, opt


@pytest.mark.parametrize("updates", [1, 4])
def test_warmup_and_decay_span_the_trainer_steps(updates):
    lrs, _, _ = _run(parse_args(FLAGS + ["--train-iters", "4"]), updates, 4)
    assert lrs == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_a_resumed_run_takes_the_flags_schedule_at_the_checkpoints_position():
    _, sched, _ = _run(parse_args(FLAGS + ["--train-iters", "4"]), 4, 2)
    state = sched.state_dict()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    longer = _schedule(opt, parse_args(FLAGS + ["--train-iters", "8"]), 4)  # extended to 8 steps
    longer.load_state_dict(state)
    lrs, _, _ = _run(None, 4, 1, longer, opt)
    assert longer.num_steps == 12 and lrs == pytest.approx([5 / 7])  # (3 - 1) of 7 decay steps done
