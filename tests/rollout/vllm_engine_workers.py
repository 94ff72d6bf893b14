"""Rank functions for tests/rollout/test_vllm_engine.py (spawned, so module level)."""

import torch
import torch.distributed as dist

from emapg_megatron.models.config import ModelConfig

TINY = dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
            num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64,
            add_qkv_bias=True)


def _mismatch_inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    samp = -torch.rand(3, 5, generator=g) * 3
    old = samp + torch.randn(3, 5, generator=g) * 0.3
    mask = (torch.rand(3, 5, generator=g) > 0.4).float()
    return samp, old, mask


def sync_mismatch_and_broadcast(bucket_bytes: int) -> dict:
    """At TP=2: the weight sync into a recording loader vs a direct export; the mismatch metric
    reduced over the world; a rollout batch broadcast over the model-parallel group."""
    from megatron.core import parallel_state as ps

    from emapg_megatron.checkpoint.weights import export_hf_weights
    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.rollout.engine import build_rollout_batch, logprob_mismatch
    from emapg_megatron.rollout.vllm_engine import broadcast_rollout_batch
    from emapg_megatron.rollout.weight_sync import sync_weights

    rank = dist.get_rank()
    cfg = ModelConfig(**TINY)
    model = build_for_this_rank(cfg)

    received = []  # the only fake: a loader that records what it is handed

    def load(bucket):
        received.append([(name, t.detach().clone()) for name, t in bucket])

    stats = sync_weights([model], cfg, load, bucket_bytes=bucket_bytes)
    direct = list(export_hf_weights([model], cfg, bucket_bytes=bucket_bytes))

    samp, old, mask = _mismatch_inputs(rank)
    reduced = logprob_mismatch(samp, old, mask, group=dist.group.WORLD)

    n = 2
    prompts = [[1 + rank, 2], [3, 4, 5 + rank]]
    responses = [[10 + rank] * (1 + s + rank) for s in range(len(prompts) * n)]
    logprobs = [[-0.1 * (s + 1 + rank)] * len(r) for s, r in enumerate(responses)]
    mine = build_rollout_batch(prompts, responses, logprobs, 12, 0, n)
    group = ps.get_model_parallel_group()
    agreed = broadcast_rollout_batch(mine, src=dist.get_process_group_ranks(group)[0], group=group)

    return {
        "buckets": [[(name, t.numel() * t.element_size()) for name, t in b] for b in received],
        "received": [(name, t) for b in received for name, t in b],
        "direct": direct,
        "stats": {"bytes": stats.bytes, "tensors": stats.tensors, "buckets": stats.buckets,
                  "seconds": stats.seconds, "load_seconds": stats.load_seconds},
        "mismatch": reduced,
        "mine": [mine.tokens, mine.loss_mask, mine.sampling_logprobs, mine.prompt_lengths],
        "mine_responses": mine.responses,
        "agreed": [agreed.tokens, agreed.loss_mask, agreed.sampling_logprobs, agreed.prompt_lengths],
        "agreed_responses": agreed.responses,
    }


# --- GPU only (vLLM): never run on the CPU machines --------------------------------------
def write_tiny_hf_dir(path) -> str:
    """A tiny Qwen2 HF directory: config.json and a byte-level BPE tokenizer (no weights: the
    engine loads dummy weights and syncs from the Megatron model)."""
    import json
    import os

    from tiny_hf import SAMPLES, byte_level_bpe
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(SAMPLES, "corpus.jsonl")) as f:
        tok = byte_level_bpe([json.loads(line)["contents"] for line in f], 400, ["<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(path)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "hidden_act": "silu", "use_sliding_window": False, "torch_dtype": "bfloat16",
              "bos_token_id": 0, "eos_token_id": 1}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def _processed_logprobs_at(logits, ids, temperature, top_p, vocab):
    """log pi_sampling(ids): temperature, then the top-p set renormalised (as vLLM samples)."""
    logits = logits.float().clone()
    logits[..., vocab:] = float("-inf")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
    sorted_lp = sorted_lp.masked_fill(before >= top_p, float("-inf"))
    logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp).log_softmax(-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def vllm_round_trip(hf_dir: str) -> dict:
    """Megatron model (BF16) -> weight sync -> vLLM sampling with processed log-probs, compared
    with the Megatron model's own log-probs of the sampled tokens; sleep frees memory."""
    from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
    from emapg_megatron.models.config import PrecisionConfig
    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.rollout.config import VLLMConfig
    from emapg_megatron.rollout.engine import logprob_mismatch
    from emapg_megatron.rollout.vllm_engine import VLLMEngine
    from emapg_megatron.trainer import shifted
    from emapg_megatron.training.schedule import positions_for

    cfg, _ = model_config_from_hf(read_hf_config(hf_dir), make_vocab_size_divisible_by=64)
    model = build_for_this_rank(cfg, PrecisionConfig(bf16=True)).cuda()
    engine = VLLMEngine(VLLMConfig(hf_dir, gpu_memory_utilization=0.3, enforce_eager=True,
                                   bucket_bytes=1 << 16), cfg, seq_length=64, pad_id=0,
                        model_chunks=[model], trainer_tp=1)
    temperature, top_p = 0.7, 0.9
    prompts = [[5, 6, 7, 8], [9, 10]]
    with engine.awake():
        free_awake = torch.cuda.mem_get_info()[0]
        batch = engine.generate(prompts, 3, temperature, top_p, 16, rng_step=1)
    free_asleep = torch.cuda.mem_get_info()[0]
    again = engine.generate(prompts, 3, temperature, top_p, 16, rng_step=1)

    tokens = batch.tokens.cuda()
    with torch.no_grad():
        logits = model(tokens, positions_for(tokens), None)
    old = torch.zeros_like(batch.sampling_logprobs)
    old[:, :-1] = _processed_logprobs_at(logits[:, :-1], tokens[:, 1:], temperature, top_p,
                                         cfg.vocab_size).cpu()

    stats = engine.last_sync
    # token-aligned -> label-aligned, as the trainer's batch (trainer.training_batch)
    return {"mismatch": logprob_mismatch(shifted(batch.sampling_logprobs), old, shifted(batch.loss_mask)),
            "same_samples": bool(torch.equal(batch.tokens, again.tokens)),
            "freed_bytes": free_asleep - free_awake, "sync": stats.metrics(),
            "sync_buckets": stats.buckets, "response_tokens": float(batch.loss_mask.sum())}
