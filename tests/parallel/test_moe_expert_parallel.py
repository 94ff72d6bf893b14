"""Mixture-of-Experts under expert parallelism on the CPU (gloo, forked ranks): a small
Megatron-Core GPTModel with MoE layers (2 layers, hidden 32, 4 experts, top-2, SequentialMLP
experts, dropless, no aux loss, fp32) at EP=2 with the ``allgather`` and the ``alltoall`` token
dispatchers gives the logits and gradients of the same weights at EP=1 (see ``moe_workers``).

Two gaps of megatron-core on the CPU are filled by this project, each checked here:

* ``alltoall``: gloo's ``all_to_all_single`` takes split sizes as int lists, the dispatcher passes
  tensors (``cpu_device.collectives`` converts them); without it the ``alltoall`` run fails with
  "incompatible function arguments";
* 0.16.1 without Transformer Engine never defines ``moe_utils.te_general_gemm``, so the router's
  ``router_gating_linear`` raises ``NameError`` (``mcore_compat`` defines it as ``None``, as 0.19
  does); without it every MoE run here fails.

Tolerance: rtol 1e-5, atol 1e-6 (fp32). The layouts run the same per-token maths; only the order in
which an expert's weight gradient sums its tokens, and the data-parallel sum of the replicated
weights' gradients, differ.
"""

import pytest
import torch
from moe_workers import EXPERTS, ep_job

from emapg_megatron.multiprocess import run_distributed

DISPATCHERS = ("allgather", "alltoall")
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_expert_parallel_matches_one_rank(dispatcher):
    ranks = run_distributed(ep_job, 2, args=((dispatcher,),), timeout=120)
    ref = ranks[0]["ref"]
    for other in ranks[1:]:  # every rank built the same EP=1 reference
        torch.testing.assert_close(other["ref"]["logits"], ref["logits"], rtol=0, atol=0)
    world = len(ranks)
    rows = ref["logits"].shape[0] // world
    assert sorted(r[dispatcher]["ep_rank"] for r in ranks) == list(range(world))

    experts_seen, summed = set(), {}
    for rank, res in enumerate(ranks):
        run = res[dispatcher]
        torch.testing.assert_close(run["logits"], ref["logits"][rank * rows:(rank + 1) * rows],
                                   rtol=RTOL, atol=ATOL, msg=f"logits of rank {rank}")
        for name, grad in run["grads"].items():
            global_name = run["names"][name]
            if ".local_experts." in name:  # this rank's expert: all the tokens routed to it
                assert global_name not in experts_seen, global_name
                experts_seen.add(global_name)
                torch.testing.assert_close(grad, ref["grads"][global_name], rtol=RTOL, atol=ATOL,
                                           msg=f"{name} of EP rank {run['ep_rank']}")
            else:  # replicated (router, attention, embeddings): this rank's tokens only
                summed[name] = summed[name] + grad if name in summed else grad.clone()
    ref_experts = {n for n in ref["grads"] if ".local_experts." in n}
    assert experts_seen == ref_experts  # every global expert's weights, each once
    assert {int(n.split(".local_experts.")[1].split(".")[0]) for n in ref_experts} == set(range(EXPERTS))
    assert any(".router." in n for n in summed)
    assert set(summed) == set(ref["grads"]) - ref_experts
    for name, grad in summed.items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=ATOL, msg=name)
    for name in ref_experts:  # not a vacuous check: every expert got tokens
        assert ref["grads"][name].abs().max() > 0, name


def test_router_gating_linear_without_transformer_engine():
    """The MoE router's gating GEMM runs (the torch path) and matches torch's, backward too."""
    from megatron.core.transformer.moe import moe_utils

    from emapg_megatron import mcore_compat

    assert moe_utils.te_general_gemm is None or moe_utils.HAVE_TE
    assert not mcore_compat.TE_GAPS_FILLED or not moe_utils.HAVE_TE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 8, generator=g, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    gx, gw = torch.autograd.grad(out.square().sum(), (x, w))
    ex, ew = torch.autograd.grad((x @ w.t()).square().sum(), (x, w))
    torch.testing.assert_close(out, x @ w.t())
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
