"""Rank functions for the trainer tests (spawned)."""

import math

import torch

from emapg_megatron.arguments import parse_args
from emapg_megatron.build import model_config


def save_initial_weights(ckpt_dir: str, argv: list, poison: bool = False):
    """Write a model-only dist checkpoint for --pretrained-checkpoint (same weights at any layout)."""
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)

    from emapg_megatron.models.gpt import build_for_this_rank

    cfg = model_config(parse_args(argv))
    gpt = build_for_this_rank(cfg)
    if poison:
        with torch.no_grad():
            gpt.decoder.final_layernorm.weight[0] = math.nan
    dist_checkpointing.save(gpt.sharded_state_dict(), ckpt_dir)
    return None


def training_checkpoint_job(root: str) -> dict:
    """Save a small checkpoint the way the trainer does (``run.loop.save`` of the trainer's
    model, optimizer, EMA, RNG and common state), then report check_finite_before_save on
    poisoned weights and a resume of it with the distributed optimizer (``run.loop.resume``)."""
    from megatron_workers import checkpoint_trainer

    from emapg_megatron.anchor import EmaAnchor, EmaConfig
    from emapg_megatron.checkpoint import training as checkpointing
    from emapg_megatron.errors import ConfigError, WeightsError
    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.run import loop
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                      num_attention_heads=2, max_position_embeddings=16,
                      make_vocab_size_divisible_by=8)
    chunks, optimizer = build_model_and_optimizer(cfg, OptimConfig())
    anchor = EmaAnchor(chunks, optimizer, EmaConfig())
    trainer = checkpoint_trainer(chunks, optimizer, anchor)
    checkpointing.materialize_optimizer_state(chunks, optimizer)  # Adam state, as after a step
    checkpointing.check_finite_before_save(chunks, anchor, 1)  # all finite: no error
    loop.save(trainer, root, 1)

    def refusal(tensor, index, value):
        old = tensor.view(-1)[index].item()
        with torch.no_grad():
            tensor.view(-1)[index] = value
        try:
            checkpointing.check_finite_before_save(chunks, anchor, 7)
            return None
        except WeightsError as e:
            return str(e)
        finally:
            with torch.no_grad():
                tensor.view(-1)[index] = old

    gpt = unwrap(chunks[0])
    out = {"weight": refusal(gpt.decoder.final_layernorm.weight, 3, math.nan),
           "ema": refusal(anchor.stores[0].data, anchor.stores[0].bucket.slots[0].lo + 1, math.inf)}

    # The layout a resume compares against: this run's, and one with the distributed optimizer,
    # whose resume of this checkpoint is refused.
    out["saved"] = checkpointing.current_layout(trainer.sharded_state_dict())
    dchunks, doptimizer = build_model_and_optimizer(cfg, OptimConfig(use_distributed_optimizer=True))
    dtrainer = checkpoint_trainer(dchunks, doptimizer, EmaAnchor(dchunks, doptimizer, EmaConfig()))
    try:
        loop.resume(root, dtrainer)
    except ConfigError as e:
        out["switch"] = str(e)
    out["distributed"] = checkpointing.current_layout(dtrainer.sharded_state_dict(is_loading=True))
    return out


def loop_with_fixed_metrics(fracs: list, failing_step: int | None = None) -> dict:
    """``run.loop.run_steps`` over a stand-in trainer whose steps report the given
    ``zero_std_group_frac`` and one sample each, with rollout dumps every 2 steps, and a logger
    that cannot write from ``failing_step`` on: the warnings and dumps the loop makes, and the
    error it stops with."""
    from types import SimpleNamespace

    from emapg_megatron.run import loop
    from emapg_megatron.run.config import CheckpointConfig, LogConfig, LoopConfig
    from emapg_megatron.trainer import StepResult

    class Trainer:
        state = SimpleNamespace(skipped_steps=0)

        def step(self, it):
            return StepResult({"zero_std_group_frac": fracs[it - 1]}, [(f"p{it}", f"r{it}", 1.0)])

    class Logger:
        warnings, dumps, failure = [], [], None

        def log(self, step, metrics):
            if step == failing_step:
                self.failure = f"--log-dir x: cannot write the metrics of step {step} (No space left on device)"

        def warn(self, message):
            self.warnings.append(message)

        def dump_rollouts(self, step, samples):
            self.dumps.append((step, samples))

    from emapg_megatron.errors import RunError

    logger, error = Logger(), None
    try:
        loop.run_steps(LoopConfig(train_iters=len(fracs)), CheckpointConfig(), Trainer(), logger, 0,
                       log=LogConfig(rollout_dump_interval=2))
    except RunError as e:
        error = (str(e), getattr(e, "agreed", False))
    return {"warned_at": [int(w.split(":")[0].split()[1]) for w in logger.warnings], "dumps": logger.dumps,
            "error": error}


def evaluate_with_known_answers(n: int) -> dict:
    """The held-out evaluation over DP ranks with a stand-in sampler whose response to a prompt is
    correct for the first ``c`` of its ``n`` samples, ``c`` being the row's ``c``: Pass@k as the
    run computes it, on every rank."""
    import torch

    from emapg_megatron.rollout.collect import SamplingSettings
    from emapg_megatron.rollout.evaluation import HeldOutEvaluation

    class Batch:
        pass

    class Sampler:
        def generate(self, prompts, n, **kw):
            batch = Batch()
            batch.responses = [[k] for _ in prompts for k in range(n)]
            batch.loss_mask, batch.stats = torch.ones(len(batch.responses), 1), None
            return batch

    class Task:
        multi_turn, stop_strings = False, []

        def prompt(self, row, tokenizer):
            return str(row["c"])

        def correct_many(self, responses, rows):
            return [int(resp) < row["c"] for resp, row in zip(responses, rows)]

    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return [1]

        def decode(self, ids):
            return str(ids[0])

    held_out = HeldOutEvaluation(Sampler(), Task(), Tokenizer(), [{"c": c} for c in (0, 1, 3, 4, 2)], n,
                                 SamplingSettings(1.0, 1.0, 16))
    return held_out(7)
