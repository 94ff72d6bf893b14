#!/usr/bin/env python3
"""Memory per GPU of a training run, computed from the model's shapes and the parallel layout.

What is counted, per rank, for the pipeline stage that holds the most parameters (the first
stage has the embedding, the last the output layer and the final norm):

* weights: bf16 (``--bf16``) or fp32, 2 or 4 bytes per local parameter;
* gradients: 4 bytes (the trainer's DDP reduces and keeps gradients in fp32,
  ``grad_reduce_in_fp32=True`` in ``training/model_and_optimizer.py``);
* fp32 main parameters (bf16 runs only; an fp32 model's weights are its main parameters) and
  Adam's two fp32 moments: 4 + 8 bytes, divided by DP with ``--use-distributed-optimizer``;
* the fp32 EMA anchor: 4 bytes; 4 / DP with ``--ema-shard-over-dp``; none on the device with
  ``--ema-cpu-offload`` (then in host memory). An fp32 model also saves the weights it swaps out
  during the anchor pass (4 bytes, 4 / DP with the distributed optimizer), transiently;
* the KV cache of one rollout sequence: keys and values of this stage's layers for this rank's
  query groups, ``2 x layers/PP x groups/TP x head_dim x 2 bytes`` (bf16) per token, as the
  built-in sampler sizes it (``rollout/kv_cache_decoding.cache_bytes_per_row``); vLLM's cache
  holds the same per token at its own TP.

Not counted: activations and the temporary buffers of one micro-batch (they grow with its tokens:
``--micro-batch-size`` x ``--seq-length``, or ``--max-tokens-per-microbatch`` with
``--sequence-packing``, and with the micro-batches in flight under PP), the CUDA context and the
allocator's cache, communication buffers, and vLLM's own share while it is awake. See
docs/memory.md.

    python tools/memory_plan.py                         # docs/memory.md's tables (markdown), 8 GPUs
    python tools/memory_plan.py --json                  # the same rows as JSON
    python tools/memory_plan.py --model qwen2.5-7b --tp 2 --dp 4 --distributed-optimizer --json
    python tools/memory_plan.py --hf-config /models/X/config.json --tp 2 --pp 2 --dp 2 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from emapg_megatron.models.config import ModelConfig  # noqa: E402

GiB = 1 << 30
EMA_MODES = ("plain", "shard", "offload", "shard-offload")

# Qwen2.5 base models: the fields of Hugging Face's Qwen/Qwen2.5-<size>/config.json that set the
# parameter count (all have a bias on the fused QKV projection; head_dim = hidden / heads).
QWEN25 = {
    "qwen2.5-0.5b": dict(hidden_size=896, ffn_hidden_size=4864, num_layers=24, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, ffn_hidden_size=8960, num_layers=28, num_attention_heads=12,
                         num_query_groups=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, ffn_hidden_size=11008, num_layers=36, num_attention_heads=16,
                       num_query_groups=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, ffn_hidden_size=18944, num_layers=28, num_attention_heads=28,
                       num_query_groups=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, ffn_hidden_size=13824, num_layers=48, num_attention_heads=40,
                        num_query_groups=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, ffn_hidden_size=27648, num_layers=64, num_attention_heads=40,
                        num_query_groups=8, vocab_size=152064, tie_word_embeddings=False),
}


def qwen25(name: str) -> ModelConfig:
    return ModelConfig(add_qkv_bias=True, **QWEN25[name])


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the memory-relevant flags of a run."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    distributed_optimizer: bool = False
    ema: str = "plain"
    bf16: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def name(self) -> str:
        parts = [f"TP{self.tp}"] + ([f"PP{self.pp}"] if self.pp > 1 else []) + [f"DP{self.dp}"]
        flags = (["dist-opt"] if self.distributed_optimizer else []) + \
            ([f"EMA {self.ema}"] if self.ema != "plain" else []) + ([] if self.bf16 else ["fp32"])
        return "·".join(parts) + (f" ({', '.join(flags)})" if flags else "")


def fits(cfg: ModelConfig, layout: Layout) -> str | None:
    """None if Megatron can build ``cfg`` at this layout, else why not (the trainer's own check)."""
    groups = cfg.num_query_groups or cfg.num_attention_heads
    if cfg.num_attention_heads % layout.tp or groups % layout.tp:
        return f"TP {layout.tp} does not divide {cfg.num_attention_heads} heads / {groups} query groups"
    if cfg.num_layers % layout.pp:
        return f"PP {layout.pp} does not divide {cfg.num_layers} layers"
    if layout.ema.startswith("shard") and not layout.distributed_optimizer:
        return "--ema-shard-over-dp needs --use-distributed-optimizer"
    return None


def head_dim(cfg: ModelConfig) -> int:
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def layer_params(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank (Megatron's GPTModel, SwiGLU, RMSNorm,
    no linear biases but the optional QKV bias; norms are replicated on every TP rank)."""
    h, d = cfg.hidden_size, head_dim(cfg)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    qkv_out = (cfg.num_attention_heads + 2 * groups) * d // tp
    n = 2 * h                                      # input and pre-MLP RMSNorm
    n += qkv_out * h + (qkv_out if cfg.add_qkv_bias else 0)
    n += 2 * d if cfg.qk_layernorm else 0          # q and k RMSNorm (Qwen3)
    n += h * cfg.num_attention_heads * d // tp     # attention output projection
    n += 3 * h * cfg.ffn_hidden_size // tp         # SwiGLU: gate + up, down
    return n


def stage_params(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds: its layers, plus the (vocabulary
    padded, TP-sharded) embedding on the first stage and the final norm and output layer on the
    last. A tied output layer is the embedding itself at PP = 1; at PP > 1 the last stage keeps its
    own copy (Megatron's shared-embedding group keeps the two equal)."""
    vocab = cfg.padded_vocab_size(tp) // tp * cfg.hidden_size
    n = cfg.num_layers // pp * layer_params(cfg, tp)
    first, last = stage == 0, stage == pp - 1
    if first:
        n += vocab
    if last:
        n += cfg.hidden_size
        if not cfg.tie_word_embeddings or not first:
            n += vocab
    return n


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_layer_params(cfg: ModelConfig, rank: int, tp: int = 1, targets=LORA_TARGETS) -> int:
    """LoRA adapter parameters of one layer on one TP rank (docs/lora.md): A ``[r, in]`` and B
    ``[out, r]`` of each target, split over TP where the base weight is: a column-parallel base
    (qkv, fc1) has A whole and B split on its rows, a row-parallel one (proj, fc2) A split on its
    columns and B whole."""
    h, d = cfg.hidden_size, head_dim(cfg)
    groups = cfg.num_query_groups or cfg.num_attention_heads
    attn = cfg.num_attention_heads * d
    per = {"linear_qkv": rank * h + (cfg.num_attention_heads + 2 * groups) * d // tp * rank,
           "linear_proj": rank * attn // tp + h * rank,
           "linear_fc1": rank * h + 2 * cfg.ffn_hidden_size // tp * rank,
           "linear_fc2": rank * cfg.ffn_hidden_size // tp + h * rank}
    return sum(per[t] for t in targets)


def model_params(cfg: ModelConfig) -> int:
    """The model's own parameter count (unpadded vocabulary, a tied output layer counted once):
    what the Hugging Face checkpoint holds."""
    vocab = cfg.vocab_size * cfg.hidden_size
    return (cfg.num_layers * layer_params(cfg) + vocab + cfg.hidden_size
            + (0 if cfg.tie_word_embeddings else vocab))


def kv_bytes_per_token(cfg: ModelConfig, tp: int = 1, pp: int = 1, itemsize: int = 2) -> int:
    """KV-cache bytes per token of one sequence on one rank (keys and values, bf16 by default)."""
    groups = cfg.num_query_groups or cfg.num_attention_heads
    return 2 * (cfg.num_layers // pp) * (groups // tp) * head_dim(cfg) * itemsize


def memory(cfg: ModelConfig, layout: Layout, seq_length: int = 8192, lora_rank: int = 0) -> dict:
    """Bytes per rank (the heaviest pipeline stage) of each counted part, and their device total.
    With ``lora_rank`` (``--lora-rank``, adapters on every target linear) the weights are the
    frozen base plus the adapters, and only the adapters (``trainable_per_rank``) have gradients,
    fp32 main params, Adam moments and an EMA (docs/lora.md)."""
    why = fits(cfg, layout)
    if why:
        raise ValueError(why)
    n = max(stage_params(cfg, layout.tp, layout.pp, s) + cfg.num_layers // layout.pp
            * lora_layer_params(cfg, lora_rank, layout.tp) for s in range(layout.pp))
    t = cfg.num_layers // layout.pp * lora_layer_params(cfg, lora_rank, layout.tp) if lora_rank else n
    shard = layout.dp if layout.distributed_optimizer else 1
    weights = n * (2 if layout.bf16 else 4)
    grads = t * 4
    main = math.ceil(t * 4 / shard) if layout.bf16 else 0
    adam = math.ceil(t * 8 / shard)
    ema = math.ceil(t * 4 / (layout.dp if layout.ema.startswith("shard") else 1))
    ema_device, ema_host = (0, ema) if layout.ema.endswith("offload") else (ema, 0)
    swap = 0 if layout.bf16 else math.ceil(t * 4 / shard)
    kv = kv_bytes_per_token(cfg, layout.tp, layout.pp)
    return {
        "params_per_rank": n, **({"trainable_per_rank": t, "lora_rank": lora_rank} if lora_rank else {}),
        "weights": weights, "grads": grads, "main_params": main, "adam": adam,
        "ema_device": ema_device, "ema_host": ema_host, "ema_swap_transient": swap,
        "total_device": weights + grads + main + adam + ema_device,
        "kv_bytes_per_token": kv, "kv_bytes_per_sequence": kv * seq_length, "seq_length": seq_length,
    }


def row(model: str, cfg: ModelConfig, layout: Layout, seq_length: int) -> dict:
    out = {"model": model, "model_params": model_params(cfg), "layout": layout.name(), **asdict(layout)}
    why = fits(cfg, layout)
    if why:
        return {**out, "fits": False, "why": why}
    return {**out, "fits": True, **memory(cfg, layout, seq_length)}


# ---------------------------------------------------------------------------------------- tables
def node_layouts(gpus: int) -> list[Layout]:
    """The columns of the docs' table for one node of ``gpus`` GPUs (bf16, EMA plain unless said)."""
    out = [Layout(1, 1, gpus), Layout(1, 1, gpus, True)]
    for tp in (2, 4, 8):
        if gpus % tp == 0:
            out.append(Layout(tp, 1, gpus // tp, gpus // tp > 1))
    for tp in (2, 4):
        if gpus % (2 * tp) == 0:
            out.append(Layout(tp, 2, gpus // (2 * tp), gpus // (2 * tp) > 1))
    if gpus % 2 == 0:
        out.append(Layout(2, 1, gpus // 2, True, "shard"))
    return [layout for layout in out if layout.gpus == gpus]


def gib(b: int) -> str:
    return f"{b / GiB:.1f}"


def markdown(models: dict[str, ModelConfig], gpus: int, seq_length: int) -> str:
    layouts = node_layouts(gpus)
    lines = [f"Static memory per GPU in GiB, bf16, {gpus} GPUs (weights + fp32 gradients + fp32 main "
             "params + Adam + fp32 EMA; no activations, no KV cache). `-`: the layout does not divide "
             "the model's heads, query groups or layers.", ""]
    lines.append("| model | parameters | " + " | ".join(layout.name() for layout in layouts) + " |")
    lines.append("|---|---|" + "---|" * len(layouts))
    for name, cfg in models.items():
        cells = []
        for layout in layouts:
            r = row(name, cfg, layout, seq_length)
            cells.append(gib(r["total_device"]) if r["fits"] else "-")
        lines.append(f"| {name} | {model_params(cfg) / 1e9:.2f} B | " + " | ".join(cells) + " |")
    lines += ["", "Bytes per local parameter, per part (N = parameters on the rank, DP = data-parallel "
              "size):", "",
              "| part | bf16 (`--bf16`) | fp32 | with `--use-distributed-optimizer` |",
              "|---|---|---|---|",
              "| weights | 2 | 4 | same |",
              "| gradients (reduced in fp32) | 4 | 4 | same |",
              "| fp32 main params | 4 | 0 (the weights) | / DP |",
              "| Adam moments (fp32) | 8 | 8 | / DP |",
              "| EMA anchor (fp32) | 4 | 4 | 4 / DP with `--ema-shard-over-dp`; 0 on the device with "
              "`--ema-cpu-offload` |",
              "| total, plain | 22 | 20 | 10 + 12 / DP (EMA plain), 6 + 16 / DP (EMA sharded) |", ""]
    lines += [f"KV cache of one rollout sequence of {seq_length} tokens (bf16), per GPU, in MiB:", ""]
    tps = (1, 2, 4, 8)
    lines.append("| model | per token, TP1 (KiB) | " + " | ".join(f"TP{tp}" for tp in tps) + " |")
    lines.append("|---|---|" + "---|" * len(tps))
    for name, cfg in models.items():
        cells = []
        for tp in tps:
            ok = fits(cfg, Layout(tp=tp)) is None
            cells.append(f"{kv_bytes_per_token(cfg, tp) * seq_length / (1 << 20):.0f}" if ok else "-")
        lines.append(f"| {name} | {kv_bytes_per_token(cfg) / 1024:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def load_hf_config(path: str) -> tuple[str, ModelConfig]:
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config

    folder = os.path.dirname(path) if os.path.basename(path) == "config.json" else path
    cfg, _ = model_config_from_hf(read_hf_config(folder))
    return os.path.basename(os.path.abspath(folder)), cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", choices=sorted(QWEN25), help="a Qwen2.5 shape (repeatable; "
                   "default: all six)")
    p.add_argument("--hf-config", action="append", default=[], metavar="PATH",
                   help="an HF model folder or its config.json (repeatable)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the table's layouts (default 8: one node)")
    p.add_argument("--tp", type=int, help="one layout instead of the table: tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (with --tp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (with --tp)")
    p.add_argument("--distributed-optimizer", action="store_true", help="--use-distributed-optimizer")
    p.add_argument("--ema", choices=EMA_MODES, default="plain",
                   help="plain, shard (--ema-shard-over-dp), offload (--ema-cpu-offload), shard-offload")
    p.add_argument("--fp32", action="store_true", help="an fp32 model (no --bf16)")
    p.add_argument("--seq-length", type=int, default=8192, help="tokens of one rollout sequence (KV cache)")
    p.add_argument("--json", action="store_true", help="JSON rows instead of markdown")
    a = p.parse_args(argv)

    models = {name: qwen25(name) for name in (a.model or ([] if a.hf_config else QWEN25))}
    for path in a.hf_config:
        name, cfg = load_hf_config(path)
        models[name] = cfg
    if a.tp is not None:
        layouts = [Layout(a.tp, a.pp, a.dp, a.distributed_optimizer, a.ema, not a.fp32)]
    else:
        layouts = node_layouts(a.gpus)
    if a.json or a.tp is not None:
        rows = [row(name, cfg, layout, a.seq_length) for name, cfg in models.items() for layout in layouts]
        print(json.dumps(rows, indent=1, ensure_ascii=False))
    else:
        print(markdown(models, a.gpus, a.seq_length), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
