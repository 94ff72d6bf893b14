"""tools/check_vllm_api.py: the static check of the vLLM API the rollout engine calls.

A synthetic ``vllm/`` source tree is written from the requirements themselves; the check must
pass on it and name exactly what is removed from it. (The real vLLM 0.10.1-0.33.0 sources were
checked with the same tool; see docs/scale.md.)"""

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import check_vllm_api as api  # noqa: E402

TOOL = os.path.join(ROOT, "tools", "check_vllm_api.py")


def write_tree(root, drop=lambda req, name: False):
    """A vllm/ tree that has everything ``api.requirements()`` asks for, less what ``drop`` says."""
    classes = defaultdict(lambda: defaultdict(list))  # path -> class -> source lines
    methods = defaultdict(lambda: defaultdict(dict))  # path -> class -> method -> its parameters
    literals = defaultdict(list)
    for req in api.requirements():
        kept = [n for n in req.names if not drop(req, n)]
        if req.kind == "literals":
            literals[os.path.join(req.path, "options.py")] += [repr(s) for s in kept]
        elif req.kind == "fields":
            classes[req.path][req.cls] += [f"    {n}: object = None" for n in kept]
        else:  # a method (its parameters the union of every requirement's), its class either way
            classes[req.path][req.cls]
            if kept and kept[0] == req.names[0]:
                methods[req.path][req.cls].setdefault(kept[0], {}).update(dict.fromkeys(kept[1:]))
    for path, by_cls in methods.items():
        for c, by_name in by_cls.items():
            for name, params in by_name.items():
                classes[path][c] += [f"    def {name}(self{''.join(f', {p}=None' for p in params)}):",
                                     "        pass"]
    files = {path: "\n".join(f"class {c}:\n" + ("\n".join(body) or "    pass")
                             for c, body in by_cls.items()) for path, by_cls in classes.items()}
    files.update({path: "\n".join(lines) for path, lines in literals.items()})
    files["vllm/_version.py"] = "__version__ = version = '9.9.9'"
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text + "\n")
    return str(root)


def test_requirements_follow_the_engine_code():
    from emapg_megatron.lora.config import LoRAConfig
    from emapg_megatron.rollout.config import VLLMConfig

    by_cls = {r.cls: r for r in api.requirements() if r.kind == "fields" and r.cls != "CompletionOutput"
              and r.feature is None}
    engine_args = {r.feature: set(r.names) for r in api.requirements() if r.cls == "EngineArgs"}
    every = VLLMConfig(hf_dir="-", lora=LoRAConfig(rank=16), return_routes=True).llm_kwargs_for(8)
    assert engine_args[None] == set(VLLMConfig(hf_dir="-").llm_kwargs_for(8))
    assert engine_args["lora"] == {"enable_lora", "max_lora_rank", "max_loras"}
    assert engine_args["r3"] == {"enable_return_routed_experts"}
    assert set().union(*engine_args.values()) == set(every)
    outputs = {n for r in api.requirements() if r.cls == "CompletionOutput" for n in r.names}
    assert {"token_ids", "logprobs", "routed_experts"} <= outputs
    assert {"logprobs", "seed", "include_stop_str_in_output"} <= set(by_cls["SamplingParams"].names)
    lora_request = next(r for r in api.requirements() if r.cls == "LoRARequest")
    assert set(lora_request.names) == {"lora_name", "lora_int_id", "lora_path"} and lora_request.feature == "lora"


def test_complete_tree_passes(tmp_path):
    report = api.check(write_tree(tmp_path))
    assert report["failed"] == 0, report["missing"]
    assert report["version"] == "9.9.9"
    assert report["checks"] == len(api.requirements())


@pytest.mark.parametrize("cls,name,expected", [
    ("SamplingParams", "logprobs", "SamplingParams.logprobs"),
    ("EngineArgs", "logprobs_mode", "EngineArgs.logprobs_mode"),
    ("LLM", "tags", "LLM.wake_up(tags=)"),
    ("LLM", "collective_rpc", "LLM.collective_rpc()"),
    ("GPUModelRunner", "get_model", "GPUModelRunner.get_model()"),
    ("", "processed_logprobs", "'processed_logprobs' in vllm/config"),
])
def test_each_missing_name_is_reported(tmp_path, cls, name, expected):
    report = api.check(write_tree(tmp_path, drop=lambda r, n: r.cls == cls and n == name))
    assert report["missing"] == [expected]
    assert report["failed"] == 1 and report["unavailable_features"] == {}


@pytest.mark.parametrize("cls,name,feature,expected", [
    ("EngineArgs", "max_lora_rank", "lora", "EngineArgs.max_lora_rank"),
    ("LLM", "lora_request", "lora", "LLM.generate(lora_request=)"),
    ("LoRARequest", "lora_int_id", "lora", "LoRARequest.lora_int_id"),
    ("LLMEngine", "remove_lora", "lora", "LLMEngine.remove_lora()"),
    ("EngineArgs", "enable_return_routed_experts", "r3", "EngineArgs.enable_return_routed_experts"),
    ("CompletionOutput", "routed_experts", "r3", "CompletionOutput.routed_experts"),
])
def test_a_missing_optional_feature_is_reported_without_failing(tmp_path, cls, name, feature, expected):
    """What only --lora-rank or --moe-routing-replay r3 needs: the image still builds, the
    report names the option this vLLM cannot serve (the engine refuses it in one line)."""
    report = api.check(write_tree(tmp_path, drop=lambda r, n: r.cls == cls and n == name and r.feature))
    assert report["failed"] == 0 and report["missing"] == []
    assert report["unavailable_features"] == {feature: [expected]}


def test_cli_exit_codes_and_json(tmp_path):
    good = write_tree(tmp_path / "good")
    bad = write_tree(tmp_path / "bad", drop=lambda r, n: r.cls == "SamplingParams" and n == "seed")
    run = lambda src: subprocess.run([sys.executable, TOOL, "--source", src],  # noqa: E731
                                     capture_output=True, text=True, timeout=120)
    ok, fail, absent = run(good), run(bad), run(str(tmp_path / "nowhere"))
    assert ok.returncode == 0 and json.loads(ok.stdout)["failed"] == 0
    assert fail.returncode == 1 and json.loads(fail.stdout)["missing"] == ["SamplingParams.seed"]
    assert absent.returncode == 2 and "no vllm/ package" in absent.stderr
