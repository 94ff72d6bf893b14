"""Rank functions of test_lora_peft.py (forked ranks, so module level): a tiny Qwen2.5-shaped HF
model (GQA with QKV bias, tied embeddings) loaded into the package's GPTModel, LoRA on every
target with seeded random adapters, exported in peft's format."""

from __future__ import annotations

import torch

HF_SHAPE = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=True)


def build_hf(out_dir: str) -> str:
    """The base model's folder, every tensor random (norms around 1, biases nonzero)."""
    import transformers

    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF_SHAPE))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(("norm" in name) + torch.randn(p.shape, generator=g) * (0.1 if p.ndim > 1 else 0.2))
    model.save_pretrained(out_dir)
    return out_dir


def _lora_model(hf_dir: str):
    from lora_workers import RANK, lora_config, random_adapters

    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.checkpoint.weights import load_hf_weights
    from emapg_megatron.lora.apply import apply_lora, set_adapter_weights
    from emapg_megatron.models.gpt import build_for_this_rank

    cfg, _ = model_config_from_hf(read_hf_config(hf_dir))
    cfg.make_vocab_size_divisible_by = 8
    model = build_for_this_rank(cfg)
    load_hf_weights([model], cfg, hf_dir)
    apply_lora(model, lora_config(), seed=RANK)
    return model, cfg, random_adapters, set_adapter_weights


def export_job(hf_dir: str, out_dir: str | None, full: dict | None = None) -> dict:
    """One rank: seeded random adapters, the LoRA model's logits and its adapters saved in peft's
    format under ``out_dir``; at TP = 2 the one-rank adapters ``full`` set and gathered back from
    the shards."""
    from lora_workers import batch, forward, lora_config
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint.peft_format import gathered_adapters, save_peft

    model, cfg, random_adapters, set_adapter_weights = _lora_model(hf_dir)
    full = random_adapters(model) if full is None else full
    set_adapter_weights(model, full)
    gathered = gathered_adapters(model)
    out = {"gathered_equal": sorted(gathered) == sorted(full)
           and all(torch.equal(gathered[k], full[k].float()) for k in full)}
    if ps.get_tensor_model_parallel_world_size() == 1:
        save_peft(out_dir, lora_config(), gathered, cfg, base=hf_dir)
        out["logits"] = forward(model, cfg.vocab_size)[..., : cfg.vocab_size]
        out["tokens"] = batch(cfg.vocab_size)[0]
        out["shapes"] = {k: tuple(v.shape) for k, v in gathered.items()}
        out["adapters"] = gathered
    return out


def make_peft_adapter(hf_dir: str, out_dir: str, rank: int, alpha: float, targets: list[str]) -> str:
    """An adapter made by peft itself on the HF base (its usual layout: each projection its own A),
    both matrices random (``init_lora_weights=False``), saved with ``save_pretrained``."""
    import peft
    import transformers

    torch.manual_seed(4)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      init_lora_weights=False))
    model.save_pretrained(out_dir)
    return out_dir


def import_job(hf_dir: str, adapter_dir: str, rank: int, alpha: float, targets: list[str]) -> dict:
    """The run's model (this TP) with adapters of ``rank`` on ``targets``, set from the peft folder
    as --lora-peft-init does: the logits (TP shards put together) and the whole adapter matrices."""
    from lora_workers import SEED, forward

    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.checkpoint.peft_format import gathered_adapters, init_from_peft
    from emapg_megatron.checkpoint.weights import load_hf_weights
    from emapg_megatron.lora.apply import apply_lora
    from emapg_megatron.lora.config import LoRAConfig
    from emapg_megatron.models.gpt import build_for_this_rank

    cfg, _ = model_config_from_hf(read_hf_config(hf_dir))
    cfg.make_vocab_size_divisible_by = 8
    model = build_for_this_rank(cfg)
    load_hf_weights([model], cfg, hf_dir)
    lora = LoRAConfig(rank=rank, alpha=alpha, target_modules=tuple(targets), peft_init=adapter_dir)
    apply_lora(model, lora, seed=SEED)
    init_from_peft([model], lora, cfg, seed=SEED)
    return {"logits": forward(model, cfg.vocab_size)[..., : cfg.vocab_size],
            "adapters": gathered_adapters(model)}
