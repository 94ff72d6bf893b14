#!/usr/bin/env python
"""Checkpoint conversion throughput and peak memory (issue 7).

Builds a random Qwen2.5-0.5B-shaped model with ``transformers`` on the CPU (494 M params, tied
embeddings, GQA, q/k/v bias), saves it as bf16 safetensors, then times

* ``hf-to-mcore`` (``--tp 1``): safetensors -> Megatron ``torch_dist`` checkpoint,
* ``mcore-to-hf``: back to sharded safetensors,

each in a fresh child process that reports its wall time and peak RSS (``VmHWM``) next to its
RSS just before converting (interpreter + torch + Megatron imports). Finally checks that the
round trip is bit-identical. Throughput = weight bytes / conversion seconds.

    python tools/bench_convert.py --json            # ~1 GB of weights, a few minutes on 2 cores
    python tools/bench_convert.py --json --layers 2 # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# Qwen2.5-0.5B's shape.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    """Peak RSS of this process image. ``ru_maxrss`` would include the parent's RSS at fork
    (Linux carries it across exec); ``VmHWM`` starts afresh at exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _child(argv: list[str]) -> None:
    """Build the HF model, or run one conversion and print its time and memory, as JSON."""
    import megatron.core  # noqa: F401
    import torch  # noqa: F401 - imported before measuring the baseline

    from emapg_megatron.checkpoint import convert

    command, src, dst = argv
    if command == "build-hf":
        print(json.dumps({"params": _build_hf(Path(dst), int(src))}))
        return
    baseline = _rss_bytes()
    start = time.perf_counter()
    if command == "hf-to-mcore":
        summary = convert.hf_to_mcore(src, dst, tp=1, progress=False)
    else:
        summary = convert.mcore_to_hf(src, dst, hf_template=None, progress=False)
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    print(json.dumps({"seconds": seconds, "baseline_rss": baseline, "peak_rss": peak,
                      "bytes": summary["bytes"]}))


def _run_child(command: str, src, dst: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", command, str(src), str(dst)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _build_hf(path: Path, layers: int) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers})
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    return n_params


def _bit_identical(a: Path, b: Path) -> bool:
    import torch

    from emapg_megatron.checkpoint.hf_io import SafetensorsReader

    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    if set(ra.names()) != set(rb.names()):
        return False
    return all(torch.equal(ra.read(n), rb.read(n)) for n in ra.names())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON summary line")
    p.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"])
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed after")
    args = p.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        hf, mcore, back = work / "hf", work / "mcore", work / "hf_back"
        for d in (mcore, back):
            shutil.rmtree(d, ignore_errors=True)
        n_params = _run_child("build-hf", args.layers, hf)["params"]  # keeps this process small
        to_mcore = _run_child("hf-to-mcore", hf, mcore)
        to_hf = _run_child("mcore-to-hf", mcore, back)
        gb = 1e9
        result = {
            "model": f"Qwen2.5-0.5B shape, {args.layers} layers, random bf16",
            "params": n_params,
            "weights_gb": to_hf["bytes"] / gb,
            "bit_identical": _bit_identical(hf, back),
            "cpu_threads": os.cpu_count(),
        }
        for name, r in (("hf_to_mcore", to_mcore), ("mcore_to_hf", to_hf)):
            result[name] = {
                "seconds": round(r["seconds"], 2),
                "gb_per_s": round(to_hf["bytes"] / gb / r["seconds"], 3),
                "peak_rss_gb": round(r["peak_rss"] / gb, 2),
                "rss_before_gb": round(r["baseline_rss"] / gb, 2),
                "peak_minus_before_over_weights":
                    round((r["peak_rss"] - r["baseline_rss"]) / to_hf["bytes"], 2),
            }
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
