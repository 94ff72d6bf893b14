"""Primitives over logits sharded along the vocabulary (Megatron's ``parallel_output=True`` layout).

Each rank of the tensor-parallel group holds ``[..., V/TP]`` logits: rank ``r`` owns the global ids
``[r V/TP, (r + 1) V/TP)``. Megatron pads the vocabulary to a multiple of ``divisible_by x TP``;
ids ``>= vocab_size`` (the true size) are padding. Everything here treats padding as zero
probability: padding columns are sliced off before any maths (they are never normalised over,
never selected by top-k, and get zero gradient), which is the single-device library
(:mod:`emapg_megatron.kl`) applied to the gathered logits ``[..., :vocab_size]``.

The group is always passed explicitly (``None`` means the shard is the whole vocabulary, TP = 1).
Work is chunked over tokens; a chunk is cast to the compute dtype (fp32, or fp64 for fp64 logits)
on its own, so no fp32 copy of the whole shard is ever made.

One collective per pass (so at most one per chunk): each rank packs, for every token, its local
(max, sum-exp[, sum-exp x logit]) and its picked logits (zero where it does not own the id) into
one buffer, chunk by chunk, and all-gathers it once; every rank then combines the per-rank partials
online (``lse_M = log sum_r s_r exp(m_r - M)`` relative to the global max ``M``, picked logits summed
over ranks, since exactly one rank owns each id). Top-k packs its per-rank candidates (values and
global ids, bit-cast into the same float buffer) into that one collective as well. The buffer is
O(TP (k + 3)) per token.

Offset invariance: adding c to every logit changes no probability, and nothing here loses accuracy
with c. Every output is formed from quantities relative to ``M`` (``log p = (z - M) - lse_M``, the
entropy from ``m_r - M``, backward's ``p = exp((z - M) - lse_M)``); the absolute ``M + lse_M`` is
only ever returned (``vocab_parallel_logsumexp``), never subtracted, since in fp32 its rounding
(~5e-4 at 1e4) would land in every log-prob.

No RL here; the differentiable fused op lives in :mod:`.policy_terms`.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

__all__ = [
    "VocabShard",
    "vocab_shard",
    "vocab_parallel_logsumexp",
    "vocab_parallel_topk",
    "vocab_parallel_logprobs_at",
]

Rows = Union[slice, torch.Tensor]

# Chunk budgets (elements of the [rows, V/TP] fp32 work buffer): cache-sized on CPU, where every
# extra pass over RAM costs; large on GPU, where kernel launches cost.
_CHUNK_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 26}


class VocabShard(NamedTuple):
    """Where this rank's columns sit in the global vocabulary."""

    tp: int  # group size
    rank: int  # rank in the group
    start: int  # global id of local column 0
    width: int  # local columns, padding included (V_padded / TP)
    n_real: int  # local columns below vocab_size (the rest is padding)
    vocab_size: int  # true vocabulary size

    @property
    def padded_vocab_size(self) -> int:
        return self.width * self.tp


def vocab_shard(logits_shard: torch.Tensor, group, vocab_size: Optional[int] = None) -> VocabShard:
    """This rank's :class:`VocabShard`. ``vocab_size=None`` means no padding."""
    if not logits_shard.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits_shard.dtype}")
    if logits_shard.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension")
    return shard_of(logits_shard.shape[-1], group, vocab_size)


def shard_of(width: int, group, vocab_size: Optional[int] = None) -> VocabShard:
    """The :class:`VocabShard` of ``width`` local columns (an output weight's rows) on this rank."""
    if group is None:
        tp, rank = 1, 0
    else:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = width * tp
    vocab_size = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size {vocab_size} must be in [1, {padded}] (= {width} local columns x TP {tp})"
        )
    start = rank * width
    n_real = min(max(vocab_size - start, 0), width)
    return VocabShard(tp, rank, start, width, n_real, vocab_size)


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def chunk_rows(chunk_size: Optional[int], width: int, device: torch.device) -> int:
    """Tokens per chunk: ``chunk_size`` or, for ``None``, a device-dependent element budget."""
    if chunk_size is None:
        budget = _CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
        return max(1, budget // max(1, width))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def iter_chunks(n_sel: int, rows_per_chunk: int, index: Optional[torch.Tensor]) -> Iterator[Tuple[slice, Rows]]:
    """``(sel, rows)`` per chunk: ``sel`` slices the selected-row space, ``rows`` selects the same
    rows of the logits (a slice: a view, no copy; an index tensor when some rows are skipped)."""
    for c0 in range(0, n_sel, rows_per_chunk):
        sel = slice(c0, min(c0 + rows_per_chunk, n_sel))
        yield sel, (sel if index is None else index[sel])


def take_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows]


def put_rows(dst: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    if isinstance(rows, slice):
        dst[rows].copy_(src)
    else:
        dst.index_copy_(0, rows, src.to(dst.dtype))


def owned_columns(ids: torch.Tensor, sh: VocabShard) -> Tuple[torch.Tensor, torch.Tensor]:
    """Local column of each global id (0 where not owned) and whether this rank owns it.

    Padding ids are owned by nobody: they carry zero probability.
    """
    lid = ids - sh.start
    owned = (lid >= 0) & (lid < sh.n_real)
    return torch.where(owned, lid, torch.zeros_like(lid)), owned


def floor_log_underflow_(x: torch.Tensor) -> torch.Tensor:
    """Clamp log-space values ``x`` (``z - shift``, compute dtype) in place at ``2 log(tiny)``,
    where ``exp`` is already exactly 0: a -inf (masked) or huge negative logit then gives
    ``exp(x) (a x + b) = 0``, not ``0 * inf = NaN``, for any factor ``|a| < 1e36``. Nothing with
    ``exp(x) > 0`` changes."""
    return x.clamp_(min=2 * math.log(torch.finfo(x.dtype).tiny))


def row_shift(m: torch.Tensor) -> torch.Tensor:
    """The per-row shift used for ``exp``: the local max, or 0 where a row has no finite logit."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


class LocalStats(NamedTuple):
    m: torch.Tensor  # [r] local max (-inf where no real column)
    s: torch.Tensor  # [r] local sum exp(z - shift)
    a: Optional[torch.Tensor]  # [r] local sum exp(z - shift) (z - shift), for the entropy
    e: torch.Tensor  # [r, n_real] exp(z - shift) (the work buffer itself when clobbered)


def local_stats(work: torch.Tensor, *, clobber: bool, entropy: bool) -> LocalStats:
    """Max and sum-exp of ``work`` ([r, n_real], compute dtype) along the last dim.

    ``clobber`` lets the buffer be overwritten with ``exp(work - shift)`` (no extra allocation).
    """
    r = work.shape[0]
    if work.shape[-1] == 0:
        zero = torch.zeros(r, dtype=work.dtype, device=work.device)
        return LocalStats(torch.full_like(zero, -float("inf")), zero, zero if entropy else None, work)
    m = work.amax(dim=-1)
    shift = row_shift(m).unsqueeze(-1)
    x = work.sub_(shift) if clobber else work - shift
    a = None
    if entropy:
        floor_log_underflow_(x)  # -inf logits: e = 0 and e x = 0, not NaN
        e = x.exp()
        a = torch.linalg.vecdot(e, x)
        if clobber:
            e = x.copy_(e)
    else:
        e = x.exp_()
    return LocalStats(m, e.sum(dim=-1), a, e)


def all_gather_rows(buf: torch.Tensor, sh: VocabShard, group) -> torch.Tensor:
    """``[r, W]`` per rank -> ``[TP, r, W]``: the one collective of a pass."""
    if sh.tp == 1 or buf.numel() == 0:  # every rank has the same rows: skipped everywhere
        return buf.unsqueeze(0).expand((sh.tp,) + tuple(buf.shape))
    buf = buf.contiguous()
    out = torch.empty((sh.tp * buf.shape[0],) + tuple(buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, buf, group=group)
    return out.view((sh.tp,) + tuple(buf.shape))


class Combined(NamedTuple):
    """The merged partials, every one relative to ``shift``, the global max: ``lse`` and ``picked - shift``
    are O(log V) however large the logits are, so subtracting them loses nothing (an absolute
    ``lse`` ~ 1e4 carries an fp32 rounding of ~5e-4 into every log-prob)."""

    shift: torch.Tensor  # [r] global max (0 where no finite logit)
    lse: torch.Tensor  # [r] log sum_v exp(z_v - shift)
    picked: torch.Tensor  # [r, n] global logits at the requested ids (0 for padding ids)
    entropy: Optional[torch.Tensor]  # [r]


def combine(stats: torch.Tensor, n_picked: int, entropy: bool) -> Combined:
    """Merge per-rank partials ``[TP, r, W]`` (columns m, s, [a], picked) online."""
    m, s = stats[..., 0], stats[..., 1]
    shift = row_shift(m.amax(dim=0))
    # m_r - M: one rounding of a small number (exact, by Sterbenz, once the logits are large); -inf
    # for a rank without a finite logit, so its s_r = 0 weighs nothing (exp(0 - M) would overflow
    # for M << 0 and give inf x 0).
    rel = m - shift
    lse = (torch.exp(rel) * s).sum(dim=0).log()
    off = 3 if entropy else 2
    picked = stats[..., off:off + n_picked].sum(dim=0)  # one owner per id: the others add 0
    ent = entropy_from_partials(rel, s, stats[..., 2], lse) if entropy else None
    return Combined(shift, lse, picked, ent)


def entropy_from_partials(rel: torch.Tensor, s: torch.Tensor, a: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``H = -sum_v p_v log p_v`` from per-rank ``(m_r - M, s_r, a_r)`` and ``lse`` (relative to M).

    ``log p_v = x_v + (m_r - M) - lse`` with ``x_v = z_v - m_r``, so
    ``H = sum_r exp(m_r - M - lse) [s_r (lse - (m_r - M)) - a_r]``: small numbers only. A rank
    without a real column (s_r = 0), or whose every p underflows (a shard of masked logits at the
    dtype's lowest value: then ``lse - rel`` overflows), adds nothing.
    """
    scale = torch.exp(rel - lse)
    term = scale * (s * (lse - rel) - a)
    return torch.where((s > 0) & (scale > 0), term, torch.zeros_like(term)).sum(dim=0)


def relative_logprobs(values: torch.Tensor, shift: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``log p = (z - M) - lse_M``: ``z`` and ``M`` are exact input values, so ``z - M`` is one
    rounding of a small number, as in Megatron's cross-entropy (``z - (M + lse_M)`` is not)."""
    return (values - shift.unsqueeze(-1)) - lse.unsqueeze(-1)


def probs_scale(local_max: torch.Tensor, shift: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(m_r - M - lse_M)``: the factor from ``exp(z - m_r)`` to ``p`` (0 where ``m_r = -inf``)."""
    return torch.exp((local_max - shift) - lse)


def gather_picked(work: torch.Tensor, lid: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """Local logits at the owned ids, 0 elsewhere (read before ``work`` is clobbered)."""
    if work.shape[-1] == 0 or lid.shape[-1] == 0:
        return torch.zeros(lid.shape, dtype=work.dtype, device=work.device)
    vals = work.gather(-1, lid)
    return torch.where(owned, vals, torch.zeros_like(vals))


class LogitRows:
    """The chunk source of :func:`forward_pass` for a logits shard ``[N, V/TP]``: the real columns of
    the requested rows, in the compute dtype (other sources form the logits on the fly, see
    :mod:`.lmhead_terms`)."""

    def __init__(self, logits2d: torch.Tensor, sh: VocabShard):
        self.real = logits2d[:, : sh.n_real]
        self.cdt = compute_dtype(logits2d)
        self.n_rows = logits2d.shape[0]
        self.device = logits2d.device

    def chunk(self, rows: Rows) -> Tuple[torch.Tensor, bool]:
        """``(work, private)``; ``private``: ``work`` is a copy (a cast or an index copy) the caller
        may overwrite, else a view of the logits."""
        z = take_rows(self.real, rows)
        return z.to(self.cdt), z.dtype != self.cdt or not isinstance(rows, slice)

    def put(self, rows: Rows, values: torch.Tensor) -> None:
        put_rows(self.real, rows, values)


class ForwardResult(NamedTuple):
    """Per selected row: the global max and the log-normaliser relative to it, the log-probs at the
    ids (-inf at padding ids), the entropy, this rank's max (the shift of the stored ``exp(z - shift)``)
    and, when asked, the global top-k (ids and log-probs, by decreasing log-prob)."""

    shift: torch.Tensor  # [R] global max M (0 where no finite logit)
    lse_rel: torch.Tensor  # [R] log sum_v exp(z_v - M)
    logprob: torch.Tensor  # [R, n]
    entropy: Optional[torch.Tensor]  # [R]
    local_max: torch.Tensor  # [R]
    topk_ids: Optional[torch.Tensor] = None  # [R, k] int64
    topk_logprob: Optional[torch.Tensor] = None  # [R, k]

    @property
    def lse(self) -> torch.Tensor:
        """The absolute log-normaliser (its rounding grows with the logits: not for differences)."""
        return self.shift + self.lse_rel


def _id_dtype(cdt: torch.dtype) -> torch.dtype:
    """Integers as wide as the compute dtype: candidate ids ride the float buffer bit-cast."""
    return torch.int64 if cdt == torch.float64 else torch.int32


def merge_topk(vals: torch.Tensor, ids: torch.Tensor, k: int, comb: Combined) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global top-k from per-rank candidates ``[TP, R, kc]`` (raw logits, global ids, -1 for a
    filler): fillers rank below every real logit, real -inf logits included."""
    n_rows = vals.shape[1]
    all_v = vals.permute(1, 0, 2).reshape(n_rows, -1)
    all_i = ids.permute(1, 0, 2).reshape(n_rows, -1)
    key = torch.where(all_i >= 0, all_v.clamp(min=torch.finfo(all_v.dtype).min), torch.full_like(all_v, -float("inf")))
    top = key.topk(k, dim=-1).indices
    return all_i.gather(-1, top).long(), relative_logprobs(all_v.gather(-1, top), comb.shift, comb.lse)


def forward_pass(
    source,
    ids2d: Optional[torch.Tensor],
    sh: VocabShard,
    group,
    *,
    rows_per_chunk: int,
    row_index: Optional[torch.Tensor] = None,
    entropy: bool = False,
    write_exp: bool = False,
    topk: int = 0,
) -> ForwardResult:
    """Log-normaliser, log-probs at ``ids2d`` ([R, n] global ids of the selected rows), entropy and
    top-``topk``, from ``source`` (:class:`LogitRows`, or any object with its ``chunk`` / ``n_rows``
    / ``cdt`` / ``device``).

    The rows (all, or ``row_index``) are processed chunk by chunk in the compute dtype; the per-rank
    partials of every chunk (and the top-k candidates: values and global ids) go into one packed
    buffer and out in ONE all-gather for the whole pass. ``write_exp`` (logits sources only)
    overwrites the real columns of the selected rows with ``exp(z - local_max)`` in the logits'
    dtype: the probabilities up to the per-row factor ``exp(local_max - lse)``.
    """
    cdt = source.cdt
    n_sel = source.n_rows if row_index is None else row_index.numel()
    n = 0 if ids2d is None else ids2d.shape[-1]
    off = 3 if entropy else 2
    kc = min(topk, sh.width)  # candidates per rank (the same on every rank)
    kl = min(kc, sh.n_real)  # of which real
    buf = torch.empty(n_sel, off + n + 2 * kc, dtype=cdt, device=source.device)
    cand_v, cand_i = buf[:, off + n:off + n + kc], buf[:, off + n + kc:].view(_id_dtype(cdt))
    cand_v.fill_(-float("inf"))
    cand_i.fill_(-1)
    lid = owned = None
    if n:
        lid, owned = owned_columns(ids2d, sh)
    for sel, rows in iter_chunks(n_sel, rows_per_chunk, row_index):
        # Work in place only where the buffer is ours (a copy) or may be clobbered.
        work, private = source.chunk(rows)
        if n:
            buf[sel, off:off + n] = gather_picked(work, lid[sel], owned[sel])
        if kl > 0:
            vals, idx = work.topk(kl, dim=-1)
            cand_v[sel, :kl] = vals
            cand_i[sel, :kl].copy_(idx + sh.start)
        st = local_stats(work, clobber=private or write_exp, entropy=entropy)
        buf[sel, 0], buf[sel, 1] = st.m, st.s
        if entropy:
            buf[sel, 2] = st.a
        if write_exp and private and sh.n_real > 0:
            source.put(rows, st.e)
    stats = all_gather_rows(buf, sh, group)
    comb = combine(stats, n, entropy)
    lp = relative_logprobs(comb.picked, comb.shift, comb.lse)
    if n:
        lp = torch.where(ids2d >= sh.vocab_size, torch.full_like(lp, -float("inf")), lp)
    top_ids = top_lp = None
    if topk:
        top_ids, top_lp = merge_topk(stats[..., off + n:off + n + kc],
                                     stats[..., off + n + kc:].view(_id_dtype(cdt)), topk, comb)
    return ForwardResult(comb.shift, comb.lse, lp, comb.entropy, buf[:, 0].clone(), top_ids, top_lp)


def check_ids(ids: torch.Tensor, upper: int, what: str, valid: Optional[torch.Tensor] = None) -> None:
    """``ValueError`` unless every id (on the ``valid`` rows) lies in ``[0, upper)``."""
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= upper)
    if valid is not None:
        bad = bad & (valid.unsqueeze(-1) if bad.dim() > valid.dim() else valid)
    if bool(bad.any()):
        raise ValueError(f"{what} holds ids outside [0, {upper}) ({int(bad.sum())} entries)")


def _flat(logits_shard: torch.Tensor) -> torch.Tensor:
    return logits_shard.reshape(-1, logits_shard.shape[-1])


@torch.no_grad()
def vocab_parallel_logsumexp(
    logits_shard: torch.Tensor, group, *, vocab_size: Optional[int] = None, chunk_size: Optional[int] = None
) -> torch.Tensor:
    """``log sum_v exp(z_v)`` over the real vocabulary: ``[..., V/TP]`` -> ``[...]`` (fp32; fp64 for
    fp64 logits). No gradient. ``vocab_size=None``: every column is real."""
    sh = vocab_shard(logits_shard, group, vocab_size)
    z = _flat(logits_shard)
    res = forward_pass(LogitRows(z, sh), None, sh, group, rows_per_chunk=chunk_rows(chunk_size, sh.width, z.device))
    return res.lse.view(logits_shard.shape[:-1])


@torch.no_grad()
def vocab_parallel_logprobs_at(
    logits_shard: torch.Tensor,
    ids: torch.Tensor,
    *,
    group,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Log-probabilities at global ids: ``ids`` ``[...]`` (one per token) or ``[..., n]``.

    Each id is owned by exactly one rank; the result is replicated on every rank (fp32; fp64 for
    fp64 logits), ``-inf`` at padding ids. No gradient (use
    :func:`~emapg_megatron.parallel.vocab_parallel_policy_terms` for the differentiable version).
    """
    sh = vocab_shard(logits_shard, group, vocab_size)
    ids2d = picked_ids(ids, logits_shard.shape[:-1], sh, "logits")
    z = _flat(logits_shard)
    res = forward_pass(LogitRows(z, sh), ids2d, sh, group, rows_per_chunk=chunk_rows(chunk_size, sh.width, z.device))
    return res.logprob.view(ids.shape)


def picked_ids(ids: torch.Tensor, lead, sh: VocabShard, what: str) -> torch.Tensor:
    """``ids`` ``[*lead]`` (one per row) or ``[*lead, n]``, checked, as ``[N, n]`` int64."""
    single = ids.shape == lead
    if not single and ids.shape[:-1] != lead:
        raise ValueError(f"ids shape {tuple(ids.shape)} does not match {what} {tuple(lead)}")
    check_ids(ids, sh.padded_vocab_size, "ids")
    n_rows = math.prod(lead)
    return (ids.reshape(n_rows, 1) if single else ids.reshape(n_rows, ids.shape[-1])).long()


def check_k(k: int, sh: VocabShard) -> None:
    if not 0 <= k <= sh.vocab_size:
        raise ValueError(f"k={k} must be in [0, vocab_size={sh.vocab_size}]")


@torch.no_grad()
def vocab_parallel_topk(
    logits_shard: torch.Tensor,
    k: int,
    *,
    vocab_size: Optional[int],
    group,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global top-k over the real vocabulary: ``(ids [..., k] int64, logprobs [..., k])``, sorted by
    decreasing log-prob, identical on every rank. No gradient.

    Each rank takes its local top-``min(k, V/TP)`` of the real columns; the candidates (values and
    global ids) and the log-normaliser partials go out in one all-gather; the top-k of the gathered
    candidates is global. Padding ids can never be selected: they are not candidates, and the
    filler slots of a rank with fewer real columns than candidates rank below every real logit.
    """
    sh = vocab_shard(logits_shard, group, vocab_size)
    lead = logits_shard.shape[:-1]
    check_k(k, sh)
    cdt = compute_dtype(logits_shard)
    dev = logits_shard.device
    z2d = _flat(logits_shard)
    n_rows = z2d.shape[0]
    if k == 0 or n_rows == 0:
        return (torch.empty(lead + (k,), dtype=torch.int64, device=dev),
                torch.empty(lead + (k,), dtype=cdt, device=dev))
    res = forward_pass(LogitRows(z2d, sh), None, sh, group, rows_per_chunk=chunk_rows(chunk_size, sh.width, dev),
                       topk=k)
    return res.topk_ids.view(lead + (k,)), res.topk_logprob.view(lead + (k,))
