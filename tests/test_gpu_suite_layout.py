"""The GPU check's plumbing, on the CPU: the GPU test set collects and is all marked ``gpu``; the one
command (tools/gpu_check.sh -> tools/run_gpu_checks.py) lists its stages and fits in 10 minutes; the
benchmarks parse the arguments it gives them; every trainer command line the GPU tests and the
trainer benchmark launch is accepted by the real CLI (``--dry-run``); the trainer benchmark's peak
memory comes from the metrics; JUnit results become JSON."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TESTS = os.path.join(REPO, "tests", "gpu")


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checks():
    return load_tool("run_gpu_checks")


@pytest.fixture(scope="module")
def gpu_helpers():
    sys.path.insert(0, GPU_TESTS)
    import gpu_helpers

    return gpu_helpers


COLLECT = r"""
import json, sys, pytest
class Dump:
    def pytest_collection_finish(self, session):
        items = [{"id": i.nodeid, "markers": sorted({m.name for m in i.iter_markers()})} for i in session.items]
        json.dump(items, open(sys.argv[1], "w"))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"], plugins=[Dump()]))
"""


def test_gpu_test_set_collects_and_every_test_is_marked_gpu(tmp_path):
    out = tmp_path / "items.json"
    r = subprocess.run([sys.executable, "-c", COLLECT, str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    items = json.loads(out.read_text())
    assert len(items) >= 8, [i["id"] for i in items]
    unmarked = [i["id"] for i in items if "gpu" not in i["markers"]]
    assert not unmarked, f"not marked gpu (so `pytest -m gpu` would drop them): {unmarked}"
    ids = " ".join(i["id"] for i in items)
    for area in ("optimizer_builds_and_trains_under_nccl[plain]", "under_nccl[distributed]",
                 "trainer_cli_two_bf16_steps_on_cuda_local_spec", "builtin_sampler_on_cuda",
                 "two_trainer_steps[plain]", "two_trainer_steps[shard-over-dp]", "two_trainer_steps[cpu-offload]",
                 "topk_kl_op_matches_single_device_library", "transformer_engine_spec", "fp8_hybrid",
                 "transformer_engine_thd_packing", "vllm_rollout_engine", "lora_on_transformer_engine_linears",
                 "fp8_lora_trainer_steps"):
        assert area in ids, f"no GPU test covers {area}"


def test_gpu_check_dry_run_lists_its_stages_within_ten_minutes(checks, tmp_path, capsys):
    assert checks.main([str(tmp_path / "out"), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in plan["stages"]] == ["env", "tests", "bench_topk_kl", "bench_rollout", "bench_train"]
    assert plan["budget_s"] <= 600 and sum(s["timeout_s"] for s in plan["stages"]) <= 600
    out = str(tmp_path / "out")
    for s in plan["stages"]:
        assert s["writes"].endswith(".json")
        script = next((a for a in s["command"] if a.endswith(".py")), None)
        assert script is None or os.path.isfile(os.path.join(REPO, script)), script
    tests = plan["stages"][1]["command"]
    assert tests[1:6] == ["-m", "pytest", "-m", "gpu", "tests/gpu"]
    assert os.path.join(out, "pytest.xml") in tests
    assert not os.path.exists(out)  # a dry run writes nothing
    # The shell entry point is the same command.
    r = subprocess.run(["bash", "tools/gpu_check.sh", out, "--dry-run"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    via_shell = json.loads(r.stdout)["stages"]
    assert [(s["name"], s["command"][1:]) for s in via_shell] == [(s["name"], s["command"][1:]) for s in plan["stages"]]


def stage_argv(checks, name, out):
    (stage,) = [s for s in checks.stages() if s.name == name]
    return checks.fill(stage.argv, out)


def test_topk_kl_benchmark_parses_the_gpu_stage_arguments(checks, tmp_path):
    bench = load_tool("bench_topk_kl")
    argv = stage_argv(checks, "bench_topk_kl", str(tmp_path))
    args = bench.build_parser().parse_args(argv[2:])
    assert (args.device, args.tp, args.tokens, args.vocab, args.dtype) == ("cuda", 1, 16384, 151936, "bfloat16")
    assert args.methods is None and args.hidden == 896  # every method, the fused LM head included
    assert {"emapg_fused", "megatron_ce", "emapg_fused_lmhead"} <= set(bench.METHODS)
    assert args.out == str(tmp_path / "bench_topk_kl.json") and args.grad_check
    # The compulsory traffic the HBM fraction is judged by: no padding at 151936 (= 1187 x 128).
    assert bench.padded_vocab(151936, 1) == 151936


def test_trainer_benchmark_command_is_accepted_by_the_trainer_cli(checks, tmp_path, capsys):
    bench = load_tool("bench_gpu_train")
    argv = stage_argv(checks, "bench_train", str(tmp_path))
    args = bench.build_parser().parse_args(argv[2:])
    assert args.steps == 12 and args.timeout < 120
    assert bench.main(argv[2:] + ["--work-dir", str(tmp_path / "work"), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["params"] == 494032768  # Qwen2.5-0.5B
    from emapg_megatron import train

    assert train.run(plan["trainer_argv"] + ["--dry-run=json"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    expect = dict(vocab_size=151936, hidden_size=896, ffn_hidden_size=4864, num_layers=24, num_attention_heads=14,
                  num_query_groups=2, add_qkv_bias=True, tie_word_embeddings=True, rotary_base=1e6)
    assert {k: resolved["model"][k] for k in expect} == expect
    assert resolved["model"]["vocab_size"] % resolved["model"]["make_vocab_size_divisible_by"] == 0  # no padding
    a = resolved["args"]
    assert a["bf16"] and a["device"] == "cuda" and a["train_iters"] == 12 and a["transformer_impl"] == "auto"


def test_trainer_benchmark_reads_peak_memory_from_the_metrics(checks, tmp_path):
    bench = load_tool("bench_gpu_train")
    rows = [{"step": s, "step_time_s": t, "tokens_per_s": 100.0 * s, "max_memory_allocated_gib": m}
            for s, t, m in ((1, 9.0, 7.5), (2, 2.0, 8.25), (3, 4.0, 8.0))]
    s = bench.summarize(rows, warmup=1, sequences_per_step=128)
    assert s["steps_timed"] == [2, 3] and s["step_time_s"]["median"] == 3.0 and s["sequences_per_s"] == 128 / 3.0
    assert s["max_memory_allocated_gib"] == 8.25  # the run's peak, warm-up steps included
    (tmp_path / "bench_train.json").write_text(json.dumps({"steps_logged": 3, "summary": s}))
    (entry,) = checks.summarize(str(tmp_path), [{"stage": "bench_train", "returncode": 0}])["stages"]
    assert entry["ok"] and entry["highlights"] == {"steps_logged": 3, "step_time_s_median": 3.0,
                                                   "tokens_per_s_median": 250.0, "max_memory_allocated_gib": 8.25}


def test_gpu_tests_trainer_command_lines_pass_the_cli(gpu_helpers, tiny_hf_model, capsys):
    """What the GPU tests launch (local spec, the three EMA modes, FP8 on TE, vLLM) validates on the CLI
    (the vLLM GPU test loads tiny_hf's model: conftest.py's tiny_hf_model)."""
    from emapg_megatron import train

    g = gpu_helpers
    variants = [(g.LOCAL_SPEC, "local"), *[(flags, "auto") for flags in g.EMA_MODES.values()],
                (g.FP8_HYBRID, "transformer_engine"), (g.vllm_flags(tiny_hf_model), "auto"),
                (g.vllm_flags(tiny_hf_model) + ["--lora-rank", "8", "--lora-alpha", "16", "--vllm-sleep-level", "1",
                                                "--train-iters", "3"], "auto")]
    for extra, impl in variants:
        assert train.run(g.TRAINER_BASE + extra + ["--dry-run=json"]) == 0, extra
        a = json.loads(capsys.readouterr().out)["args"]
        assert a["device"] == "cuda" and a["bf16"] and a["tensor_model_parallel_size"] == 1
        assert a["transformer_impl"] == impl, extra
        # one PPO mini-batch per step: what the tests' "step 1 KL is 0" relies on
        assert a["global_batch_size"] == a["rollout_batch_size"] * a["num_samples_per_prompt"]


def test_junit_results_become_json(checks, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4">'
        '<testcase classname="tests.gpu.t" name="a" time="1.5"/>'
        '<testcase classname="tests.gpu.t" name="b" time="0.1"><failure message="boom">trace</failure></testcase>'
        '<testcase classname="tests.gpu.t" name="c" time="0"><skipped message="needs vLLM: no module"/></testcase>'
        '<testcase classname="tests.gpu.t" name="d" time="0"><error message="fixture"/></testcase>'
        '</testsuite></testsuites>')
    res = checks.junit_to_json(str(xml))
    assert res["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1} and res["total"] == 4
    assert res["tests"][2] == {"id": "tests.gpu.t::c", "outcome": "skipped", "seconds": 0.0,
                               "message": "needs vLLM: no module"}
    run = {"stage": "tests", "returncode": 0}
    assert not checks.stage_ok(run, res)
    ok = {"counts": {"passed": 8, "failed": 0, "error": 0, "skipped": 3}, "total": 11}
    assert checks.stage_ok(run, ok) and not checks.stage_ok({"stage": "tests", "returncode": 1}, ok)
    assert not checks.stage_ok({"stage": "env", "returncode": 0}, {"cuda_available": False})


def test_phase_stage_limits_fit_the_machine(checks):
    """Each phase's stages are bounded per stage, and the driver's budget caps them together; the
    install comes first and every stage after it needs the phase's group."""
    for phase in ("mcore", "te", "vllm"):
        plan = checks.phase_stages(phase)
        assert plan[0].kind == "install" and all(s.needs == checks.PHASE_GROUP[phase] for s in plan[1:])
        assert all(0 < s.timeout_s <= 300 for s in plan)
        assert len({s.result for s in plan}) == len(plan)  # one JSON file per stage


def test_every_phase_trainer_benchmark_passes_the_trainer_cli(checks, tmp_path, capsys):
    """The local, TE and FP8 trainer benchmarks of the phases: the argv the trainer would get
    validates (--dry-run=json) with the layer implementation and FP8 format asked for."""
    bench = load_tool("bench_gpu_train")
    from emapg_megatron import train

    seen = {}
    for phase in ("mcore", "te"):
        for s in checks.phase_stages(phase):
            if s.kind != "bench_train":
                continue
            args = bench.build_parser().parse_args(checks.fill(s.argv, str(tmp_path))[2:])
            assert train.run(bench.trainer_argv(args, str(tmp_path / "log")) + ["--dry-run=json"]) == 0, s.name
            a = json.loads(capsys.readouterr().out)["args"]
            seen[s.name] = (a["transformer_impl"], a["fp8_format"], a["train_iters"])
    assert seen == {"bench_train_local": ("local", None, 8), "bench_train_te": ("transformer_engine", None, 8),
                    "bench_train_fp8": ("transformer_engine", "hybrid", 8)}
