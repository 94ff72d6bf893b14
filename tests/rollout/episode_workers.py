"""Rank functions for ``test_episode_answer.py`` (spawned, so module level)."""

from emapg_megatron.tasks.base import Segment


class ScriptedEnv:
    """Answers a turn with the observation ``[7, rank]`` (so copies on other ranks would differ),
    done after two turns; with ``fail``, rank 0's copy raises on its first step."""

    max_turn_tokens = 4

    def __init__(self, fail: bool = False):
        self.fail, self.segments, self.done, self.steps = fail, [], False, 0
        self.response_text = ""

    def step(self, text, token_ids=None):
        import torch.distributed as dist

        self.steps += 1
        if self.fail and dist.get_rank() == 0:
            raise ValueError("retriever returned malformed JSON")
        self.segments.append(Segment(text, "model", list(token_ids)))
        self.segments.append(Segment("", "observation", [7, dist.get_rank()]))
        self.response_text += text
        self.done = self.steps >= 2


def answer_two_turns_both_ways() -> dict:
    """Two turns with good environments, then with one that raises on rank 0 (one spawn)."""
    return {"ok": answer_two_turns(False), "failed": answer_two_turns(True)}


def answer_two_turns(fail: bool) -> dict:
    from megatron.core import parallel_state as ps

    from emapg_megatron.rollout.episodes import Episode, Turn, answer

    eps = [Episode([1, 2], ScriptedEnv(fail), tokenizer=None, max_len=32) for _ in range(2)]
    try:
        for t in range(2):
            answer(eps, [Turn([3 + t, 4], [-0.5, -0.25], f"turn{t}") for _ in eps],
                   ps.get_model_parallel_group())
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ids": [ep.ids for ep in eps], "mask": [ep.mask for ep in eps],
            "logprobs": [ep.logprobs for ep in eps], "done": [ep.done for ep in eps],
            "text": [ep.response_text for ep in eps], "steps": [ep.env.steps for ep in eps]}
