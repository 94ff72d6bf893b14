"""Rank functions for the partial-rollout sampler tests (spawned, so module level)."""

from types import SimpleNamespace

from kv_cache_workers import EOS, MAX_NEW, PROMPTS, _model, _sampler

N = 2


def _seqs(prefixes=None):
    """Each prompt's N samples, keyed as partial rollouts key them (start step 5, pos * N + k)."""
    out = []
    for pos, prompt in enumerate(PROMPTS):
        for k in range(N):
            tokens, lps = (prefixes or {}).get(pos * N + k, ([], []))
            out.append(SimpleNamespace(prompt=prompt, tokens=tokens, logprobs=lps, rng_step=5,
                                       row=pos * N + k))
    return out


def continue_across_steps(ckpt: str, save: bool, halt_after: int, shape: dict):
    """The samples generated in one go, and the same samples stopped after ``halt_after`` decode
    steps and continued by a second call (the same weights): through the lockstep cache and the
    fixed-shape decode step (partial rollouts' default), one spawn for both."""
    model = _model(ckpt, save, shape)
    return {("fixed_shape" if m else "lockstep"): _continued(model, halt_after, m) for m in (False, True)}


def _continued(model, halt_after: int, fixed_shape: bool) -> dict:
    sampler = _sampler(model, kv_cache=True, eos_id=EOS, fixed_shape=fixed_shape)
    kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW)
    whole = sampler.continue_sequences(_seqs(), **kw).turns
    calls = [0]

    def enough(finished):
        calls[0] += 1
        return calls[0] >= halt_after

    first = sampler.continue_sequences(_seqs(), enough=enough, **kw).turns
    carried = {q.row: (t.token_ids, t.logprobs) for q, t in zip(_seqs(), first) if not t.finish_reason}
    second = sampler.continue_sequences([q for q in _seqs(carried) if q.row in carried], **kw).turns
    joined = {q.row: t for q, t in zip(_seqs(), first)}
    joined.update({row: t for row, t in zip(sorted(carried), second)})
    as_lists = lambda turns: [(t.token_ids, t.logprobs, t.finish_reason) for t in turns]  # noqa: E731
    return {"whole": as_lists(whole), "joined": as_lists([joined[r] for r in sorted(joined)]),
            "carried": len(carried), "first_lengths": [len(t.token_ids) for t in first]}
