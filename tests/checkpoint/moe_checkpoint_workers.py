"""Tiny HF mixtures of experts (Qwen3-MoE, Mixtral) and the rank functions of
test_checkpoint_moe.py (spawned, so module level).

Every layer holds 4 experts, 2 per token. ``qwen3_moe`` renormalises its top-k weights
(Qwen3-30B-A3B's norm_topk_prob), ``qwen3_moe_fused_tied`` does not (transformers' default) and is
stored the way transformers >= 5 holds experts in memory (one ``gate_up_proj`` / ``down_proj``
tensor per layer; its ``_ref`` twin is the same model as ``save_pretrained`` writes it: one tensor
per expert and projection), ``mixtral`` is Mixtral (Llama attention, ``block_sparse_moe``),
``qwen3_moe_mixed`` a Qwen3-MoE whose first layer's MLP is dense (``decoder_sparse_step`` 2).
"""

from pathlib import Path

import torch

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)

# name -> (family, config overrides, stored fused)
MODELS = {
    "qwen3_moe": ("qwen3_moe", dict(QWEN3_MOE, norm_topk_prob=True), False),
    "qwen3_moe_fused_tied": ("qwen3_moe", dict(QWEN3_MOE, norm_topk_prob=False, head_dim=16,
                                               tie_word_embeddings=True), True),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), False),
    # every second layer a MoE layer (HF's decoder_sparse_step): layer 0's MLP is dense
    "qwen3_moe_mixed": ("qwen3_moe", dict(QWEN3_MOE, norm_topk_prob=True, decoder_sparse_step=2), False),
}
BUCKET = 16 * 1024  # several buckets per model, a gathered expert slot (EP x 48 x 32 x 4 B) fits


def tokens(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (batch, seq), generator=g)


def build_hf_model(family: str, overrides: dict, seed: int):
    """A transformers MoE model with every tensor random (norms around 1)."""
    import transformers as tf

    config_cls, model_cls = {"qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
                             "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[family]
    model = model_cls(config_cls(**{**COMMON, **overrides}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name else 0.0
            p.copy_(centre + torch.randn(p.shape, generator=g) * (0.1 if p.ndim > 1 else 0.2))
    return model.eval()


def save_hf_models(root: Path) -> dict[str, str]:
    """The models' folders; a fused one also as ``<name>_ref`` (save_pretrained's layout)."""
    from safetensors.torch import save_file

    dirs = {}
    for seed, (name, (family, overrides, fused)) in enumerate(MODELS.items()):
        model = build_hf_model(family, overrides, seed + 10)
        path = root / (name + "_ref" if fused else name)
        model.save_pretrained(path)
        (path / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
        dirs[path.name] = str(path)
        if fused:  # transformers' in-memory names: experts fused, Mixtral's router under mlp.
            out = root / name
            out.mkdir()
            for f in ("config.json", "generation_config.json", "tokenizer_config.json"):
                (out / f).write_text((path / f).read_text())
            state = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
            assert "model.layers.0.mlp.experts.gate_up_proj" in state
            save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
            dirs[name] = str(out)
    return dirs


def reference_dir(hf_dirs: dict, name: str) -> str:
    """The per-expert folder of model ``name`` (what an export must reproduce bit for bit)."""
    return hf_dirs.get(name + "_ref", hf_dirs[name])


# --- rank functions -----------------------------------------------------------------------


def _logits_from(cfg, load):
    """Build this rank's model (fp32), fill it with ``load(model)``; the full logits on the
    last stage's TP rank 0, else None."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint.verify import megatron_logits
    from emapg_megatron.models.gpt import build_for_this_rank

    model = build_for_this_rank(cfg)
    load(model)
    model.eval()  # Megatron's MoE layer refuses TP > 1 without sequence parallelism in training mode
    logits = megatron_logits([model], tokens())
    if logits is None or ps.get_tensor_model_parallel_rank() != 0:
        return model, None
    return model, logits[..., : cfg.vocab_size]


def convert_job(hf_dirs: dict, root: str) -> dict:
    """One rank: the CLI both ways (checked for TP=2 x EP=2), the TP=1 logits, the checkpoint keys."""
    from emapg_megatron.checkpoint import cli, convert, hf_mapping
    from emapg_megatron.models.gpt import build_for_this_rank

    root = Path(root)
    out = {"rc": {}, "logits": {}, "key_mismatches": {}}
    for name in MODELS:
        ckpt = root / "mcore" / name
        out["rc"][name] = cli.main(["hf-to-mcore", "--hf-dir", hf_dirs[name], "--out", str(ckpt),
                                    "--tp", "2", "--ep", "2", "--dtype", "fp32", "--no-progress"])
        out["rc"][name + "/export"] = cli.main(
            ["mcore-to-hf", "--load", str(ckpt), "--out", str(root / "hf" / name),
             "--hf-template", hf_dirs[name], "--no-progress"])
        cfg = convert.checkpoint_model_config(ckpt)  # its model config checked against its tensors
        _, out["logits"][name] = _logits_from(cfg, lambda m, c=ckpt: convert.load_mcore([m], c))
        # Megatron's checkpoint keys (experts stacked) are the table's stored keys.
        mapping = hf_mapping.HFMapping(cfg)
        out["key_mismatches"][name] = [
            (n, sh.key) for n, sh in build_for_this_rank(cfg).sharded_state_dict().items()
            if not n.endswith("_extra_state") and sh.key != mapping.stored_key(mapping.lookup(n))]
    return out


def parallel_job(hf_dirs: dict, root: str, save: str | None) -> dict:
    """Any layout: logits after load_mcore and after load_hf_weights (each rank reading its own
    experts' slices), the export stream (all experts on every rank), and a save of the HF-loaded
    model to ``root/save/<name>``."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint import convert, weights

    root = Path(root)
    out = {"ep_rank": ps.get_expert_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
           "local_experts": {}}
    for name in MODELS:
        ckpt = root / "mcore" / name
        cfg = convert.checkpoint_model_config(ckpt)
        res = {}
        _, res["logits_mcore"] = _logits_from(cfg, lambda m, c=ckpt: convert.load_mcore([m], c))
        model, res["logits_hf"] = _logits_from(
            cfg, lambda m, c=cfg, d=hf_dirs[name]: weights.load_hf_weights([m], c, d))
        # this stage's MoE layers' local experts (None: its layers' MLPs are all dense)
        out["local_experts"][name] = next((len(layer.mlp.experts.local_experts) for layer in model.decoder.layers
                                           if hasattr(layer.mlp, "experts")), None)
        buckets = list(weights.export_hf_buckets([model], cfg, bucket_bytes=BUCKET))
        res["buckets"] = len(buckets)
        res["export"] = {n: t for b in buckets for n, t in b}
        res["owned"] = [n for n, _ in weights.export_hf_weights([model], cfg, all_stages=False)]
        if save is not None:
            convert.save_mcore([model], root / save / name, convert.read_checkpoint_metadata(ckpt))
        out[name] = res
    return out


LOCAL_NORM_KEY = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
TE_NORM_KEY = "decoder.layers.pre_mlp_layernorm.weight"  # a MoE layer's, in TE's spec


def export_job(hf_dirs: dict, root: str, saved: str, te_keys: bool = True) -> dict:
    """One rank: mcore-to-hf of the checkpoints another layout saved (resharded to TP=EP=1), and
    (``te_keys``) of the converted ``qwen3_moe`` saved again with the key Transformer Engine's
    spec stores a MoE layer's pre-MLP norm under."""
    import json

    from megatron.core import dist_checkpointing

    from emapg_megatron import mcore_compat
    from emapg_megatron.checkpoint import cli, convert
    from emapg_megatron.models.gpt import build_for_this_rank

    root = Path(root)
    out = {name: cli.main(["mcore-to-hf", "--load", str(root / saved / name), "--out",
                           str(root / (saved + "_hf") / name), "--no-progress"])
           for name in MODELS}
    if not te_keys:
        return out
    ckpt, te = root / "mcore" / "qwen3_moe", root / "te_keys"
    model = build_for_this_rank(convert.checkpoint_model_config(ckpt))
    convert.load_mcore([model], ckpt)
    sharded = model.sharded_state_dict()
    for sh in sharded.values():
        if getattr(sh, "key", None) == LOCAL_NORM_KEY:
            sh.key = TE_NORM_KEY
    te.mkdir()
    dist_checkpointing.save({"model": sharded, mcore_compat.VERSION_KEY: mcore_compat.VERSION}, str(te))
    meta = {**convert.read_checkpoint_metadata(ckpt), "saved_tp": 1}
    (te / convert.METADATA).write_text(json.dumps(meta))
    out["te_stored_norm_keys"] = sorted(k for k in dist_checkpointing.load_tensors_metadata(str(te))
                                        if k in (LOCAL_NORM_KEY, TE_NORM_KEY))
    out["te_keys"] = cli.main(["mcore-to-hf", "--load", str(te), "--out", str(root / "te_keys_hf"),
                               "--no-progress"])
    return out
