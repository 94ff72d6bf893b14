"""The built-in sampler: autoregressive generation on the Megatron model itself.

It recomputes the full (right-padded) sequence at every decoding step instead of keeping a
KV cache: simple, exact, and TP/PP-aware because every step is one forward-only pipeline
schedule. Meant for CPU runs, tests and small GPU runs; vLLM is the engine at scale.

Randomness is one uniform number per (sequence, token), drawn from a generator keyed by
(seed, step, turn) and indexed by the sequence's place in the *global* batch, so the same
global batch samples the same tokens at any TP/PP/DP layout: the basis of the
layout-equivalence tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from emapg_megatron import runtime
from emapg_megatron.rollout.engine import RolloutBatch, build_rollout_batch, warn_if_truncated_sampling
from emapg_megatron.rollout.episodes import Turn, run_episodes
from emapg_megatron.training.schedule import forward_only, split_microbatches


def sample_from_logits(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float,
                       top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of ``[S, V]`` logits; returns (ids, log-prob under the sampler)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass strictly before each token
        sorted_lp = sorted_lp.masked_fill(before >= top_p, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
        logp = torch.log_softmax(logp, dim=-1)
    cdf = logp.exp().cumsum(-1)
    ids = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    ids = ids.clamp_max(logits.shape[-1] - 1)
    return ids, logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


class MegatronSampler:
    def __init__(self, model_chunks, *, vocab_size: int, eos_id: int | None, pad_id: int,
                 seq_length: int, micro_batch_size: int, seed: int, tokenizer=None):
        self.model_chunks = model_chunks
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.tokenizer = tokenizer  # decodes turns for stop strings and environments

    def update_weights(self, model_chunks) -> None:
        self.model_chunks = model_chunks  # same live model: nothing to copy

    def metrics(self) -> dict:
        return {}

    def _next_token_logits(self, tokens: torch.Tensor, lengths: torch.Tensor):
        """Full-vocabulary logits at each sequence's last position (last PP stage only)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        def pick(logits_shard, mb):
            rows = torch.arange(logits_shard.shape[0], device=logits_shard.device)
            last = logits_shard[rows, mb["lengths"] - 1]
            return {"logits": gather_from_tensor_model_parallel_region(last)}

        device = runtime.device()
        mbs = split_microbatches({"tokens": tokens.to(device), "lengths": lengths.to(device)},
                                 min(self.micro_batch_size, tokens.shape[0]))
        outs = forward_only(self.model_chunks, mbs, pick)
        return torch.cat([o["logits"] for o in outs]) if outs else None

    def _broadcast_from_last_stage(self, *tensors):
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return tensors
        src = ps.get_pipeline_model_parallel_last_rank()
        for t in tensors:
            dist.broadcast(t, src=src, group=ps.get_pipeline_model_parallel_group())
        return tensors

    def _uniforms(self, rng_step: int, turn: int, rows: list[int], width: int) -> torch.Tensor:
        """One uniform per (sequence, token), keyed by global sequence index: layout-independent.

        Drawn on the host generator (the same numbers on any device), then placed on the device.
        """
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + rng_step) * 1009 + turn)
        total = max(rows) + 1
        return torch.rand(total, width, generator=g)[torch.as_tensor(rows)].to(runtime.device())

    def _decode(self, histories, budgets: list[int], uniforms: torch.Tensor, temperature: float,
                top_p: float, stop: Sequence[str] | None) -> list[Turn]:
        """Continue each history by up to its budget; stop at eos or a stop string (kept)."""
        S = len(histories)
        tokens = torch.full((S, self.seq_length), self.pad_id, dtype=torch.long)
        lengths = torch.tensor([len(h) for h in histories], dtype=torch.long)
        if int((lengths + torch.tensor(budgets)).max()) > self.seq_length:
            raise ValueError(f"prompt + new tokens exceed --seq-length {self.seq_length}")
        for s, h in enumerate(histories):
            tokens[s, :len(h)] = torch.as_tensor(h)
        turns = [Turn([], [], "") for _ in range(S)]
        done = torch.tensor([b <= 0 for b in budgets])
        device = runtime.device()
        for t in range(max(budgets, default=0)):
            if bool(done.all()):
                break
            ids = torch.zeros(S, dtype=torch.long, device=device)
            lp = torch.zeros(S, device=device)
            logits = self._next_token_logits(tokens, lengths)
            if logits is not None:  # only the real vocabulary, never Megatron's padding ids
                ids, lp = sample_from_logits(logits[:, :self.vocab_size], uniforms[:, t],
                                             temperature, top_p)
            self._broadcast_from_last_stage(ids, lp)
            ids, lp = ids.cpu(), lp.cpu()  # the bookkeeping below is per sequence, on the host
            for s in torch.nonzero(~done).flatten().tolist():
                turn = turns[s]
                turn.token_ids.append(int(ids[s]))
                turn.logprobs.append(float(lp[s]))
                tokens[s, lengths[s]] = ids[s]
                lengths[s] += 1
                done[s] = self._finished(turn, budgets[s], stop)
        for turn in turns:
            turn.text = self.tokenizer.decode(turn.token_ids) if self.tokenizer else ""
        return turns

    def _finished(self, turn: Turn, budget: int, stop) -> bool:
        if self.eos_id is not None and turn.token_ids[-1] == self.eos_id:
            turn.finish_reason = "stop"
            return True
        if stop and self.tokenizer is not None:
            text = self.tokenizer.decode(turn.token_ids)
            if any(text.endswith(s) for s in stop):
                turn.finish_reason = "stop"
                return True
        if len(turn.token_ids) >= budget:
            turn.finish_reason = "length"
            return True
        return False

    def generate(self, prompts, n: int, temperature: float, top_p: float, max_new_tokens: int,
                 *, stop: Sequence[str] | None = None, rng_step: int = 0,
                 seq_index: Sequence[int] | None = None) -> RolloutBatch:
        """``seq_index``: each sequence's index in the global batch (keys its randomness)."""
        warn_if_truncated_sampling(top_p)
        S = len(prompts) * n
        histories = [prompts[s // n] for s in range(S)]
        rows = list(seq_index) if seq_index is not None else list(range(S))
        uniforms = self._uniforms(rng_step, 0, rows, max_new_tokens)
        turns = self._decode(histories, [max_new_tokens] * S, uniforms, temperature, top_p, stop)
        return build_rollout_batch(prompts, [t.token_ids for t in turns], [t.logprobs for t in turns],
                                   self.seq_length, self.pad_id, n)

    def generate_episodes(self, prompts, n: int, envs, *, tokenizer, temperature: float, top_p: float,
                          max_new_tokens: int, stop: Sequence[str] | None = None, rng_step: int = 0,
                          seq_index: Sequence[int] | None = None):
        """Multi-turn rollouts (see :func:`emapg_megatron.rollout.episodes.run_episodes`)."""

        def continue_fn(histories, budgets, active, turn):
            index = seq_index if seq_index is not None else range(len(envs))
            uniforms = self._uniforms(rng_step, turn, [index[s] for s in active],
                                      max(budgets, default=1))
            return self._decode(histories, budgets, uniforms, temperature, top_p, stop)

        return run_episodes(continue_fn, prompts, n, envs, tokenizer=tokenizer, top_p=top_p,
                            max_new_tokens=max_new_tokens, seq_length=self.seq_length,
                            pad_id=self.pad_id)
