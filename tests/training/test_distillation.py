"""On-policy distillation: a frozen teacher of another depth and width is the KL anchor.

The teacher is loaded through the HF converter (--teacher-load-hf) on the student's TP/PP layout.
Three trainer steps at TP=2, PP=2 and TP=2 with sequence parallelism give the one-rank metrics
(rel <= 1e-4) on real shapes: Qwen2.5 (tied embeddings, GQA, QKV bias) and Qwen3 (tied,
qk-layernorm). The teacher pass really differs from an EMA pass (a test below), and every bad
teacher input is one line before any work.
"""

import pytest
import torch
from test_equivalence_matrix import ARCHS, LAYOUTS, argv_for
from train_run_workers import train_steps
from trainer_launch import COMPARED

from emapg_megatron.errors import ConfigError
from emapg_megatron.multiprocess import run_distributed

STEPS = 3
DISTILLED = [a for a in ARCHS if a.startswith("qwen")]
TEACHER_SHAPE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6,
                     num_key_value_heads=2)
# the teacher replaces the EMA: drop the EMA flags of the equivalence matrix's base
KEEP = {"--ema-update-period": 2, "--ema-eta": 2}


def build_teacher(out_dir, arch: str) -> str:
    import transformers

    family, extra = ARCHS[arch]
    cfg = getattr(transformers, f"{family}Config")(vocab_size=16, max_position_embeddings=64,
                                                   **TEACHER_SHAPE, **extra)
    torch.manual_seed(1)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    with torch.no_grad():  # a peaked teacher, so the KL to it is far from the student's self
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return str(out_dir)


def without_ema(argv: list) -> list:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in KEEP:
            i += KEEP[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def distill_argv(student: str, teacher: str, layout: str) -> list:
    return [*without_ema(argv_for(student, layout)), "--teacher-load-hf", teacher, "--kl-coef", "0.5"]


@pytest.fixture(scope="module")
def models(hf_models, tmp_path_factory):
    """Each student (conftest.py's hf_models, shared with the equivalence matrix) and its teacher."""
    return {a: (hf_models[a], build_teacher(tmp_path_factory.mktemp(f"t-{a}"), a)) for a in DISTILLED}


@pytest.fixture(scope="module")
def references(models):
    """The one-rank run of each architecture (the same for every layout)."""
    return {a: run_distributed(train_steps, 1, args=(one_rank(distill_argv(s, t, "tp2")), STEPS))[0]["metrics"]
            for a, (s, t) in models.items()}


CASES = [(a, lay) for a in DISTILLED for lay in ("tp2", "pp2", "tp2-sp")]


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout", CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
def test_teacher_layout_matches_one_rank(arch, layout, models, references):
    student, teacher = models[arch]
    ref = references[arch]
    nproc, tp, pp, _ = LAYOUTS[layout]
    outs = run_distributed(train_steps, nproc, tp=tp, pp=pp,
                           args=(distill_argv(student, teacher, layout), STEPS), timeout=600)
    for rank, out in enumerate(outs):
        for step, (m, r) in enumerate(zip(out["metrics"], ref), start=1):
            assert m["reward_mean"] == r["reward_mean"], (rank, step)
            assert "ema_lag" not in m and m["teacher_pass_s"] >= 0
            for k in COMPARED:
                if k != "ema_lag":
                    assert m[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), (k, rank, step)
    assert ref[-1]["kl"] > 0.05  # a real teacher signal, not the policy against itself


def one_rank(argv: list) -> list:
    """The same run on one process: TP = PP = 1, no sequence parallelism."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
            out += [argv[i], "1"]
            i += 2
        elif argv[i] == "--sequence-parallel":
            i += 1
        else:
            out.append(argv[i])
            i += 1
    return out


# --- bad input: one line, before any work -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_hf_model, tmp_path_factory):
    """A student HF folder with a tokenizer, and teachers: a good one, one of another vocabulary,
    one whose query groups TP=2 cannot split, one with another tokenizer of the same size."""
    import json
    import pathlib
    import shutil

    root = tmp_path_factory.mktemp("tiny")
    student = tiny_hf_model  # conftest.py's, read only: each teacher below is a changed copy
    n = json.loads((pathlib.Path(student) / "config.json").read_text())["vocab_size"]

    def variant(name, **config):
        """The student's folder with ``config`` changed and weights of that shape."""
        from transformers import AutoConfig, AutoModelForCausalLM

        shutil.copytree(student, root / name)
        d = {k: v for k, v in json.loads((pathlib.Path(student) / "config.json").read_text()).items()
             if k not in ("layer_types", "architectures", "transformers_version")}
        cfg = AutoConfig.for_model(d.pop("model_type"), **{**d, **config})
        AutoModelForCausalLM.from_config(cfg).save_pretrained(root / name, safe_serialization=True)
        return str(root / name)

    other_tok = variant("other-tokenizer")
    tok_path = root / "other-tokenizer" / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[5], sorted(vocab)[6]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_path.write_text(json.dumps(tok))
    return {"student": student, "teacher": variant("teacher", num_hidden_layers=3),
            "vocab": variant("vocab", vocab_size=n - 8), "groups": variant("groups", num_key_value_heads=1),
            "tokenizer": other_tok, "n": n}


def _refused(tiny, *flags, world="1"):
    from emapg_megatron import build

    argv = ["--preset", "tiny-cpu", "--task", "math", "--load-hf", tiny["student"], "--data-path",
            "data/samples/math.jsonl", "--seq-length", "128", "--max-position-embeddings", "128",
            "--chat-template", "never", "--tensor-model-parallel-size", world, "--dry-run",
            "--world-size", world, *flags]
    with pytest.raises(ConfigError) as e:
        build.prepare(argv)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_teacher_of_another_vocabulary_names_both_sizes(tiny):
    """Fewer rows than the student (a larger, padded one over the same tokenizer is accepted:
    test_distillation_padded_vocab.py)."""
    msg = _refused(tiny, "--teacher-load-hf", tiny["vocab"])
    assert f"vocabulary has {tiny['n'] - 8} rows, the student's {tiny['n']}" in msg


def test_a_teacher_of_another_tokenizer_is_refused(tiny):
    assert "its tokenizer differs from the student's" in _refused(tiny, "--teacher-load-hf", tiny["tokenizer"])


def test_a_teacher_the_layout_cannot_split_is_refused(tiny):
    msg = _refused(tiny, "--teacher-load-hf", tiny["groups"], world="2")
    assert "the teacher cannot be split like the student" in msg and "query groups (1)" in msg


@pytest.mark.parametrize("flags, expected", [
    (["--teacher-load-hf", "/nonexistent/teacher"], "--teacher-load-hf path does not exist: /nonexistent/teacher"),
    (["--teacher-checkpoint", "/nonexistent/ckpt"], "--teacher-checkpoint path does not exist: /nonexistent/ckpt"),
    (["--teacher-load-hf", "T", "--ema-eta", "0.5"], "--ema-eta cannot apply with --teacher-load-hf"),
    (["--teacher-load-hf", "T", "--ema-cpu-offload"], "--ema-cpu-offload cannot apply"),
    (["--teacher-load-hf", "T", "--teacher-checkpoint", "T"], "not both"),
    (["--teacher-load-hf", "T", "--kl-coef", "0"], "needs --kl-coef > 0"),
    (["--teacher-cpu-offload"], "--teacher-cpu-offload needs a teacher"),
    (["--no-task-reward"], "--no-task-reward is for distillation"),
])
def test_teacher_flags_that_cannot_apply(tiny, flags, expected):
    flags = [tiny["teacher"] if f == "T" else f for f in flags]
    assert expected in _refused(tiny, *flags)


def test_a_checkpoint_teacher_is_read_from_its_metadata(tiny, tmp_path):
    """--teacher-checkpoint takes emapg-convert's output (its stored model config)."""
    from emapg_megatron import build
    from emapg_megatron.checkpoint.convert import hf_to_mcore

    hf_to_mcore(tiny["teacher"], tmp_path / "mcore")
    argv = ["--preset", "tiny-cpu", "--task", "math", "--load-hf", tiny["student"], "--data-path",
            "data/samples/math.jsonl", "--seq-length", "128", "--max-position-embeddings", "128",
            "--chat-template", "never", "--tensor-model-parallel-size", "1", "--dry-run",
            "--teacher-checkpoint", str(tmp_path / "mcore")]
    inputs = build.prepare(argv)
    assert inputs.teacher_cfg.num_layers == 3 and inputs.teacher_cfg.vocab_size == tiny["n"]


@pytest.mark.slow
def test_a_trainer_checkpoint_teaches_and_a_distilled_run_resumes_only_with_its_teacher(tmp_path):
    """The trainer end to end, as emapg-train runs it on 2 ranks once its checks passed: a run's
    --save folder is a teacher; the distilled run resumes with it; resumed without it, the
    checkpoint (no EMA) is refused in one line, exit 2."""
    from trainer_launch import emapg_train as launch

    teacher, student = tmp_path / "teacher", tmp_path / "student"
    run = launch("--train-iters", "2", "--save", str(teacher), "--log-dir", str(tmp_path / "t-log"))
    assert run.returncode == 0, run.stderr
    distil = ["--teacher-checkpoint", str(teacher), "--num-layers", "1", "--no-task-reward",  # the demo's
              "--kl-coef", "1", "--kl-loss-type", "topk-forward", "--save", str(student),
              "--log-dir", str(tmp_path / "s-log")]
    run = launch(*distil, "--train-iters", "2")
    assert run.returncode == 0, run.stderr
    assert "teacher " + str(teacher) + ": 2 layers" in run.stdout
    run = launch(*distil, "--train-iters", "3", "--load", str(student))
    assert run.returncode == 0, run.stderr
    rest = [a for a in distil if a not in ("--teacher-checkpoint", str(teacher), "--no-task-reward")]
    run = launch(*rest, "--train-iters", "4", "--load", str(student))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: checkpoint {student}/iter_0000003 has no EMA tensor ema.embedding.word_embeddings.weight "
        "(it holds no EMA anchor: a distillation run's checkpoint resumes with its teacher, "
        "--teacher-load-hf or --teacher-checkpoint)"]
