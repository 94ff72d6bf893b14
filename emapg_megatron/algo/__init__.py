"""RL algorithm pieces: advantages and the PPO-clip + KL policy loss (no Megatron here)."""
