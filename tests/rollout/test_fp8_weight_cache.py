"""Transformer Engine's FP8 layers keep an FP8 copy of their weights between microbatches
(``is_first_microbatch``); Megatron's schedule refreshes it at each call's first microbatch, the
in-process sampler (forwards outside the schedule) after each update (``update_weights``). TE is
not needed to check the flag: Megatron's ``MegatronModule.set_is_first_microbatch`` sets it on
any module that has one, when the config asks for FP8."""

import pytest
import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from emapg_megatron.models.gpt import refresh_quantized_weights
from emapg_megatron.rollout import megatron_sampler


def _chunk(fp8):
    chunk = MegatronModule(config=TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, fp8=fp8))
    chunk.linear = torch.nn.Linear(2, 2)
    chunk.linear.is_first_microbatch = False  # as a TE layer after its first forward
    return chunk


@pytest.mark.parametrize("fp8, refreshed", [("hybrid", True), (None, False)])
def test_fp8_layers_cast_their_weights_again_after_a_refresh(fp8, refreshed):
    chunk = _chunk(fp8)
    refresh_quantized_weights([chunk, torch.nn.Linear(2, 2)])  # a chunk without the hook is left alone
    assert chunk.linear.is_first_microbatch is refreshed


def test_the_sampler_refreshes_them_when_the_weights_move():
    sampler = megatron_sampler.MegatronSampler.__new__(megatron_sampler.MegatronSampler)
    chunk = _chunk("hybrid")
    sampler.update_weights([chunk])
    assert sampler.model_chunks == [chunk] and chunk.linear.is_first_microbatch is True
