"""Rank functions for the multi-process Megatron tests (spawned, so module level)."""

import torch

from emapg_megatron.models.gpt import ModelConfig

TINY = dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
            num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def batch(seed: int, n: int = 4, seq: int = 16, vocab: int = 100):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def positions(tokens):
    return torch.arange(tokens.shape[1]).expand_as(tokens)


def save_or_load(sharded_sd_fn, ckpt_dir: str, save: bool):
    """Save (reference run) or load (parallel run) through Megatron's dist_checkpointing."""
    from megatron.core import dist_checkpointing

    if save:
        dist_checkpointing.save(sharded_sd_fn(), ckpt_dir)
        return None
    return dist_checkpointing.load(sharded_sd_fn(), ckpt_dir)


def _forward_step(data_iterator, model):
    from functools import partial

    tokens, labels = next(data_iterator)
    per_token = model(tokens, positions(tokens), None, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach()}

    return per_token, partial(loss_func)


def run_schedule(model_chunks, microbatches, forward_only=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = microbatches[0][0].shape[1]
    mbs = microbatches[0][0].shape[0]
    out = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(microbatches),
        model=model_chunks,
        num_microbatches=len(microbatches),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )
    return [d["loss"] for d in out]


def grads_by_global_name(ddp_model):
    from emapg_megatron.training.model_and_optimizer import global_param_name, unwrap

    gpt = unwrap(ddp_model)
    return {global_param_name(gpt, n): p.main_grad.detach().clone()
            for n, p in gpt.named_parameters()}


def params_by_global_name(ddp_model):
    from emapg_megatron.training.model_and_optimizer import global_param_name, unwrap

    gpt = unwrap(ddp_model)
    return {global_param_name(gpt, n): p.detach().clone() for n, p in gpt.named_parameters()}


def foundation_run(ckpt_dir: str, save: bool, dist_opt: bool = False, adam_eps: float = 1e-8):
    """Logits, one pipeline fwd/bwd and one optimizer step on fixed data, from fixed weights."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.training.model_and_optimizer import (
        OptimConfig, build_model_and_optimizer, unwrap, zero_grads)

    cfg = tiny_config()
    chunks, opt = build_model_and_optimizer(
        cfg, OptimConfig(lr=1e-2, use_distributed_optimizer=dist_opt, clip_grad=1.0,
                           adam_eps=adam_eps))
    gpt = unwrap(chunks[0])
    loaded = save_or_load(gpt.sharded_state_dict, ckpt_dir, save)
    if loaded is not None:
        gpt.load_state_dict(loaded)
        opt.reload_model_params()
    result = {}
    if ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage():
        tokens, _ = batch(0)
        with torch.no_grad():
            result["logits"] = gpt(tokens, positions(tokens), None)
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
