"""Rank functions for test_moe_expert_parallel.py (forked ranks, so module level): a small
Megatron-Core GPTModel with MoE layers (local spec, SequentialMLP experts) run at expert parallelism
EP=2 with the allgather and the alltoall token dispatchers, against the same weights at EP=1.

Every rank first builds the EP=1 model from the seed (the layout ``run_distributed`` sets up: TP=PP=
EP=1), keeps its weights as the global ones and runs it on both ranks' batches concatenated: the
reference. Then the parallel state is rebuilt at EP=2 (the same two ranks, EP carved out of DP) and
each rank copies the global weights into its model, its local expert ``i`` being global expert
``rank * local + i``, and runs its own batch. Expert parallelism only moves tokens between ranks, so
each rank's logits are the reference's rows of its batch, each local expert's gradient is the
reference's gradient of that global expert (its tokens come from both ranks), and the replicated
weights' gradients (router, attention, embeddings) summed over the ranks (what the data-parallel
all-reduce does) are the reference's.
"""

from __future__ import annotations

import torch

LAYERS, HIDDEN, HEADS, FFN = 2, 32, 4, 64
EXPERTS, TOPK = 4, 2
VOCAB, SEQ, BATCH = 64, 8, 2  # BATCH rows per rank


def batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[world * BATCH, SEQ]``: rank r's batch is rows ``r*BATCH:(r+1)*BATCH``."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g)
    return tokens, labels


def build(ep: int, dispatcher: str, seed: int):
    """The MoE GPTModel under the current parallel state (fp32, no dropout, dropless, no aux loss)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False, moe_expert_capacity_factor=None, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", expert_model_parallel_size=ep,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope")
    return model.cuda()  # CPU mode maps it to the CPU


def forward_backward(model, tokens, labels) -> tuple[torch.Tensor, dict]:
    """Logits ``[B, S, V]`` and every parameter's gradient of the summed cross-entropy."""
    device = torch.device("cuda", torch.cuda.current_device())
    tokens, labels = tokens.to(device), labels.to(device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
    logits = model(tokens, position_ids, mask)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1),
                                             reduction="sum")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def local_expert_key(name: str, ep_rank: int, local: int) -> str:
    """The EP=1 model's name of this EP rank's parameter ``name`` (local expert i -> global)."""
    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    i, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * local + int(i)}.{rest}"


def ep_job(dispatchers: tuple, seed: int = 1234) -> dict:
    """The EP=1 reference (both batches) and, per dispatcher, this rank's EP=2 run (its batch)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    world, rank = dist.get_world_size(), dist.get_rank()
    tokens, labels = batches(world)
    ref = build(1, "allgather", seed)
    weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_logits, ref_grads = forward_backward(ref, tokens, labels)
    out = {"ref": {"logits": ref_logits, "grads": ref_grads}}
    del ref

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=world, create_gloo_process_groups=True)
    ep_rank = ps.get_expert_model_parallel_rank()
    local = EXPERTS // world
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    for dispatcher in dispatchers:
        model = build(world, dispatcher, seed)
        names = {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                names[n] = local_expert_key(n, ep_rank, local)
                p.copy_(weights[names[n]])
        logits, grads = forward_backward(model, tokens[rows], labels[rows])
        out[dispatcher] = {"logits": logits, "grads": grads, "names": names, "ep_rank": ep_rank}
    return out
