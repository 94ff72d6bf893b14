#!/usr/bin/env bash
# The math run with FP8 training GEMMs: Transformer Engine's hybrid format (E4M3 forward, E5M2
# gradients) with delayed scaling, BF16 everywhere else. The weight sync dequantises, so vLLM
# samples in BF16; watch the logged sampler-vs-trainer log-prob mismatch. Same environment
# variables and stages as math_deepscaler_1.5b.sh (checkpoints under math-1.5b-<kl>-fp8-<stage>).
PRECISION=fp8 exec bash "$(dirname "$0")/math_deepscaler_1.5b.sh" "$@"
