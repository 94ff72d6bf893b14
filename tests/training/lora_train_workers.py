"""Rank functions of tests/training/test_lora_trainer.py: a LoRA run built as emapg_megatron.train
builds it, what DDP, the optimizer and the anchor hold, and the passes at the start (spawned)."""

from contextlib import nullcontext

import torch


def _local_logits(chunks, vocab: int, seq: int = 8):
    """The logits of a fixed batch (None under pipeline parallelism: one stage only)."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.models.gpt import unwrap

    gpt = unwrap(chunks[0])
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return None
    tokens = (torch.arange(2 * seq).view(2, seq) * 7 + 3) % vocab
    pos = torch.arange(seq).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        return chunks[0](tokens, pos, None).float().clone() if gpt.post_process else None


def counted_bytes(chunks, optimizer, anchor) -> dict:
    """Bytes of the tensors this rank allocated, by part (tools/memory_plan.py's names): weights,
    DDP's gradient buffers, fp32 main params that are not the weights themselves, Adam's state,
    the EMA."""
    from emapg_megatron.anchor.layout import inner_optimizers

    def nbytes(t):
        return t.numel() * t.element_size()

    weights = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    opts = inner_optimizers(optimizer)
    mains = [p for opt in opts for g in opt.param_groups for p in g["params"]]
    states = [t for opt in opts for st in getattr(opt, "optimizer", opt).state.values()
              for t in st.values() if torch.is_tensor(t) and t.numel() > 1]
    return {"weights": sum(nbytes(p) for c in chunks for p in c.parameters()),
            "grads": sum(nbytes(b.grad_data) for c in chunks for buf in c.buffers for b in buf.buckets),
            "main_params": sum(nbytes(p) for p in mains if p.untyped_storage().data_ptr() not in weights),
            "adam": sum(nbytes(t) for t in states),
            "ema_device": sum(nbytes(s.data) for s in getattr(anchor, "stores", []))}


def lora_state(argv: list, steps: int) -> dict:
    """Build the run, report what DDP, the optimizer and the anchor hold, check the passes at the
    start (adapters on, off, the anchor's model), then take ``steps`` trainer steps."""
    from emapg_megatron import build
    from emapg_megatron.anchor.layout import inner_optimizers
    from emapg_megatron.lora.apply import adapter_parameters, adapters_off
    from emapg_megatron.models.gpt import unwrap

    inputs = build.prepare(argv)
    trainer = build.build_trainer(inputs)
    chunks, optimizer, anchor = trainer.model_chunks, trainer.state.optimizer, trainer.state.anchor
    gpt = unwrap(chunks[0])
    adapters = {name: p for name, p, _ in adapter_parameters(gpt)}
    adapter_ids = {id(p) for p in adapters.values()}
    grad_buffer = sum(b.grad_data.numel() for c in chunks for buf in c.buffers for b in buf.buckets)
    in_buffers = [p for c in chunks for buf in c.buffers for p in buf.params]
    opt_params = [p for opt in inner_optimizers(optimizer) for g in opt.param_groups for p in g["params"]]
    main_numel = sum(p.numel() for p in opt_params)
    out = {
        "adapter_numel": sum(p.numel() for p in adapters.values()),
        "base_numel": sum(p.numel() for n, p in gpt.named_parameters() if id(p) not in adapter_ids),
        "trainable": sorted(n for n, p in gpt.named_parameters() if p.requires_grad),
        "adapter_names": sorted(adapters),
        "grad_buffer_numel": grad_buffer,
        "ddp_params_are_adapters": all(id(p) in adapter_ids for p in in_buffers) and len(in_buffers) == len(adapters),
        "base_has_main_grad": any(hasattr(p, "main_grad") for n, p in gpt.named_parameters() if id(p) not in adapter_ids),
        "optimizer_main_numel": main_numel,
        "anchor": type(anchor).__name__,
        "ema_numel": sum(s.data.numel() for s in anchor.stores) if hasattr(anchor, "stores") else 0,
        "ema_names": sorted(n for _, slot in anchor.layout.slots() for n in [slot.name]) if hasattr(anchor, "layout") else [],
    }
    vocab = inputs.model_cfg.vocab_size
    policy = _local_logits(chunks, vocab)
    with adapters_off(chunks):
        base = _local_logits(chunks, vocab)
    with anchor.model() as anchor_chunks:
        anchored = _local_logits(anchor_chunks, vocab)
    out["base_logits"] = base
    out["start_equal_base"] = policy is None or torch.equal(policy, base)
    out["start_equal_anchor"] = policy is None or torch.equal(policy, anchored)
    before = {n: p.detach().float().clone() for n, p in gpt.named_parameters()}
    out["metrics"] = [trainer.step(i).metrics for i in range(1, steps + 1)]
    after = {n: p.detach().float().clone() for n, p in gpt.named_parameters()}
    out["base_unchanged"] = all(torch.equal(before[n], after[n]) for n in before if ".lora." not in n)
    out["moved"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    policy = _local_logits(chunks, vocab)
    with adapters_off(chunks):
        base_after = _local_logits(chunks, vocab)
    out["model_cfg"], out["counted"] = inputs.model_cfg.to_dict(), counted_bytes(chunks, optimizer, anchor)
    out["base_after_equal_base"] = policy is None or torch.equal(base, base_after)
    out["policy_moved_from_base"] = policy is None or not torch.equal(policy, base_after)
    return out


def pretrained_start(ckpt: str, model_argv: list, argv: list, lora: list) -> dict:
    """Write a model-only checkpoint of ``model_argv``'s model, then start the run ``argv
    --pretrained-checkpoint ckpt`` without and with ``lora``: the starting logits of the first,
    and what :func:`lora_state` (no step) says of the second."""
    from trainer_workers import save_initial_weights

    from emapg_megatron import build

    save_initial_weights(ckpt, model_argv)
    argv = [*argv, "--pretrained-checkpoint", ckpt]
    inputs = build.prepare(argv)
    full = _local_logits(build.build_trainer(inputs).model_chunks, inputs.model_cfg.vocab_size)
    return {"full": full, **lora_state([*argv, *lora], 0)}


def lora_states(argvs: list, steps: int) -> list:
    """:func:`lora_state` of each run in turn, in one process."""
    return [lora_state(argv, steps) for argv in argvs]


def _named(chunks) -> dict:
    """This rank's parameters by global name (+ TP rank of a TP-split one), as train_steps keys them."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.models.gpt import global_param_name, unwrap

    gpt = unwrap(chunks[0])
    tp_rank = ps.get_tensor_model_parallel_rank()
    return {f"{global_param_name(gpt, n)}|tp{tp_rank if getattr(p, 'tensor_model_parallel', False) else '*'}":
            p.detach().float().clone() for n, p in gpt.named_parameters()}


def lora_save_and_continue(argv: list, ckpt: str, saved_at: int, steps: int, adapters_only: bool = True) -> dict:
    """``saved_at`` trainer steps, a checkpoint (the trainer's ``run.loop.save``), then on to
    ``steps``: the metrics after the checkpoint and the final parameters and EMA. Not
    ``adapters_only``: the checkpoint holds the base weights too and records no base (as a random
    base's does, and every LoRA checkpoint before adapters-only ones)."""
    from emapg_megatron import build
    from emapg_megatron.run import loop

    inputs = build.prepare([*argv, "--save", ckpt])  # a run that saves: its base is hashed and recorded
    trainer = build.build_trainer(inputs)
    if not adapters_only:
        trainer.state.lora_base = None
    for i in range(1, saved_at + 1):
        trainer.step(i)
    loop.save(trainer.state, ckpt, saved_at, loop.RunRecord(model=build.model_metadata(inputs)))
    saved = _named(trainer.model_chunks)
    metrics = [trainer.step(i).metrics for i in range(saved_at + 1, steps + 1)]
    anchor = trainer.state.anchor
    return {"metrics": metrics, "saved": saved, "params": _named(trainer.model_chunks),
            "ema": anchor.gathered() if hasattr(anchor, "gathered") else {}}


def lora_resume(argv: list, ckpt: str, steps: int) -> dict:
    """Resume ``ckpt`` (``run.loop.resume``, ``--load ckpt`` added to ``argv`` when it has none)
    and take the steps after it up to ``steps``."""
    from emapg_megatron import build
    from emapg_megatron.run import loop

    inputs = build.prepare(argv if "--load" in argv else [*argv, "--load", ckpt])
    trainer = build.build_trainer(inputs)
    start = loop.resume(ckpt, trainer.state)
    resumed = _named(trainer.model_chunks)
    logits = _local_logits(trainer.model_chunks, inputs.model_cfg.vocab_size)
    from emapg_megatron.lora.apply import adapters_off, has_adapters

    with adapters_off(trainer.model_chunks) if has_adapters(trainer.model_chunks[0]) else nullcontext():
        base_logits = _local_logits(trainer.model_chunks, inputs.model_cfg.vocab_size)
    metrics = [trainer.step(i).metrics for i in range(start + 1, steps + 1)]
    anchor = trainer.state.anchor
    return {"metrics": metrics, "resumed": resumed, "logits": logits, "base_logits": base_logits, "params": _named(trainer.model_chunks),
            "ema": anchor.gathered() if hasattr(anchor, "gathered") else {}}


def build_only(argv: list) -> None:
    """The run's components as emapg-train builds them (its --load checked first), no step."""
    from emapg_megatron import build

    build.build_trainer(build.prepare(argv))


def export_merged(ckpt: str, out: str, vocab: int, seq: int = 8, lora_base: str | None = None):
    """``emapg-convert mcore-to-hf`` of a LoRA run's checkpoint (adapters merged; the base read from
    the folder it records, or ``lora_base``), read back with transformers: its logits of
    :func:`_local_logits`'s batch."""
    import transformers

    from emapg_megatron.checkpoint.convert import mcore_to_hf

    mcore_to_hf(ckpt, out, progress=False, lora_base=lora_base)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    tokens = (torch.arange(2 * seq).view(2, seq) * 7 + 3) % vocab
    with torch.no_grad():
        return model(tokens).logits.float()


def export_peft(ckpt: str, out: str, base: str, vocab: int, seq: int = 8):
    """``emapg-convert lora-to-peft`` of a LoRA run's checkpoint, loaded by peft on the HF base
    model: its logits of :func:`_local_logits`'s batch."""
    import peft
    import transformers

    from emapg_megatron.checkpoint import cli

    assert cli.main(["lora-to-peft", "--load", ckpt, "--out", out]) == 0
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out).eval()
    tokens = (torch.arange(2 * seq).view(2, seq) * 7 + 3) % vocab
    with torch.no_grad():
        return model(tokens).logits.float()


def continue_from_peft(argv: list, steps: int) -> dict:
    """A run started from a peft adapter (--lora-peft-init): its logits before any step, then
    ``steps`` trainer steps."""
    from emapg_megatron import build

    inputs = build.prepare(argv)
    trainer = build.build_trainer(inputs)
    logits = _local_logits(trainer.model_chunks, inputs.model_cfg.vocab_size)
    return {"logits": logits, "metrics": [trainer.step(i).metrics for i in range(1, steps + 1)]}
