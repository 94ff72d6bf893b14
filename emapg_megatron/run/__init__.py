"""The run's shell around the trainer: the loop (steps, checkpoints on an interval or a signal,
resume), what a run writes (metrics, curves, TensorBoard, W&B, rollout dumps), the one-run locks
and the clearing of an earlier run's outputs. It sits above ``checkpoint/`` and the trainer and
imports only from below."""
