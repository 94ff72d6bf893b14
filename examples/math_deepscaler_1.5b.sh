#!/usr/bin/env bash
# EMA-PG on math: DeepSeek-R1-Distill-Qwen-1.5B on DeepScaleR-style data (paper Sec. 6), one node
# of 8x H100, BF16, vLLM rollouts colocated with training, staged response lengths 8k/16k/24k.
#
#   MODEL_DIR=/models/DeepSeek-R1-Distill-Qwen-1.5B DATA_DIR=/data/deepscaler SAVE_DIR=/ckpt \
#   STAGE=8k bash examples/math_deepscaler_1.5b.sh          # then STAGE=16k, then STAGE=24k
#
# Environment:
#   MODEL_DIR   HF directory of the base model (config.json, tokenizer, safetensors)
#   DATA_DIR    training data; TRAIN_FILE inside it (default deepscaler.json: the DeepScaleR
#               40k problems with `problem` and `answer` columns)
#   SAVE_DIR    checkpoints and logs go to SAVE_DIR/math-1.5b-<kl>-<stage>; a later stage
#               resumes (--load) from the previous stage's directory: step count, optimizer,
#               LR schedule and the EMA anchor all carry over
#   STAGE       8k | 16k | 24k (default 8k)
#   KL_LOSS     topk-reverse (default: Top-k reverse KL, k = 32, the paper's EMA-PG) or k3 (what
#               the reference math scripts actually ran: K3 with the EMA anchor); see
#               math_deepscaler_1.5b_k3.sh
#   PRECISION   bf16 (default) or fp8 (TE hybrid FP8 for the trainer's GEMMs; vLLM samples in
#               BF16 from the dequantised weights); see math_deepscaler_1.5b_fp8.sh
#   KL_TAIL     unbiased (default; the corrected tail gradient) or paper (the tail exactly as
#               printed / as in the reference code); see docs/kl_estimators.md
#   NNODES NPROC NODE_RANK MASTER_ADDR MASTER_PORT   launcher (default one node, 8 GPUs)
#   DRY_RUN=1   validate the configuration on CPU instead of training
# Extra arguments are passed to the trainer and override the flags below.
# shellcheck source=examples/lib/launch.sh
source "$(dirname "$0")/lib/launch.sh"
require_env MODEL_DIR DATA_DIR SAVE_DIR

STAGE=${STAGE:-8k}
KL_LOSS=${KL_LOSS:-topk-reverse}
PRECISION=${PRECISION:-bf16}
KL_TAIL=${KL_TAIL:-unbiased}
TRAIN_FILE=${TRAIN_FILE:-deepscaler.json}

# Stage schedule. The reference moved 8k -> 16k at step 480 and 16k -> 24k at step 800
# (steps are cumulative: a stage trains up to --train-iters). The 24k end is not given in the
# reference README; 1000 is our choice.
MAX_PROMPT_LEN=1024
case "$STAGE" in
    8k)  RESPONSE_LEN=8192;  TRAIN_ITERS=480;  MICRO_BATCH=2; PREVIOUS= ;;
    16k) RESPONSE_LEN=16384; TRAIN_ITERS=800;  MICRO_BATCH=1; PREVIOUS=8k ;;
    24k) RESPONSE_LEN=24576; TRAIN_ITERS=1000; MICRO_BATCH=1; PREVIOUS=16k ;;
    *) echo "error: STAGE must be 8k, 16k or 24k (got $STAGE)" >&2; exit 2 ;;
esac

case "$KL_LOSS" in
    topk-reverse) KL_TAG=topk ;;
    k3) KL_TAG=k3 ;;  # sampled K3 (GRPO's estimator); --kl-topk-tokens is then unused
    *) echo "error: KL_LOSS must be topk-reverse or k3 (got $KL_LOSS)" >&2; exit 2 ;;
esac

case "$PRECISION" in
    bf16) PRECISION_FLAGS=(--bf16) ; RUN_TAG=math-1.5b-$KL_TAG ;;
    fp8)  PRECISION_FLAGS=(--bf16 --fp8-format hybrid --fp8-recipe delayed) ; RUN_TAG=math-1.5b-$KL_TAG-fp8 ;;
    *) echo "error: PRECISION must be bf16 or fp8 (got $PRECISION)" >&2; exit 2 ;;
esac

RUN_DIR=$SAVE_DIR/$RUN_TAG-$STAGE
LOAD_FLAGS=()
[[ -n "$PREVIOUS" ]] && LOAD_FLAGS=(--load "$SAVE_DIR/$RUN_TAG-$PREVIOUS")

emapg_train \
    --task math \
    --load-hf "$MODEL_DIR" \
    --data-path "$DATA_DIR/$TRAIN_FILE" \
    --seed 1234 \
    --train-iters "$TRAIN_ITERS" \
    `# layout: TP 2 x DP 4 per node; the distributed optimizer shards fp32 state over DP` \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 1 \
    --use-distributed-optimizer \
    "${PRECISION_FLAGS[@]}" \
    `# sequence: prompt (<= 1024) + response` \
    --seq-length "$((MAX_PROMPT_LEN + RESPONSE_LEN))" \
    --max-new-tokens "$RESPONSE_LEN" \
    `# rollout: 128 prompts x 8 samples per step, DeepScaleR's temperature 0.6, no top-p` \
    --rollout-engine vllm \
    --rollout-batch-size 128 \
    --num-samples-per-prompt 8 \
    --temperature 0.6 \
    --top-p 1.0 \
    `# GRPO with clip-higher: mini-batch 64 prompts = 512 sequences, 1 PPO epoch` \
    --global-batch-size 512 \
    --micro-batch-size "$MICRO_BATCH" \
    --ppo-epochs 1 \
    --advantage-norm group \
    --clip-eps-low 0.2 \
    --clip-eps-high 0.28 \
    --loss-agg-mode token-mean \
    --entropy-coef 0.0 \
    `# AdamW, full fine-tune` \
    --lr 1e-6 \
    --lr-decay-style constant \
    --lr-warmup-iters 0 \
    --weight-decay 0.01 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --adam-eps 1e-8 \
    --clip-grad 1.0 \
    `# token-level KL to the EMA anchor: beta 0.001, Top-k k = 32 (or K3), IW unclipped` \
    --kl-loss-type "$KL_LOSS" \
    --kl-topk-tokens 32 \
    --kl-tail "$KL_TAIL" \
    --kl-coef 0.001 \
    --kl-in-reward-coef 0.0 \
    `# EMA anchor: eta 0.95, updated every T_ema = 10 steps` \
    --ema-eta 0.95 \
    --ema-update-period 10 \
    `# checkpoints every 20 steps (and on SIGTERM), logs next to them` \
    --save "$RUN_DIR" \
    --save-interval 20 \
    "${LOAD_FLAGS[@]}" \
    --log-dir "$RUN_DIR/logs" \
    --log-interval 1 \
    "$@"
