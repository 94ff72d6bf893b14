"""The pure parts of routing replay and the expert-load metric (models/routing_replay.py)."""

import torch

from emapg_megatron.models.routing_replay import (
    expert_load,
    layers_to_routes,
    route_dtype,
    routes_to_layers,
)


def test_routes_round_trip_between_the_router_order_and_per_sequence():
    b, s, k = 3, 5, 2
    # the router sees [s, b] tokens flattened sequence-major: token (p, j) is row p * b + j
    per_layer = [torch.arange(s * b * k).view(s * b, k) % 7 + 10 * layer for layer in range(2)]
    routes = layers_to_routes(per_layer, b, s, torch.int16)
    assert routes.shape == (b, s, 2, k) and routes.dtype == torch.int16
    assert torch.equal(routes[2, 4, 1], per_layer[1][4 * b + 2].to(torch.int16))  # sequence 2, position 4
    back = routes_to_layers(routes)
    assert all(torch.equal(x, y) and x.dtype == torch.int64 for x, y in zip(back, per_layer))
    assert route_dtype(256) == torch.uint8 and route_dtype(257) == torch.int16


def test_expert_load_counts_the_masked_tokens_of_each_layer():
    routes = torch.tensor([[[[0, 1]], [[1, 2]], [[3, 3]]]], dtype=torch.uint8)  # [1, 3, 1 layer, k=2]
    mask = torch.tensor([[1, 1, 0]])
    counts = expert_load(routes, mask, num_experts=4)
    assert counts.tolist() == [[1.0, 2.0, 1.0, 0.0]]  # the third token is masked out
    assert expert_load(routes, torch.zeros(1, 3), 4).tolist() == [[0.0] * 4]
