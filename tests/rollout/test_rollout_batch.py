"""The rollout batch is as wide as its longest sequence (rounded up to 8), never padded to
--seq-length, and too long a sequence is refused."""

import pytest
import torch

from emapg_megatron.rollout.engine import build_rollout_batch

PROMPTS = [[1, 2, 3], [4, 5]]


def test_width_is_the_longest_sequence_rounded_up_to_8():
    batch = build_rollout_batch(PROMPTS, [[7] * 6, [8], [9] * 2, []], [[-0.5] * 6, [-1.0], [-0.25] * 2, []],
                                seq_length=64, pad_id=0, n=2)
    assert batch.tokens.shape == batch.loss_mask.shape == batch.sampling_logprobs.shape == (4, 16)
    assert batch.tokens[0, :9].tolist() == [1, 2, 3] + [7] * 6 and not batch.tokens[0, 9:].any()
    assert batch.loss_mask[3].sum() == 0 and batch.prompt_lengths.tolist() == [3, 3, 2, 2]
    assert torch.equal(batch.sampling_logprobs[2, 2:4], torch.tensor([-0.25, -0.25]))


def test_width_never_exceeds_seq_length():
    batch = build_rollout_batch(PROMPTS[:1], [[7] * 7], [[0.0] * 7], seq_length=10, pad_id=0, n=1)
    assert batch.tokens.shape == (1, 10)
    with pytest.raises(ValueError, match="exceeds --seq-length 9"):
        build_rollout_batch(PROMPTS[:1], [[7] * 7], [[0.0] * 7], seq_length=9, pad_id=0, n=1)


@pytest.mark.parametrize("sp, fp8, expected", [
    (False, None, 1), (True, None, 2),   # sequence parallelism splits the width over TP=2
    (False, "hybrid", 8), (True, "hybrid", 16),  # FP8: 8 tokens per rank
])
def test_the_trainer_pads_batch_widths_for_sequence_parallelism_and_fp8(monkeypatch, sp, fp8, expected):
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from emapg_megatron.trainer import Trainer

    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 2)
    model = SimpleNamespace(config=SimpleNamespace(sequence_parallel=sp, fp8=fp8))
    assert Trainer._width_multiple(SimpleNamespace(model_chunks=[model])) == expected
