"""Rank functions for the EMA-anchor tests (spawned, so module level).

Each job batches several checks into one spawned run (start-up dominates on CPU).
"""

import os

# This CPU advertises AMX but the VM does not enable it: oneDNN's bf16 AMX kernels raise SIGILL.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch
import torch.nn.functional as F
from megatron_workers import batch as cpu_batch
from megatron_workers import checkpoint_trainer, run_schedule, tiny_config

from emapg_megatron.training.schedule import positions_for as positions

ETA, BETA = 0.7, 0.1


# --------------------------------------------------------------------------- building blocks
def batch(seed, **kwargs):
    from emapg_megatron.runtime import device

    return tuple(t.to(device()) for t in cpu_batch(seed, **kwargs))


def build(*, seed=7, dist_opt=False, bf16=False, lr=1e-2, **overrides):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return build_model_and_optimizer(tiny_config(**overrides),
                                     OptimConfig(lr=lr, use_distributed_optimizer=dist_opt),
                                     PrecisionConfig(bf16=bf16))


def anchor_for(chunks, opt, **cfg):
    from emapg_megatron.anchor import EmaAnchor, EmaConfig

    return EmaAnchor(chunks, opt, EmaConfig(**{"eta": ETA, "update_period": 1, **cfg}))


def gpt_of(chunks):
    from emapg_megatron.models.gpt import unwrap

    return unwrap(chunks[0])


def named_params(chunks):
    from megatron_workers import params_by_global_name

    return params_by_global_name(chunks[0])


def dp_slice(items):
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return items[rank * len(items) // dp:(rank + 1) * len(items) // dp]


def lm_step(chunks, opt, anchor, iteration, seed, *, reference_pass=False):
    """One LM training step (PP=1, any TP/DP); optionally an anchor forward first. Returns the loss."""
    from emapg_megatron.training.model_and_optimizer import zero_grads

    tokens, labels = batch(seed, n=4)
    tokens, labels = dp_slice(tokens), dp_slice(labels)
    zero_grads(chunks, opt)
    if reference_pass:
        with anchor.swapped_in():
            gpt_of(chunks)(tokens, positions(tokens), None)
    loss = chunks[0](tokens, positions(tokens), None, labels=labels).float().mean()
    loss.backward()
    chunks[0].finish_grad_sync()
    opt.step()
    if anchor is not None:
        anchor.step(iteration)
    return loss.detach()


def kl_step(chunks, opt, anchor, iteration, seed):
    """LM loss + β·KL(π_θ ‖ π_ema), the anchor logits from a swapped-in pass (TP=1). Returns (loss, kl)."""
    from emapg_megatron.training.model_and_optimizer import zero_grads

    tokens, labels = batch(seed, n=4)
    tokens, labels = dp_slice(tokens), dp_slice(labels)
    zero_grads(chunks, opt)
    with anchor.swapped_in():
        ref = gpt_of(chunks)(tokens, positions(tokens), None).float()
    logits = chunks[0](tokens, positions(tokens), None).float()
    logp, logq = F.log_softmax(logits, -1), F.log_softmax(ref, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    loss = F.nll_loss(logp.flatten(0, 1), labels.flatten()) + BETA * kl
    loss.backward()
    chunks[0].finish_grad_sync()
    opt.step()
    anchor.step(iteration)
    return loss.detach(), kl.detach()


def pipeline_step(chunks, opt, anchor, iteration, seed):
    from emapg_megatron.training.model_and_optimizer import zero_grads

    zero_grads(chunks, opt)
    # The schedule ends with Megatron's finalize_model_grads (the model config's hook): the DP sync
    # and the tied embedding grads of the first and last stage.
    losses = run_schedule(chunks, [batch(seed + i, n=2) for i in range(2)])
    opt.step()
    anchor.step(iteration)
    return torch.stack(losses) if losses else torch.empty(0)


def sequences(n=3, seq=12):
    return [batch(100 + i, n=1, seq=seq) for i in range(n)]


def direct_logprob(chunks):
    """−log π(y|x) by a plain forward with ``labels=`` (PP=1): the path without the schedule."""
    def fn(seq):
        tokens, labels = seq
        return -chunks[0](tokens, positions(tokens), None, labels=labels).float().sum()
    return fn


def sequence_nll(logits, mb):
    """−log π(y|x) of one sequence from the vocab-sharded logits (Megatron's CE, as ``labels=``)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, mb["labels"]).float().sum(), {}


def pipeline_logprob(chunks):
    """Forward + backward of −log π(y|x) through the trainer's pipeline pass (any PP), as the
    trainer's stability monitor calls it; returns None."""
    def fn(seq):
        from emapg_megatron.training.schedule import forward_backward

        tokens, labels = seq
        forward_backward(chunks, [{"tokens": tokens, "labels": labels}], sequence_nll)
    return fn


def reference_fisher_trace(gpt, seqs):
    """Single-device E‖∇ log π(y|x)‖² with plain autograd (tied weights are one parameter).

    Deliberately not the monitor's path: GPTModel's own ``labels=`` loss and ``autograd.grad``
    are the oracle for the estimates taken through the schedule and the monitor."""
    params = [p for p in gpt.parameters() if p.requires_grad]
    total = 0.0
    for tokens, labels in seqs:
        lp = -gpt(tokens, positions(tokens), None, labels=labels).float().sum()
        grads = torch.autograd.grad(lp, params)
        total += sum(g.double().square().sum().item() for g in grads)
    return total / len(seqs)


def save(state, ckpt_dir):
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(state, ckpt_dir)


def load(state, ckpt_dir):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(state, ckpt_dir)


def load_model(chunks, opt, ckpt_dir):
    """The model weights only, at any TP/PP, as ``--pretrained-checkpoint`` loads them."""
    from emapg_megatron.build import load_pretrained

    load_pretrained(chunks, opt, ckpt_dir)


def error(fn):
    from emapg_megatron.errors import ConfigError

    try:
        fn()
    except ConfigError as e:
        return str(e)
    return ""


# --------------------------------------------------------------------------- single rank
def closed_form_checks():
    """EMA after n updates of a known fp32 parameter sequence vs the closed form (float64)."""
    chunks, opt = build()
    params = list(gpt_of(chunks).parameters())
    theta0 = [p.detach().double().cpu() for p in params]

    def theta(k):  # a known, non-linear sequence, as the fp32 values the params will hold
        return [(t0 * (1 + 0.1 * k) + 0.01 * k * k).float().double() for t0 in theta0]

    out = {}
    for eta, period, steps in [(0.9, 1, 6), (0.5, 3, 7), (0.0, 2, 4), (1.0, 1, 3)]:
        for p, t0 in zip(params, theta0):
            p.data.copy_(t0)
        anchor = anchor_for(chunks, opt, eta=eta, update_period=period)
        expected = [t.clone() for t in theta0]
        flags = []
        for k in range(1, steps + 1):
            for p, t in zip(params, theta(k)):
                p.data.copy_(t)  # FP32Optimizer: the main param is the model param
            flags.append(anchor.step(k))
            if k % period == 0 and eta < 1:
                expected = [eta * e + (1 - eta) * t for e, t in zip(expected, theta(k))]
        ema = anchor.gathered()
        names = list(named_params(chunks))
        got = [ema[n].double() for n in names]
        key = f"eta={eta},T={period}"
        out[key] = {
            "flags": flags,
            "num_updates": anchor.num_updates,
            "max_rel_err": max(((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected)),
            # η=0 copies the policy exactly, η=1 never moves: bit-exact expectations.
            "exact": all(torch.equal(g.float(), e.float()) for g, e in zip(got, expected)),
        }
    return out


def bf16_pitfall():
    """Adam lr 1e-5 on a bf16 model: an fp32 EMA of the main params tracks, a bf16 EMA freezes."""
    chunks, opt = build(bf16=True, lr=1e-5)
    anchor = anchor_for(chunks, opt, eta=0.9)
    inner = opt.chained_optimizers[0]
    pairs = [(p, m) for mg, sg in zip(inner.float16_groups, inner.fp32_from_float16_groups)
             for p, m in zip(mg, sg)]
    exact = [m.detach().double().cpu() for _, m in pairs]
    naive = [p.detach().clone() for p, _ in pairs]  # bf16 EMA of the bf16 weights
    start = [e.clone() for e in exact]
    for it in range(1, 31):
        lm_step(chunks, opt, anchor, it, seed=it)
        exact = [0.9 * e + 0.1 * m.detach().double().cpu() for e, (_, m) in zip(exact, pairs)]
        for n, (p, _) in zip(naive, pairs):
            n.lerp_(p.detach(), 0.1)
    names = {id(p): n for n, p in gpt_of(chunks).named_parameters()}
    from emapg_megatron.models.gpt import global_param_name

    ema = anchor.gathered()
    got = [ema[global_param_name(gpt_of(chunks), names[id(p)])].double() for p, _ in pairs]
    moved = max((e - s).abs().max().item() for e, s in zip(exact, start))
    return {
        "moved": moved,
        "fp32_err": max((g - e).abs().max().item() for g, e in zip(got, exact)),
        "bf16_err": max((n.double().cpu() - e).abs().max().item() for n, e in zip(naive, exact)),
    }


def swap_identity(dist_opt=False, bf16=False, shard=False, offload=False):
    """A reference pass changes nothing: weights bit-identical, next loss and weights bit-identical."""
    kwargs = dict(dist_opt=dist_opt, bf16=bf16)
    cfg = dict(shard_over_dp=shard, cpu_offload=offload, transfer_numel=3000)
    runs = {}
    for with_ref in (True, False):
        chunks, opt = build(**kwargs)
        anchor = anchor_for(chunks, opt, **cfg)
        lm_step(chunks, opt, anchor, 1, seed=1)
        lm_step(chunks, opt, anchor, 2, seed=2)
        before = named_params(chunks)
        run = {"inside_equals_ema": True, "inside_differs": False}
        if with_ref:
            ema = anchor.gathered()
            with anchor.swapped_in():
                torch.rand(3)  # consumes RNG inside: must not leak out
                for name, p in named_params(chunks).items():
                    run["inside_equals_ema"] &= torch.equal(p, ema[name].to(p))
                    run["inside_differs"] |= not torch.equal(p, before[name])
                tokens, _ = batch(9, n=2)
                gpt_of(chunks)(tokens, positions(tokens), None)
            after = named_params(chunks)
            run["restored"] = all(torch.equal(after[n], before[n]) for n in before)
        run["rng"] = torch.rand(2)  # CPU generator; the CUDA one is checked through the losses
        run["loss3"] = lm_step(chunks, opt, anchor, 3, seed=3)
        run["params3"] = named_params(chunks)
        run["lag"] = anchor.lag()
        run["ema"] = anchor.gathered()
        runs[with_ref] = run
    a, b = runs[True], runs[False]
    return {
        "inside_equals_ema": a["inside_equals_ema"], "inside_differs": a["inside_differs"],
        "restored": a["restored"], "rng_same": torch.equal(a["rng"], b["rng"]),
        "loss_same": torch.equal(a["loss3"], b["loss3"]),
        "params_same": all(torch.equal(a["params3"][n], b["params3"][n]) for n in a["params3"]),
        "lag": a["lag"], "ema": a["ema"],
    }


def train_reference(ckpt_dir, steps=3):
    """TP=1 reference: EMA after ``steps`` LM steps from the weights saved in ``ckpt_dir``."""
    chunks, opt = build()
    load_model(chunks, opt, ckpt_dir)
    anchor = anchor_for(chunks, opt)
    fisher = StabilityProbe(chunks)
    out = {"fisher_start": fisher.direct(), "fisher_start_ref": reference_fisher_trace(gpt_of(chunks), sequences())}
    for it in range(1, steps + 1):
        lm_step(chunks, opt, anchor, it, seed=10 + it)
    out.update(ema=anchor.gathered(), lag=anchor.lag())
    return out


class StabilityProbe:
    def __init__(self, chunks):
        from emapg_megatron.anchor import StabilityMonitor

        self.chunks = chunks
        self.monitor = StabilityMonitor(eta=ETA, interval=1, lr=1e-4, beta=0.1)

    def direct(self):
        return self.monitor.estimate(self.chunks, dp_slice(sequences()), direct_logprob(self.chunks)).fisher_trace

    def pipelined(self):
        return self.monitor.estimate(self.chunks, dp_slice(sequences()), pipeline_logprob(self.chunks)).fisher_trace


def guard_checks(chunks, opt):
    anchor = anchor_for(chunks, opt, update_period=2)
    out = {"repeat": [anchor.step(2), anchor.step(2), anchor.num_updates]}
    with anchor.swapped_in():
        for name, fn in [("step_inside", lambda: anchor.step(4)), ("nested", lambda: anchor.swapped_in().__enter__())]:
            try:
                fn()
                out[name] = ""
            except RuntimeError as e:
                out[name] = str(e)
    return out


def gpu_job():
    """One CUDA rank: the closed form, the bf16 pitfall and the swap paths with pinned-memory offload."""
    out = {"closed_form": closed_form_checks(), "bf16": bf16_pitfall()}
    out["swap"] = {f"bf16={bf16},offload={off}": swap_identity(bf16=bf16, offload=off)
                   for bf16, off in [(True, False), (True, True), (False, True)]}
    for res in out["swap"].values():
        res.pop("ema")
    return out


def single_rank_job(root):
    """World 1: closed form, bf16 pitfall, swap identity, bad input, TP=1 references."""
    from emapg_megatron.anchor import EmaAnchor, EmaConfig

    out = {"closed_form": closed_form_checks(), "bf16": bf16_pitfall()}
    out["swap"] = {f"bf16={bf16},offload={off}": swap_identity(bf16=bf16, offload=off)
                   for bf16, off in [(False, False), (True, True), (False, True)]}
    for res in out["swap"].values():
        res.pop("ema")
    chunks, opt = build()
    out["guards"] = guard_checks(chunks, opt)
    out["err_shard_without_distopt"] = error(
        lambda: EmaAnchor(chunks, opt, EmaConfig(shard_over_dp=True)))
    out["err_eta"] = error(lambda: EmaAnchor(chunks, opt, EmaConfig(eta=1.5)))
    # References for the TP=2 / PP=2 jobs, from weights they load.
    save(gpt_of(chunks).sharded_state_dict(), f"{root}/model_tp1")
    out["reference"] = train_reference(f"{root}/model_tp1")
    tied, tied_opt = build(tie_word_embeddings=True, seed=8)
    save(gpt_of(tied).sharded_state_dict(), f"{root}/model_tied")
    anchor = anchor_for(tied, tied_opt)
    probe = StabilityProbe(tied)
    out["tied"] = {"fisher": probe.pipelined(), "fisher_ref": reference_fisher_trace(gpt_of(tied), sequences())}
    out["tied"]["losses"] = [pipeline_step(tied, tied_opt, anchor, it, seed=20 + it) for it in (1, 2, 3)]
    out["tied"].update(ema=anchor.gathered(), lag=anchor.lag())
    # An EMA checkpoint of another model shape is refused, naming the tensor.
    save({"ema": anchor_for(chunks, opt).sharded_state_dict()}, f"{root}/ema_ffn128")
    other, other_opt = build(ffn_hidden_size=96)
    other_anchor = anchor_for(other, other_opt)
    out["err_ckpt_shape"] = error(lambda: other_anchor.check_checkpoint(f"{root}/ema_ffn128"))
    out["err_ckpt_missing"] = error(lambda: other_anchor.check_checkpoint(f"{root}/model_tp1"))
    return out


# --------------------------------------------------------------------------- TP=2
def tp2_job(root):
    """Same weights and updates as the TP=1 reference; EMA checkpoint round trip at TP=2."""
    chunks, opt = build()
    load_model(chunks, opt, f"{root}/model_tp1")
    anchor = anchor_for(chunks, opt)
    probe = StabilityProbe(chunks)
    out = {"fisher_start": probe.direct()}
    for it in range(1, 4):
        lm_step(chunks, opt, anchor, it, seed=10 + it)
    out["lag"] = anchor.lag()
    ema = anchor.gathered()
    save({"ema": anchor.sharded_state_dict()}, f"{root}/ema_tp2")
    # The EMA written as a model checkpoint (fp32: the swapped-in weights are the EMA bits),
    # so Megatron's own model resharding is the oracle for the EMA's.
    with anchor.swapped_in():
        save(gpt_of(chunks).sharded_state_dict(), f"{root}/ema_as_model_tp2")
    anchor.reset()
    moved = any(not torch.equal(ema[n], t) for n, t in anchor.gathered().items())
    anchor.load_state_dict(load({"ema": anchor.sharded_state_dict()}, f"{root}/ema_tp2")["ema"])
    back = anchor.gathered()
    out.update(reset_moved=moved, roundtrip_exact=all(torch.equal(back[n], ema[n]) for n in ema),
               meta=anchor.state_dict_meta())
    return out


# --------------------------------------------------------------------------- PP=2 (tied embeddings)
def pp2_job(root):
    chunks, opt = build(tie_word_embeddings=True, seed=8)
    load_model(chunks, opt, f"{root}/model_tied")
    anchor = anchor_for(chunks, opt)
    out = {"fisher": StabilityProbe(chunks).pipelined()}
    out["losses"] = [pipeline_step(chunks, opt, anchor, it, seed=20 + it) for it in (1, 2, 3)]
    out.update(ema=anchor.gathered(), lag=anchor.lag())
    return out


# --------------------------------------------------------------------------- DP=2, distributed optimizer
def resume_run(root, *, split, steps=6, **cfg):
    """LM + β·KL training with the EMA; with ``split`` save after 3 steps and resume in fresh
    objects, through the trainer's own checkpoint path (``run.loop.save`` / ``resume``:
    model, optimizer and EMA state, torch RNG, EMA layout check, Adam step restore)."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.run import loop

    # A bf16 model with fp32 main params sharded by the distributed optimizer, as on a GPU.
    chunks, opt = build(dist_opt=True, bf16=True)
    anchor = anchor_for(chunks, opt, update_period=2, **cfg)
    trainer = checkpoint_trainer(chunks, opt, anchor)  # before the first step, in both runs
    record = []
    first = range(1, 4) if split else range(1, steps + 1)
    for it in first:
        record.append(kl_step(chunks, opt, anchor, it, seed=30 + it))
    if not split:
        return record, anchor.gathered(), named_params(chunks)

    ckpt = f"{root}/resume"
    loop.save(trainer, ckpt, 3)
    # Fresh objects with other weights: everything must come from the checkpoint.
    chunks, opt = build(dist_opt=True, bf16=True, seed=99)
    anchor = anchor_for(chunks, opt, update_period=2, **cfg)
    torch.manual_seed(12345)
    assert loop.resume(ckpt, checkpoint_trainer(chunks, opt, anchor)) == 3
    assert ps.get_data_parallel_world_size() == 2
    for it in range(4, steps + 1):
        record.append(kl_step(chunks, opt, anchor, it, seed=30 + it))
    return record, anchor.gathered(), named_params(chunks)


def dp2_job(root):
    out = {"swap": {}}
    for bf16, shard, off in [(True, True, True), (False, True, False), (False, False, True), (True, False, False)]:
        out["swap"][f"bf16={bf16},shard={shard},offload={off}"] = swap_identity(
            dist_opt=True, bf16=bf16, shard=shard, offload=off)
    # TP=2 checkpoint loaded at TP=1 x DP=2 with a DP-sharded EMA.
    chunks, opt = build(dist_opt=True)
    anchor = anchor_for(chunks, opt, shard_over_dp=True)
    anchor.check_checkpoint(f"{root}/ema_tp2")
    anchor.load_state_dict(load({"ema": anchor.sharded_state_dict()}, f"{root}/ema_tp2")["ema"])
    oracle, oracle_opt = build()
    load_model(oracle, oracle_opt, f"{root}/ema_as_model_tp2")
    out["tp2_at_tp1"] = anchor.gathered()
    out["tp2_at_tp1_oracle"] = named_params(oracle)
    out["tp2_at_tp1_meta"] = anchor.state_dict_meta()
    cfg = dict(shard_over_dp=True, cpu_offload=True, transfer_numel=5000)
    out["full"] = resume_run(root, split=False, **cfg)
    out["resumed"] = resume_run(root, split=True, **cfg)
    return out
