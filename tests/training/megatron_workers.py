"""Rank functions for the multi-process Megatron tests (spawned, so module level)."""

import torch

from emapg_megatron.models.config import ModelConfig
from emapg_megatron.training.schedule import positions_for

TINY = dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
            num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def batch(seed: int, n: int = 4, seq: int = 16, vocab: int = 100):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def save_or_load(chunks, optimizer, ckpt_dir: str, save: bool) -> None:
    """Save the model (reference run) through Megatron's dist_checkpointing, or load it (parallel
    run) as ``--pretrained-checkpoint`` does (``build.load_pretrained``: any TP/PP)."""
    from megatron.core import dist_checkpointing

    from emapg_megatron.build import load_pretrained
    from emapg_megatron.models.gpt import unwrap

    if save:
        dist_checkpointing.save(unwrap(chunks[0]).sharded_state_dict(), ckpt_dir)
    else:
        load_pretrained(chunks, optimizer, ckpt_dir)


def lm_loss(logits, mb):
    """Mean next-token cross-entropy of one micro-batch, from the vocab-sharded logits.

    Megatron's ``vocab_parallel_cross_entropy`` on the full padded vocabulary: the per-token loss
    GPTModel computes when given ``labels=`` (its padding columns count as real ones), so the
    single-device references that call ``model(..., labels=...)`` directly compute the same value.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    loss = vocab_parallel_cross_entropy(logits, mb["labels"]).float().mean()
    return loss, {"loss": loss.detach()}


def run_schedule(model_chunks, microbatches):
    """Forward + backward of :func:`lm_loss` over ``(tokens, labels)`` micro-batches through the
    trainer's own pipeline pass (``training.schedule.forward_backward``), which ends with
    Megatron's finalize_model_grads (the model config's hook). The losses, on the last stage."""
    from emapg_megatron.training.schedule import forward_backward

    mbs = [{"tokens": tokens, "labels": labels} for tokens, labels in microbatches]
    return [out["loss"] for out in forward_backward(model_chunks, mbs, lm_loss)]


def checkpoint_trainer(model_chunks, optimizer, anchor):
    """The trainer's checkpoint state (:class:`~emapg_megatron.step.state.TrainState`: model,
    optimizer, EMA, a constant LR schedule), saved and resumed by ``run.loop.save`` / ``resume``,
    for workers that build model and optimizer themselves.

    Call it before the first optimizer step: like the trainer's, the schedule sets each parameter
    group's learning rate and weight decay (Megatron leaves the decay of norms and biases to it).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from emapg_megatron.step.state import TrainState

    cfg = optimizer.config
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr, max_lr=cfg.lr, min_lr=cfg.lr, lr_warmup_steps=0, lr_decay_steps=1,
        lr_decay_style="constant", start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")
    return TrainState(model_chunks, optimizer, scheduler, anchor)


def grads_by_global_name(ddp_model):
    from emapg_megatron.models.gpt import global_param_name, unwrap

    gpt = unwrap(ddp_model)
    return {global_param_name(gpt, n): p.main_grad.detach().clone()
            for n, p in gpt.named_parameters()}


def params_by_global_name(ddp_model):
    from emapg_megatron.models.gpt import global_param_name, unwrap

    gpt = unwrap(ddp_model)
    return {global_param_name(gpt, n): p.detach().clone() for n, p in gpt.named_parameters()}


def foundation_run(ckpt_dir: str, save: bool, dist_opt: bool = False, adam_eps: float = 1e-8):
    """Logits, one pipeline fwd/bwd and one optimizer step on fixed data, from fixed weights."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import (
        build_model_and_optimizer,
        zero_grads,
    )

    cfg = tiny_config()
    chunks, opt = build_model_and_optimizer(
        cfg, OptimConfig(lr=1e-2, use_distributed_optimizer=dist_opt, clip_grad=1.0,
                           adam_eps=adam_eps))
    gpt = unwrap(chunks[0])
    save_or_load(chunks, opt, ckpt_dir, save)
    result = {}
    if ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage():
        tokens, _ = batch(0)
        with torch.no_grad():
            result["logits"] = gpt(tokens, positions_for(tokens), None)
    # 4 micro-batches of the global batch, split over DP ranks.
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    micro = [batch(s, n=2) for s in range(1, 5)]
    mine = micro[dp_rank * len(micro) // dp:(dp_rank + 1) * len(micro) // dp]
    result["params_before"] = params_by_global_name(chunks[0])
    inner = getattr(opt, "chained_optimizers", [opt])
    result["optimizer"] = sorted({type(o).__name__ for o in inner})
    zero_grads(chunks, opt)
    losses = run_schedule(chunks, mine)  # ends with Megatron's finalize_model_grads (config hook)
    result["losses"] = torch.stack(losses) if losses else torch.empty(0)
    result["grads"] = grads_by_global_name(chunks[0])
    ok, grad_norm, _ = opt.step()
    result["step_ok"] = torch.tensor(bool(ok))
    result["params"] = params_by_global_name(chunks[0])
    return result


def assert_pp2_matches(first: dict, last: dict, ref: dict) -> None:
    """A PP=2 run (``losses``, ``grads`` by global name per stage) equals the one-rank ``ref``: the
    loss only on the last stage, the two stages' gradients together those of the whole model."""
    assert first["losses"].numel() == 0  # the loss lives on the last stage
    torch.testing.assert_close(last["losses"], ref["losses"], rtol=0, atol=1e-6)
    merged = {**first["grads"], **last["grads"]}
    assert set(merged) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(merged[name], g, rtol=1e-5, atol=1e-6, msg=name)
