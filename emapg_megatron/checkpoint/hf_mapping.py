"""The one table that maps Hugging Face Llama / Qwen2 / Qwen3 tensors onto Megatron-Core params.

Everything that moves weights between the two worlds goes through :class:`HFMapping`: the
converter CLI, the trainer's ``--load-hf`` (:func:`emapg_megatron.checkpoint.weights.load_hf_weights`)
and the weight export to rollout engines (:func:`~emapg_megatron.checkpoint.weights.export_hf_weights`).

Each row of :data:`RULES` names one Megatron parameter (by its TE-fused name, which is also the
key Megatron's ``sharded_state_dict`` stores, plus the local-spec alias), the HF tensors it is made
of and a *codec* that knows how the tensor is split over tensor-parallel ranks:

* import: ``codec.to_megatron(read, hf_names, tp_rank, tp, local_shape)`` reads only this rank's
  slice of the HF tensors (``read(name, index)`` may be a lazy safetensors slice);
* export: ``codec.to_hf(shards)`` turns the full list of TP shards (rank order) back into the HF
  tensors.

The layouts (Megatron-Core 0.16, ``get_gpt_layer_*_spec``):

* ``linear_qkv``: rows grouped per query group ``g``: ``[q heads of g, k_g, v_g]``; TP ranks own
  contiguous groups. The Qwen2 bias uses the same layout.
* ``linear_fc1``: every TP rank holds ``[gate_r; up_r]`` (its own chunk of each).
* ``linear_proj`` / ``linear_fc2``: row-parallel (split on the input dim).
* embedding / ``output_layer``: vocab-parallel rows, padded with zero rows to a multiple of
  ``make_vocab_size_divisible_by x TP`` on import; the padding is dropped on export.
* tied embeddings: no ``lm_head`` is read or written; at PP>1 the last stage's copy
  (``output_layer.weight``) is imported from ``model.embed_tokens.weight`` and not exported.

Mixture of experts (every layer; Qwen3-MoE and Mixtral names, :data:`MOE_NAMES`): the router
``mlp.router.weight`` is replicated; expert ``e`` is ``mlp.experts.local_experts.{e}.linear_fc1``
(``[gate_r; up_r]`` as the dense MLP) and ``linear_fc2`` (row-parallel), split over the
*expert* tensor-parallel ranks. The table names experts by their global index; on expert-parallel
rank ``r`` of ``EP`` local expert ``i`` is global expert ``r * experts / EP + i``
(:func:`~emapg_megatron.checkpoint.weights.load_hf_weights` renames). HF folders hold one tensor
per expert and projection (what ``save_pretrained`` writes); the fused 3-D tensors transformers
>= 5 keeps in memory (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``mlp.experts.down_proj``
``[E, H, F]``) are read too (:meth:`HFMapping.source`), and never written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from emapg_megatron.checkpoint.hf_config import architecture_for
from emapg_megatron.errors import ConfigError
from emapg_megatron.models.config import ModelConfig

# read(hf_name, index) -> tensor; index is a tuple of slices (None: the whole tensor).
Read = Callable[[str, "tuple[slice, ...] | None"], torch.Tensor]


def _rows(start: int, stop: int) -> tuple[slice, ...]:
    return (slice(start, stop),)


@dataclass(frozen=True)
class Replicated:
    """The same tensor on every TP rank (norms)."""

    tp_dim = None

    def to_megatron(self, read: Read, names, rank, tp, local_shape):
        return read(names[0], None)

    def to_hf(self, shards):
        return [shards[0]]


@dataclass(frozen=True)
class RowParallel:
    """Split on the input dim (``linear_proj``, ``linear_fc2``)."""

    tp_dim = 1

    def to_megatron(self, read: Read, names, rank, tp, local_shape):
        n = local_shape[1]
        return read(names[0], (slice(None), slice(rank * n, (rank + 1) * n)))

    def to_hf(self, shards):
        return [torch.cat(shards, dim=1)]


@dataclass(frozen=True)
class VocabParallel:
    """Rows split over TP after padding the vocabulary with zero rows."""

    vocab_size: int
    tp_dim = 0

    def to_megatron(self, read: Read, names, rank, tp, local_shape):
        rows = local_shape[0]
        start, stop = rank * rows, min((rank + 1) * rows, self.vocab_size)
        real = read(names[0], _rows(min(start, stop), stop))
        if real.shape[0] == rows:
            return real
        return torch.cat([real, real.new_zeros(rows - real.shape[0], *real.shape[1:])])

    def to_hf(self, shards):
        rows = shards[0].shape[0]
        keep = [s[: max(0, min(rows, self.vocab_size - r * rows))] for r, s in enumerate(shards)]
        return [torch.cat(keep, dim=0)]


@dataclass(frozen=True)
class FusedQKV:
    """``linear_qkv`` weight or bias: per query group ``[q heads of the group, k, v]``."""

    num_heads: int
    num_groups: int
    head_dim: int
    tp_dim = 0

    def to_megatron(self, read: Read, names, rank, tp, local_shape):
        groups = self.num_groups // tp
        q_rows = self.num_heads // self.num_groups * self.head_dim
        g0 = rank * groups
        q = read(names[0], _rows(g0 * q_rows, (g0 + groups) * q_rows))
        k = read(names[1], _rows(g0 * self.head_dim, (g0 + groups) * self.head_dim))
        v = read(names[2], _rows(g0 * self.head_dim, (g0 + groups) * self.head_dim))
        rest = q.shape[1:]
        parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def to_hf(self, shards):
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        q_rows = self.num_heads // self.num_groups * self.head_dim
        grouped = full.view(self.num_groups, q_rows + 2 * self.head_dim, *rest)
        q, k, v = grouped.split([q_rows, self.head_dim, self.head_dim], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]


@dataclass(frozen=True)
class GateUp:
    """``linear_fc1``: each TP rank holds ``[gate_r; up_r]``."""

    ffn_hidden_size: int
    tp_dim = 0

    def to_megatron(self, read: Read, names, rank, tp, local_shape):
        n = self.ffn_hidden_size // tp
        return torch.cat([read(name, _rows(rank * n, (rank + 1) * n)) for name in names], dim=0)

    def to_hf(self, shards):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


@dataclass(frozen=True)
class Rule:
    megatron: str  # TE-fused name (= Megatron's checkpoint key), {i} = global layer index,
    # {e} = global expert index; HF names: {moe} the MoE block, {gate}/{up}/{down} the projections
    hf: tuple[str, ...]
    codec: str
    aliases: tuple[str, ...] = ()  # local-spec names of the same tensor
    when: Callable[[ModelConfig], bool] | None = None
    mlp: str | None = None  # a layer's MLP tensor: "dense" or "experts", per layer of a MoE model
    export: bool = True


_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
_EMBED = "model.embed_tokens.weight"
_EXPERT = _H + "{moe}.experts.{e}."

#: The HF names of a MoE layer: the block (its router is ``{moe}.gate.weight``) and each expert's
#: gate / up / down projections. Qwen3-MoE's also name any MoE model no HF architecture computes.
MOE_NAMES = {
    "qwen3_moe": dict(moe="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "mixtral": dict(moe="block_sparse_moe", gate="w1", up="w3", down="w2"),
}


def moe_names(cfg: ModelConfig) -> dict:
    """:data:`MOE_NAMES` of ``cfg``'s architecture: Mixtral's for a Mixtral, else Qwen3-MoE's."""
    return MOE_NAMES["mixtral" if architecture_for(cfg) == "MixtralForCausalLM" else "qwen3_moe"]


# The mapping, in HF state-dict order. Megatron names are global (PP-stage independent).
RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", (_EMBED,), "vocab"),
    Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",),
         "replicated", aliases=(_L + "input_layernorm.weight",)),
    Rule(_L + "self_attention.linear_qkv.weight",
         tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule(_L + "self_attention.linear_qkv.bias",
         tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv",
         when=lambda c: c.add_qkv_bias),
    Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), "replicated",
         when=lambda c: c.qk_layernorm),
    Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), "replicated",
         when=lambda c: c.qk_layernorm),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "row"),
    Rule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",),
         "replicated", aliases=(_L + "pre_mlp_layernorm.weight",)),
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
         "gate_up", mlp="dense"),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row", mlp="dense"),
    Rule(_L + "mlp.router.weight", (_H + "{moe}.gate.weight",), "replicated", mlp="experts"),
    Rule(_L + "mlp.experts.local_experts.{e}.linear_fc1.weight",
         (_EXPERT + "{gate}.weight", _EXPERT + "{up}.weight"), "expert_gate_up", mlp="experts"),
    Rule(_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (_EXPERT + "{down}.weight",), "row",
         mlp="experts"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab",
         when=lambda c: not c.tie_word_embeddings),
    # Tied: the last PP stage holds a copy of the embedding; it is never exported.
    Rule("output_layer.weight", (_EMBED,), "vocab", when=lambda c: c.tie_word_embeddings,
         export=False),
)

#: Keys Megatron stores one tensor under in its two layer specs (stored key -> the other spec's):
#: a MoE layer's pre-MLP norm is ``mlp.linear_fc1.layer_norm_weight`` in the local spec (as a dense
#: layer's, fused into linear_fc1 under TE) but ``pre_mlp_layernorm.weight`` in Transformer
#: Engine's, where nothing fuses it. A dense checkpoint stores the first under either spec.
STORED_KEY_ALIASES = {
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight"}


def stored_key_alias(key: str) -> str | None:
    """The other spec's key of stored key ``key`` (:data:`STORED_KEY_ALIASES`, also under a layer's
    own index: the keys of a model mixing dense and MoE layers), or None."""
    layer = re.match(r"^decoder\.layers\.(\d+\.)?", key)
    if layer is None:
        return None
    index = layer.group(1) or ""
    stacked = "decoder.layers." + key[layer.end():]
    pairs = {**STORED_KEY_ALIASES, **{v: k for k, v in STORED_KEY_ALIASES.items()}}
    other = pairs.get(stacked)
    return None if other is None else "decoder.layers." + index + other[len("decoder.layers."):]

# HF tensors a checkpoint may carry that we do not need.
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Entry:
    megatron: str
    aliases: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    codec: object
    export: bool
    expert: int | None = None  # the global expert index of an expert's weight


@dataclass
class HFMapping:
    """:data:`RULES` expanded for one model: lookup by Megatron name, import and export."""

    cfg: ModelConfig
    entries: list[Entry] = field(init=False)
    _by_name: dict[str, Entry] = field(init=False, repr=False)

    def __post_init__(self):
        c = self.cfg
        groups = c.num_query_groups or c.num_attention_heads
        head_dim = c.kv_channels or c.hidden_size // c.num_attention_heads
        moe_ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size
        codecs = {
            "replicated": Replicated(),
            "row": RowParallel(),
            "vocab": VocabParallel(c.vocab_size),
            "qkv": FusedQKV(c.num_attention_heads, groups, head_dim),
            "gate_up": GateUp(c.ffn_hidden_size),
            "expert_gate_up": GateUp(moe_ffn),
        }
        h, v, f = c.hidden_size, c.vocab_size, c.ffn_hidden_size
        q, kv = c.num_attention_heads * head_dim, groups * head_dim
        self.names = moe_names(c) if c.is_moe else MOE_NAMES["qwen3_moe"]
        mlp = self.names
        shapes = {
            "embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
            "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
            "q_norm.weight": (head_dim,), "k_norm.weight": (head_dim,), "o_proj.weight": (h, q),
            "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
            "gate.weight": (c.num_experts, h),
        }
        # an expert's projections (Qwen3-MoE names them like a dense MLP's) are moe_ffn wide
        expert_shapes = {f"{mlp['gate']}.weight": (moe_ffn, h), f"{mlp['up']}.weight": (moe_ffn, h),
                         f"{mlp['down']}.weight": (h, moe_ffn)}

        def shape(name):
            suffix = ".".join(name.rsplit(".", 2)[-2:])
            return expert_shapes[suffix] if ".experts." in name else shapes[suffix]

        self.entries, self._by_name = [], {}
        for layer in [None, *range(c.num_layers)]:
            for rule in RULES:
                if ("{i}" in rule.megatron) != (layer is not None):
                    continue
                if rule.when is not None and not rule.when(c):
                    continue
                if rule.mlp is not None and (rule.mlp == "experts") != c.is_moe_layer(layer):
                    continue
                for expert in range(c.num_experts) if "{e}" in rule.megatron else [None]:
                    names = dict(i=layer, e=expert, **mlp)
                    hf = tuple(n.format(**names) for n in rule.hf)
                    entry = Entry(rule.megatron.format(**names),
                                  tuple(a.format(**names) for a in rule.aliases), hf,
                                  tuple(shape(n) for n in hf), codecs[rule.codec], rule.export, expert)
                    self.entries.append(entry)
                    for name in (entry.megatron, *entry.aliases):
                        self._by_name[name] = entry
        # The final norm / lm_head rows come after the layers in HF order.
        tail = ("decoder.final_layernorm.weight", "output_layer.weight")
        self.entries.sort(key=lambda e: e.megatron in tail)

    def lookup(self, megatron_name: str) -> Entry | None:
        """The entry for a global Megatron param name (TE-fused or local-spec naming)."""
        return self._by_name.get(megatron_name)

    def stored_shapes(self) -> dict[str, tuple[int | None, ...]]:
        """The global shape of each model tensor a ``torch_dist`` checkpoint of this model stores,
        by Megatron's key: a layer's tensors stacked on a leading dimension of ``num_layers``
        (``decoder.layers.X``); the vocabulary dimension None (padded to the saver's TP). The tied
        output layer is not stored."""
        shapes = {}
        for e in self.entries:
            if e.megatron == "output_layer.weight" and not e.export:
                continue
            if isinstance(e.codec, VocabParallel):
                shape = (None, *e.hf_shapes[0][1:])
            else:  # the fused tensors stack their HF parts' rows
                shape = (sum(s[0] for s in e.hf_shapes), *e.hf_shapes[0][1:])
            if e.expert is not None:  # the experts of a layer stacked on a second dimension
                shape = (self.cfg.num_experts, *shape)
            if e.megatron.startswith("decoder.layers.") and self.layers_stacked:
                shape = (self.cfg.num_layers, *shape)
            shapes[self.stored_key(e)] = shape
        return shapes

    @property
    def layers_stacked(self) -> bool:
        """Whether Megatron stacks the layers' tensors under one key: yes unless dense and MoE
        layers mix (its ``moe_layer_freq`` list), when each layer keeps its index."""
        return self.cfg.moe_layer_pattern() is None

    def stored_key(self, entry: Entry) -> str:
        """The key Megatron's ``sharded_state_dict`` stores ``entry`` under: a layer's tensors
        without the layer index when stacked, an expert's without its index
        (``decoder.layers.mlp.experts.experts.linear_fc1.weight``)."""
        key = entry.megatron
        if self.layers_stacked:
            key = re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", key)
        if entry.expert is not None:
            key = key.replace(f".local_experts.{entry.expert}.", ".experts.")
        return key

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: s for e in self.entries for n, s in zip(e.hf, e.hf_shapes)}

    def check_hf(self, available: Mapping[str, Sequence[int]]) -> None:
        """Raise :class:`ConfigError` listing missing, unexpected and mis-shaped HF tensors."""
        expected = self.expected_hf_shapes()
        ignorable = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        missing = sorted(set(expected) - set(available))
        unexpected = sorted(n for n in set(available) - set(expected)
                            if n not in ignorable and not n.endswith(_IGNORED_HF_SUFFIXES))
        wrong = sorted(f"{n}: {tuple(available[n])} != {expected[n]}"
                       for n in set(expected) & set(available)
                       if tuple(available[n]) != expected[n])
        problems = [f"{label} ({len(items)}): {', '.join(items)}"
                    for label, items in (("missing tensors", missing),
                                         ("unexpected tensors", unexpected),
                                         ("mismatched shapes", wrong)) if items]
        if problems:
            raise ConfigError("HF checkpoint does not match the model config: " + "; ".join(problems))

    def source(self, read: Read, available: Mapping[str, Sequence[int]]
               ) -> tuple[Read, dict[str, tuple[int, ...]]]:
        """The HF tensors as this table names them, checked (:meth:`check_hf`): ``read`` and the
        tensor shapes of an HF folder or state dict, with the fused experts of transformers >= 5
        (``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2F, H]``, ``...down_proj``
        ``[E, H, F]``, Mixtral's router ``mlp.gate.weight``) seen as one tensor per expert and
        projection, each read as a slice of the fused one."""
        shapes = {n: tuple(s) for n, s in available.items()}
        virtual = self._fused_experts(shapes) if self.cfg.is_moe else {}
        self.check_hf(shapes)
        if not virtual:
            return read, shapes

        def fused_read(name, index):
            if name not in virtual:
                return read(name, index)
            real, expert, offset = virtual[name]
            if expert is None:
                return read(real, index)
            index = tuple(index or ())
            rows = (index[0] if index else slice(None)).indices(shapes[name][0])
            rest = index[1:] if len(index) > 1 else (slice(None),)
            return read(real, (slice(expert, expert + 1), slice(offset + rows[0], offset + rows[1]),
                               *rest))[0]

        return fused_read, shapes

    def _fused_experts(self, shapes: dict) -> dict[str, tuple[str, int | None, int]]:
        """Replace the fused expert tensors in ``shapes`` by the per-expert names they hold;
        returns ``{per-expert name: (fused name, expert, first row)}``."""
        c, n = self.cfg, self.names
        experts, ffn, h = c.num_experts, c.moe_ffn_hidden_size or c.ffn_hidden_size, c.hidden_size
        virtual = {}
        for i in range(c.num_layers):
            fused = f"model.layers.{i}.mlp."
            gate_up, down = fused + "experts.gate_up_proj", fused + "experts.down_proj"
            for name, want in ((gate_up, (experts, 2 * ffn, h)), (down, (experts, h, ffn))):
                if name in shapes and shapes[name] != want:
                    raise ConfigError(f"HF checkpoint does not match the model config: mismatched shapes "
                                      f"(1): {name}: {shapes[name]} != {want}")
            per_expert = _EXPERT.format(i=i, e="{e}", **n) + "{proj}.weight"
            parts = ((gate_up, ((n["gate"], 0, (ffn, h)), (n["up"], ffn, (ffn, h)))),
                     (down, ((n["down"], 0, (h, ffn)),)))
            for name, projections in parts:
                if shapes.pop(name, None) is None:
                    continue
                for e in range(experts):
                    for proj, offset, shape in projections:
                        virtual[per_expert.format(e=e, proj=proj)] = (name, e, offset)
                        shapes[per_expert.format(e=e, proj=proj)] = shape
            router = _H.format(i=i) + f"{n['moe']}.gate.weight"
            if router != fused + "gate.weight" and fused + "gate.weight" in shapes:
                virtual[router] = (fused + "gate.weight", None, 0)
                shapes[router] = shapes.pop(fused + "gate.weight")
        return virtual

    def to_megatron(self, megatron_name: str, read: Read, tp_rank: int, tp: int,
                    local_shape: Sequence[int]) -> torch.Tensor:
        """This TP rank's slice of a Megatron param, read from HF tensors."""
        entry = self._require(megatron_name)
        return entry.codec.to_megatron(read, entry.hf, tp_rank, tp, tuple(local_shape))

    def to_hf(self, megatron_name: str, shards: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs from all TP shards of a Megatron param (rank order).

        Outputs own their memory: neither views (which would pin the caller's gather buffer
        and share storage, which safetensors refuses) nor aliases of the live parameters.
        """
        entry = self._require(megatron_name)
        inputs = {s.untyped_storage().data_ptr() for s in shards}
        out = entry.codec.to_hf(list(shards))
        return [(n, t.clone() if t._base is not None or t.untyped_storage().data_ptr() in inputs else t)
                for n, t in zip(entry.hf, out)]

    def _require(self, name: str) -> Entry:
        entry = self.lookup(name)
        if entry is None:
            raise ConfigError(f"no HF mapping for Megatron parameter {name!r}")
        return entry


def dict_reader(state_dict: Mapping[str, torch.Tensor]) -> Read:
    """A :data:`Read` over an in-memory HF state dict."""

    def read(name, index):
        t = state_dict[name]
        return t if index is None else t[index]

    return read
