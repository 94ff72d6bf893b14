"""On a GPU: a replayed CUDA graph of the fixed-shape decode step samples what the eager step
samples, also after the weights changed in place and the decoder was reset (the CPU suite checks
the eager step against the KV-cached path)."""

import pytest
import torch

from emapg_megatron.multiprocess import run_distributed

pytestmark = pytest.mark.gpu


def test_replayed_graph_samples_what_the_eager_step_samples():
    from static_decode_workers import graphs_against_eager

    (out,) = run_distributed(graphs_against_eager, 1, device="cuda", timeout=600)
    assert out["buckets"] == [1, 2, 4] and out["memory"] >= 0
    for graphs, eager in (("graphs", "eager"), ("graphs_after_update", "eager_after_update")):
        assert out[graphs]["first"] == out[eager]["first"]  # the prefills: eager in both
        for (ids_g, lps_g), (ids_e, lps_e) in zip(out[graphs]["steps"], out[eager]["steps"]):
            assert ids_g == ids_e, graphs
            torch.testing.assert_close(torch.tensor(lps_g), torch.tensor(lps_e), atol=1e-5, rtol=0)
    # the update moved the samples: the replayed graphs read the new weights
    assert out["eager_after_update"]["steps"] != out["eager"]["steps"]
