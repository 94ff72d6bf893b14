"""Configs of rollout collection (partial rollouts) and of the engines: the built-in Megatron
sampler and vLLM."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from emapg_megatron.configurable import above, at_least, between, check_fields, option
from emapg_megatron.errors import ConfigError
from emapg_megatron.lora.config import LoRAConfig

ENGINES = ("megatron", "vllm")
MAX_FORWARD_TOKENS = 16384
"""Tokens (rows x width) above which a cached forward runs in micro-batches of rows: the default
of --inference-batch-times-seqlen-threshold."""
DEFAULT_BUCKET_MB = 512
VLLM_MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM (0.10.2 on; later ones add 1) accepts as ``max_lora_rank``."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(f"--lora-rank {rank} is above vLLM's largest max_lora_rank "
                      f"({VLLM_MAX_LORA_RANKS[-1]}): use the built-in sampler or a lower rank")


@dataclass
class SamplerConfig:
    """Which engine samples the rollouts, and the built-in sampler's KV cache."""

    engine: str = option("megatron", flag="--rollout-engine", choices=ENGINES)
    """Built-in Megatron sampler (CPU and GPU) or vLLM (GPU)."""
    kv_cache: bool = option(True, flag="--rollout-kv-cache", negatable=True)
    """Built-in sampler: decode through Megatron-Core's KV cache, feeding only new tokens (finished
    sequences leave the batch); --no-rollout-kv-cache recomputes the whole sequence per token (the
    reference; also what sequence parallelism falls back to)."""
    max_requests: int | None = option(None, flag="--inference-max-requests", range=at_least(1))
    """Built-in sampler with the KV cache: at most this many sequences share one cache
    (Megatron-LM's flag); the rest of a rank's sequences follow in later waves. Megatron's static
    cache is allocated whole, every position up to --seq-length, so this bounds its memory.
    Default: as many as fit in 80% of the free GPU memory (all on CPU)."""
    max_forward_tokens: int = option(MAX_FORWARD_TOKENS, flag="--inference-batch-times-seqlen-threshold",
                                     range=at_least(1, also=(-1,)))
    """Built-in sampler with the KV cache: a forward of more rows x tokens than this (a long prefill
    of many sequences) runs in micro-batches of rows through Megatron's KV cache, bounding its
    activation memory (Megatron-LM's flag; here at any PP size, and on by default, where
    Megatron-LM's default -1 is off); -1: never split."""

    fixed_shape: bool | None = option(None, flag="--inference-fixed-shape-decode", negatable=True)
    """Built-in sampler with the KV cache: decode with a fixed-shape step (a static cache of
    --inference-max-requests slots x --seq-length per layer, each slot at its own length, attention
    under a length mask, every waiting prefill in one forward, sampling on the device) instead of
    Megatron-Core's static context; the same samples. Default: on with --partial-rollouts (it
    prefills a carried sequence in one forward), else off. On a GPU it replays CUDA graphs: 8x the
    default path's tokens/s on an H100 (local spec; it has not yet run on the TE spec there)."""
    cuda_graphs: bool | None = option(None, flag="--inference-cuda-graphs", negatable=True)
    """With the fixed-shape decode step on a GPU at pipeline size 1: capture the step once per
    batch-size bucket as a CUDA graph and replay it (prefills stay eager). Default: on there
    (on an H100, 6.3x the eager step's tokens/s at the Qwen2.5-0.5B shape; BENCHMARKS.md)."""
    continuous_batching: bool = option(True, flag="--inference-continuous-batching", negatable=True)
    """With the fixed-shape decode step: a slot whose sequence finishes takes the next waiting
    sequence at once (continuous batching); --no-inference-continuous-batching refills the slots
    only when all are free (waves). The same samples either way."""

    @property
    def forward_token_limit(self) -> int | None:
        """Rows x tokens of one cached forward before it is split; None: never split."""
        return None if self.max_forward_tokens == -1 else self.max_forward_tokens

    @property
    def schedule(self) -> str:
        """The fixed-shape step's slot schedule: "continuous" or "waves"."""
        return "continuous" if self.continuous_batching else "waves"

    def resolved(self, partial_rollouts: bool) -> SamplerConfig:
        """This config with its defaults decided: the fixed-shape step on exactly with partial
        rollouts unless given (its slots prefill a carried sequence in one forward, where the
        lockstep context re-feeds it a token per forward: docs/partial_rollouts.md); its CUDA
        graphs left to the machine unless given (None: wherever the step runs on a GPU at PP=1)."""
        fixed = partial_rollouts if self.fixed_shape is None else self.fixed_shape
        return replace(self, fixed_shape=fixed)

    def validate(self) -> None:
        check_fields(self)


@dataclass
class PartialRolloutConfig:
    """Partial rollouts: carry unfinished sequences into the next step (docs/partial_rollouts.md)."""

    enabled: bool = option(False, flag="--partial-rollouts", aliases=("--rl-partial-rollouts",),
                           trajectory=True)
    """Partial rollouts (docs/partial_rollouts.md): keep --partial-rollout-oversample x
    --rollout-batch-size prompt groups in flight and stop generating as soon as
    --rollout-batch-size groups have every sample finished; the unfinished sequences keep their
    tokens, behaviour log-probs and policy versions and continue first in the next step under the
    new weights (prefilled again in one forward by the fixed-shape decode step, which this turns on
    by default). Groups are never split. Built-in KV-cached sampler only."""
    oversample: float = option(3.0, flag="--partial-rollout-oversample", range=at_least(1), trajectory=True)
    """--partial-rollouts: prompt groups in flight per step, as a multiple of --rollout-batch-size
    (rounded up); the carried groups come first, then fresh prompts. More keeps more rows decoding
    (and more sequences go stale): 3 trained more tokens per forward than 2 at 32 and at 256 new
    tokens (BENCHMARKS.md, "Partial rollouts")."""
    max_staleness: int = option(1, range=at_least(0), trajectory=True)
    """--partial-rollouts: a carried sequence holding a token more than K policy versions older than
    the policy it would be trained at is dropped (counted in partial/dropped_stale) and restarts
    from its prompt; 0 restarts every carried sequence."""

    def pool_size(self, batch_size: int) -> int:
        """Prompt groups in flight per step (at least ``batch_size``, the step's prompts)."""
        return math.ceil(batch_size * self.oversample)

    def validate(self) -> None:
        check_fields(self)


@dataclass
class VLLMConfig:
    """vLLM colocated with the trainer (--rollout-engine vllm)."""

    hf_dir: str = ""
    """Tokenizer and config.json; the weights come from the trainer (the run's --load-hf)."""
    tensor_parallel_size: int | None = option(None, flag="--vllm-tensor-parallel-size", range=at_least(1))
    """vLLM's TP degree (default: the trainer's); it divides the trainer's."""
    gpu_memory_utilization: float = option(0.5, flag="--vllm-gpu-memory-utilization",
                                           range=between(0, 1, low_open=True))
    """Fraction of the whole GPU (weights + KV cache) vLLM may use while awake."""
    sleep_level: int = option(2, flag="--vllm-sleep-level", choices=(0, 1, 2))
    """vLLM sleep mode during training: 0 never sleeps; 1 copies its weights to CPU and frees the
    KV cache; 2 frees both (the default: every step overwrites the weights anyway)."""
    weight_sync_bucket_mb: float = option(DEFAULT_BUCKET_MB, flag="--vllm-weight-sync-bucket-mb",
                                          range=above(0))
    """Weight-sync bucket size (MiB)."""
    enforce_eager: bool = option(False, flag="--vllm-enforce-eager")
    """Skip CUDA-graph capture in vLLM (faster start, slower decode)."""
    dtype: str = "bfloat16"
    """vLLM's weight dtype (the sync loads BF16 tensors as they are)."""
    enable_prefix_caching: bool = True
    """The n samples of a prompt share its prefill."""
    seed: int = 1234
    """Sampling seed (the run's --seed)."""
    per_request_seed: bool = True
    """Seed each request from its global sequence index: samples independent of the DP layout."""
    llm_kwargs: dict = field(default_factory=dict)
    """Anything else for vllm.LLM."""
    lora: LoRAConfig | None = None
    """The run's LoRA (--lora-rank > 0): vLLM serves the adapters through its LoRA requests on
    the frozen base (docs/lora.md, "Rollouts through vLLM")."""
    return_routes: bool = False
    """Ask vLLM for the experts it routed every token to (``enable_return_routed_experts``): set
    by the engine when it records a MoE policy's routes (R3; docs/moe.md, "Routing replay")."""

    @property
    def bucket_bytes(self) -> int:
        return int(self.weight_sync_bucket_mb * 2**20)

    def for_trainer(self, trainer_tp: int | None) -> VLLMConfig:
        """This config with the TP degree resolved (unset: the trainer's)."""
        return replace(self, tensor_parallel_size=self.tensor_parallel_size or trainer_tp or 1)

    def validate(self, trainer_tp: int | None = None) -> None:
        if not os.path.isfile(os.path.join(self.hf_dir, "config.json")):
            raise ConfigError(f"vLLM needs a Hugging Face model directory with config.json and the "
                              f"tokenizer: {self.hf_dir}")
        self.check_settings(trainer_tp)

    def check_settings(self, trainer_tp: int | None = None) -> None:
        """Everything but the model directory; the CLI runs this before any work starts."""
        if self.sleep_level not in (0, 1, 2):
            raise ConfigError(f"vLLM sleep level must be 0, 1 or 2 (got {self.sleep_level})")
        check_fields(self)
        refused = sorted({"quantization", "kv_cache_dtype"} & set(self.llm_kwargs))
        if refused:
            # The sync loads the trainer's BF16 tensors as they are: quantized vLLM weights would
            # need re-quantizing after every load.
            raise ConfigError(f"vLLM llm_kwargs {refused} are not supported by the weight sync")
        if self.lora is not None and self.lora.enabled:
            vllm_max_lora_rank(self.lora.rank)
        tp = self.tensor_parallel_size or trainer_tp or 1
        if trainer_tp is not None and trainer_tp % tp != 0:
            # A vLLM TP group must not straddle two data-parallel ranks (different prompts).
            raise ConfigError(f"--vllm-tensor-parallel-size {tp} must divide "
                              f"--tensor-model-parallel-size {trainer_tp}")

    def llm_kwargs_for(self, max_model_len: int) -> dict:
        return {
            "model": self.hf_dir,
            "tokenizer": self.hf_dir,
            "dtype": self.dtype,
            "seed": self.seed,
            "tensor_parallel_size": self.tensor_parallel_size or 1,
            "distributed_executor_backend": "external_launcher",
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_model_len": max_model_len,
            "enable_sleep_mode": self.sleep_level > 0,
            "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching,
            "load_format": "dummy",
            "logprobs_mode": "processed_logprobs",
            **({"enable_return_routed_experts": True} if self.return_routes else {}),
            **self.lora_kwargs(),
            **self.llm_kwargs,
        }

    def lora_kwargs(self) -> dict:
        """vLLM's LoRA engine arguments for the run's adapters (none without LoRA): one adapter
        at a time, its rank rounded up to one vLLM accepts."""
        if self.lora is None or not self.lora.enabled:
            return {}
        return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(self.lora.rank), "max_loras": 1}
