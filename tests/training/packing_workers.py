"""Rank functions for the sequence-packing tests (spawned, so module level).

One process runs the same batch both ways, padded (``split_microbatches``) and packed
(``packing.plan`` / ``pack``), through the trainer's passes, so the two share weights and layout.
"""


import torch
from megatron_workers import tiny_config

from emapg_megatron.algo.config import LossConfig
from emapg_megatron.algo.policy_loss import normaliser
from emapg_megatron.kl.config import KLConfig
from emapg_megatron.step.passes import PolicyPasses
from emapg_megatron.training import packing

VOCAB = 100
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def rollout_like(seed: int, lengths: list[int], L: int) -> dict:
    """Right-padded sequences of the given lengths, label-aligned as ``trainer.training_batch``
    makes them: a prompt of a quarter (loss mask 0), then the response (1)."""
    g = torch.Generator().manual_seed(seed)
    S = len(lengths)
    tokens = torch.randint(1, VOCAB, (S, L), generator=g)
    loss_mask = torch.zeros(S, L)
    for i, n in enumerate(lengths):
        tokens[i, n:] = 0
        loss_mask[i, max(1, n // 4):n] = 1.0
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    mask = torch.zeros_like(loss_mask)
    mask[:, :-1] = loss_mask[:, 1:]
    return {"tokens": tokens, "labels": labels, "mask": mask,
            "sampling_logprob": -torch.rand(S, L, generator=g) * mask,
            "advantages": torch.randn(S, generator=g)}


def local_share(batch: dict) -> dict:
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = batch["tokens"].shape[0] // dp
    return {k: v[r * n:(r + 1) * n] for k, v in batch.items()}


def to_device(batch: dict) -> dict:
    from emapg_megatron import runtime

    return {k: v.to(runtime.device()) for k, v in batch.items()}


def no_grad_passes(chunks, passes, batch, microbatches_of):
    """The trainer's old and anchor passes (the anchor is the policy itself here)."""
    from emapg_megatron.training.schedule import forward_only

    mbs, merge = microbatches_of(batch)
    batch = {**batch, **merge(forward_only(chunks, mbs, passes.old), mbs)}
    mbs, merge = microbatches_of(batch)
    return {**batch, **merge(forward_only(chunks, mbs, passes.anchor), mbs)}


def update(chunks, opt, passes, batch, microbatches_of) -> tuple[dict, dict]:
    """Gradients and metric sums of one ``train_minibatch`` (no optimizer step)."""
    from megatron.core import parallel_state as ps
    from megatron_workers import grads_by_global_name

    from emapg_megatron.training.collectives import reduce_sum
    from emapg_megatron.training.model_and_optimizer import zero_grads
    from emapg_megatron.training.schedule import forward_backward

    dp = ps.get_data_parallel_world_size()
    mbs, _ = microbatches_of(batch)
    norm = reduce_sum({"n": normaliser(batch["mask"], passes.loss.agg_mode)},
                      group=ps.get_data_parallel_group())["n"]
    scale = len(mbs) * dp / max(norm, 1.0)

    def loss(logits, mb):
        total, metrics = passes.loss_terms(logits, mb)
        return total * scale, {**metrics, "loss": total.detach() / norm}

    zero_grads(chunks, opt)
    outs = forward_backward(chunks, mbs, loss)
    sums = {k: sum(float(o[k]) for o in outs) for k in outs[0]} if outs else {}
    return sums, grads_by_global_name(chunks[0])


def padded_microbatches(micro_batch_size: int):
    """The trainer's padded strategy: ``batch -> (micro-batches, merge)``."""
    from emapg_megatron.training.microbatches import PaddedBatches

    return _split_and_merge(PaddedBatches(micro_batch_size), [])


def packed_microbatches(max_tokens: int, plans: list):
    """The trainer's packed strategy (its plans appended to ``plans``)."""
    return _split_and_merge(packing.PackedBatches(max_tokens), plans)


def _split_and_merge(strategy, plans: list):
    def of(batch):
        plan = strategy.plan(batch)
        plans.append(plan)
        return plan.split(batch), plan.merge

    return of


def packed_vs_padded(lengths: list[int], L: int, max_tokens: int, kl_type: str = "topk-reverse",
                     sequence_parallel: bool = False, bf16: bool = False, shape: dict | None = None) -> dict:
    """Old/anchor outputs, loss, metrics and gradients of one batch, padded and packed, for every
    aggregation mode; plus the packing plans (micro-batch counts, rows, padding). ``shape``:
    model config overrides (tied embeddings, qk-layernorm, qkv bias, ...)."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    cfg = tiny_config(max_position_embeddings=256, **(shape or {}))
    chunks, opt = build_model_and_optimizer(cfg, OptimConfig(lr=1e-3), PrecisionConfig(bf16=bf16),
                                            sequence_parallel=sequence_parallel)
    passes = PolicyPasses(KLConfig(loss_type=kl_type, k=4), LossConfig(kl_coef=0.1, entropy_coef=0.01),
                                vocab_size=VOCAB)
    batch = to_device(local_share(rollout_like(0, lengths, L)))
    plans = []
    padded, packed = padded_microbatches(2), packed_microbatches(max_tokens, plans)
    out = {"padded_passes": no_grad_passes(chunks, passes, batch, padded),
           "packed_passes": no_grad_passes(chunks, passes, batch, packed)}
    full = out["padded_passes"] if ps.is_pipeline_last_stage() else batch  # the same inputs for both
    for agg in AGG_MODES:
        passes.loss.agg_mode = agg
        out[agg] = {"padded": update(chunks, opt, passes, full, padded),
                    "packed": update(chunks, opt, passes, full, packed)}
    out["plans"] = [{"groups": p.groups, "rows": p.row_tokens, "padding": p.padding_fraction}
                    for p in plans]
    out["last_stage"] = ps.is_pipeline_last_stage()
    return out
