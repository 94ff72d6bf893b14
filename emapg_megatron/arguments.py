"""Command line of the trainer: Megatron-LM flag names, YAML configs, presets, validation.

Precedence: built-in defaults < ``--preset`` < ``--config FILE.yaml`` < the command line.
YAML keys are flag names without dashes, with ``-`` or ``_`` (``kl-coef`` or ``kl_coef``).
Everything is validated by :func:`validate` before any process group or model exists.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from importlib import resources

import yaml

from emapg_megatron.algo.policy_loss import LossConfig
from emapg_megatron.algo.rollout_correction import ROLLOUT_IS_MODES
from emapg_megatron.anchor.ema import EmaConfig
from emapg_megatron.kl import LOSS_TYPE_NAMES, TOPK_TAILS
from emapg_megatron.models.gpt import PrecisionConfig
from emapg_megatron.rollout.kv_cache_decoding import MAX_FORWARD_TOKENS
from emapg_megatron.rollout.vllm_engine import VLLMConfig
from emapg_megatron.runtime import ConfigError, ParallelConfig, validate_parallel
from emapg_megatron.tasks.search import SearchConfig
from emapg_megatron.trainer import KLConfig, StepConfig
from emapg_megatron.training.model_and_optimizer import OptimConfig

TASKS = ("synthetic-copy", "math", "search")
PRESETS_PACKAGE = "emapg_megatron.presets"


def _groups(p: argparse.ArgumentParser):
    return {name: p.add_argument_group(name) for name in (
        "run", "parallel", "model", "precision", "optimization", "checkpointing", "logging",
        "rollout", "task", "vllm", "grpo", "kl", "ema")}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help text already says what the default is, or there
    is none (an unset optional flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is None:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="emapg-train",
        description="EMA Policy Gradient / GRPO on Megatron-Core. Launch with "
                    "`torchrun --nproc_per_node N -m emapg_megatron.train ...`. The defaults of the "
                    "model and KL flags are a real LM's; for a first run on a CPU, use "
                    "--preset tiny-cpu. Megatron-LM's names for the same settings are accepted "
                    "(--grpo-group-size, --grpo-kl-beta, ...).",
        formatter_class=_HelpFormatter,
    )
    g = _groups(p)
    a = g["run"].add_argument
    a("--preset", default=None, help="named configuration shipped with the package, e.g. tiny-cpu")
    a("--config", default=None, help="YAML file supplying any flag; the command line overrides it")
    a("--dry-run", action="store_true",
      help="validate everything, print the resolved config and the parallel layout, then exit")
    a("--world-size", type=int, default=None,
      help="world size to validate a --dry-run against (default: $WORLD_SIZE or 1); a real run "
           "launched by torchrun with another $WORLD_SIZE is refused")
    a("--task", default="synthetic-copy", choices=TASKS, help="RL task providing prompts and rewards")
    a("--data-path", default=None, help="local parquet/jsonl training data (math and search tasks)")
    a("--long-prompts", default="error", choices=("error", "drop"),
      help="prompts longer than --seq-length minus --max-new-tokens (search: --max-turn-tokens): "
           "error stops before training with their count and first row; drop leaves them out and "
           "logs the count")
    a("--seed", type=int, default=1234, help="random seed for weights, data order and sampling")
    a("--train-iters", type=int, default=100,
      help="total trainer steps; a run resumed with --load continues up to this total")
    a("--max-skipped-steps", type=int, default=10,
      help="the run stops when more than this many steps (counted across resumes) were skipped "
           "for a NaN/inf loss or gradient")

    a = g["parallel"].add_argument
    a("--tensor-model-parallel-size", type=int, default=1, help="TP degree (vocab-sharded logits)")
    a("--pipeline-model-parallel-size", type=int, default=1, help="PP degree")
    a("--sequence-parallel", action="store_true",
      help="Megatron sequence parallelism: with TP >= 2, shard the norms' and dropout's activations "
           "along the sequence over the TP group (needs --seq-length divisible by TP)")
    a("--use-distributed-optimizer", action="store_true",
      help="shard optimizer state and fp32 main params across data-parallel ranks")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"),
      help="cpu runs Megatron-Core on the CPU with gloo; auto picks cuda when a GPU is visible")
    a("--distributed-backend", default="auto", choices=("auto", "gloo", "nccl"),
      help="torch.distributed backend; auto = nccl on GPU, gloo on CPU")
    a("--distributed-timeout-minutes", type=int, default=30, help="collective timeout")

    a = g["model"].add_argument
    a("--num-layers", type=int, default=2, help="transformer layers")
    a("--hidden-size", type=int, default=64, help="model width")
    a("--ffn-hidden-size", type=int, default=128, help="SwiGLU inner width")
    a("--num-attention-heads", type=int, default=4, help="query heads")
    a("--num-query-groups", type=int, default=None,
      help="key/value heads (GQA); default: as many as query heads, or 1 with --group-query-attention")
    a("--group-query-attention", action="store_true",
      help="Megatron-LM's GQA switch: --num-query-groups sets the groups (1 when not given); "
           "--num-query-groups alone also works")
    a("--kv-channels", type=int, default=None, help="head dim; default hidden/heads")
    a("--max-position-embeddings", type=int, default=256, help="RoPE table length")
    a("--seq-length", type=int, default=64, help="maximum prompt + response length in tokens")
    a("--rotary-base", type=float, default=10000.0, help="RoPE base")
    a("--norm-epsilon", type=float, default=1e-6, help="RMSNorm epsilon")
    a("--add-qkv-bias", action="store_true", help="bias on the fused QKV projection (Qwen2)")
    a("--qk-layernorm", action="store_true", help="RMSNorm on queries and keys (Qwen3)")
    a("--untie-embeddings-and-output-weights", action="store_true",
      help="separate output layer instead of the tied input embedding")
    a("--make-vocab-size-divisible-by", type=int, default=128,
      help="pad the vocabulary to a multiple of this x TP")
    a("--vocab-size", type=int, default=None,
      help="vocabulary of a randomly initialised model (synthetic task; default: its tokenizer's "
           "13 ids). Larger sizes model a real LM head for benchmarks; ids beyond the tokenizer's "
           "decode to nothing")
    a("--init-method-std", type=float, default=0.02, help="weight init std (random init only)")
    a("--load-hf", default=None,
      help="initialise weights, model shape and tokenizer from a Hugging Face checkpoint directory")
    a("--pretrained-checkpoint", default=None,
      help="initialise weights from a Megatron dist checkpoint (e.g. from emapg-convert), any "
           "TP/PP; the model flags must describe its architecture (checked against the one it "
           "stores)")

    a = g["precision"].add_argument
    a("--bf16", action="store_true", help="bf16 weights and activations, fp32 main params")
    a("--transformer-impl", default="auto", choices=("auto", "local", "transformer_engine"),
      help="layer implementation: Megatron's local spec (CPU and GPU), Transformer Engine's "
           "(GPU; needed for FP8), or auto: TE on a GPU when it imports, else local")
    a("--fp8-format", default=None, choices=("e4m3", "hybrid"),
      help="FP8 GEMMs via Transformer Engine (needs --bf16 and a Hopper GPU): e4m3 everywhere, or "
           "hybrid: e4m3 forward, e5m2 gradients")
    a("--fp8-recipe", default="delayed", choices=("delayed", "tensorwise", "blockwise"),
      help="FP8 scaling recipe")

    a = g["optimization"].add_argument
    a("--lr", type=float, default=1e-6, help="peak learning rate")
    a("--min-lr", type=float, default=0.0, help="final learning rate of the decay")
    a("--lr-decay-style", default="constant", choices=("constant", "linear", "cosine"),
      help="learning-rate schedule after warm-up")
    a("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    a("--lr-warmup-fraction", type=float, default=None,
      help="warm-up as a fraction of --train-iters, in [0, 1) (instead of --lr-warmup-iters)")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    a("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    a("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    a("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0 disables)")
    a("--micro-batch-size", type=int, default=8, help="sequences per forward/backward micro-batch")
    a("--sequence-packing", action="store_true",
      help="pack whole sequences into token rows for the old, anchor and training passes, so no "
           "compute goes to padding: Transformer Engine attention gets PackedSeqParams (THD, "
           "cu_seqlens), the local spec a block-diagonal causal mask with per-sequence positions "
           "(chosen automatically); with DP > 1, sequences move between DP ranks within their PPO "
           "mini-batch so every rank computes about the same tokens (logged as dp_token_imbalance); "
           "every loss normalisation stays that of the padded batch")
    a("--max-tokens-per-microbatch", type=int, default=None,
      help="--sequence-packing: token budget of one packed micro-batch (a longer sequence gets "
           "its own); micro-batch counts are equal on every DP rank and loads balanced. Default: "
           "--micro-batch-size x --seq-length")
    a("--global-batch-size", type=int, default=None,
      help="sequences per optimizer step (PPO mini-batch); default: the whole rollout batch")

    a = g["checkpointing"].add_argument
    a("--save", default=None, help="checkpoint directory to write")
    a("--load", default=None, help="checkpoint directory to resume from")
    a("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")

    a = g["logging"].add_argument
    a("--log-dir", default="runs/emapg", help="metrics.jsonl, curves.png and TensorBoard go here")
    a("--tensorboard-dir", default=None, help="TensorBoard directory (default: LOG_DIR/tensorboard)")
    a("--log-interval", type=int, default=1, help="print a progress line every N steps")

    a = g["rollout"].add_argument
    a("--rollout-engine", default="megatron", choices=("megatron", "vllm"),
      help="built-in Megatron sampler (CPU and GPU) or vLLM (GPU)")
    a("--rollout-kv-cache", action=argparse.BooleanOptionalAction, default=True,
      help="built-in sampler: decode through Megatron-Core's KV cache, feeding only new tokens "
           "(finished sequences leave the batch); --no-rollout-kv-cache recomputes the whole "
           "sequence per token (the reference; also what sequence parallelism falls back to)")
    a("--inference-max-requests", type=int, default=None,
      help="built-in sampler with the KV cache: at most this many sequences share one cache "
           "(Megatron-LM's flag); the rest of a rank's sequences follow in later waves. Megatron's "
           "static cache is allocated whole, every position up to --seq-length, so this bounds "
           "its memory. Default: as many as fit in 80%% of the free GPU memory (all on CPU)")
    a("--inference-batch-times-seqlen-threshold", type=int, default=MAX_FORWARD_TOKENS,
      help="built-in sampler with the KV cache: a forward of more rows x tokens than this (a long "
           "prefill of many sequences) runs in micro-batches of rows through Megatron's inference "
           "path, bounding its activation memory (Megatron-LM's flag; here at any PP size, and "
           "on by default, where Megatron-LM's default -1 is off). Default %(default)s; -1: never "
           "split")
    a("--rollout-batch-size", "--grpo-prompts-per-step", dest="rollout_batch_size", type=int,
      default=8, help="prompts per trainer step (B)")
    a("--num-samples-per-prompt", "--grpo-group-size", dest="num_samples_per_prompt", type=int,
      default=8, help="responses per prompt (N, the GRPO group)")
    a("--max-new-tokens", type=int, default=16,
      help="response length limit (--task search: each model turn has --max-turn-tokens instead)")
    a("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    a("--top-p", type=float, default=1.0,
      help="nucleus sampling threshold in (0, 1]; the KL estimators' importance weights use the "
           "sampler's own (truncated) log-probs, so they stay consistent, but the samples no longer "
           "come from the policy (see docs/kl_estimators.md)")

    a = g["task"].add_argument
    a("--chat-template", default="auto", choices=("auto", "always", "never"),
      help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    a("--math-format-bonus", type=float, default=0.0, help="math: reward bonus for a boxed answer")
    a("--max-turns", type=int, default=SearchConfig.max_turns, help="search: model turns per episode")
    a("--max-turn-tokens", type=int, default=500,
      help="search: token budget of one model turn (0: --max-new-tokens)")
    a("--max-obs-tokens", type=int, default=500, help="search: token budget of one observation")
    a("--retriever", default=None,
      help="search: corpus jsonl (in-process BM25) or http:// URL of a retriever service")
    a("--retriever-topk", type=int, default=3, help="search: passages per search")

    a = g["vllm"].add_argument
    a("--vllm-tensor-parallel-size", type=int, default=None,
      help="vLLM's TP degree (default: the trainer's)")
    a("--vllm-gpu-memory-utilization", type=float, default=0.5,
      help="fraction of GPU memory vLLM may use while awake")
    a("--vllm-sleep-level", type=int, default=2, choices=(0, 1, 2),
      help="vLLM sleep mode during training: 0 never sleeps; 1 copies its weights to CPU and frees "
           "the KV cache; 2 frees both (the default: every step overwrites the weights anyway)")
    a("--vllm-weight-sync-bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    a("--vllm-enforce-eager", action="store_true", help="skip CUDA-graph capture in vLLM")

    a = g["grpo"].add_argument
    a("--advantage-norm", default="group", choices=("group", "global", "none"),
      help="group: (R-mean)/std per prompt; global: z-score over the batch; none: R-mean only")
    a("--advantage-eps", type=float, default=1e-6, help="epsilon added to the std")
    a("--ppo-epochs", "--grpo-iterations", dest="ppo_epochs", type=int, default=1,
      help="passes over the rollout batch (Lambda)")
    a("--clip-eps-low", "--grpo-clamp-eps-lower", dest="clip_eps_low", type=float, default=0.2,
      help="PPO clip epsilon below 1")
    a("--clip-eps-high", "--grpo-clamp-eps-upper", dest="clip_eps_high", type=float, default=0.28,
      help="PPO clip epsilon above 1 (clip-higher)")
    a("--loss-agg-mode", default="token-mean",
      choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
      help="how per-token losses are averaged over the batch")
    a("--entropy-coef", "--grpo-entropy-term-weight", dest="entropy_coef", type=float, default=0.0,
      help="entropy bonus coefficient")
    a("--rollout-is", default="none", choices=ROLLOUT_IS_MODES,
      help="correct the PPO term for the rollout engine's log-probs differing from the trainer's: "
           "tis truncates the per-token ratio pi_old/pi_sampling at the threshold; mis (IcePop) "
           "keeps the ratio inside [lower, threshold] and drops tokens outside; none takes the "
           "rollout as on-policy (docs/rollout_correction.md)")
    a("--rollout-is-threshold", type=float, default=2.0,
      help="upper bound of the ratio for --rollout-is tis/mis (> 1)")
    a("--rollout-is-threshold-lower", type=float, default=None,
      help="--rollout-is mis: lower bound of the ratio (default: 1/threshold)")

    a = g["kl"].add_argument
    a("--kl-loss-type", default="topk-reverse", choices=LOSS_TYPE_NAMES,
      help="token-level KL estimator against the anchor: sampled k1..k5/k3++, Top-k KL, "
           "or a Top-k f-divergence")
    a("--kl-topk-tokens", type=int, default=32, help="k of the Top-k estimators (>= 1 for topk-*)")
    a("--kl-alpha", type=float, default=None,
      help="alpha of the alpha-divergence (--kl-loss-type topk-alpha only): any finite value but 0 "
           "and 1, which are the two KL limits")
    a("--kl-tail", default="unbiased", choices=TOPK_TAILS,
      help="Top-k tail: unbiased (corrected gradient), paper (Algorithms 1/2 as printed), none")
    a("--kl-iw-clip", type=float, nargs=2, default=None, metavar=("MIN", "MAX"),
      help="clip the importance weight pi/pi_sampling of the sampled KL terms: the Top-k "
           "estimators' tail (no effect with --kl-tail none) and the sampled k1..k5 estimators")
    a("--kl-coef", "--grpo-kl-beta", dest="kl_coef", type=float, default=0.001,
      help="beta: weight of the token-level KL loss")
    a("--fused-lm-head", action=argparse.BooleanOptionalAction, default=True,
      help="compute the old, anchor and loss passes' log-probs, top-k and entropy from the final "
           "hidden states and the output weight, chunk by chunk, never holding the logits "
           "(O(hidden + k) bytes per token for backward whatever the vocabulary); "
           "--no-fused-lm-head runs Megatron's output layer and the ops on its logits")
    a("--kl-in-reward-coef", type=float, default=0.0,
      help="sequence-level KL subtracted from the reward (WARP baseline); 0 disables")

    a = g["ema"].add_argument
    a("--ema-eta", "--ref-policy-ema-tau", dest="ema_eta", type=float, default=0.9,
      help="EMA anchor decay eta; 1.0 is the fixed reference policy of GRPO")
    a("--ema-update-period", type=int, default=10, help="update the EMA every T_ema steps")
    a("--ema-shard-over-dp", action="store_true",
      help="shard the EMA across data-parallel ranks (needs --use-distributed-optimizer)")
    a("--ema-cpu-offload", action="store_true", help="keep the EMA in pinned CPU memory")
    a("--ema-stability-interval", type=int, default=0,
      help="estimate the stability margin 1+eta-alpha*beta*lambda every N steps (0: off)")
    return p


def _yaml_defaults(parser: argparse.ArgumentParser, path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest in ("config", "preset"):
            raise ConfigError(f"{what} {path}: unknown option {key!r}")
        try:
            out[dest] = _yaml_value(actions[dest], value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{what} {path}: {key}: {e}") from None
    return out


def _yaml_value(action: argparse.Action, value):
    """A YAML value checked as the command line checks the flag: type, arity and choices."""
    if value is None:
        return None
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false (got {value!r})")
        return value
    if isinstance(action.nargs, int):
        if not isinstance(value, list) or len(value) != action.nargs:
            raise ValueError(f"must be a list of {action.nargs} values (got {value!r})")
        return [_yaml_scalar(action, v) for v in value]
    return _yaml_scalar(action, value)


def _yaml_scalar(action: argparse.Action, value):
    if isinstance(value, (list, dict)):
        raise ValueError(f"must be a single value (got {value!r})")
    kind = action.type
    if kind in (int, float) and isinstance(value, bool):
        raise ValueError(f"must be a number (got {value!r})")
    if kind is int and not (isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("+-").isdigit())):
        raise ValueError(f"must be an integer (got {value!r})")
    out = kind(value) if kind is not None else (value if isinstance(value, str) else str(value))
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))} (got {value!r})")
    return out


def preset_path(name: str) -> str:
    path = resources.files(PRESETS_PACKAGE) / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir()
                           if p.name.endswith(".yaml"))
        raise ConfigError(f"unknown --preset {name!r}; available: {', '.join(available)}")
    return str(path)


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    if first.preset:
        parser.set_defaults(**_yaml_defaults(parser, preset_path(first.preset), "preset"))
    if first.config:
        parser.set_defaults(**_yaml_defaults(parser, first.config, "--config file"))
    return parser.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int, cfg: ComponentConfigs | None = None) -> None:
    """Every check that needs no process group. Raises ConfigError with one line.

    A ``--dry-run`` skips only the checks that need the target hardware (GPU present).
    """
    for dest, low in AT_LEAST.items():  # first: later checks divide by some of them
        value = getattr(args, dest)
        _check(value is None or value >= low, f"--{dest.replace('_', '-')} must be >= {low} (got {value})")
    cfg = cfg or component_configs(args)
    validate_parallel(cfg.parallel, world_size, check_devices=not args.dry_run)
    cfg.optim.validate()
    cfg.ema.validate(args.use_distributed_optimizer)
    cfg.kl.validate()
    cfg.loss.validate()
    cfg.step.validate()
    _validate_schedule(args)
    _check(args.vocab_size is None or args.load_hf is None,
           "--vocab-size is for a randomly initialised model: --load-hf sets the vocabulary")
    _check(args.vocab_size is None or args.vocab_size >= 13,
           f"--vocab-size must cover the synthetic task's 13 token ids (got {args.vocab_size})")
    _check(args.rollout_batch_size >= 1, "--rollout-batch-size and --num-samples-per-prompt must be >= 1")
    _validate_batches(args, world_size)
    _check(args.load is None or os.path.isdir(args.load),
           f"--load path does not exist: {args.load}")
    if not args.dry_run:  # a dry run may validate paths of the machine the run will use
        for flag, path in (("--save", args.save), ("--log-dir", args.log_dir),
                           ("--tensorboard-dir", args.tensorboard_dir)):
            _check_writable_dir(flag, path)
    _check(args.load_hf is None or os.path.isdir(args.load_hf),
           f"--load-hf path does not exist: {args.load_hf}")
    _check(args.pretrained_checkpoint is None or os.path.isdir(args.pretrained_checkpoint),
           f"--pretrained-checkpoint path does not exist: {args.pretrained_checkpoint}")
    _check(args.data_path is None or os.path.exists(args.data_path),
           f"--data-path does not exist: {args.data_path}")
    _check(args.task == "synthetic-copy" or args.load_hf is not None,
           f"--task {args.task} needs --load-hf (for the tokenizer and weights)")
    _check(args.task == "synthetic-copy" or args.data_path is not None,
           f"--task {args.task} needs --data-path")
    _check(args.fp8_format is None or args.bf16, "--fp8-format needs --bf16")
    _check(not args.sequence_parallel or args.tensor_model_parallel_size >= 2,
           "--sequence-parallel needs --tensor-model-parallel-size >= 2")
    _check(not args.sequence_parallel or args.seq_length % args.tensor_model_parallel_size == 0,
           f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
           f"--tensor-model-parallel-size {args.tensor_model_parallel_size}")
    _check(args.task != "search" or args.retriever is not None, "--task search needs --retriever")
    _check(args.rollout_engine != "vllm" or args.load_hf is not None,
           "--rollout-engine vllm needs --load-hf (vLLM reads the tokenizer and config from it)")
    _check(args.rollout_engine != "vllm" or args.device != "cpu",
           "--rollout-engine vllm needs a GPU: drop --device cpu, or sample with the built-in "
           "--rollout-engine megatron")
    _check(args.max_turns >= 1, "--max-turns must be >= 1")
    _check(args.inference_max_requests is None or args.inference_max_requests >= 1,
           f"--inference-max-requests must be >= 1 (got {args.inference_max_requests})")
    _check(args.inference_batch_times_seqlen_threshold == -1 or args.inference_batch_times_seqlen_threshold >= 1,
           f"--inference-batch-times-seqlen-threshold must be >= 1 or -1 "
           f"(got {args.inference_batch_times_seqlen_threshold})")
    _check(args.rollout_is == "none" or (args.temperature == 1.0 and args.top_p == 1.0),
           "--rollout-is compares the engine's log-probs with the trainer's, which are taken at "
           "temperature 1 without top-p: it needs --temperature 1 --top-p 1")
    _validate_vllm(args)


#: Integer flags and their smallest valid value (None, where allowed, means "not set").
AT_LEAST = {"train_iters": 1, "micro_batch_size": 1, "global_batch_size": 1, "num_layers": 1,
            "hidden_size": 1, "num_attention_heads": 1, "num_query_groups": 1, "seq_length": 2,
            "make_vocab_size_divisible_by": 1, "log_interval": 1, "save_interval": 0,
            "max_skipped_steps": 0, "lr_warmup_iters": 0}


def _validate_schedule(args) -> None:
    """The learning-rate schedule's flags, as Megatron's OptimizerParamScheduler asserts them."""
    _check(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
           "give --lr-warmup-iters or --lr-warmup-fraction, not both")
    _check(args.lr_warmup_fraction is None or 0.0 <= args.lr_warmup_fraction < 1.0,
           f"--lr-warmup-fraction must be in [0, 1) (got {args.lr_warmup_fraction})")
    _check(args.lr_warmup_iters < args.train_iters,
           f"--lr-warmup-iters {args.lr_warmup_iters} must be below --train-iters {args.train_iters}")


def _validate_vllm(args) -> None:
    vllm_config(args).check_settings(trainer_tp=args.tensor_model_parallel_size)


def _validate_batches(args, world_size: int) -> None:
    dp = parallel_config(args).data_parallel_size(world_size)
    _check(args.rollout_batch_size % dp == 0,
           f"--rollout-batch-size {args.rollout_batch_size} is not divisible by the "
           f"data-parallel size {dp}")
    rollout = args.rollout_batch_size * args.num_samples_per_prompt
    gbs = args.global_batch_size or rollout
    _check(rollout % gbs == 0,
           f"--global-batch-size {gbs} does not divide the rollout batch "
           f"({args.rollout_batch_size} prompts x {args.num_samples_per_prompt} samples = {rollout})")
    _check(gbs % (args.num_samples_per_prompt * dp) == 0,
           f"--global-batch-size {gbs} must hold whole prompt groups split evenly over data-parallel "
           f"ranks: a multiple of --num-samples-per-prompt {args.num_samples_per_prompt} x DP {dp}")
    _check(gbs % (args.micro_batch_size * dp) == 0,
           f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
           f"{args.micro_batch_size} x data-parallel size {dp}")


def _check_writable_dir(flag: str, path: str | None) -> None:
    """``path`` is a directory, or one can be made there: its nearest existing ancestor is a
    writable directory (else rank 0 would fail alone, after the build, leaving the others waiting)."""
    if path is None:
        return
    there = os.path.abspath(path)
    while not os.path.exists(there):
        there = os.path.dirname(there)
    _check(os.path.isdir(there), f"{flag} {path}: {there} is not a directory")
    _check(os.access(there, os.W_OK | os.X_OK), f"{flag} {path}: {there} is not writable")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# --- flags -> component configs: the one place that maps them ----------------------------------
#: For each component config, the flag (argparse dest) of every field not named like its flag.
#: A field named like its flag needs no entry; a field with no flag keeps its default.
FLAG_OF_FIELD = {
    ParallelConfig: {"backend": "distributed_backend", "timeout_minutes": "distributed_timeout_minutes"},
    EmaConfig: {"eta": "ema_eta", "update_period": "ema_update_period",
                "shard_over_dp": "ema_shard_over_dp", "cpu_offload": "ema_cpu_offload",
                "stability_interval": "ema_stability_interval"},
    KLConfig: {"loss_type": "kl_loss_type", "k": "kl_topk_tokens", "tail": "kl_tail",
               "iw_clip": "kl_iw_clip", "alpha": "kl_alpha"},
    LossConfig: {"agg_mode": "loss_agg_mode"},
    StepConfig: {"num_samples": "num_samples_per_prompt", "mini_batch_size": "global_batch_size"},
    VLLMConfig: {"tensor_parallel_size": "vllm_tensor_parallel_size",
                 "gpu_memory_utilization": "vllm_gpu_memory_utilization",
                 "sleep_level": "vllm_sleep_level", "enforce_eager": "vllm_enforce_eager"},
}


def component_config(cls, args: argparse.Namespace, **derived):
    """``cls`` with every field that has a flag taken from ``args`` (``derived``: computed fields)."""
    renames = FLAG_OF_FIELD.get(cls, {})
    values = {}
    for f in fields(cls):
        dest = renames.get(f.name, f.name)
        if f.name in derived:
            values[f.name] = derived[f.name]
        elif hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    return cls(**values)


@dataclass
class ComponentConfigs:
    """Every component's config, built once from the flags by :func:`component_configs`."""

    parallel: ParallelConfig
    """Layout, device and process-group settings (runtime)."""
    precision: PrecisionConfig
    """dtype, FP8 and layer implementation (models/gpt)."""
    optim: OptimConfig
    """Megatron optimizer (training/model_and_optimizer)."""
    ema: EmaConfig
    """EMA anchor (anchor/ema)."""
    kl: KLConfig
    """Token-level KL term (trainer, KL registry)."""
    loss: LossConfig
    """Policy loss (algo/policy_loss)."""
    step: StepConfig
    """One RL step: sampling, batching, advantages (trainer)."""
    vllm: VLLMConfig
    """vLLM rollout engine (rollout/vllm_engine)."""


def component_configs(args) -> ComponentConfigs:
    rollout = args.rollout_batch_size * args.num_samples_per_prompt
    return ComponentConfigs(
        parallel=parallel_config(args),
        precision=component_config(PrecisionConfig, args),
        optim=component_config(OptimConfig, args),
        ema=component_config(EmaConfig, args),
        kl=component_config(KLConfig, args),
        loss=component_config(LossConfig, args),
        step=component_config(StepConfig, args, mini_batch_size=args.global_batch_size or rollout),
        vllm=vllm_config(args),
    )


def parallel_config(args) -> ParallelConfig:
    return component_config(ParallelConfig, args)


def vllm_config(args) -> VLLMConfig:
    return component_config(VLLMConfig, args, hf_dir=args.load_hf or "",
                            tensor_parallel_size=args.vllm_tensor_parallel_size or args.tensor_model_parallel_size,
                            bucket_bytes=args.vllm_weight_sync_bucket_mb << 20)


def topk_k(args) -> int:
    """k actually used: 0 for the sampled estimators (which need no top-k ids)."""
    return args.kl_topk_tokens if args.kl_loss_type.startswith("topk-") else 0
