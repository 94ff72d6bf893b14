"""On-policy distillation's anchor: a frozen teacher GPTModel of its own depth and width.

With ``--teacher-load-hf`` / ``--teacher-checkpoint`` the teacher takes the EMA anchor's place in
the step: the anchor pass (the anchor's log-probs at the sampled tokens and at the Top-k ids) runs
on the teacher's model instead of the policy with the EMA swapped in, so every ``--kl-loss-type``
and ``--kl-tail`` estimates KL(student || teacher) (or the forward direction) through the same
vocab-parallel / fused-LM-head ops, and ``--kl-in-reward-coef`` subtracts the sampled-token
log-ratio to the teacher from the reward. The teacher is built on the student's TP/PP layout (its
heads and layers split as the student's), holds no optimizer state and no gradients, and is read
from its own path at every start (a checkpoint of the run does not hold it). There is no EMA.

:func:`teacher_model_config` resolves and checks the teacher's shape before any process group;
:class:`Teacher` has the anchor interface the trainer uses (``model()``, ``step``, ``metrics``,
the checkpoint hooks) next to :class:`~emapg_megatron.anchor.ema.EmaAnchor`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

from megatron.core.transformer.module import Float16Module

from emapg_megatron.anchor.config import TeacherConfig
from emapg_megatron.anchor.protocol import FixedAnchor
from emapg_megatron.checkpoint import load_hf_weights
from emapg_megatron.checkpoint.convert import (
    checkpoint_model_config,
    load_mcore,
    training_step_dir,
)
from emapg_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
from emapg_megatron.checkpoint.hf_io import has_tokenizer
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig, MoEOptions, PrecisionConfig
from emapg_megatron.models.gpt import build_for_this_rank
from emapg_megatron.training.optimizer_step import check_loaded_weights


def teacher_model_config(teacher: TeacherConfig, student: ModelConfig, *, tp: int, pp: int,
                         seq_length: int, ep: int = 1) -> ModelConfig:
    """The teacher's architecture (its config.json, or the model config its checkpoint stores),
    checked against the student's vocabulary and the run's layout; padded like the student's.
    A MoE teacher's experts are split by the run's EP like the student's; a dense teacher has none
    to split (the expert-parallel ranks are data-parallel ranks for it)."""
    where = f"{teacher.flag} {teacher.path}"
    if teacher.load_hf:
        cfg, _ = model_config_from_hf(read_hf_config(teacher.load_hf))
    else:  # checked against the tensors it stores
        cfg = checkpoint_model_config(training_step_dir(teacher.checkpoint))
    check_vocabulary(where, cfg.vocab_size, student.vocab_size,
                     comparable=bool(teacher.load_hf) and has_tokenizer(teacher.load_hf))
    if cfg.max_position_embeddings < seq_length:
        raise ConfigError(f"{where}: the teacher's position table ({cfg.max_position_embeddings}) is "
                          f"shorter than --seq-length {seq_length}")
    try:
        cfg.validate(tp, pp, ep if cfg.is_moe else 1)
    except ConfigError as e:
        raise ConfigError(f"{where}: the teacher cannot be split like the student: {e}") from None
    return replace(cfg, make_vocab_size_divisible_by=student.make_vocab_size_divisible_by)


def check_vocabulary(where: str, teacher_rows: int, student_rows: int, *, comparable: bool) -> None:
    """The teacher scores every id the student can sample: as many vocabulary rows, or more when
    only padding differs (Qwen2.5-7B's 152,064 rows against 0.5B's 151,936, over one tokenizer),
    which needs the teacher's tokenizer files to show the tokenizers are the same. Its extra rows
    are never sampled and carry no probability: the passes mask every column from the student's
    vocabulary size on, on the teacher's output as on the student's."""
    if teacher_rows < student_rows:
        raise ConfigError(f"{where}: the teacher's vocabulary has {teacher_rows} rows, the student's "
                          f"{student_rows}: the teacher must score every id the student can sample "
                          "(the same tokenizer, as many rows or padded larger)")
    if teacher_rows > student_rows and not comparable:
        raise ConfigError(f"{where}: the teacher's vocabulary has {teacher_rows} rows, the student's "
                          f"{student_rows}: a teacher padded larger is taken from an HF folder with its "
                          "tokenizer files, checked to be the student's tokenizer (this one has none)")


def check_same_tokenizer(teacher: TeacherConfig, student_tokenizer) -> None:
    """An HF teacher folder with tokenizer files must hold the student's tokenizer (same ids for
    the same strings); a folder without them and a checkpoint are checked by their vocabulary
    size only."""
    if (not teacher.load_hf or not has_tokenizer(teacher.load_hf)
            or not callable(getattr(student_tokenizer, "get_vocab", None))):
        return
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(teacher.load_hf, local_files_only=True)
    except (OSError, ValueError):
        return  # weights and config only: the vocabulary size was checked
    ours = student_tokenizer.get_vocab()
    if theirs.get_vocab() != ours:
        raise ConfigError(f"--teacher-load-hf {teacher.load_hf}: its tokenizer differs from the student's "
                          f"({len(theirs.get_vocab())} and {len(ours)} tokens, other ids for the same "
                          "strings): distillation needs the same tokenizer")


class Teacher(FixedAnchor):  # a frozen teacher: no update, no state of its own to save
    """The frozen teacher on this rank: its model chunks, as an
    :class:`~emapg_megatron.anchor.protocol.Anchor`."""

    def __init__(self, chunks: list, cpu_offload: bool = False):
        self.chunks = chunks
        self.cpu_offload = cpu_offload
        self.pass_seconds = 0.0
        self.device = next(chunks[0].parameters()).device
        if cpu_offload:
            self._move("cpu")

    @classmethod
    def build(cls, teacher: TeacherConfig, model_cfg: ModelConfig, prec: PrecisionConfig, *,
              sequence_parallel: bool = False, moe: MoEOptions | None = None) -> "Teacher":
        """Build this rank's part of the teacher (collective: loads its weights at any TP/PP)."""


        model = build_for_this_rank(model_cfg, prec, sequence_parallel=sequence_parallel, moe=moe)
        if prec.bf16:
            model = Float16Module(model.config, model)
        model.requires_grad_(False)
        if teacher.load_hf:
            load_hf_weights([model], model_cfg, teacher.load_hf)
        else:
            load_mcore([model], training_step_dir(teacher.checkpoint))
        check_loaded_weights([model], f"{teacher.flag} {teacher.path}")
        return cls([model], cpu_offload=teacher.cpu_offload)

    def _move(self, device) -> None:
        for chunk in self.chunks:
            chunk.to(device)

    @contextmanager
    def model(self):
        """The teacher's chunks for the anchor pass (on the device for it under --teacher-cpu-offload)."""
        start = time.monotonic()
        if self.cpu_offload:
            self._move(self.device)
        try:
            yield self.chunks
        finally:
            if self.cpu_offload:
                self._move("cpu")
            self.pass_seconds = time.monotonic() - start

    def metrics(self) -> dict:
        """The last teacher pass's seconds (its share of the step's time)."""
        return {"teacher_pass_s": self.pass_seconds}

    def memory_bytes(self) -> int:
        """Bytes of the teacher's weights on this rank."""
        return sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())
