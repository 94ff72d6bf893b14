"""The GPU check: the GPU test set and the GPU benchmarks, each writing JSON, in one command.

    bash tools/gpu_check.sh [OUT_DIR]          # = python tools/run_gpu_checks.py [OUT_DIR]
    bash tools/gpu_check.sh --dry-run          # list the stages and their commands, run nothing

Stages, in order, each with its own time limit inside a total budget (default 590 s, so the whole
command ends within 10 minutes on one H100):

* ``env``           versions of torch, CUDA, the GPU, Megatron-Core, TE, vLLM -> env.json
                    (stage limits: env 30 s, tests 200 s, bench_topk_kl 90 s, bench_rollout 150 s, bench_train 120 s;
                    whether TE and vLLM really import shows in the tests' skip reasons)
* ``tests``         ``pytest -m gpu tests/gpu`` -> pytest.xml (JUnit) and pytest.json
* ``bench_topk_kl`` fused Top-k KL vs Megatron's vocab_parallel_cross_entropy, bf16, T = 16384
                    tokens, V = 151936: time, peak memory, fraction of the measured HBM bandwidth
                    -> bench_topk_kl.json
* ``bench_rollout`` built-in sampler, KV cache vs recompute: tokens/s against the response length
                    -> bench_rollout.json
* ``bench_train``   12 bf16 trainer steps of a Qwen2.5-0.5B-shaped model: step time, tokens/s,
                    peak memory -> bench_train.json

then ``summary.json`` and a printed summary. Exit status 1 if a stage failed or a test failed
(skipped tests are fine: they say which optional package is missing). Works offline.

On the project's lent GPU machine (15 minutes of machine time in all, one transfer of at most
64 MiB per command; docs/dev/gpu_kit.md) the same driver runs one **phase** per command, most
valuable figures first, each stage's limit cut to what is left of ``--budget``:

    python3 tools/run_gpu_checks.py OUT --phase mcore --budget 330 --bundle "$OUT"
    python3 tools/run_gpu_checks.py OUT --phase te --budget 240 --bundle "$OUT"

* ``mcore``: install megatron-core from ``.gpukit-mcore`` (``kit.py install --only mcore``), env, the
  CUDA-graph test of the fixed-shape decode step, the three decode paths at the Qwen2.5-0.5B shape
  (128 x 1,024 tokens; ms per step at batch 1/16/128), a bf16 local-spec trainer benchmark, then the
  rest of the GPU test set;
* ``te``: install Transformer Engine (its folders, the kept built extension), env, the TE-spec and
  FP8 trainer benchmarks (the local-spec one of ``mcore`` is their baseline on the same machine),
  the TE/FP8/THD GPU tests, then LoRA on TE's linears when the budget leaves room;
* ``vllm``: install vLLM, env, the vLLM GPU test, then the vLLM LoRA test when the budget leaves room.

A stage that needs a package whose install failed is skipped, saying so. ``--bundle DIR`` puts
``summary_<phase>.json`` (every stage's JSON inline) and ``<phase>.tar.gz`` (JSON, JUnit, logs)
in DIR, rewritten after every stage (the machine returns at most 8 files). ``--rehearse`` runs
each stage's CPU stand-in instead (tiny shapes, ``--collect-only``, ``--dry-run``, no install):
the suite runs every phase so, so that on the GPU only the GPU is unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join("runs", "gpu_check")
TOTAL_BUDGET_S = 590.0

OFFLINE_ENV = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", CUDA_DEVICE_MAX_CONNECTIONS="1")

ENV_PROBE = r"""
import json, sys
import torch
info = {"python": sys.version.split()[0], "torch": str(torch.__version__), "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)),
                gpu_memory_gib=round(p.total_memory / 2**30, 1), gpus=torch.cuda.device_count(),
                nccl=".".join(map(str, torch.cuda.nccl.version())))
from importlib import metadata
for dist in ("megatron-core", "transformers", "triton", "transformer-engine", "transformer-engine-torch",
             "vllm", "flashinfer-python"):
    try:
        info[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
        info[dist] = None
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
"""


@dataclass
class Stage:
    name: str
    what: str
    timeout_s: float
    argv: list = field(default_factory=list)  # {out} is replaced by the output directory
    result: str = ""  # the JSON file the stage writes, under {out}
    kind: str = ""  # how its result is judged and summarised (default: its name)
    rehearse: list | None = None  # the CPU stand-in of argv (--rehearse); None: nothing to run
    needs: str | None = None  # the kit group whose install this stage needs

    def __post_init__(self):
        self.kind = self.kind or self.name


def env_stage(python: str, **extra) -> Stage:
    """The versions of everything a GPU run's figures depend on (every plan's first stage after
    the install)."""
    argv = [python, "-c", ENV_PROBE, "{out}/env.json"]
    return Stage("env", "versions of torch, CUDA, the GPU, Megatron-Core, TE, vLLM", 30, argv, "env.json", **extra)


def stages(python: str = sys.executable, pytest_timeout_plugin: bool = True) -> list[Stage]:
    test_argv = [python, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
                 "--junitxml", "{out}/pytest.xml", "-o", "junit_family=xunit2"]
    if pytest_timeout_plugin:
        test_argv += ["--timeout", "240"]  # one hung test must not eat the benchmarks' time
    return [
        env_stage(python),
        Stage("tests", "pytest -m gpu tests/gpu (>= 8 tests)", 200, test_argv, "pytest.json"),
        Stage("bench_topk_kl", "fused Top-k KL (from logits and from hidden states) vs Megatron CE, "
              "bf16, T=16384, V=151936, H=896", 90,
              [python, "tools/bench_topk_kl.py", "--device", "cuda", "--tp", "1", "--tokens", "16384",
               "--vocab", "151936", "--hidden", "896", "--k", "32", "--dtype", "bfloat16", "--repeats", "5",
               "--timeout", "80", "--out", "{out}/bench_topk_kl.json"],
              "bench_topk_kl.json"),
        Stage("bench_rollout", "built-in sampler tokens/s vs response length 32..2048, KV cache vs "
              "recompute (to 512), 12 layers x 1024 hidden, fp32, 16 sequences", 150,
              [python, "tools/bench_rollout.py", "--device", "cuda", "--model", "small", "--batch", "16",
               "--lengths", "32,512,2048", "--uncached-max", "512", "--json", "--out", "{out}/bench_rollout.json"],
              "bench_rollout.json"),
        Stage("bench_train", "12 bf16 trainer steps, Qwen2.5-0.5B shapes, random init", 120,
              [python, "tools/bench_gpu_train.py", "--out", "{out}/bench_train.json", "--steps", "12",
               "--timeout", "100"],
              "bench_train.json"),
    ]


KIT = "tools/gpu_install/kit.py"
SITE = "/tmp/site"  # where kit.py install puts the carried packages
DECODE_ARGS = ["--compare-decoders", "--model", "qwen2.5-0.5b", "--bf16", "--batch", "128", "--prompt", "64",
               "--lengths", "1024", "--step-batches", "1,16,128", "--step-tokens", "64"]
DECODE_REHEARSAL = ["--compare-decoders", "--batch", "4", "--prompt", "8", "--lengths", "16",
                    "--step-batches", "1,4", "--step-tokens", "8"]
NOT_REHEARSED = "rehearsal: not run on a CPU"
PHASE_GROUP = {"mcore": "mcore", "te": "te", "vllm": "vllm"}


def phase_stages(phase: str, python: str = sys.executable, pytest_timeout_plugin: bool = True) -> list[Stage]:
    """The stages of one command on the lent machine (``phase``), most valuable first."""
    def pytest_stage(name, what, limit, selection, needs):
        argv = [python, "-m", "pytest", "-m", "gpu", *selection, "-q", "-rs", "-p", "no:cacheprovider",
                "--junitxml", f"{{out}}/{name}.xml", "-o", "junit_family=xunit2"]
        if pytest_timeout_plugin:
            argv += ["--timeout", str(int(limit) - 10)]
        return Stage(name, what, limit, argv, f"{name}.json", kind="tests", needs=needs,
                     rehearse=argv[:5] + selection + ["--collect-only", "-q", "-p", "no:cacheprovider"])

    def train_stage(name, what, limit, impl, extra=()):
        argv = [python, "tools/bench_gpu_train.py", "--out", f"{{out}}/{name}.json", "--steps", "8", "--warmup", "2",
                "--transformer-impl", impl, *extra, "--timeout", str(int(limit) - 15)]
        return Stage(name, what, limit, argv, f"{name}.json", kind="bench_train", needs=PHASE_GROUP[phase],
                     rehearse=argv + ["--work-dir", "{out}/work", "--dry-run"])

    group = PHASE_GROUP[phase]
    install = Stage("install", f"kit.py install --only {group}: the carried {group} packages into {SITE}", 120,
                    [python, KIT, "install", "--only", group, "--target", SITE], "install.json")
    env = env_stage(python, needs=group, rehearse=[python, "-c", ENV_PROBE, "{out}/env.json"])
    if phase == "mcore":
        decode = [python, "tools/bench_rollout.py", "--device", "cuda", *DECODE_ARGS, "--out", "{out}/bench_decode.json"]
        return [install, env,
                pytest_stage("test_graphs", "CUDA graphs of the fixed-shape decode step vs eager (and reused "
                             "after an in-place weight update)", 90,
                             ["tests/gpu/test_static_decode_gpu.py"], group),
                Stage("bench_decode", "decode paths at the Qwen2.5-0.5B shape, bf16: graphs / fixed-shape eager "
                      "/ lockstep, 128 x 1024 tokens; ms per step at batch 1/16/128", 150, decode,
                      "bench_decode.json", needs=group,
                      rehearse=[python, "tools/bench_rollout.py", "--device", "cpu", *DECODE_REHEARSAL,
                                "--out", "{out}/bench_decode.json"]),
                train_stage("bench_train_local", "8 bf16 trainer steps, local spec, Qwen2.5-0.5B shapes", 110,
                            "local"),
                pytest_stage("gpu_tests", "the rest of the GPU test set", 200,
                             ["tests/gpu", "--deselect",
                              "tests/gpu/test_static_decode_gpu.py::test_replayed_graph_samples_what_the_eager_step_samples",
                              "-k", "not transformer_engine and not fp8 and not vllm"], group)]
    if phase == "te":
        return [install, env,
                train_stage("bench_train_te", "8 bf16 trainer steps, Transformer Engine spec", 110,
                            "transformer_engine"),
                train_stage("bench_train_fp8", "8 FP8 (hybrid, delayed scaling) trainer steps, TE spec", 110,
                            "transformer_engine", ("--fp8-format", "hybrid")),
                pytest_stage("te_tests", "TE spec vs HF logits, THD packing vs padded, FP8 trainer steps", 200,
                             ["tests/gpu/test_gpu_optional.py", "-k", "(transformer_engine or fp8) and not lora"],
                             group),
                # issue 42's, after the TE figures: run when the budget leaves room
                pytest_stage("lora_te_tests", "LoRA on TE's linears vs the local ones (fp32), FP8 LoRA steps",
                             150, ["tests/gpu/test_gpu_optional.py", "-k", "lora and (transformer_engine or fp8)"],
                             group)]
    if phase == "vllm":
        return [install, env,
                pytest_stage("vllm_tests", "vLLM rollout engine: weight sync, sleep/wake, log-prob agreement", 300,
                             ["tests/gpu/test_gpu_optional.py", "-k", "vllm and not lora"], group),
                # LoRA through vLLM is one more vLLM start: last, when the budget leaves room
                pytest_stage("vllm_lora_tests", "vLLM LoRA requests: adapters-only sync, log-prob agreement", 240,
                             ["tests/gpu/test_gpu_optional.py", "-k", "vllm and lora"], group)]
    raise ValueError(f"unknown phase {phase!r}")


def fill(argv: list, out: str) -> list:
    return [a.replace("{out}", out) for a in argv]


# --- JUnit XML -> JSON ------------------------------------------------------------------------
def junit_to_json(xml_path: str) -> dict:
    """Counts and one entry per test (outcome, seconds, the skip reason or failure message)."""
    root = ET.parse(xml_path).getroot()
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip()[:2000]
                break
        tests.append({"id": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": message})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "total": len(tests), "tests": tests}


# --- running ------------------------------------------------------------------------------------
def child_env(site: str | None = None) -> dict:
    """This process's environment, offline, with the repository (and ``site``, the kit's
    packages) importable."""
    env = dict(os.environ, **OFFLINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, site, os.environ.get("PYTHONPATH")) if p)
    return env


def run_logged(argv: list, log_path: str, timeout_s: float, env: dict):
    """Run ``argv`` in its own process group with its output in ``log_path``: its exit status, or
    "timeout" after the whole group (torchrun and its ranks too) was killed at ``timeout_s``."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return "timeout"


def run_stage(stage: Stage, out: str, timeout_s: float, argv: list | None = None,
              site: str | None = None) -> dict:
    log_path = os.path.join(out, f"{stage.name}.log")
    t0 = time.monotonic()
    rc = run_logged(fill(argv or stage.argv, out), log_path, timeout_s, child_env(site))
    res = {"stage": stage.name, "returncode": rc, "seconds": round(time.monotonic() - t0, 1),
           "timeout_s": round(timeout_s, 1), "log": log_path}
    if stage.kind == "tests":
        xml = os.path.join(out, stage.result[:-len(".json")] + ".xml")
        if os.path.exists(xml):
            with open(os.path.join(out, stage.result), "w", encoding="utf-8") as f:
                json.dump(junit_to_json(xml), f, indent=1)
    elif stage.kind == "install":
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-4000:]
        with open(os.path.join(out, stage.result), "w", encoding="utf-8") as f:
            json.dump({"returncode": rc, "seconds": res["seconds"], "log_tail": tail}, f, indent=1)
    return res


def load(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stage_ok(res: dict, data, kind: str | None = None, rehearsal: bool = False) -> bool:
    kind = kind or res["stage"]
    if rehearsal and res["returncode"] == NOT_REHEARSED:
        return True
    if res["returncode"] != 0 or (data is None and not rehearsal):
        return False
    if rehearsal:
        return True  # the stand-in ran; nothing of the GPU's is judged
    if kind == "env":
        return bool(data.get("cuda_available"))  # the GPU check on a machine without one fails here
    if kind == "tests" and res["stage"] != "tests":
        c = data["counts"]
        return c["failed"] == 0 and c["error"] == 0 and c["passed"] >= 1
    if kind == "tests":
        c = data["counts"]
        return c["failed"] == 0 and c["error"] == 0 and data["total"] >= 8 and c["passed"] >= 1
    return True


def summarize(out: str, results: list[dict], plan: list[Stage] | None = None, rehearsal: bool = False) -> dict:
    summary = {"out_dir": out, "stages": []}
    for res in results:
        stage = next(s for s in (plan or stages()) if s.name == res["stage"])
        data = load(os.path.join(out, stage.result))
        entry = {**res, "ok": stage_ok(res, data, stage.kind, rehearsal), "result": stage.result}
        if plan is not None:
            entry["data"] = data  # inline: the bundle's one file holds every figure
        if stage.kind == "env" and data:
            entry["highlights"] = {k: data.get(k) for k in ("gpu", "torch", "cuda", "megatron-core",
                                                              "transformer-engine", "vllm")}
        elif stage.kind == "tests" and data:
            entry["highlights"] = {**data["counts"], "total": data["total"],
                                   "not_passed": {t["id"]: f"{t['outcome']}: {t['message'][:300]}"
                                                  for t in data["tests"] if t["outcome"] != "passed"}}
        elif res["stage"] == "bench_topk_kl" and data:
            entry["highlights"] = {
                "hbm_copy_gbps": round(data["meta"].get("hbm_copy_gbps", 0.0)),
                "methods": {r["method"]: {"ms": r["fwd_bwd_ms"],
                                          "peak_GiB": round(r["peak_mem_bytes"] / 2**30, 2)
                                          if r.get("peak_mem_bytes") is not None else None,
                                          "hbm_fraction": r.get("hbm_fraction"),
                                          "grad_err": r.get("max_abs_grad_err")} for r in data["rows"]}}
        elif stage.kind == "bench_decode" and data:
            entry["highlights"] = {"tokens_per_s": {r["path"]: r["tokens_per_s"] for r in data["rows"]},
                                   "step_ms": data["step_ms"], "ratios": data.get("ratios"),
                                   "same_tokens_as_fixed": data.get("same_tokens_as_fixed"),
                                   "complete": data.get("complete")}
        elif stage.kind == "bench_train" and data:
            s = data.get("summary") or {}
            entry["highlights"] = {
                "steps_logged": data.get("steps_logged"),
                "step_time_s_median": (s.get("step_time_s") or {}).get("median"),
                "tokens_per_s_median": (s.get("tokens_per_s") or {}).get("median"),
                "max_memory_allocated_gib": s.get("max_memory_allocated_gib")}
        summary["stages"].append(entry)
    summary["ok"] = all(e["ok"] for e in summary["stages"])
    return summary


def print_summary(summary: dict) -> None:
    print("\n=== GPU check summary ===")
    for e in summary["stages"]:
        print(f"[{'ok' if e['ok'] else 'FAIL':4s}] {e['stage']:14s} {e['seconds']:7.1f}s "
              f"(limit {e['timeout_s']:.0f}s, exit {e['returncode']})  -> {e['result']}")
        for k, v in (e.get("highlights") or {}).items():
            if isinstance(v, dict):
                print(f"         {k}:")
                for k2, v2 in v.items():
                    print(f"           {k2}: {v2}")
            else:
                print(f"         {k}: {v}")
    print(f"overall: {'ok' if summary['ok'] else 'FAILED'}; files in {summary['out_dir']}")


def bundle(summary: dict, out: str, dest: str, phase: str) -> None:
    """``summary_<phase>.json`` and ``<phase>.tar.gz`` (everything under ``out``) in ``dest``,
    each written whole under a temporary name first."""
    import tarfile

    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, f"summary_{phase}.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)
    tar = os.path.join(dest, f"{phase}.tar.gz")
    with tarfile.open(tar + ".tmp", "w:gz") as t:
        t.add(out, arcname=phase, filter=lambda info: None if info.name.endswith(("/work", "/bench_train"))
              else info)
    os.replace(tar + ".tmp", tar)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", nargs="?", default=DEFAULT_OUT, help=f"where the JSON goes (default {DEFAULT_OUT})")
    p.add_argument("--phase", choices=("all", *PHASE_GROUP), default="all",
                   help="all: every stage, on a node that has its packages; mcore/te/vllm: one command on "
                        "the lent GPU machine, installing that kit group first")
    p.add_argument("--dry-run", action="store_true", help="print the stages and their commands, run nothing")
    p.add_argument("--rehearse", action="store_true",
                   help="run each stage's CPU stand-in (tiny shapes, collect-only, dry runs; no install)")
    p.add_argument("--bundle", default=None, help="also write summary_<phase>.json and <phase>.tar.gz here, "
                                                  "after every stage")
    p.add_argument("--only", nargs="+", default=None, help="run only these stages")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all stages together")
    a = p.parse_args(argv)
    import importlib.util

    timeout_plugin = importlib.util.find_spec("pytest_timeout") is not None
    plan = stages(pytest_timeout_plugin=timeout_plugin) if a.phase == "all" else \
        phase_stages(a.phase, pytest_timeout_plugin=timeout_plugin)
    names = [s.name for s in plan]
    unknown = sorted(set(a.only or []) - set(names))
    if unknown:
        p.error(f"unknown stage(s) {unknown}; stages are {names}")
    plan = [s for s in plan if a.only is None or s.name in a.only]
    out = os.path.abspath(a.out_dir)
    if a.dry_run:
        print(json.dumps({"out_dir": out, "phase": a.phase, "budget_s": a.budget, "stages": [
            {"name": s.name, "what": s.what, "timeout_s": s.timeout_s, "writes": s.result,
             "command": fill(s.argv, out), "rehearsal": fill(s.rehearse, out) if s.rehearse else None}
            for s in plan]}, indent=1))
        return 0
    os.makedirs(out, exist_ok=True)
    deadline = time.monotonic() + a.budget
    site = SITE if a.phase != "all" and not a.rehearse else None
    results, failed_install = [], None
    for s in plan:
        left = deadline - time.monotonic()
        skip = None
        if left < 5:
            skip = "no time left"
        elif s.needs and s.needs == failed_install:
            skip = f"skipped: the {s.needs} install failed"
        elif a.rehearse and s.rehearse is None:
            skip = NOT_REHEARSED
        if skip:
            results.append({"stage": s.name, "returncode": skip, "seconds": 0.0, "timeout_s": 0.0, "log": None})
        else:
            print(f"--- {s.name}: {s.what} (limit {min(s.timeout_s, left):.0f}s)", flush=True)
            results.append(run_stage(s, out, min(s.timeout_s, left), s.rehearse if a.rehearse else None, site))
            if s.kind == "install" and results[-1]["returncode"] != 0:
                failed_install = PHASE_GROUP[a.phase]
        summary = summarize(out, results, plan if a.phase != "all" else None, a.rehearse)
        summary.update(phase=a.phase, rehearsal=a.rehearse, budget_s=a.budget)
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        if a.bundle:
            bundle(summary, out, a.bundle, a.phase)
    print_summary(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
