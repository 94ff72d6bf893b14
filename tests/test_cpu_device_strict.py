"""Strict CPU device mode (issue 15): placement bugs that crash on a GPU raise on CPU too.

``cpu_device.install()`` is process-global, so every check runs in a fresh process: the rule
cases below run together in one subprocess (``python this_file.py --cases``, with
``EMAPG_STRICT_DEVICE=1``, after ``runtime.initialize`` of a 1-rank gloo world) and report one
result each; the Megatron cases spawn ranks with :func:`run_distributed`, which inherit the
environment variable.
"""

import copy
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

STRICT_ENV = "EMAPG_STRICT_DEVICE"
HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------------------
# Rule cases: each returns normally (legal pattern) or raises (violation). Run in the subprocess.


def _D(t):
    from emapg_megatron import cpu_device

    return cpu_device.is_device_tensor(t)


def _dev(*shape, **kw):
    return torch.randn(*shape, device="cuda", **kw)


def ok_factories_tag_device_requests():
    for device in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0),
                   torch.cuda.current_device()):
        assert _D(torch.zeros(2, device=device)), device
    assert _D(torch.tensor([1.0], device="cuda"))
    assert _D(torch.arange(3, device="cuda"))
    assert not _D(torch.zeros(2)) and not _D(torch.zeros(2, device="cpu"))


def ok_device_tensor_reports_cuda():
    t, h = _dev(2), torch.randn(2)
    assert t.device == torch.device("cuda", 0) and t.is_cuda and not t.is_cpu
    assert t.get_device() == 0 and t.type() == "torch.cuda.FloatTensor"
    assert h.device == torch.device("cpu") and not h.is_cuda and h.is_cpu
    assert h.get_device() == -1 and h.type() == "torch.FloatTensor"


def ok_views_params_data_inplace_keep_tag():
    t = _dev(2, 3)
    p = torch.nn.Parameter(t)
    for v in (t[0], t[:, 1:], t.t(), t.view(6), t.detach(), p, p.data, p.detach(), p[0]):
        assert _D(v)
    t.add_(1.0).mul_(2.0)
    assert _D(t)


def ok_outputs_of_device_ops_are_device():
    t, w = _dev(2, 4), _dev(3, 4)
    for out in (t * 2, t.sum(), torch.cat([t, t]), torch.nn.functional.linear(t, w),
                t.max(dim=1).values, torch.topk(t, 2).indices, t.float().softmax(-1),
                t.to(torch.bool), t.to(dtype=torch.float64), t.long(), t.type(torch.float16)):
        assert _D(out)


def ok_device_idioms_move_to_device():
    t, h = _dev(3), torch.randn(3)
    moved = [h.cuda(), h.to("cuda"), h.to(torch.cuda.current_device()), h.to(t.device), h.to(t),
             h.to(device=t.device, dtype=torch.float64), h.type_as(t),
             torch.as_tensor(h, device="cuda")]
    for m in moved:
        assert _D(m) and m.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    assert not _D(h)  # the host tensor itself stays on the host
    made = [torch.empty(2, device=t.device), t.new_zeros(2), t.new_tensor([1.0, 2.0]),
            torch.zeros_like(t), torch.randn_like(t)]
    assert all(_D(m) for m in made)
    assert t.cuda() is t and t.to("cuda") is t


def ok_cpu_is_an_untagged_copy():
    t = _dev(3)
    for c in (t.cpu(), t.to("cpu"), t.to(torch.device("cpu")), t.to(torch.randn(1)),
              torch.zeros_like(t, device="cpu")):
        assert not _D(c)
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert _D(t)
    h = torch.randn(2)
    assert h.cpu() is h


def ok_shape_only_uses_of_the_other_side():
    t, h = _dev(2, 3), torch.arange(3)
    # expand_as / view_as / reshape_as read only the other tensor's shape (legal on a GPU) and
    # stay on self's side.
    assert not _D(h.expand_as(t)) and not _D(torch.randn(6).view_as(t))
    assert not _D(torch.randn(6).reshape_as(t))
    assert _D(t.reshape(6).view_as(torch.randn(2, 3)))


def ok_module_to_device():
    m = torch.nn.Linear(2, 2)
    assert not _D(m.weight)
    m.cuda()
    assert _D(m.weight) and _D(m.bias)
    m.cpu()
    assert not _D(m.weight)
    m.to("cuda")
    assert _D(m.weight)


def raises_mul_host_by_device():
    # The sampler pattern: torch.rand(n) * cdf_on_gpu.
    torch.rand(4) * _dev(4)


def raises_device_scalar_with_host_tensor():
    torch.rand(4) + _dev(4).sum()


def ok_host_scalars_mix_with_device():
    t = _dev(4)
    assert _D(t * torch.tensor(2.0))
    assert _D(torch.where(t > 0, t, torch.tensor(0.0)))
    assert _D(t.clamp(min=torch.tensor(0.0)))


def raises_rmsnorm_built_on_host():
    # A module built without device= next to device layers (the Megatron local-spec RMSNorm).
    torch.nn.RMSNorm(4)(_dev(2, 4))


def ok_rmsnorm_on_device():
    assert _D(torch.nn.RMSNorm(4, device="cuda")(_dev(2, 4)))
    assert _D(torch.nn.RMSNorm(4).cuda()(_dev(2, 4)))


def raises_embedding_of_host_batch():
    # A batch built on the host fed to a device model.
    emb = torch.nn.Embedding(10, 4, device="cuda")
    emb(torch.tensor([[1, 2, 3]]))


def ok_embedding_of_device_batch():
    emb = torch.nn.Embedding(10, 4, device="cuda")
    assert _D(emb(torch.tensor([[1, 2, 3]], device="cuda")))


def ok_host_indices_index_device_tensor():
    t = _dev(4)
    assert _D(t[torch.tensor([0, 2])]) and _D(t[torch.tensor([True, False, True, False])])
    t[torch.tensor([0, 1])] = 0.0
    t[torch.tensor([0, 1])] = torch.zeros(2, device="cuda")
    t[0:2] = torch.zeros(2)  # basic indexing assigns through copy_: cross-device is fine
    t.index_put_((torch.tensor([3]),), torch.tensor(1.0))
    assert _D(t)


def raises_device_indices_into_host_tensor():
    torch.randn(4)[torch.tensor([0, 1], device="cuda")]


def raises_advanced_setitem_of_host_values():
    t = _dev(4)
    t[torch.tensor([0, 1])] = torch.zeros(2)


def raises_index_select_with_host_index():
    _dev(4).index_select(0, torch.tensor([0, 1]))


def raises_gather_with_host_index():
    torch.gather(_dev(2, 3), 1, torch.tensor([[0], [1]]))


def raises_searchsorted_host_values():
    torch.searchsorted(_dev(4).sort().values, torch.rand(3))


def ok_copy_between_sides():
    t, h = _dev(3), torch.randn(3)
    t.copy_(h)
    h.copy_(t)
    assert _D(t) and not _D(h)
    model = torch.nn.Linear(2, 2, device="cuda")
    model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    assert _D(model.weight)


def raises_cpu_generator_for_device_factory():
    torch.rand(3, device="cuda", generator=torch.Generator().manual_seed(0))


def ok_cpu_generator_then_move():
    g = torch.Generator().manual_seed(0)
    assert _D(torch.rand(3, generator=g).to("cuda"))


def ok_gradients_are_device_tensors():
    lin = torch.nn.Linear(4, 4, device="cuda")
    lin(_dev(2, 4)).sum().backward()
    assert _D(lin.weight.grad) and _D(lin.bias.grad)

    seen = {}

    class MatMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(w)
            return a @ w

        @staticmethod
        def backward(ctx, grad_out):
            (w,) = ctx.saved_tensors
            seen["grad_out"] = _D(grad_out)
            return grad_out @ w.t(), None

    a = _dev(2, 4, requires_grad=True)
    MatMul.apply(a, _dev(4, 4)).sum().backward()
    assert seen["grad_out"] and _D(a.grad)
    (g,) = torch.autograd.grad(lin(_dev(1, 4)).mean(), [lin.weight])
    assert _D(g)


def ok_gradients_cross_back_over_transfers():
    x = _dev(3, requires_grad=True)
    (x.cpu() * 2).sum().backward()
    (x.to("cpu", torch.float64) * 2).sum().backward()
    assert _D(x.grad)
    h = torch.randn(3, requires_grad=True)
    (h.cuda() * 2).sum().backward()
    (h.to(torch.cuda.current_device()) * 2).sum().backward()
    assert not _D(h.grad)


def raises_mix_inside_custom_backward():
    # A custom autograd.Function's backward is checked like the forward.
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, grad_out):
            return grad_out * torch.full((3,), 2.0)  # host tensor in device backward

    Scale.apply(_dev(3, requires_grad=True)).sum().backward()


def raises_host_gradient_for_device_output():
    out = _dev(3, requires_grad=True) * 2
    out.backward(torch.ones(3))


def raises_assigning_host_grad():
    p = torch.nn.Parameter(_dev(3))
    p.grad = torch.zeros(3)


def raises_numpy_of_device_tensor():
    _dev(2).numpy()


def ok_record_stream_of_device_tensor():
    # Megatron's MoE dispatcher: a device tensor copied to the host on a side stream
    _dev(2).record_stream(torch.cuda.current_stream())


def raises_record_stream_of_host_tensor():
    torch.randn(2).record_stream(torch.cuda.current_stream())


def ok_deepcopy_keeps_side():
    t = _dev(2)
    assert _D(copy.deepcopy(t)) and not _D(copy.deepcopy(torch.randn(2)))
    assert _D(copy.deepcopy(torch.nn.Linear(2, 2, device="cuda")).weight)


def ok_freed_storage_leaves_no_tag():
    for _ in range(50):
        t = torch.empty(4096, device="cuda")
        del t
        assert not _D(torch.empty(4096))


# -- torch.distributed on the 1-rank world (gloo underneath, NCCL emulated) --


def raises_all_reduce_host_on_default_group():
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(2))


def raises_all_reduce_host_0dim():
    import torch.distributed as dist

    dist.all_reduce(torch.tensor(1.0))


def ok_all_reduce_device_on_default_group():
    import torch.distributed as dist

    t = torch.ones(2, device="cuda")
    dist.all_reduce(t)
    assert _D(t)


def raises_all_gather_into_tensor_host_input():
    import torch.distributed as dist

    dist.all_gather_into_tensor(torch.empty(2, device="cuda"), torch.zeros(2))


def ok_megatron_mappings_on_device():
    from megatron.core.tensor_parallel import mappings

    assert _D(mappings.reduce_from_tensor_model_parallel_region(torch.ones(2, device="cuda")))
    assert _D(mappings.gather_from_tensor_model_parallel_region(torch.ones(2, device="cuda")))


def ok_megatron_captured_collectives_are_checked():
    # Megatron keeps `dist_all_gather_func = torch.distributed.all_gather_into_tensor` from import.
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers, mappings

    for mod in (mappings, layers, param_and_grad_buffer):
        assert hasattr(mod.dist_all_gather_func, "_emapg_original"), mod.__name__
        assert hasattr(mod.dist_reduce_scatter_func, "_emapg_original"), mod.__name__


def ok_megatron_gloo_groups_take_host_tensors():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.all_reduce(torch.zeros(2), group=ps.get_data_parallel_group_gloo())
    dist.all_reduce(torch.zeros(2), group=ps.get_data_parallel_group_gloo(with_context_parallel=True))


def raises_megatron_nccl_group_host_tensor():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.all_reduce(torch.zeros(2), group=ps.get_data_parallel_group())


def ok_gloo_new_group_and_registered_groups():
    import torch.distributed as dist

    from emapg_megatron import cpu_device

    dist.all_reduce(torch.zeros(2), group=dist.new_group([0], backend="gloo"))
    plain = dist.new_group([0])
    try:
        dist.all_reduce(torch.zeros(2), group=plain)
    except cpu_device.DeviceMixError:
        pass
    else:
        raise AssertionError("a default-backend group took a host tensor")
    cpu_device.register_host_groups([plain])
    dist.all_reduce(torch.zeros(2), group=plain)


def ok_object_collectives_exempt():
    import torch.distributed as dist

    out = [None]
    dist.all_gather_object(out, {"step": 1})
    objs = [{"a": 1}]
    dist.broadcast_object_list(objs, src=0)
    assert out == [{"step": 1}] and objs == [{"a": 1}]


def raises_isend_host_tensor():
    import torch.distributed as dist

    dist.isend(torch.zeros(2), dst=0)


def raises_batch_isend_irecv_host_tensor():
    import torch.distributed as dist

    dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.zeros(2), 0)])


CASES = [name for name in list(globals()) if name.startswith(("ok_", "raises_"))]


def _run_cases() -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from emapg_megatron.multiprocess import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    from emapg_megatron import cpu_device, runtime

    runtime.quiet_expected_warnings()
    runtime.initialize(runtime.ParallelConfig(device="cpu"))  # install() reads the env var
    results = {"_strict": cpu_device.strict()}
    for name in CASES:
        try:
            globals()[name]()
            results[name] = {"ok": True}
        except cpu_device.DeviceMixError as e:
            results[name] = {"ok": False, "mix": True, "msg": str(e)}
        except BaseException:  # noqa: BLE001 - reported to the parent
            results[name] = {"ok": False, "mix": False, "msg": traceback.format_exc()}
    runtime.destroy()
    return results


def _strict_env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env[STRICT_ENV] = "1"
    return env


@pytest.fixture(scope="module")
def case_results():
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--cases"], cwd=HERE,
                          env=_strict_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cases_ran_strict(case_results):
    assert case_results["_strict"] is True
    assert set(case_results) == set(CASES) | {"_strict"}


# Expected fragment of the message: the op (or collective) each violation must name.
NAMED = {
    "raises_mul_host_by_device": "torch.Tensor.mul",
    "raises_device_scalar_with_host_tensor": "torch.Tensor.add",
    "raises_rmsnorm_built_on_host": "torch.nn.functional.rms_norm",
    "raises_embedding_of_host_batch": "torch.nn.functional.embedding",
    "raises_device_indices_into_host_tensor": "indexes a host tensor with device indices",
    "raises_advanced_setitem_of_host_values": "advanced indexing",
    "raises_index_select_with_host_index": "index_select",
    "raises_gather_with_host_index": "torch.gather",
    "raises_searchsorted_host_values": "torch.searchsorted",
    "raises_cpu_generator_for_device_factory": "Generator",
    "raises_host_gradient_for_device_output": "backward",
    "raises_mix_inside_custom_backward": "torch.Tensor.mul",
    "raises_assigning_host_grad": "grad",
    "raises_numpy_of_device_tensor": "numpy",
    "raises_record_stream_of_host_tensor": "record_stream",
    "raises_all_reduce_host_on_default_group": "torch.distributed.all_reduce on an NCCL",
    "raises_all_reduce_host_0dim": "torch.distributed.all_reduce on an NCCL",
    "raises_all_gather_into_tensor_host_input": "torch.distributed.all_gather_into_tensor",
    "raises_megatron_nccl_group_host_tensor": "torch.distributed.all_reduce",
    "raises_isend_host_tensor": "torch.distributed.isend",
    "raises_batch_isend_irecv_host_tensor": "torch.distributed.batch_isend_irecv",
}


@pytest.mark.parametrize("name", [c for c in CASES if c.startswith("ok_")])
def test_legal_pattern_passes(case_results, name):
    res = case_results[name]
    assert res["ok"], res["msg"]


@pytest.mark.parametrize("name", [c for c in CASES if c.startswith("raises_")])
def test_violation_raises(case_results, name):
    res = case_results[name]
    assert not res["ok"], f"{name} did not raise"
    assert res["mix"], f"{name} raised something else than DeviceMixError:\n{res['msg']}"
    assert NAMED[name] in res["msg"], res["msg"]


def test_every_violation_names_its_op():
    assert set(NAMED) == {c for c in CASES if c.startswith("raises_")}


def _python(code: str, env) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_install_strict_sets_env_for_spawned_ranks():
    env = {k: v for k, v in os.environ.items() if k != STRICT_ENV}
    env["OMP_NUM_THREADS"] = "1"
    code = ("import os; from emapg_megatron import cpu_device as c; c.install(strict=True); "
            f"print(c.strict(), os.environ['{STRICT_ENV}'])")
    assert _python(code, env) == "True 1"


def test_plain_install_stays_permissive():
    env = {k: v for k, v in os.environ.items() if k != STRICT_ENV}
    env["OMP_NUM_THREADS"] = "1"
    code = ("import torch; from emapg_megatron import cpu_device as c; c.install(); "
            "t = torch.rand(4) * torch.zeros(4, device='cuda'); "
            "print(c.strict(), t.device, torch.zeros(1).type())")
    assert _python(code, env) == "False cpu torch.cuda.FloatTensor"


# ---------------------------------------------------------------------------------------------
# Megatron GPTModel under strict mode (spawned ranks inherit EMAPG_STRICT_DEVICE).

TINY = dict(vocab_size=100, make_vocab_size_divisible_by=64, hidden_size=64, ffn_hidden_size=128,
            num_layers=2, num_attention_heads=4, num_query_groups=2, max_position_embeddings=64)


def _gpt_rank(move_to_device: bool):
    from megatron.core import parallel_state as ps

    from emapg_megatron import cpu_device
    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import build_gpt_model
    from emapg_megatron.training.schedule import positions_for

    assert cpu_device.strict()
    tp = ps.get_tensor_model_parallel_world_size()
    model = build_gpt_model(ModelConfig(**TINY), tp=tp)
    host_params = sorted(n for n, p in model.named_parameters() if not cpu_device.is_device_tensor(p))
    if move_to_device:
        model.cuda()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    tokens = tokens.cuda()
    loss = model(tokens, positions_for(tokens), None, labels=tokens)
    loss.float().mean().backward()
    grads_on_device = all(cpu_device.is_device_tensor(p.grad) for p in model.parameters())
    # The TP group is an NCCL group on a GPU: a host tensor there fails, the gloo DP group takes it.
    from megatron.core.tensor_parallel import mappings

    try:
        mappings.reduce_from_tensor_model_parallel_region(torch.zeros(1))
        host_on_tp = "accepted"
    except cpu_device.DeviceMixError as e:
        host_on_tp = "refused" if "all_reduce" in str(e) else str(e)
    torch.distributed.all_reduce(torch.zeros(1), group=ps.get_data_parallel_group_gloo())
    return {"host_params": host_params, "loss_on_device": cpu_device.is_device_tensor(loss),
            "grads_on_device": grads_on_device, "host_on_tp": host_on_tp,
            "loss": loss.detach().cpu()}


@pytest.mark.slow
def test_gpt_forward_strict_as_built(monkeypatch):
    """build_gpt_model places every weight on the device (its norms included), with no .cuda().

    Megatron's WrappedTorchNorm builds torch.nn.RMSNorm without device=: on the code before this
    fix the first input_layernorm raised here (rms_norm: cuda input, cpu weight), as on a GPU.
    """
    from emapg_megatron.multiprocess import run_distributed

    monkeypatch.setenv(STRICT_ENV, "1")
    (out,) = run_distributed(_gpt_rank, 1, args=(False,))
    assert out["host_params"] == [] and out["loss_on_device"] and out["grads_on_device"]


@pytest.mark.slow
def test_gpt_tp2_forward_backward_strict_with_device_norms(monkeypatch):
    """The strict layer itself: Megatron GPT (TP=2, norms moved by .cuda()) runs clean."""
    from emapg_megatron.multiprocess import run_distributed

    monkeypatch.setenv(STRICT_ENV, "1")
    outs = run_distributed(_gpt_rank, 2, tp=2, args=(True,))
    for out in outs:
        assert out["host_params"] == []
        assert out["loss_on_device"] and out["grads_on_device"]
        assert out["host_on_tp"] == "refused"
        assert torch.isfinite(out["loss"]).all()
    torch.testing.assert_close(outs[0]["loss"], outs[1]["loss"])


if __name__ == "__main__" and sys.argv[1:] == ["--cases"]:
    print(json.dumps(_run_cases()))
