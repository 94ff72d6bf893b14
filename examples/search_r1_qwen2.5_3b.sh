#!/usr/bin/env bash
# EMA-PG on agentic search: Qwen2.5-3B (base) learns to call a search engine, Search-R1 protocol
# (paper Sec. 6, Table 2), one node of 8x H100, BF16, vLLM rollouts colocated with training.
#
#   MODEL_DIR=/models/Qwen2.5-3B DATA_DIR=/data/nq_hotpotqa SAVE_DIR=/ckpt \
#   RETRIEVER=http://127.0.0.1:8000/retrieve bash examples/search_r1_qwen2.5_3b.sh
#
# Environment:
#   MODEL_DIR   HF directory of Qwen2.5-3B (base)
#   DATA_DIR    TRAIN_FILE inside it (default train.parquet: the NQ + HotpotQA training sets in
#               Search-R1's format, `question` and `golden_answers` columns)
#   SAVE_DIR    checkpoints and logs go to SAVE_DIR/search-3b-topk
#   RETRIEVER   a retriever service URL (Search-R1's e5 server over Wikipedia-18, or
#               `python -m emapg_megatron.tasks.retriever --corpus C`), or a corpus jsonl for the
#               in-process BM25 retriever
#   KL_TAIL     unbiased (default) or paper (the tail as in the reference code)
#   NNODES NPROC NODE_RANK MASTER_ADDR MASTER_PORT   launcher (default one node, 8 GPUs)
#   DRY_RUN=1   validate the configuration on CPU instead of training
# Extra arguments are passed to the trainer and override the flags below.
# shellcheck source=examples/lib/launch.sh
source "$(dirname "$0")/lib/launch.sh"
require_env MODEL_DIR DATA_DIR SAVE_DIR RETRIEVER

KL_TAIL=${KL_TAIL:-unbiased}
TRAIN_FILE=${TRAIN_FILE:-train.parquet}
RUN_DIR=$SAVE_DIR/search-3b-topk

# Episode: a prompt of at most 2048 tokens, then at most 4 model turns of at most 500 tokens,
# each but the last answered by at most 500 observation tokens (3 retrieved passages):
# 2048 + 4 x 500 + 3 x 500 = 5548 <= 6144.
emapg_train \
    --task search \
    --load-hf "$MODEL_DIR" \
    --data-path "$DATA_DIR/$TRAIN_FILE" \
    --seed 1234 \
    --train-iters 1005 \
    `# layout: TP 2 x DP 4 per node; the distributed optimizer shards fp32 state over DP` \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 1 \
    --use-distributed-optimizer \
    --bf16 \
    --seq-length 6144 \
    `# the Search-R1 environment: base model, plain prompt (no chat template)` \
    --retriever "$RETRIEVER" \
    --retriever-topk 3 \
    --max-turns 4 \
    --max-turn-tokens 500 \
    --max-obs-tokens 500 \
    --chat-template never \
    `# rollout: 512 prompts x 5 samples per step; the reference sampled with top-p 0.95 (the` \
    `# recorded sampling log-prob keeps the KL importance weight exact)` \
    --rollout-engine vllm \
    --rollout-batch-size 512 \
    --num-samples-per-prompt 5 \
    --max-new-tokens 500 \
    --temperature 1.0 \
    --top-p 0.95 \
    `# GRPO with clip-higher: mini-batch 256 prompts = 1280 sequences, 1 PPO epoch` \
    --global-batch-size 1280 \
    --micro-batch-size 2 \
    --ppo-epochs 1 \
    --advantage-norm group \
    --clip-eps-low 0.2 \
    --clip-eps-high 0.28 \
    --loss-agg-mode token-mean \
    --entropy-coef 0.0 \
    `# AdamW, betas (0.9, 0.95), warm-up over 28.5% of the steps, then constant` \
    --lr 1e-6 \
    --lr-warmup-fraction 0.285 \
    --lr-decay-style constant \
    --weight-decay 0.01 \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --clip-grad 1.0 \
    `# Top-k reverse KL to the EMA anchor: beta 0.001, k = 32, tail on, importance weight` \
    `# unclipped (no --kl-iw-clip)` \
    --kl-loss-type topk-reverse \
    --kl-topk-tokens 32 \
    --kl-tail "$KL_TAIL" \
    --kl-coef 0.001 \
    --kl-in-reward-coef 0.0 \
    `# EMA anchor: eta 0.9, updated every T_ema = 10 steps` \
    --ema-eta 0.9 \
    --ema-update-period 10 \
    --save "$RUN_DIR" \
    --save-interval 50 \
    --log-dir "$RUN_DIR/logs" \
    --log-interval 1 \
    "$@"
