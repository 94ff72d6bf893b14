"""``emapg-convert`` (also ``tools/convert_checkpoint.py``): HF <-> Megatron-Core checkpoints.

    emapg-convert hf-to-mcore --hf-dir D --out M --tp T --pp P [--ep E] [--dtype bf16|fp32]
    emapg-convert mcore-to-hf --load M --out D [--hf-template D0] [--lora-base B]
    emapg-convert lora-to-peft --load M --out A
    emapg-convert verify --hf-dir D --load M --tp T --pp P [--ep E]

The flags are generated from one config per command (``emapg_megatron.configurable``: each
option's range and help next to it). User errors (a bad option value, unsupported architecture,
missing or mismatched tensors, a checkpoint's model config out of bounds or unlike its tensors,
TP not dividing the heads or groups, an existing output, an output that is, holds or lies inside
an input) print one ``error:`` line and exit with status 2, before anything is written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from emapg_megatron import configurable
from emapg_megatron.configurable import above, at_least, between, option
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import INT_LIMITS

DESCRIPTION = ("Convert checkpoints between Hugging Face (safetensors) and Megatron-Core (torch_dist), "
               "and compare their logits.")
MAX_PARALLEL = 1024  # TP/PP sizes (each must also divide the heads, groups or layers)


@dataclass
class HfToMcore:
    """HF safetensors directory -> Megatron torch_dist checkpoint."""

    hf_dir: str = option(path="dir")
    """The Hugging Face model directory to convert (config.json and safetensors)."""
    out: str = option()
    """The checkpoint directory to write (apart from --hf-dir)."""
    tp: int = option(1, range=between(1, MAX_PARALLEL))
    """Tensor-parallel size the checkpoint will be trained at (vocabulary padding, head checks); it
    loads at any TP."""
    pp: int = option(1, range=between(1, MAX_PARALLEL))
    """Pipeline-parallel size it will be trained at (checks that it divides the layers)."""
    ep: int = option(1, range=between(1, MAX_PARALLEL))
    """Expert-parallel size a mixture of experts will be trained at (checks that it divides the
    experts); it loads at any EP."""
    dtype: str | None = option(None, choices=("bf16", "fp32"))
    """Stored dtype (default: the HF checkpoint's; fp16 becomes bf16)."""
    make_vocab_size_divisible_by: int = option(128, range=between(1, INT_LIMITS["make_vocab_size_divisible_by"]))
    """Pad the vocabulary to a multiple of this x --tp, as the trainer's flag of that name."""
    overwrite: bool = option(False)
    """Replace an existing --out (written aside first, swapped in when complete)."""
    no_progress: bool = option(False)
    """No progress bar."""


@dataclass
class McoreToHf:
    """Megatron checkpoint -> HF safetensors directory."""

    load: str = option(path="dir")
    """The checkpoint to export: emapg-convert's, a trainer's --save directory (its latest step) or
    one of its iter_N directories."""
    out: str = option()
    """The HF directory to write (apart from --load and the tokenizer's folder)."""
    hf_template: str | None = option(None, path="dir")
    """HF directory to take config.json extras and tokenizer files from (default: the --load-hf
    folder the training run recorded, when it is still there)."""
    max_shard_size_gb: float = option(5.0, range=above(0))
    """Largest safetensors shard, in GiB (a larger tensor gets a shard of its own)."""
    lora_base: str | None = option(None, path="dir")
    """A LoRA run whose checkpoint holds the adapters alone: the folder of their base, when it is no
    longer where the run recorded it (its weight files must have the recorded sha256)."""
    overwrite: bool = option(False)
    """Replace an existing --out (written aside first, swapped in when complete)."""
    no_progress: bool = option(False)
    """No progress bar."""


@dataclass
class LoraToPeft:
    """A LoRA run's adapters -> a peft adapter folder (adapter_config.json, adapter_model.safetensors)."""

    load: str = option(path="dir")
    """The LoRA run's checkpoint: its --save directory (the latest step) or one of its iter_N."""
    out: str = option()
    """The adapter folder to write (apart from --load); peft.PeftModel.from_pretrained loads it on
    the base model, emapg-train --lora-peft-init continues from it."""
    overwrite: bool = option(False)
    """Replace an existing --out (written aside first, swapped in when complete)."""


@dataclass
class Verify:
    """Compare the logits of the HF model and the Megatron checkpoint (prints JSON)."""

    hf_dir: str = option(path="dir")
    """The Hugging Face model directory (the reference: transformers, fp32, on the CPU)."""
    load: str = option(path="dir")
    """The Megatron checkpoint to compare (or a trainer's --save directory: its latest step)."""
    tp: int = option(1, range=between(1, MAX_PARALLEL))
    """Tensor-parallel size to load the checkpoint at (one rank per TP x PP)."""
    pp: int = option(1, range=between(1, MAX_PARALLEL))
    """Pipeline-parallel size to load it at."""
    ep: int = option(1, range=between(1, MAX_PARALLEL))
    """Expert-parallel size to load a mixture of experts at (TP x PP x EP ranks, expert TP =
    TP)."""
    batch: int = option(2, range=at_least(1))
    """Sequences of random tokens compared."""
    seq_len: int = option(32, range=at_least(1))
    """Tokens per sequence (at most the model's positions)."""
    seed: int = option(0, range=at_least(0))
    """Seed of the random tokens."""
    device: str = option("cpu", choices=("cpu", "cuda"))
    """Where the Megatron ranks run (the HF reference is always CPU fp32)."""


COMMANDS = {"hf-to-mcore": HfToMcore, "mcore-to-hf": McoreToHf, "lora-to-peft": LoraToPeft, "verify": Verify}


def _parser() -> configurable.ArgumentParser:
    p = configurable.ArgumentParser(prog="emapg-convert", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    for name, config in COMMANDS.items():
        doc = config.__doc__.strip()
        configurable.add_arguments(sub.add_parser(name, help=doc, formatter_class=configurable.HelpFormatter),
                                   config)
    return p


def parse_args(argv: list[str] | None = None):
    """``(command, its config)``, every option checked (ConfigError with one line)."""
    values = vars(_parser().parse_args(argv))
    cfg = configurable.build(COMMANDS[values["command"]], values)
    configurable.check_fields(cfg)
    configurable.check_paths(cfg)
    return values["command"], cfg


def _run(command: str, cfg) -> dict:
    from emapg_megatron.checkpoint import convert, verify  # Megatron: after the flags are checked

    if command == "hf-to-mcore":
        return convert.hf_to_mcore(cfg.hf_dir, cfg.out, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep,
                                   dtype=cfg.dtype,
                                   make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
                                   overwrite=cfg.overwrite, progress=not cfg.no_progress)
    if command == "mcore-to-hf":
        return convert.mcore_to_hf(cfg.load, cfg.out, hf_template=cfg.hf_template,
                                   max_shard_bytes=max(1, int(cfg.max_shard_size_gb * 1024**3)),
                                   overwrite=cfg.overwrite, progress=not cfg.no_progress,
                                   lora_base=cfg.lora_base)
    if command == "lora-to-peft":
        return convert.lora_to_peft(cfg.load, cfg.out, overwrite=cfg.overwrite)
    return verify.verify(cfg.hf_dir, cfg.load, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, batch=cfg.batch,
                         seq_len=cfg.seq_len, seed=cfg.seed, device=cfg.device)


def main(argv: list[str] | None = None) -> int:
    try:
        result = _run(*parse_args(argv))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
