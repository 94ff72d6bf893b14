"""Every example script (except the CPU demos, run in full: tiny_cpu.sh, the main job, and
opd_tiny_cpu.sh, whose flags tests/training/test_distillation.py runs) with DRY_RUN=1 on CPU: the
trainer validates the whole configuration for the script's world size, reading only a hand-written config.json shaped
like the real model, and the resolved flags are the paper's hyperparameters."""

import glob
import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.one_suite("mcore019")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SAMPLES = os.path.join(ROOT, "data", "samples")

# DeepSeek-R1-Distill-Qwen-1.5B (a Qwen2.5-Math-1.5B derivative: untied head, RoPE base 1e4)
R1_DISTILL_QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 131072,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 4096,
    "torch_dtype": "bfloat16", "bos_token_id": 151646, "eos_token_id": 151643,
}
QWEN2_5_3B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 2048,
    "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
}
# Trainer flags the search example needs that arguments.py does not have yet.
PENDING_SEARCH_FLAGS = ("--retriever", "--retriever-topk", "--max-turns", "--max-turn-tokens",
                        "--max-obs-tokens", "--chat-template")


def test_every_example_is_covered():
    scripts = {os.path.basename(p) for p in glob.glob(os.path.join(EXAMPLES, "*.sh"))}
    covered = {"math_deepscaler_1.5b.sh", "math_deepscaler_1.5b_k3.sh", "math_deepscaler_1.5b_fp8.sh",
               "search_r1_qwen2.5_3b.sh", "eval_math.sh", "eval_search.sh"}
    # the CPU demos run in full; the MoE demo's preset is trained by tests/training/test_moe_trainer.py
    # and its report is tests/test_moe_report.py's; the LoRA demo's preset is checked by
    # tests/training/test_lora_trainer.py (its LoRA runs are that file's) and its report is tiny_cpu.sh's
    assert scripts - {"tiny_cpu.sh", "opd_tiny_cpu.sh", "moe_tiny_cpu.sh", "lora_tiny_cpu.sh"} == covered


def _model_dir(tmp_path, config: dict) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _run(script: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "DRY_RUN": "1", "DRY_RUN_OUTPUT": "json", "OMP_NUM_THREADS": "1", **env}
    for name in ("NNODES", "NPROC", "WORLD_SIZE", "STAGE", "KL_LOSS", "PRECISION"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(["bash", os.path.join(EXAMPLES, script), *args], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _resolved(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


COMMON = dict(train_iters=None, lr=1e-6, weight_decay=0.01, clip_grad=1.0, clip_eps_low=0.2,
              clip_eps_high=0.28, ppo_epochs=1, kl_coef=0.001, kl_topk_tokens=32,
              ema_update_period=10, kl_iw_clip=None, rollout_engine="vllm", bf16=True,
              use_distributed_optimizer=True, advantage_norm="group")


def _check(args: dict, **expected):
    for key, value in {**COMMON, **expected}.items():
        if value is not None:
            assert args[key] == value, (key, args[key], value)


STAGES = {"8k": (8192, 480, None), "16k": (16384, 800, "8k"), "24k": (24576, 1000, "16k")}


@pytest.mark.parametrize("stage", list(STAGES))
def test_math_stages(tmp_path, stage):
    save = tmp_path / "save"
    response, iters, previous = STAGES[stage]
    if previous:
        (save / f"math-1.5b-topk-{previous}").mkdir(parents=True)
    out = _run("math_deepscaler_1.5b.sh", {
        "MODEL_DIR": _model_dir(tmp_path, R1_DISTILL_QWEN_1_5B), "DATA_DIR": SAMPLES,
        "TRAIN_FILE": "math.jsonl", "SAVE_DIR": str(save), "STAGE": stage})
    res = _resolved(out)
    assert res["layout"] == {"world_size": 8, "tensor_model_parallel_size": 2,
                             "pipeline_model_parallel_size": 1, "data_parallel_size": 4}
    model = res["model"]
    assert (model["hidden_size"], model["num_layers"], model["num_attention_heads"],
            model["num_query_groups"], model["vocab_size"], model["rotary_base"],
            model["tie_word_embeddings"], model["add_qkv_bias"]) == (1536, 28, 12, 2, 151936, 10000.0,
                                                                     False, True)
    args = res["args"]
    _check(args, task="math", train_iters=iters, rollout_batch_size=128, num_samples_per_prompt=8,
           global_batch_size=512, max_new_tokens=response, seq_length=1024 + response,
           kl_loss_type="topk-reverse", ema_eta=0.95, fp8_format=None, temperature=0.6, top_p=1.0,
           save=str(save / f"math-1.5b-topk-{stage}"),
           load=str(save / f"math-1.5b-topk-{previous}") if previous else None)
    if not previous:
        assert args["load"] is None


def test_math_k3_variant(tmp_path):
    args = _resolved(_run("math_deepscaler_1.5b_k3.sh", {
        "MODEL_DIR": _model_dir(tmp_path, R1_DISTILL_QWEN_1_5B), "DATA_DIR": SAMPLES,
        "TRAIN_FILE": "math.jsonl", "SAVE_DIR": str(tmp_path / "save")}))["args"]
    _check(args, kl_loss_type="k3", ema_eta=0.95, train_iters=480,
           save=str(tmp_path / "save" / "math-1.5b-k3-8k"))


def test_math_fp8_variant_two_nodes(tmp_path):
    res = _resolved(_run("math_deepscaler_1.5b_fp8.sh", {
        "MODEL_DIR": _model_dir(tmp_path, R1_DISTILL_QWEN_1_5B), "DATA_DIR": SAMPLES,
        "TRAIN_FILE": "math.jsonl", "SAVE_DIR": str(tmp_path / "save"), "NNODES": "2"}))
    assert res["layout"]["world_size"] == 16 and res["layout"]["data_parallel_size"] == 8
    _check(res["args"], fp8_format="hybrid", fp8_recipe="delayed", kl_loss_type="topk-reverse",
           save=str(tmp_path / "save" / "math-1.5b-topk-fp8-8k"))


def test_math_bad_stage_is_one_line(tmp_path):
    out = _run("math_deepscaler_1.5b.sh", {
        "MODEL_DIR": _model_dir(tmp_path, R1_DISTILL_QWEN_1_5B), "DATA_DIR": SAMPLES,
        "SAVE_DIR": str(tmp_path), "STAGE": "32k"})
    assert out.returncode == 2 and out.stderr.strip() == "error: STAGE must be 8k, 16k or 24k (got 32k)"
    out = _run("math_deepscaler_1.5b.sh", {"DATA_DIR": SAMPLES, "SAVE_DIR": str(tmp_path), "MODEL_DIR": ""})
    assert out.returncode == 2 and "set MODEL_DIR" in out.stderr


def test_search(tmp_path):
    out = _run("search_r1_qwen2.5_3b.sh", {
        "MODEL_DIR": _model_dir(tmp_path, QWEN2_5_3B), "DATA_DIR": SAMPLES, "TRAIN_FILE": "qa.jsonl",
        "SAVE_DIR": str(tmp_path / "save"), "RETRIEVER": os.path.join(SAMPLES, "corpus.jsonl")})
    if out.returncode != 0 and "unrecognized arguments" in out.stderr:
        unknown = out.stderr.split("unrecognized arguments:")[1].split()
        if {a for a in unknown if a.startswith("--")} <= set(PENDING_SEARCH_FLAGS):
            pytest.xfail("the trainer has no multi-turn/retriever flags yet: "
                         + " ".join(PENDING_SEARCH_FLAGS))
    res = _resolved(out)
    assert res["layout"]["data_parallel_size"] == 4
    model = res["model"]
    assert (model["hidden_size"], model["num_layers"], model["num_attention_heads"],
            model["num_query_groups"], model["rotary_base"], model["tie_word_embeddings"]) == (
        2048, 36, 16, 2, 1000000.0, True)
    _check(res["args"], task="search", train_iters=1005, rollout_batch_size=512,
           num_samples_per_prompt=5, global_batch_size=1280, lr_warmup_fraction=0.285,
           adam_beta1=0.9, adam_beta2=0.95, kl_loss_type="topk-reverse", kl_tail="unbiased",
           ema_eta=0.9, max_new_tokens=500, max_turns=4, max_turn_tokens=500)


@pytest.mark.parametrize("script,task,data", [("eval_math.sh", "math", "math.jsonl"),
                                              ("eval_search.sh", "search", "qa.jsonl")])
def test_eval(tmp_path, script, task, data):
    env = {"CKPT": str(tmp_path / "ckpt"), "MODEL_DIR": _model_dir(tmp_path, QWEN2_5_3B),
           "DATA_DIR": SAMPLES, "EVAL_FILES": data, "RETRIEVER": os.path.join(SAMPLES, "corpus.jsonl")}
    out = _run(script, env)
    assert out.returncode == 0, out.stderr
    assert f"mcore-to-hf --load {tmp_path / 'ckpt'} --out {tmp_path / 'ckpt'}-hf" in out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"dry run: python -m emapg_megatron.evaluate --task {task} "
                           f"--data-path {os.path.join(SAMPLES, data)} --load {tmp_path / 'ckpt'}-hf")
    if task == "math":
        assert "--num-samples-per-prompt 32 --temperature 0.8 --top-p 0.9 --max-new-tokens 28000 --seed 429" in line
    else:
        assert "--max-turns 4 --num-samples-per-prompt 1 --temperature 0.0" in line
    out = _run(script, {**env, "EVAL_FILES": "missing.jsonl"})
    assert out.returncode != 0 and "not found" in out.stderr
