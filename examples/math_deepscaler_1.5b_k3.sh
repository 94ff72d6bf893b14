#!/usr/bin/env bash
# The math run as the reference math scripts actually ran it: the EMA anchor (eta 0.95) with the
# sampled K3 estimator instead of Top-k KL. Same environment variables and stages as
# math_deepscaler_1.5b.sh; everything else is identical.
KL_LOSS=k3 exec bash "$(dirname "$0")/math_deepscaler_1.5b.sh" "$@"
