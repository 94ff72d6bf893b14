"""Rank functions for test_vllm_routes.py (forked ranks, so module level)."""

import torch


def broadcast_routes(dtype_name: str) -> dict:
    """``broadcast_rollout_batch`` over the model-parallel group (TP = 2): each rank passes its
    own batch (tokens and routes made from its rank); every rank returns what it got."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from emapg_megatron.rollout.engine import RolloutBatch
    from emapg_megatron.rollout.vllm_engine import broadcast_rollout_batch

    rank, dtype = dist.get_rank(), getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 50, (3, 8), generator=g)
    plens = torch.tensor([2, 3, 1])
    responses = [tokens[s, plens[s]:plens[s] + 4].tolist() for s in range(3)]
    routes = torch.randint(0, 300 if dtype == torch.int16 else 200, (3, 8, 2, 2), generator=g).to(dtype)
    batch = RolloutBatch(tokens, torch.ones(3, 8), torch.randn(3, 8, generator=g), plens, responses,
                         routes=routes)
    src = dist.get_process_group_ranks(ps.get_model_parallel_group())[0]
    got = broadcast_rollout_batch(batch, src=src, group=ps.get_model_parallel_group())
    plain = lambda b: {"tokens": b.tokens, "routes": b.routes, "responses": b.responses}  # noqa: E731
    return {"rank": rank, "sent": plain(batch), "got": plain(got)}


def one_step_with_stub_engine(argv: list, shift: int) -> dict:
    """One trainer step of the tiny MoE preset whose rollout engine is a stub of vLLM: the built-in
    sampler's batch, with its routes replaced by ones passed through :func:`vllm_routes` as vLLM
    returns them (``[fed - 1, layers, k]`` int32 per sequence), each expert id shifted by ``shift``
    (mod the experts): routes the sampler did not take. Returns the step's route metrics and
    whether the old pass was handed exactly the stub's routes."""
    import numpy as np

    from emapg_megatron import build
    from emapg_megatron.models.routing_replay import ROLLOUT_ROUTES, ROUTES
    from emapg_megatron.rollout.route_recording import lay_routes
    from emapg_megatron.rollout.vllm_engine import vllm_routes

    inputs = build.prepare(argv)
    trainer = build.build_trainer(inputs)
    engine, model_cfg = trainer.collector.engine, inputs.model_cfg
    generate, laid = engine.generate, {}

    def stub(prompts, n, *args, **kwargs):
        batch = generate(prompts, n, *args, **kwargs)
        rows = []
        for s, resp in enumerate(batch.responses):
            fed = len(prompts[s // n]) + len(resp)
            sampled = batch.routes[s, :fed - 1].numpy().astype(np.int32)
            returned = (sampled + shift) % model_cfg.num_experts  # vLLM's array, other experts
            rows.append(vllm_routes(returned, fed=fed, model_cfg=model_cfg, dtype=batch.routes.dtype))
        batch.routes = lay_routes(rows, batch.tokens.shape[1])
        laid["routes"] = batch.routes.clone()
        return batch

    engine.generate = stub
    before = trainer.routing.before_passes

    def spy(batch):
        out = before(batch)
        if ROUTES in out:
            laid["handed"] = bool(torch.equal(out[ROUTES].cpu(), batch[ROLLOUT_ROUTES].cpu()))
        return out

    trainer.routing.before_passes = spy
    m = trainer.step(1).metrics
    return {"moe_route_agreement": m.get("moe_route_agreement"), "handed": laid.get("handed"),
            "rollout_logprob_diff": m.get("rollout_logprob_diff"), "stub_ran": "routes" in laid}


def stub_cases(argv: list, runs: dict) -> dict:
    """:func:`one_step_with_stub_engine` of each ``name: (extra flags, shift)``, in one process."""
    return {name: one_step_with_stub_engine([*argv, *extra], shift) for name, (extra, shift) in runs.items()}
