"""Check a Megatron checkpoint against its HF source: same tokens, compare the logits.

The HF side runs ``transformers`` in fp32 on the CPU in this process; the Megatron side runs on
TP x PP ranks forked on CPU (fp32, local spec) and loads the checkpoint with resharding.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from transformers import AutoModelForCausalLM

from emapg_megatron import runtime
from emapg_megatron.checkpoint.convert import checkpoint_model_config, load_mcore, training_step_dir
from emapg_megatron.checkpoint.hf_config import check_same_architecture, read_hf_config
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.gpt import build_for_this_rank
from emapg_megatron.multiprocess import run_distributed


def megatron_logits(model_chunks, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full (padded) vocabulary logits ``[b, s, V_pad]`` on the last PP stage, None elsewhere.

    Runs Megatron's pipeline schedule (forward only), so it works at any PP; vocab-parallel
    logits are gathered over TP.
    """
    tokens = tokens.to(runtime.device())
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).expand(b, s)

    def step(data_iterator, model):
        # No loss function: the schedule returns the last stage's output (the logits).
        return model(next(data_iterator), positions, None), None

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([tokens]), model=model_chunks,
            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(out[0])


def _verify_rank(ckpt_dir: str, tokens: torch.Tensor) -> dict:
    cfg = checkpoint_model_config(ckpt_dir)
    model = build_for_this_rank(cfg)
    load_mcore([model], ckpt_dir)
    model.eval()  # Megatron's MoE layer refuses TP > 1 without sequence parallelism in training mode
    logits = megatron_logits([model], tokens)
    if logits is None or ps.get_tensor_model_parallel_rank() != 0:
        return {}
    return {"logits": logits[..., : cfg.vocab_size].float().cpu()}


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    per_token = F.cosine_similarity(ours, ref, dim=-1)
    return {
        "max_abs_logit_diff": (ours - ref).abs().max().item(),
        "cosine_similarity": F.cosine_similarity(ours.flatten(), ref.flatten(), dim=0).item(),
        "min_token_cosine_similarity": per_token.min().item(),
        "top1_agreement": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


#: The most bytes the compared logits (fp32, each side) may take: the check needs a few tokens.
MAX_LOGITS_BYTES = 1 << 30


def check_tokens(batch: int, seq_len: int, cfg) -> None:
    """``batch`` x ``seq_len`` random tokens fit the model's positions and the logits bound."""
    if seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's {cfg.max_position_embeddings} positions")
    nbytes = batch * seq_len * cfg.padded_vocab_size(1) * 4
    if nbytes > MAX_LOGITS_BYTES:
        raise ConfigError(f"--batch {batch} x --seq-len {seq_len} tokens need {nbytes / 2**30:.1f} GiB of "
                          f"logits per side, more than the {MAX_LOGITS_BYTES >> 30} GiB allowed: the check "
                          "needs a few tokens (the defaults are 2 x 32)")


def verify(hf_dir: str | Path, ckpt_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
           batch: int = 2, seq_len: int = 32, seed: int = 0, device: str = "cpu",
           timeout: float = 1800.0) -> dict:
    """Logit agreement between the HF model and the Megatron checkpoint loaded at TP x PP (x EP
    for a mixture of experts: TP x PP x EP ranks, the EP ranks each running the same tokens).
    ``ckpt_dir``: a checkpoint, or a trainer's ``--save`` directory (its latest step)."""
    ckpt_dir = training_step_dir(ckpt_dir)
    cfg = checkpoint_model_config(ckpt_dir)
    cfg.validate(tp, pp, ep)
    check_tokens(batch, seq_len, cfg)
    check_same_architecture(read_hf_config(hf_dir), cfg, "--hf-dir")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    results = run_distributed(_verify_rank, tp * pp * ep, tp=tp, pp=pp, ep=ep,
                              args=(str(ckpt_dir), tokens), device=device, timeout=timeout)
    ours = next(r["logits"] for r in results if r)
    layout = {"tp": tp, "pp": pp, **({"ep": ep} if cfg.is_moe else {})}
    return {**compare_logits(ours, hf_logits(hf_dir, tokens)), **layout, "tokens": batch * seq_len}
