"""LoRA adapters on the GPTModel's tensor-parallel linears (docs/lora.md): the config
(``lora.config``, no torch), the adapter maths (``lora.adapters``) and putting adapters on a model,
merging and unmerging them (``lora.apply``). The trainer applies them before DDP and the
optimizer when --lora-rank > 0 (``training.model_and_optimizer``)."""
