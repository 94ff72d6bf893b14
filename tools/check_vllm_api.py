"""Check that the vLLM API our rollout engine calls exists in a given vLLM, without importing it.

vLLM needs CUDA, so CPU machines cannot run the engine; this reads vLLM's *source* (an installed
package, or an unpacked wheel) with ``ast`` and checks every name the engine relies on: the
``LLM`` keyword arguments (as ``EngineArgs`` fields, LoRA's included), the ``SamplingParams``
fields, the ``LLM`` methods and their parameters, the worker's ``get_model``, the models'
``load_weights``, the ``CompletionOutput`` fields (``routed_experts`` for a MoE policy's routes,
R3), LoRA's ``LoRARequest`` fields and
``LLMEngine.remove_lora``, and the option values (``external_launcher``,
``processed_logprobs``). The keyword arguments are taken from the engine's own code
(:meth:`VLLMConfig.llm_kwargs_for` with a LoRA rank and routes returned, :func:`sampling_kwargs`), so the check
follows the engine.

    python tools/check_vllm_api.py                      # the installed vLLM (the Docker build runs this)
    python tools/check_vllm_api.py --source DIR         # DIR/vllm/... e.g. an unzipped wheel

Prints JSON; exits 1 when anything is missing.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Requirement:
    """``names`` must be fields (``kind="fields"``) or methods with those parameters
    (``kind="method"``, names = (method, *params)) of ``cls`` in ``path``, or string literals
    in ``path``, a file or every ``.py`` file under a directory (``kind="literals"``)."""

    path: str
    cls: str
    kind: str
    names: tuple[str, ...]
    why: str
    feature: str | None = None
    """None: every run needs it (missing: the check fails); else the option that needs it alone
    ("lora": --lora-rank with vLLM, "r3": --moe-routing-replay r3 with vLLM), reported as
    unavailable without failing (the engine refuses that option in one line on such a vLLM)."""


def requirements() -> list[Requirement]:
    from emapg_megatron.lora.config import LoRAConfig
    from emapg_megatron.rollout.config import VLLMConfig
    from emapg_megatron.rollout.vllm_engine import sampling_kwargs

    # every run's keywords, and those LoRA (enable_lora, max_lora_rank, max_loras) and R3
    # (enable_return_routed_experts) add
    core = VLLMConfig(hf_dir="-").llm_kwargs_for(1)
    lora_kwargs = sorted(set(VLLMConfig(hf_dir="-", lora=LoRAConfig(rank=8)).llm_kwargs_for(1)) - set(core))
    r3_kwargs = sorted(set(VLLMConfig(hf_dir="-", return_routes=True).llm_kwargs_for(1)) - set(core))
    sp_kwargs = sorted(sampling_kwargs(n=1, temperature=1.0, top_p=1.0, max_tokens=1, stop=None,
                                       seed=None))
    llm, worker = "vllm/entrypoints/llm.py", "vllm/v1/worker/gpu_model_runner.py"
    return [
        Requirement("vllm/engine/arg_utils.py", "EngineArgs", "fields", tuple(sorted(core)),
                    "vllm.LLM(**VLLMConfig.llm_kwargs_for(...))"),
        Requirement("vllm/engine/arg_utils.py", "EngineArgs", "fields", tuple(lora_kwargs),
                    "vllm.LLM(...) with --lora-rank", feature="lora"),
        Requirement("vllm/engine/arg_utils.py", "EngineArgs", "fields", tuple(r3_kwargs),
                    "vllm.LLM(...) with --moe-routing-replay r3", feature="r3"),
        Requirement("vllm/sampling_params.py", "SamplingParams", "fields", tuple(sp_kwargs),
                    "SamplingParams(**sampling_kwargs(...))"),
        Requirement(llm, "LLM", "method", ("generate", "prompts", "sampling_params", "use_tqdm"), "sampling"),
        Requirement(llm, "LLM", "method", ("generate", "lora_request"), "sampling with the adapter",
                    feature="lora"),
        Requirement(llm, "LLM", "method", ("sleep", "level"), "sleep while training"),
        Requirement(llm, "LLM", "method", ("wake_up", "tags"), "wake weights / KV cache apart"),
        Requirement(llm, "LLM", "method", ("collective_rpc", "method", "args"), "weight sync"),
        Requirement(llm, "LLM", "method", ("reset_prefix_cache",), "after a weight sync"),
        Requirement(llm, "LLM", "method", ("get_tokenizer",), "episodes and evaluation"),
        Requirement(worker, "GPUModelRunner", "method", ("get_model",),
                    "_load_weights_on_worker unwraps the CUDA-graph wrapper"),
        Requirement("vllm/model_executor/models/qwen2.py", "Qwen2ForCausalLM", "method",
                    ("load_weights", "weights"), "weight sync into Qwen2 / R1-Distill"),
        Requirement("vllm/model_executor/models/llama.py", "LlamaForCausalLM", "method",
                    ("load_weights", "weights"), "weight sync into Llama"),
        Requirement("vllm/lora/request.py", "LoRARequest", "fields",
                    ("lora_name", "lora_int_id", "lora_path"),
                    "LoRA: each sync's adapter, a peft folder on disk", feature="lora"),
        Requirement("vllm/v1/engine/llm_engine.py", "LLMEngine", "method", ("remove_lora", "lora_id"),
                    "LoRA: LLM.llm_engine drops the previous adapter", feature="lora"),
        Requirement("vllm/outputs.py", "CompletionOutput", "fields",
                    ("index", "text", "token_ids", "logprobs", "finish_reason"),
                    "reading samples"),
        Requirement("vllm/outputs.py", "CompletionOutput", "fields", ("routed_experts",),
                    "a MoE policy's routes (R3): LLM(enable_return_routed_experts=True)", feature="r3"),
        Requirement("vllm/config", "", "literals", ("processed_logprobs",),
                    "log pi_sampling after temperature / top-p"),
        Requirement("vllm/config", "", "literals", ("external_launcher",),
                    "vLLM inside the trainer's torchrun processes"),
        Requirement("vllm/envs.py", "", "literals", ("VLLM_ENABLE_V1_MULTIPROCESSING",),
                    "in-process engine core, so collective_rpc reaches this process's model"),
    ]


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _params(cls: ast.ClassDef, method: str) -> set[str] | None:
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method:
            a = n.args
            return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
    return None


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _literals(path: str) -> set[str]:
    files = ([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
             if os.path.isdir(path) else [path])
    return {n.value for f in files for n in ast.walk(_parse(f))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def missing(req: Requirement, root: str) -> list[str]:
    """What of ``req`` is absent under ``root`` (the directory holding ``vllm/``)."""
    path = os.path.join(root, req.path)
    if req.kind == "literals" and not os.path.exists(path):
        path += ".py"  # vllm/config was one module before vLLM 0.10
    if req.kind == "literals" and os.path.exists(path):
        have = _literals(path)
        return [f"'{s}' in {req.path}" for s in req.names if s not in have]
    if not os.path.isfile(path):
        return [f"file {req.path}"]
    tree = _parse(path)
    cls = _class(tree, req.cls)
    if cls is None:
        return [f"class {req.cls} in {req.path}"]
    if req.kind == "fields":
        return [f"{req.cls}.{s}" for s in req.names if s not in _fields(cls)]
    method, *params = req.names
    have = _params(cls, method)
    if have is None:
        return [f"{req.cls}.{method}()"]
    return [f"{req.cls}.{method}({p}=)" for p in params if p not in have]


def check(root: str) -> dict:
    """The report: ``failed`` / ``missing`` count what every run needs; ``unavailable_features``
    names each option (``lora``, ``r3``) this vLLM cannot serve, with what it lacks."""
    reqs = requirements()
    results = [{"requirement": f"{r.cls or r.path}: {', '.join(r.names)}", "why": r.why,
                "feature": r.feature, "missing": missing(r, root)} for r in reqs]
    failed = [r for r in results if r["missing"] and r["feature"] is None]
    unavailable = {}
    for r in results:
        if r["missing"] and r["feature"] is not None:
            unavailable.setdefault(r["feature"], []).extend(r["missing"])
    return {"source": root, "version": _version(root), "checks": len(results),
            "failed": len(failed), "missing": [m for r in failed for m in r["missing"]],
            "unavailable_features": unavailable, "results": results}


def _version(root: str) -> str | None:
    path = os.path.join(root, "vllm", "_version.py")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        for node in ast.walk(ast.parse(f.read())):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and any(getattr(t, "id", "") in ("version", "__version__") for t in node.targets)):
                return str(node.value.value)
    return None


def installed_root() -> str:
    spec = importlib.util.find_spec("vllm")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: vLLM is not installed here; pass --source DIR (an unzipped wheel)")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="directory containing the vllm/ package (default: the "
                                     "installed vLLM)")
    args = ap.parse_args(argv)
    root = args.source or installed_root()
    if not os.path.isdir(os.path.join(root, "vllm")):
        print(f"error: no vllm/ package under {root}", file=sys.stderr)
        return 2
    report = check(root)
    print(json.dumps(report, indent=1))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
