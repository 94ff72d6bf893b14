"""Bad input fails before any work starts: one line on stderr, exit code 2, no traceback.

The CLI's entry point runs in this process (a ``--dry-run`` starts no process group), so each case
costs milliseconds rather than an interpreter start; ``test_cli_subprocess_exit_code`` checks once
that the real command line behaves the same.
"""

import contextlib
import io
import subprocess
import sys
from types import SimpleNamespace

import pytest

from emapg_megatron import train

BASE = ["--preset", "tiny-cpu", "--dry-run"]
EP_BATCH = ["--tensor-model-parallel-size", "1", "--micro-batch-size", "16", "--global-batch-size", "64"]


def run_cli(*argv, env_world=None):
    """``python -m emapg_megatron.train BASE argv`` in process: (returncode, stdout, stderr)."""
    argv = [*BASE, *argv] + (["--world-size", str(env_world)] if env_world is not None else [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.mark.launch
def test_cli_subprocess_exit_code():
    cmd = [sys.executable, "-m", "emapg_megatron.train", *BASE, "--ema-eta", "1.5", "--world-size", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: --ema-eta must be in [0, 1] (got 1.5)", r.stderr


@pytest.mark.parametrize("argv, world, message", [
    (["--tensor-model-parallel-size", "8"], 8, "does not divide the number of attention heads"),
    ([], 3, "is not TP x PP x DP"),
    (["--distributed-backend", "nccl"], 2, "CPU mode cannot use the nccl backend"),
    (["--kl-topk-tokens", "64"], 2, "exceeds the vocabulary"),
    (["--ema-eta", "1.5"], 2, "--ema-eta must be in [0, 1]"),
    (["--ema-update-period", "0"], 2, "--ema-update-period must be >= 1"),
    (["--ema-shard-over-dp"], 2, "needs --use-distributed-optimizer"),
    (["--global-batch-size", "48"], 2, "does not divide the rollout batch"),
    (["--micro-batch-size", "48"], 2, "is not divisible by --micro-batch-size"),
    (["--load", "/nonexistent/ckpt"], 2, "--load path does not exist"),
    (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"], 2, None),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"],
     2, "does not divide the number of layers"),
    (["--kl-iw-clip", "2", "1"], 2, "--kl-iw-clip needs 0 <= MIN <= MAX"),
    (["--task", "math"], 2, "needs --load-hf"),
    (["--task", "math", "--load-hf", "/tmp"], 2, "needs --data-path"),
    (["--vllm-tensor-parallel-size", "2", "--tensor-model-parallel-size", "1"], 1,
     "--vllm-tensor-parallel-size 2 must divide --tensor-model-parallel-size 1"),
    (["--vllm-gpu-memory-utilization", "0"], 2, "--vllm-gpu-memory-utilization must be in (0, 1]"),
    # mixture of experts (issue 41)
    ([*EP_BATCH, "--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "--expert-model-parallel-size 2 does not divide the 3 experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], 2, "the router's top-k (5) exceeds the 4 experts"),
    ([*EP_BATCH, "--expert-model-parallel-size", "2"], 2, "needs a mixture-of-experts model"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "1"], 2,
     "expert TP=1 x EP=4 x PP=1 does not divide it"),
    ([*EP_BATCH, "--num-experts", "4", "--moe-grouped-gemm", "--device", "cpu"], 2, "--moe-grouped-gemm runs on a GPU"),
    (["--num-experts", "1000000000"], 2, "num_experts must be an integer from 1 to 4096"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "1000000000"], 2, "moe_ffn_hidden_size must be an integer"),
    (["--hidden-size", "100000000"], 2, "hidden_size must be an integer from 1 to 65536"),
    ([*EP_BATCH, "--num-experts", "4", "--expert-model-parallel-size", "2", "--partial-rollouts"], 2,
     "--partial-rollouts is not supported at --expert-model-parallel-size 2"),
    ([*EP_BATCH, "--num-experts", "4", "--expert-model-parallel-size", "2", "--sequence-packing"], 2,
     "--sequence-packing is not supported at --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 2, "invalid choice: 'flex'"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "-1"], 2, "--moe-aux-loss-coeff must be >= 0"),
    (["--num-experts", "4"], 2, "MoE layers train at --tensor-model-parallel-size 2 only with --sequence-parallel"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
      "--moe-routing-replay", "r2"], 2,
     "--moe-routing-replay r2 does not support --pipeline-model-parallel-size > 1"),
    (["--moe-routing-replay", "r2"], 2, "--moe-routing-replay r2 needs a mixture-of-experts model"),
    (["--vllm-weight-sync-bucket-mb", "0"], 2, "--vllm-weight-sync-bucket-mb must be > 0"),
    (["--kl-topk-tokens", "0"], 2, "--kl-loss-type topk-reverse needs --kl-topk-tokens >= 1"),
    (["--kl-loss-type", "topk-alpha"], 2, "--kl-loss-type topk-alpha needs --kl-alpha"),
    (["--kl-loss-type", "topk-alpha", "--kl-alpha", "1"], 2, "--kl-alpha: alpha-divergence got alpha=1.0"),
    (["--kl-alpha", "0.5"], 2, "--kl-alpha is only for --kl-loss-type topk-alpha"),
    (["--kl-loss-type", "k3", "--kl-topk-tokens", "0"], 2, None),  # sampled: no top-k needed
    (["--sequence-parallel", "--tensor-model-parallel-size", "1"], 1,
     "--sequence-parallel needs --tensor-model-parallel-size >= 2"),
    (["--sequence-parallel", "--seq-length", "9"], 2, "--sequence-parallel needs --seq-length 9 divisible"),
    (["--bf16", "--fp8-format", "hybrid", "--seq-length", "12", "--max-position-embeddings", "16"], 2,
     "FP8 needs --seq-length (12) to be a multiple of 8"),
    (["--bf16", "--fp8-format", "hybrid"], 2,
     "FP8 needs every GEMM dimension to be a multiple of 16: the padded vocabulary / TP is 8"),
    (["--vocab-size", "5"], 2, "--vocab-size must cover the synthetic task's 13 token ids"),
    (["--rollout-is", "tis", "--rollout-is-threshold", "1"], 2, "--rollout-is-threshold must be a finite number > 1"),
    (["--rollout-is", "tis", "--rollout-is-threshold-lower", "0.5"], 2, "lower bound of --rollout-is mis only"),
    (["--rollout-is", "mis", "--rollout-is-threshold-lower", "1.5"], 2, "must be in [0, 1)"),
    (["--rollout-is", "tis", "--temperature", "0.7"], 2, "it needs --temperature 1 --top-p 1"),
    (["--rollout-is", "mis", "--rollout-is-threshold", "5", "--rollout-is-threshold-lower", "0.2"], 2, None),
    (["--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1 (got 0)"),
    (["--inference-max-requests", "0"], 2, "--inference-max-requests must be >= 1 (got 0)"),
    (["--inference-max-requests", "4"], 2, None),
    (["--inference-batch-times-seqlen-threshold", "0"], 2,
     "--inference-batch-times-seqlen-threshold must be >= 1 or -1 (got 0)"),
    (["--inference-batch-times-seqlen-threshold", "-1"], 2, None),
    # values Megatron would assert on (or divide by) later, after the process group exists
    (["--micro-batch-size", "0"], 2, "--micro-batch-size must be >= 1 (got 0)"),
    (["--global-batch-size", "0"], 2, "--global-batch-size must be >= 1 (got 0)"),
    (["--log-interval", "0"], 2, "--log-interval must be >= 1 (got 0)"),
    (["--num-layers", "0"], 2, "--num-layers must be >= 1 (got 0)"),
    (["--make-vocab-size-divisible-by", "0"], 2, "--make-vocab-size-divisible-by must be >= 1 (got 0)"),
    (["--lr-warmup-iters", "150"], 2, "--lr-warmup-iters 150 must be below --train-iters 150"),
    (["--lr-warmup-fraction", "1.0"], 2, "--lr-warmup-fraction must be in [0, 1) (got 1.0)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], 2, "not both"),
    (["--lr-warmup-fraction", "0.1"], 2, None),
    (["--min-lr", "0.01"], 2, "need 0 <= --min-lr <= --lr (got 0.01, 0.002)"),
    (["--weight-decay", "-1"], 2, "--weight-decay must be >= 0 (got -1.0)"),
    (["--adam-beta2", "1.0"], 2, "--adam-beta1 and --adam-beta2 must be in [0, 1)"),
    (["--lr", "nan"], 2, "must be finite"),
    (["--rollout-engine", "vllm", "--load-hf", "/tmp"], 2, "--rollout-engine vllm needs a GPU"),
    # hardware-free precision checks run in a dry run too
    (["--bf16", "--fp8-format", "hybrid", "--make-vocab-size-divisible-by", "16",
      "--transformer-impl", "local"], 2, "drop --transformer-impl local"),
])
def test_bad_input_is_one_clear_line(argv, world, message):
    r = run_cli(*argv, env_world=world)
    if message is None:  # a valid layout: the dry run succeeds
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr


def test_missing_config_file_and_unknown_key(tmp_path):
    r = run_cli("--config", str(tmp_path / "nope.yaml"), env_world=2)
    assert r.returncode == 2 and "not found" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl-coef: 0.1\nnot-a-flag: 3\n")
    r = run_cli("--config", str(bad), env_world=2)
    assert r.returncode == 2 and "unknown option 'not-a-flag'" in r.stderr


def test_yaml_config_then_command_line_precedence(tmp_path):
    from emapg_megatron.arguments import parse_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text("kl_coef: 0.05\nema-eta: 0.95\n")
    args = parse_args(["--preset", "tiny-cpu", "--config", str(cfg), "--ema-eta", "0.5"])
    assert args.loss.kl_coef == 0.05  # from YAML, over the preset
    assert args.ema.eta == 0.5  # the command line wins
    assert args.parallel.tensor_model_parallel_size == 2  # from the preset
    assert parse_args(["--ref-policy-ema-tau", "0.8"]).ema.eta == 0.8  # reference-repo alias


def test_help_explains_every_flag():
    from emapg_megatron.arguments import build_parser

    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions[1:]:  # after --help: a default is said once, by the text or appended
        said = "default" in (action.help or "").lower() or action.default is None
        assert (formatter._get_help_string(action) == action.help) == said, action.option_strings


def test_megatron_lm_flag_names_are_accepted():
    """Megatron-LM's RL flags set the same settings (a launch line written for it runs here)."""
    from emapg_megatron.arguments import parse_args
    from emapg_megatron.build import model_config

    args = parse_args(["--grpo-prompts-per-step", "3", "--grpo-group-size", "4", "--grpo-iterations", "2",
                       "--grpo-clamp-eps-lower", "0.1", "--grpo-clamp-eps-upper", "0.3",
                       "--grpo-kl-beta", "0.05", "--grpo-entropy-term-weight", "0.01",
                       "--group-query-attention"])
    assert (args.step.rollout_batch_size, args.step.num_samples, args.step.ppo_epochs) == (3, 4, 2)
    assert (args.loss.clip_eps_low, args.loss.clip_eps_high, args.loss.kl_coef, args.loss.entropy_coef) == \
        (0.1, 0.3, 0.05, 0.01)
    assert model_config(args).num_query_groups == 1  # Megatron-LM's default with the switch
    assert model_config(parse_args(["--group-query-attention", "--num-query-groups", "2"])).num_query_groups == 2
    assert model_config(parse_args([])).num_query_groups is None  # one group per head


def test_world_size_flag_is_for_dry_runs(monkeypatch):
    from emapg_megatron.build import world_size_from_env
    from emapg_megatron.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert world_size_from_env(SimpleNamespace(world_size=8, dry_run=True)) == 8  # the flag wins
    assert world_size_from_env(SimpleNamespace(world_size=None, dry_run=False)) == 2
    with pytest.raises(ConfigError, match="--world-size 8 but this run has 2 processes"):
        world_size_from_env(SimpleNamespace(world_size=8, dry_run=False))
    monkeypatch.delenv("WORLD_SIZE")
    assert world_size_from_env(SimpleNamespace(world_size=None, dry_run=True)) == 1


def test_pretrained_checkpoint_must_hold_the_architecture_of_the_run(tmp_path):
    """Checked against the model config the checkpoint stores, before any weights are read."""
    import json

    from emapg_megatron.build import check_pretrained_architecture
    from emapg_megatron.checkpoint.convert import FORMAT, METADATA
    from emapg_megatron.errors import ConfigError
    from emapg_megatron.models.config import ModelConfig

    run = ModelConfig(vocab_size=40, num_query_groups=None)
    check_pretrained_architecture(run, str(tmp_path))  # no stored config (not ours): not checked
    stored = ModelConfig(vocab_size=40, num_query_groups=4, max_position_embeddings=4096)
    (tmp_path / METADATA).write_text(json.dumps({"format": FORMAT, "model_config": stored.to_dict()}))
    check_pretrained_architecture(run, str(tmp_path))  # 4 groups = one per head; RoPE length free
    stored.num_layers, stored.qk_layernorm = 4, True
    (tmp_path / METADATA).write_text(json.dumps({"format": FORMAT, "model_config": stored.to_dict()}))
    with pytest.raises(ConfigError, match=r"num_layers: checkpoint 4, run 2; qk_layernorm: checkpoint True"):
        check_pretrained_architecture(run, str(tmp_path))


@pytest.mark.parametrize("yaml_text, message", [
    ("lr: [1, 2]\n", "lr: must be a single value"),
    ("train-iters: 2.7\n", "train-iters: must be an integer"),
    ("train-iters: true\n", "train-iters: must be a number"),
    ('dry-run: "false"\n', "dry-run: must be true, false or one of summary, json"),
    ("kl-tail: bogus\n", "kl-tail: must be one of unbiased, paper, none"),
    ("kl-iw-clip: 2\n", "kl-iw-clip: must be a list of 2 values"),
    ("lr: abc\n", "lr: could not convert string to float"),
])
def test_yaml_values_get_the_command_line_checks(tmp_path, yaml_text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    r = run_cli("--config", str(cfg), env_world=2)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --config file") and message in lines[0], r.stderr


def test_yaml_values_of_the_right_type_are_taken(tmp_path):
    from emapg_megatron.arguments import parse_args

    cfg = tmp_path / "c.yaml"
    cfg.write_text("kl-iw-clip: [0.5, 2]\ntrain-iters: 3\nlr: 1e-5\nbf16: false\nkl-tail: paper\n")
    args = parse_args(["--config", str(cfg)])
    assert (args.kl.iw_clip, args.loop.train_iters, args.optim.lr, args.precision.bf16, args.kl.tail) == \
        ((0.5, 2.0), 3, 1e-5, False, "paper")


def test_over_long_prompts_stop_before_any_work():
    r = run_cli("--max-new-tokens", "6", env_world=2)
    assert r.returncode == 2
    assert r.stderr.startswith("error: all 4096 prompts in the built-in synthetic-copy data are longer "
                               "than --seq-length 8 - --max-new-tokens 6 = 2 tokens")


def test_unwritable_output_paths_stop_before_any_work(tmp_path):
    """Checked in the launching process, before a process group exists (a dry run skips it: its
    paths may be those of another machine)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for flag in ("--save", "--log-dir", "--tensorboard-dir"):
        r = run_cli(flag, str(blocker / "sub"), env_world=2)
        assert r.returncode == 0, r.stderr  # --dry-run
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            train.main(["--preset", "tiny-cpu", "--tensor-model-parallel-size", "1", flag, str(blocker / "sub")])
        assert e.value.code == 2 and err.getvalue().strip() == f"error: {flag} {blocker / 'sub'}: {blocker} is not a directory"


def test_vllm_samples_a_mixture_of_experts_policy_at_any_expert_parallelism():
    """vLLM gets every expert from the weight sync (tests/rollout/test_vllm_engine_orchestration.py)
    and its ranks need not run in step: no expert-group sampling."""
    from emapg_megatron.arguments import parse_args, validate_architecture
    from emapg_megatron.models.config import ModelConfig

    for ep in ("1", "2"):
        cfg = parse_args(["--preset", "tiny-cpu", "--rollout-engine", "vllm", "--tensor-model-parallel-size", "1",
                          "--expert-model-parallel-size", ep])
        validate_architecture(cfg, ModelConfig(vocab_size=13, num_experts=4))
