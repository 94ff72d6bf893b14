"""Tiny HF models and the rank functions of the checkpoint tests (spawned, so module level)."""

from pathlib import Path

import torch

COMMON = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

# name -> (family, config overrides, dtype, save_pretrained kwargs)
MODELS = {
    "llama_gqa_untied": ("llama", dict(rope_theta=500000.0), torch.float32, {}),
    # Llama 3.1/3.2-style RoPE scaling (factor 32 as in Llama 3.2); short contexts still use the
    # scaled low frequencies, so a missing or wrong scaling changes the logits.
    "llama32_rope_scaled_untied": ("llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), torch.float32, {}),
    "qwen2_bias_tied": ("qwen2", dict(tie_word_embeddings=True, rms_norm_eps=1e-5), torch.float32,
                        dict(max_shard_size="100KB")),  # sharded input with an index
    "qwen3_qknorm_untied": ("qwen3", dict(head_dim=24), torch.float32, {}),
    "qwen3_qknorm_tied_mha": ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=4, head_dim=16),
                              torch.float32, {}),
    "qwen2_bias_tied_bf16": ("qwen2", dict(tie_word_embeddings=True), torch.bfloat16, {}),
}
FP32_MODELS = [n for n, m in MODELS.items() if m[2] == torch.float32]


def tokens(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (batch, seq), generator=g)


def build_hf_model(family: str, overrides: dict, seed: int):
    """A transformers model with every tensor random (biases and norms included)."""
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    model = model_cls(config_cls(**{**COMMON, **overrides}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name else 0.0
            p.copy_(centre + torch.randn(p.shape, generator=g) * (0.1 if p.ndim > 1 else 0.2))
    return model.eval()


def save_hf_models(root: Path) -> dict[str, str]:
    dirs = {}
    for seed, (name, (family, overrides, dtype, save_kwargs)) in enumerate(MODELS.items()):
        model = build_hf_model(family, overrides, seed).to(dtype)
        path = root / name
        model.save_pretrained(path, **save_kwargs)
        (path / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
        dirs[name] = str(path)
    return dirs


def hf_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    from emapg_megatron.checkpoint.hf_io import SafetensorsReader

    reader = SafetensorsReader(hf_dir)
    return {n: reader.read(n) for n in reader.names()}


# --- rank functions -----------------------------------------------------------------------


def _logits_from(cfg, load):
    """Build this rank's model (fp32), fill it with ``load(model)``, return the full logits."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint.verify import megatron_logits
    from emapg_megatron.models.gpt import build_for_this_rank

    model = build_for_this_rank(cfg)
    load(model)
    logits = megatron_logits([model], tokens())
    if logits is None or ps.get_tensor_model_parallel_rank() != 0:
        return model, None
    return model, logits[..., : cfg.vocab_size]


def _stacked(name: str) -> str:
    """Megatron stores all layers under one key: drop the layer index."""
    parts = name.split(".")
    return ".".join(parts[:2] + parts[3:]) if name.startswith("decoder.layers.") else name


def convert_job(hf_dirs: dict, root: str) -> dict:
    """One rank: the CLI both ways (dtype fp32 / default), TP=1 logits, local-spec checkpoint keys."""
    import shutil

    from emapg_megatron.checkpoint import cli, convert, hf_mapping
    from emapg_megatron.models.gpt import build_for_this_rank

    root = Path(root)
    out = {"rc": {}, "logits": {}}
    for name, hf_dir in hf_dirs.items():
        dtype = [] if name.endswith("bf16") else ["--dtype", "fp32"]
        out["rc"][name] = cli.main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(root / "mcore" / name),
                                    "--tp", "2", "--no-progress", *dtype])
        shard = ["--max-shard-size-gb", "0.0001"] if name.startswith("llama") else []
        out["rc"][name + "/export"] = cli.main(
            ["mcore-to-hf", "--load", str(root / "mcore" / name), "--out", str(root / "hf" / name),
             "--hf-template", hf_dir, "--no-progress", *shard])
        if name == "qwen3_qknorm_untied":  # no template: config.json from the stored original
            out["rc"][name + "/no-template"] = cli.main(
                ["mcore-to-hf", "--load", str(root / "mcore" / name), "--out",
                 str(root / "hf_no_template" / name), "--no-progress"])
        if name.endswith("bf16"):
            continue
        ckpt = root / "mcore" / name
        cfg = convert.checkpoint_model_config(ckpt)
        _, out["logits"][name] = _logits_from(cfg, lambda m, c=ckpt: convert.load_mcore([m], c))

    # Megatron's checkpoint keys for the local spec are the table's canonical (TE-fused) names.
    cfg = convert.checkpoint_model_config(root / "mcore" / "qwen3_qknorm_untied")
    mapping = hf_mapping.HFMapping(cfg)
    model = build_for_this_rank(cfg)
    out["key_mismatches"] = [
        (name, sh.key) for name, sh in model.sharded_state_dict().items()
        if not name.endswith("_extra_state") and sh.key != _stacked(mapping.lookup(name).megatron)]

    # A load that fails half way leaves no output directory and no temporary one.
    broken = root / "broken"
    shutil.copytree(root / "mcore" / "llama_gqa_untied", broken)
    for f in broken.glob("*.distcp"):
        f.unlink()
    try:  # a damaged checkpoint is one error line (exit code 2) before torch reads it
        out["broken_raised"] = cli.main(["mcore-to-hf", "--load", str(broken), "--out",
                                         str(root / "hf_broken"), "--no-progress"]) == 2
    except BaseException:  # noqa: BLE001 - torch DCP raises CheckpointException(BaseException)
        out["broken_raised"] = False
    out["broken_left"] = sorted(p.name for p in root.iterdir() if "broken" in p.name and p != broken)
    return out


def parallel_job(hf_dirs: dict, root: str, bucket_bytes: int) -> dict:
    """TP=2 or PP=2: logits after load_mcore and after load_hf_weights, the export stream, and
    (TP=2) a save of the HF-loaded model / (PP=2) a load of that TP=2 save."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint import convert, weights
    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    root = Path(root)
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name in FP32_MODELS:
        ckpt = root / "mcore" / name
        cfg = convert.checkpoint_model_config(ckpt)
        res = {}
        _, res["logits_mcore"] = _logits_from(cfg, lambda m, c=ckpt: convert.load_mcore([m], c))
        model, res["logits_hf"] = _logits_from(
            cfg, lambda m, c=cfg, d=hf_dirs[name]: weights.load_hf_weights([m], c, d))
        buckets = list(weights.export_hf_buckets([model], cfg, bucket_bytes=bucket_bytes))
        res["buckets"] = [[n for n, _ in b] for b in buckets]
        res["export"] = {n: t for b in buckets for n, t in b}
        res["owned"] = [n for n, _ in weights.export_hf_weights([model], cfg, all_stages=False)]
        res["export_as_bf16"] = dict(weights.export_hf_weights([model], cfg, dtype=torch.bfloat16))
        if tp == 2:
            res["one_param_buckets"] = [[n for n, _ in b] for b in
                                        weights.export_hf_buckets([model], cfg, bucket_bytes=1)]
            convert.save_mcore([model], root / "tp2_saved" / name,
                               convert.read_checkpoint_metadata(ckpt))
        else:
            _, res["logits_tp2_saved"] = _logits_from(
                cfg, lambda m, c=root / "tp2_saved" / name: convert.load_mcore([m], c))
        out[name] = res
    # The trainer's bf16 model (DDP(Float16Module(GPTModel))): the stream keeps dtype and bits.
    bf16 = "qwen2_bias_tied_bf16"
    cfg = convert.checkpoint_model_config(root / "mcore" / bf16)
    chunks, _ = build_model_and_optimizer(cfg, OptimConfig(), PrecisionConfig(bf16=True))
    weights.load_hf_weights(chunks, cfg, hf_dirs[bf16])
    out[bf16] = {"export": dict(weights.export_hf_weights(chunks, cfg, bucket_bytes=bucket_bytes))}
    return out


def fp8_job(hf_dir: str, root: str) -> dict:
    """GPU, one rank, TE spec: the same HF weights run in BF16 and with FP8 compute."""
    from megatron.core import dist_checkpointing

    from emapg_megatron.checkpoint import convert, hf_config, weights
    from emapg_megatron.checkpoint.verify import megatron_logits
    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.models.gpt import unwrap
    from emapg_megatron.training.config import OptimConfig
    from emapg_megatron.training.model_and_optimizer import build_model_and_optimizer

    cfg, arch = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir))
    toks = tokens(batch=2, seq=32)
    out = {}
    for label, fp8 in (("bf16", None), ("fp8", "e4m3")):
        prec = PrecisionConfig(bf16=True, fp8_format=fp8, fp8_recipe="delayed")
        chunks, _ = build_model_and_optimizer(cfg, OptimConfig(), prec)
        gpt = unwrap(chunks[0])
        weights.load_hf_weights(chunks, cfg, hf_dir)  # TE-fused layernorm names
        out[label] = {
            "fp8": gpt.config.fp8,
            "logits": megatron_logits(chunks, toks)[..., : cfg.vocab_size].float().cpu(),
            "qkv_type": type(gpt.decoder.layers[0].self_attention.linear_qkv).__name__,
            "head_types": [type(gpt.embedding.word_embeddings).__name__, type(gpt.output_layer).__name__],
            "head_dtypes": [str(gpt.embedding.word_embeddings.weight.dtype),
                            str(gpt.output_layer.weight.dtype)],
            "export": {n: t.cpu() for n, t in weights.export_hf_weights(chunks, cfg)},
        }
        ckpt = Path(root) / label
        convert.save_mcore(chunks, ckpt, convert.checkpoint_metadata(cfg, arch, "bf16", tp=1, pp=1))
        out[label]["ckpt_dtypes"] = sorted({str(t.dtype) for t in
                                            dist_checkpointing.load_tensors_metadata(str(ckpt)).values()})
    return out


def resumed_vs_exported(argv: list, ckpt: str, export: str) -> dict:
    """The trained weights as the trainer resumes them from ``ckpt`` (its production path, at
    this job's layout), against the same model with the HF export's weights loaded into it
    (the HF import path): ``{global name: bit-equal}``."""
    from emapg_megatron import build
    from emapg_megatron.checkpoint import load_hf_weights
    from emapg_megatron.models.gpt import global_param_name, unwrap
    from emapg_megatron.run import loop

    inputs = build.prepare(argv)
    trainer = build.build_trainer(inputs)
    loop.resume(ckpt, trainer.state)
    gpt = unwrap(trainer.model_chunks[0])
    trained = {global_param_name(gpt, n): p.detach().clone() for n, p in gpt.named_parameters()}
    load_hf_weights(trainer.model_chunks, inputs.model_cfg, export, progress=False)
    return {global_param_name(gpt, n): torch.equal(trained[global_param_name(gpt, n)], p.detach())
            for n, p in gpt.named_parameters()}
