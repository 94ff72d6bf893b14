"""A teacher whose vocabulary is padded larger than the student's, over the same tokenizer
(Qwen2.5-0.5B's 151,936 rows against 7B's 152,064): accepted, its padding rows never sampled and
carrying no mass into the top-k or the tail, so distillation trains exactly as with the same
teacher cut to the student's rows; a teacher with fewer rows, or padded but of another tokenizer,
is refused in one line (issue 39, distillation)."""

import json
import shutil

import pytest
import torch
from train_run_workers import train_steps
from trainer_launch import COMPARED

from emapg_megatron.errors import ConfigError
from emapg_megatron.multiprocess import run_distributed

PAD = 16  # the teacher's extra rows


def _teacher(root, student: str, rows: int, source: dict) -> str:
    """A 3-layer Qwen2 teacher with the student's tokenizer files and ``rows`` vocabulary rows,
    its weights ``source`` cut (or padded) to them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / f"teacher-{rows}"
    shutil.copytree(student, out)
    d = {k: v for k, v in json.loads((out / "config.json").read_text()).items()
         if k not in ("layer_types", "architectures", "transformers_version")}
    cfg = AutoConfig.for_model(d.pop("model_type"), **{**d, "vocab_size": rows, "num_hidden_layers": 3})
    model = AutoModelForCausalLM.from_config(cfg)
    big = source["model.embed_tokens.weight"].shape[0]  # the embedding, and a tied or untied head
    state = {k: (v[:rows] if v.dim() == 2 and v.shape[0] == big else v) for k, v in source.items()}
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tiny_hf import build_tiny_hf
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("padded")
    student = build_tiny_hf(str(root / "student"))
    n = json.loads((root / "student" / "config.json").read_text())["vocab_size"]
    d = {k: v for k, v in json.loads((root / "student" / "config.json").read_text()).items()
         if k not in ("layer_types", "architectures", "transformers_version")}
    cfg = AutoConfig.for_model(d.pop("model_type"), **{**d, "vocab_size": n + PAD, "num_hidden_layers": 3})
    torch.manual_seed(3)
    big = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # a peaked teacher, and padding rows that would matter if they leaked
        big.get_input_embeddings().weight.mul_(6.0)
        big.get_input_embeddings().weight[n:] = 50.0
    weights = big.state_dict()
    return {"student": student, "n": n, "padded": _teacher(root, student, n + PAD, weights),
            "cut": _teacher(root, student, n, weights), "smaller": _teacher(root, student, n - PAD, weights)}


def _argv(student: str, teacher: str, tp: int = 1) -> list:
    return ["--preset", "tiny-cpu", "--task", "math", "--load-hf", student, "--data-path",
            "data/samples/math.jsonl", "--seq-length", "192", "--max-new-tokens", "8", "--chat-template",
            "never", "--teacher-load-hf", teacher, "--kl-coef", "1", "--kl-loss-type", "topk-forward",
            "--kl-topk-tokens", "8", "--rollout-batch-size", "2", "--num-samples-per-prompt", "2",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--make-vocab-size-divisible-by", "16",
            "--tensor-model-parallel-size", str(tp), "--lr", "1e-3"]


@pytest.mark.slow
def test_a_teacher_padded_larger_trains_as_the_one_cut_to_the_students_rows(folders):
    pytest.importorskip("math_verify")
    cut = run_distributed(train_steps, 1, args=(_argv(folders["student"], folders["cut"]), 3))[0]["metrics"]
    for tp in (1, 2):
        outs = run_distributed(train_steps, tp, tp=tp, args=(_argv(folders["student"], folders["padded"], tp), 3),
                               timeout=600)
        for out in outs:
            for step, (m, r) in enumerate(zip(out["metrics"], cut), start=1):
                assert m["reward_mean"] == r["reward_mean"], (tp, step)
                for k in COMPARED:
                    if k != "ema_lag":
                        assert m[k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), (k, tp, step)
    assert cut[-1]["kl"] > 0.05 and all(torch.isfinite(torch.tensor(m["kl"])) for m in cut)


def test_a_teacher_with_fewer_rows_is_refused(folders):
    from emapg_megatron import build

    with pytest.raises(ConfigError) as e:
        build.prepare([*_argv(folders["student"], folders["smaller"]), "--dry-run"])
    msg = str(e.value)
    assert "\n" not in msg and f"{folders['n'] - PAD} rows" in msg and f"the student's {folders['n']}" in msg
