"""Text generation for ``evaluate --load`` with the built-in Megatron sampler (CPU or GPU).

The fallback when vLLM or a GPU is missing: one process, TP=PP=1, weights and tokenizer from
a Hugging Face directory (``emapg-convert mcore-to-hf`` turns a training checkpoint into one).
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer

from emapg_megatron import runtime
from emapg_megatron.checkpoint import load_hf_weights
from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.gpt import build_for_this_rank
from emapg_megatron.multiprocess import free_port
from emapg_megatron.rollout.config import SamplerConfig
from emapg_megatron.rollout.megatron_sampler import MegatronSampler
from emapg_megatron.tasks.base import encode_text


class MegatronGenerationBackend:
    """``backend(prompts, n, stop=..., max_new_tokens=...) -> n texts per prompt``."""

    def __init__(self, model_chunks, tokenizer, model_cfg, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int):
        if not (temperature >= 0 and 0 < top_p <= 1 and max_new_tokens >= 1):
            raise ConfigError(f"need --temperature >= 0 (0: greedy), 0 < --top-p <= 1 and "
                              f"--max-new-tokens >= 1 (got {temperature}, {top_p}, {max_new_tokens})")
        self.model_chunks, self.tokenizer, self.seed = model_chunks, tokenizer, seed
        self.vocab_size, self.max_positions = model_cfg.vocab_size, model_cfg.max_position_embeddings
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.calls = 0

    def _sampler(self, seq_length: int, micro_batch_size: int) -> MegatronSampler:
        """The built-in sampler with its defaults (the KV cache in lockstep), its cache and buffers
        sized to one call's longest sequence."""
        return MegatronSampler(self.model_chunks, SamplerConfig().resolved(partial_rollouts=False),
                               vocab_size=self.vocab_size, eos_id=self.tokenizer.eos_token_id,
                               pad_id=self.tokenizer.pad_token_id or 0, seq_length=seq_length,
                               micro_batch_size=micro_batch_size, seed=self.seed, tokenizer=self.tokenizer)

    def __call__(self, prompts: list[str], n: int, *, stop=None, max_new_tokens: int | None = None,
                 **_ignored) -> list[list[str]]:
        budget = max_new_tokens or self.max_new_tokens
        if not prompts:
            return []
        ids = [encode_text(self.tokenizer, p) for p in prompts]
        longest = max(len(i) for i in ids) + budget
        if longest > self.max_positions:
            raise ConfigError(f"prompt + {budget} new tokens = {longest} exceeds the model's "
                              f"{self.max_positions} positions")
        batch = self._sampler(longest, len(ids) * n).generate(ids, n, self.temperature, self.top_p, budget,
                                                             stop=stop, rng_step=self.calls)
        self.calls += 1
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in batch.responses]
        return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


def load_megatron_backend(hf_dir: str, *, temperature: float = 1.0, top_p: float = 1.0,
                          max_new_tokens: int = 512, seed: int = 0, **_ignored):
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConfigError(f"--load {hf_dir}: not a Hugging Face directory (no config.json); "
                          f"convert a training checkpoint with `emapg-convert mcore-to-hf` first")
    cfg, _ = model_config_from_hf(read_hf_config(hf_dir), make_vocab_size_divisible_by=1)
    for key, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    runtime.quiet_expected_warnings()
    runtime.initialize(runtime.ParallelConfig(), seed)
    model = build_for_this_rank(cfg)
    load_hf_weights([model], cfg, hf_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    return MegatronGenerationBackend([model], tokenizer, cfg, temperature=temperature, top_p=top_p,
                                     max_new_tokens=max_new_tokens, seed=seed)


def _free_port() -> int:
    return free_port()
