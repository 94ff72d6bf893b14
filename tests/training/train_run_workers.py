"""Rank functions that build the run as emapg_megatron.train does and take trainer steps (spawned)."""

import torch


def train_steps(argv: list, steps: int, export_hf: bool = False):
    """Build the run as ``emapg_megatron.train`` does and take ``steps`` trainer steps.

    Returns the per-step metrics and this rank's parameters keyed by what they are: the global
    name, plus the TP rank for TP-split weights. Replicated weights (norms, biases of row-parallel
    layers, every weight across DP, the tied embedding on the first and last stage) share a key.
    With ``export_hf``, also ``hf``: the whole model as the HF export streams it (every shard
    gathered: comparable across layouts), on global rank 0 only.
    """
    from megatron.core import parallel_state as ps

    from emapg_megatron import build
    from emapg_megatron.models.gpt import global_param_name, unwrap

    inputs = build.prepare(argv)
    model_cfg = inputs.model_cfg
    trainer = build.build_trainer(inputs)
    metrics = [trainer.step(i).metrics for i in range(1, steps + 1)]
    gpt = unwrap(trainer.model_chunks[0])
    tp_rank = ps.get_tensor_model_parallel_rank()
    params = {}
    for name, p in gpt.named_parameters():
        if getattr(p, "shared_embedding", False) or name == "output_layer.weight" and model_cfg.tie_word_embeddings:
            name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
        split = getattr(p, "tensor_model_parallel", False)
        params[f"{global_param_name(gpt, name)}|tp{tp_rank if split else '*'}"] = p.detach().float().clone()
    out = {"metrics": metrics, "params": params}
    if export_hf:
        from emapg_megatron.checkpoint.weights import export_hf_weights

        hf = {n: t.float().clone() for n, t in export_hf_weights(trainer.model_chunks, model_cfg)}
        if torch.distributed.get_rank() == 0:
            out["hf"] = hf
    return out


def train_each_loss_type(base_argv: list, loss_types: list, steps: int):
    """``steps`` trainer steps with each ``--kl-loss-type`` in turn: {type: last step's metrics}."""
    from emapg_megatron import build

    out = {}
    for name in loss_types:
        extra = ["--kl-alpha", "0.7"] if name == "topk-alpha" else []
        trainer = build.build_trainer(build.prepare([*base_argv, "--kl-loss-type", name, *extra]))
        out[name] = [trainer.step(i).metrics for i in range(1, steps + 1)][-1]
    return out


def refused_update_changes_nothing():
    """A NaN gradient on one rank: the gradient step is refused and no weight or state changes."""
    import math

    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer
    from emapg_megatron.training.optimizer_step import step_if_finite

    chunks, opt = build_model_and_optimizer(
        ModelConfig(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                    make_vocab_size_divisible_by=8), OptimConfig(lr=1e-2))

    class Steps:
        count = 0

        def step(self, increment):
            self.count += increment

    def state():
        return [p.detach().clone() for p in chunks[0].parameters()]

    for p in chunks[0].parameters():
        p.main_grad.fill_(1e-3)
    sched, before = Steps(), state()
    if torch.distributed.get_rank() == 0:
        next(iter(chunks[0].parameters())).main_grad[0] = math.nan
    refused = not step_if_finite(chunks, opt, sched, [0.0])[0]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, state()))
    adam_untouched = len(getattr(opt, "optimizer", opt).state) == 0  # torch Adam creates state lazily
    for p in chunks[0].parameters():
        p.main_grad.fill_(1e-3)
    applied, grad_norm = step_if_finite(chunks, opt, sched, [0.0])
    moved = not all(torch.equal(a, b) for a, b in zip(before, state()))
    numel = sum(p.numel() for p in chunks[0].parameters())
    return {"refused": refused, "expected_grad_norm": 1e-3 * math.sqrt(numel), "unchanged": unchanged, "adam_untouched": adam_untouched,
            "applied": applied, "grad_norm": grad_norm, "moved": moved, "scheduler_steps": sched.count}


def train_with_skewed_engine(argv: list) -> dict:
    """One trainer step whose rollout engine reports skewed log-probs on known tokens.

    Each response's first token gets ratio pi_old/pi_sampling = 3 (above the default threshold 2)
    and its second 1/3 (below MIS's lower bound 1/2): returns the step's metrics and the expected
    shares of truncated (tis) and masked (mis) tokens.
    """
    import math

    from emapg_megatron import build

    trainer = build.build_trainer(build.prepare(argv))
    generate, counts = trainer.engine.generate, {}

    def skewed(*a, **kw):
        batch = generate(*a, **kw)
        lengths = batch.loss_mask.sum(-1).long()
        for s, start in enumerate(batch.prompt_lengths.tolist()):
            batch.sampling_logprobs[s, start] -= math.log(3.0)
            if lengths[s] >= 2:
                batch.sampling_logprobs[s, start + 1] += math.log(3.0)
        tokens = float(lengths.sum())
        counts.update(tis=len(lengths) / tokens, mis=(len(lengths) + int((lengths >= 2).sum())) / tokens)
        return batch

    trainer.engine.generate = skewed
    return {"metrics": trainer.step(1).metrics, "expected": counts}
