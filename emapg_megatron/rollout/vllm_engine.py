"""vLLM rollout engine, colocated with the Megatron trainer on the same GPUs.

Layout. Every training rank (``torchrun`` process) hosts one vLLM worker:
``LLM(distributed_executor_backend="external_launcher")`` joins the trainer's process group and
forms vLLM TP groups of ``tensor_parallel_size`` consecutive ranks; the remaining factor of the
world is vLLM's "external data parallel" dimension (every group generates on its own). Megatron
orders TP fastest too, so when ``tensor_parallel_size`` divides the trainer's TP a vLLM group
sits inside one Megatron model-parallel group and sees that group's prompts. When the two
layouts differ (vLLM TP < trainer TP, or PP > 1) the batch of the group's first rank is
broadcast over the model-parallel group, so every stage trains on the same samples.

Memory. With ``sleep_level`` 1 or 2 the engine sleeps while the trainer runs
(``enable_sleep_mode=True``; level 1 backs the weights up in CPU memory, level 2 drops them,
the KV cache is always dropped). :meth:`VLLMEngine.update_weights` wakes only the weights,
loads the trainer's weights bucket by bucket and resets the prefix cache;
:meth:`VLLMEngine.generate` wakes the KV cache, samples and puts everything back to sleep.

Log-probs. ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob. We rely on
``LLM(logprobs_mode="processed_logprobs")`` (vLLM >= 0.10.2): the log-softmax of the logits
*after* temperature and top-k/top-p, i.e. log pi_sampling, which the KL estimators' importance
weight needs. vLLM's default (``raw_logprobs``) is the untempered, untruncated model
distribution, and older vLLM has no choice at all; the engine refuses those versions.
:func:`logprob_mismatch` compares the recorded log-probs with the trainer's recomputed ones.

Weights. The engine starts with ``load_format="dummy"`` (nothing read from disk): the first
generate syncs from the trainer (``model_chunks``) through
:func:`emapg_megatron.rollout.weight_sync.sync_weights`, which streams HF-named full tensors
into the worker's ``model.load_weights`` via ``LLM.collective_rpc``.

LoRA (``cfg.lora``; docs/lora.md, "Rollouts through vLLM"). vLLM is built with ``enable_lora``
and one adapter slot; the frozen base streams once (``adapters="exclude"``: no adapter matrix;
the linears vLLM wraps for LoRA take their weights as ``<linear>.base_layer.weight``), again only
after a level-2 sleep dropped it. Every sync writes the adapters (whole matrices, every
pipeline stage's) as a peft folder in this rank's private temporary directory and makes a new
``LoRARequest`` (a new name and id: vLLM keys its prefix cache on the name) that every generate
passes; the previous adapter is removed from vLLM and its folder deleted, so one folder exists
at a time. :meth:`VLLMEngine.close` (or garbage collection) deletes the directory.

Routes (R3; docs/moe.md, "Routing replay"). Given a ``route_dtype`` (a MoE policy whose routes
the trainer replays), vLLM is built with ``enable_return_routed_experts`` and each
``CompletionOutput.routed_experts`` (``[prompt + completion - 1, all layers, k]`` int32: the
routes of every token vLLM fed, from position 0; the last sampled token is never fed) becomes the
sequence's ``[positions, MoE layers, k]`` routes (:func:`vllm_routes`), laid into the batch as the
built-in sampler lays its own. A multi-turn episode's routes are those of its last request, whose
prompt was the whole history.

Importing this module never imports vLLM; constructing an engine without vLLM raises a
one-line :class:`~emapg_megatron.errors.ConfigError`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import logging
import os
import re
import shutil
import stat
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from packaging.version import Version

from emapg_megatron import runtime
from emapg_megatron.errors import ConfigError, RunError, agreed
from emapg_megatron.rollout import weight_sync
from emapg_megatron.rollout.config import VLLMConfig
from emapg_megatron.rollout.engine import (
    RolloutBatch,
    build_rollout_batch,
)
from emapg_megatron.rollout.episodes import Episode, Turn, run_episodes
from emapg_megatron.rollout.route_recording import fill_routes, lay_routes
from emapg_megatron.tasks.base import encode_text

logger = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'emapg-megatron[gpu]', or use the NGC-based image built from "
                "docker/Dockerfile")
MIN_VLLM = "0.10.2"  # logprobs_mode="processed_logprobs", V1 external_launcher, wake_up(tags=)


def import_vllm():
    """The ``vllm`` module, or a one-line ConfigError saying how to get it."""
    try:
        import vllm
    except ImportError:
        raise ConfigError(f"the vLLM rollout engine needs vLLM, which is not installed: "
                          f"{INSTALL_HINT}") from None
    version = getattr(vllm, "__version__", "0")
    if Version(version).release < Version(MIN_VLLM).release:
        raise ConfigError(f"vLLM {version} is too old for the rollout engine (needs >= {MIN_VLLM} "
                          f"for processed log-probs): {INSTALL_HINT}")
    return vllm


def request_seed(base: int, step: int, index: int, turn: int = 0) -> int:
    """A per-request sampling seed from (run seed, trainer step, global sequence index, turn)."""
    digest = hashlib.blake2b(f"{base}:{step}:{index}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def sampled_logprobs(token_ids: Sequence[int], logprobs) -> list[float]:
    """The log-prob of each sampled token from a vLLM ``CompletionOutput.logprobs`` list
    (one ``{token_id: Logprob}`` mapping per position)."""
    if logprobs is None or len(logprobs) < len(token_ids):
        raise RuntimeError("vLLM returned no log-probs for the sampled tokens "
                           "(SamplingParams(logprobs=0) is required)")
    out = []
    for pos, tok in enumerate(token_ids):
        entry = logprobs[pos][tok]
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def sampling_kwargs(*, n: int, temperature: float, top_p: float, max_tokens: int,
                    stop: Sequence[str] | None, seed: int | None, logprobs: int | None = 0) -> dict:
    """``vllm.SamplingParams`` keyword arguments. ``logprobs=0`` returns just the sampled
    token's log-prob; the stop string stays in the text and tokens, as the built-in sampler does."""
    return dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                stop=list(stop) if stop else None, include_stop_str_in_output=True,
                logprobs=logprobs, seed=seed)


# --- routes (R3) ------------------------------------------------------------------------
def vllm_routes(routed, *, fed: int, model_cfg, dtype: torch.dtype) -> torch.Tensor:
    """One completion's ``CompletionOutput.routed_experts`` as ``[positions, MoE layers, k]``
    routes in ``dtype``, position 0 first.

    vLLM's convention: ``[fed - 1, num_hidden_layers, num_experts_per_tok]`` int32 for a sequence
    of ``fed`` tokens (prompt + completion; the last sampled token is never fed), every layer of
    the model (a dense layer's rows are never written: zeros), logical (global) expert ids. A
    length of ``fed`` is accepted too; a layer count of the MoE layers alone too. Anything else is
    a one-line :class:`RunError`."""
    if routed is None:
        raise RunError("vLLM returned no routed experts (CompletionOutput.routed_experts is None): "
                       "--moe-routing-replay r3 with --rollout-engine vllm needs a vLLM whose "
                       "LLM(enable_return_routed_experts=True) returns them "
                       "(tools/check_vllm_api.py); use r2")
    routes = np.asarray(routed)
    if routes.ndim != 3 or not np.issubdtype(routes.dtype, np.integer):
        raise RunError(f"vLLM's routed experts are {routes.dtype} of shape {list(routes.shape)}, "
                       "not integer expert ids shaped [positions, layers, top-k]")
    positions, layers, k = routes.shape
    if positions not in (fed - 1, fed):
        raise RunError(f"vLLM returned routes for {positions} positions of a {fed}-token sequence "
                       f"(prompt + completion): neither {fed - 1} (vLLM's convention: the last "
                       f"sampled token is never fed) nor {fed}")
    moe = model_cfg.moe_layers
    if layers == model_cfg.num_layers and layers != len(moe):
        routes = routes[:, moe]  # vLLM covers every layer; a dense layer's rows hold nothing
    elif layers != len(moe):
        raise RunError(f"vLLM returned routes for {layers} layers; the policy has "
                       f"{model_cfg.num_layers} layers, {len(moe)} of them MoE layers")
    if k != model_cfg.moe_router_topk:
        raise RunError(f"vLLM returned {k} experts per token; the policy routes each token to "
                       f"{model_cfg.moe_router_topk} (--moe-router-topk)")
    experts = model_cfg.num_experts
    if routes.size and (routes.min() < 0 or routes.max() >= experts):
        bad = int(routes.min()) if routes.min() < 0 else int(routes.max())
        raise RunError(f"vLLM routed a token to expert {bad}, outside the policy's {experts} "
                       f"experts 0..{experts - 1} (physical ids of an expert-load balancer?)")
    ordered = np.sort(routes, axis=-1)
    if k > 1 and routes.size and (ordered[..., 1:] == ordered[..., :-1]).any():
        raise RunError("vLLM routed a token to the same expert twice in one layer: not a top-k")
    return torch.from_numpy(np.ascontiguousarray(routes).astype(np.int64)).to(dtype)


_ADAPTER_DIR = re.compile(r"emapg-vllm-lora-r\d+-p(\d+)-")


def sweep_stale_adapter_dirs(root: str | None = None) -> list[str]:
    """Remove the LoRA adapter folders (in ``root``, the temp folder by default) of engines whose
    process is gone: a SIGKILL, or the second stop signal's immediate exit, skips ``close()``.
    Only this user's folders named with a process id no process of this node has; returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        found = _ADAPTER_DIR.match(name)
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if (found is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or _process_alive(int(found.group(1)))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has it
        return True
    return True


#: What each option adds to ``LLM(...)``, for the one line a vLLM without it gets.
_OPTION_KWARGS = {"enable_lora": "--lora-rank", "enable_return_routed_experts": "--moe-routing-replay r3"}


def _start_llm(vllm, kwargs: dict):
    """``vllm.LLM(**kwargs)``; a vLLM that lacks an option's keyword (tools/check_vllm_api.py lists
    them as unavailable features) is one ConfigError line naming the option."""
    try:
        return vllm.LLM(**kwargs)
    except TypeError as e:
        key, option = next(((k, flag) for k, flag in _OPTION_KWARGS.items() if k in kwargs and k in str(e)),
                           (None, None))
        if option is None:
            raise
        raise ConfigError(f"{option} with --rollout-engine vllm: this vLLM ({getattr(vllm, '__version__', '?')}) "
                          f"does not take LLM({key}=...): use a vLLM that does, or drop {option}") from None


# --- keeping a model-parallel group on one batch ----------------------------------------
def broadcast_rollout_batch(batch: RolloutBatch, *, src: int, group) -> RolloutBatch:
    """Every rank of ``group`` gets rank ``src``'s batch (all ranks pass same-shaped batches, with
    routes on every rank or on none)."""
    device = runtime.device()
    lengths = torch.tensor([len(r) for r in batch.responses], dtype=torch.long)
    parts = [t.to(device, copy=True) for t in (batch.tokens, batch.loss_mask,
                                               batch.sampling_logprobs, batch.prompt_lengths, lengths)]
    if batch.routes is not None:  # as int32: NCCL has no int16 (routes of > 256 experts)
        parts.append(batch.routes.to(device=device, dtype=torch.int32, copy=True))
    for t in parts:
        dist.broadcast(t, src=src, group=group)
    tokens, mask, lps, plens, lengths = (t.cpu() for t in parts[:5])
    responses = [tokens[s, plens[s]:plens[s] + lengths[s]].tolist() for s in range(tokens.shape[0])]
    routes = None if batch.routes is None else parts[5].cpu().to(batch.routes.dtype)
    return RolloutBatch(tokens, mask, lps, plens, responses, routes=routes)


VLLM_LORA_WRAPPED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF linears vLLM wraps in a LoRA layer when it is built with ``enable_lora`` (all of them,
whatever an adapter targets): the wrapper holds the original linear as ``base_layer``."""


def vllm_lora_base_name(name: str) -> str:
    """The name vLLM's ``model.load_weights`` takes for the HF weight ``name`` when LoRA is on:
    a wrapped linear's weight and bias live under ``base_layer`` (``...q_proj.base_layer.weight``;
    the plain name is a KeyError there), everything else keeps its name."""
    module, _, leaf = name.rpartition(".")
    if leaf in ("weight", "bias") and module.rpartition(".")[2] in VLLM_LORA_WRAPPED \
            and ".experts." not in module:
        return f"{module}.base_layer.{leaf}"
    return name


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _load_weights_on_worker(worker, weights) -> None:
    # Runs inside the vLLM worker (in this process: external_launcher, in-process engine core).
    # get_model() unwraps the CUDA-graph wrapper that model_runner.model may be.
    worker.model_runner.get_model().load_weights(weights=weights)


# --- the engine -----------------------------------------------------------------------------
class VLLMEngine:
    """:class:`~emapg_megatron.rollout.engine.RolloutEngine` on a colocated vLLM.

    Construct it on every rank at the same time (a collective). vLLM refuses to start unless
    ``gpu_memory_utilization`` of the whole GPU is free, and sizes its KV cache to fill that share.
    The trainer builds it after the model, optimizer and EMA anchor, so the start-up check sees
    them; Adam's state is only created at the first optimizer step, so leave room for it
    (about 8 bytes per locally held parameter element, less with the distributed optimizer).
    """

    def __init__(self, cfg: VLLMConfig, model_cfg, *, seq_length: int, pad_id: int,
                 model_chunks=None, trainer_tp: int | None = None, pipeline_parallel: int = 1,
                 route_dtype: torch.dtype | None = None):
        """``route_dtype``: return a MoE policy's routes in that dtype (R3; None: none)."""
        vllm = import_vllm()
        cfg.validate(trainer_tp)
        cfg = replace(cfg.for_trainer(trainer_tp), return_routes=route_dtype is not None)
        # The worker (and its model) must live in this process for load_weights.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if dist.is_initialized():  # external_launcher reads these; torchrun sets them, python does not
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()
                                                    if torch.cuda.is_available() else 0))
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.model_chunks = model_chunks
        self.route_dtype = route_dtype
        self._sampling_params_cls = vllm.SamplingParams
        self.lora = cfg.lora if cfg.lora is not None and cfg.lora.enabled else None
        if self.lora is not None:
            self._lora_request_cls = importlib.import_module("vllm.lora.request").LoRARequest
        self.llm = _start_llm(vllm, cfg.llm_kwargs_for(seq_length))
        self.tokenizer = self.llm.get_tokenizer()
        # R3: vLLM's route capture need not be alike on every rank of its TP group (it writes it on
        # TP rank 0), so the model-parallel group's first rank reads the routes and its batch is
        # everyone's
        self.needs_broadcast = (pipeline_parallel > 1 or route_dtype is not None or
                                (trainer_tp is not None and trainer_tp != cfg.tensor_parallel_size))
        self._weights_awake = self._kv_awake = True
        self._weights_valid = False  # dummy weights until the first sync
        self._base_valid = False  # LoRA: vLLM holds the frozen base (synced once, until dropped)
        self._depth = 0
        self.last_sync = None
        self.lora_request = None  # LoRA: the adapter every generate passes (None before a sync)
        self._lora_dir = None
        self._closed = False
        if self.lora is not None:  # private (0700), this rank's; one adapter folder at a time
            sweep_stale_adapter_dirs()  # a killed run's (close() never ran)
            self._lora_dir = tempfile.mkdtemp(prefix=f"emapg-vllm-lora-r{_rank()}-p{os.getpid()}-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._lora_dir, True)
        self._sleep()

    # --- memory states ---------------------------------------------------------------
    def _sleep(self) -> None:
        if not self.cfg.sleep_level:
            return
        self.llm.sleep(level=self.cfg.sleep_level)
        self._weights_awake = self._kv_awake = False
        if self.cfg.sleep_level == 2:
            # level 2 drops the weights (LoRA: the base and the adapter slot too): resync both
            # before generating
            self._weights_valid = self._base_valid = False

    def _wake(self, tag: str) -> None:
        # vLLM maps fresh physical memory on wake: give back what torch's allocator caches
        # from training first (activations, logits), or the wake can run out of memory.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=[tag])
        if tag == "weights":
            self._weights_awake = True
        else:
            self._kv_awake = True

    @contextlib.contextmanager
    def awake(self):
        """Weights current and KV cache allocated inside; asleep again after (re-entrant)."""
        if self._depth == 0:
            if not self._weights_valid:
                if self.model_chunks is None:
                    raise RuntimeError("VLLMEngine holds dummy weights: call "
                                       "update_weights(model_chunks) before generating")
                self.update_weights(self.model_chunks)
            elif not self._weights_awake:
                self._wake("weights")
            if not self._kv_awake:
                self._wake("kv_cache")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._sleep()

    # --- weights -------------------------------------------------------------------------
    def _load(self, bucket) -> None:
        self.llm.collective_rpc(_load_weights_on_worker, args=(bucket,))

    def _load_lora_base(self, bucket) -> None:
        self._load([(vllm_lora_base_name(name), t) for name, t in bucket])

    def update_weights(self, model_chunks=None):
        """Copy the trainer's current weights into vLLM; returns (and keeps) the SyncStats.

        With LoRA: the frozen base only when vLLM lacks it (the first sync, and after a level-2
        sleep), then the adapters as a new LoRA request. The weights stay awake afterwards: the
        next generate only has to wake the KV cache.
        """
        if self._closed:
            raise RuntimeError("VLLMEngine.update_weights after close()")
        if model_chunks is not None:
            self.model_chunks = model_chunks
        if not self._weights_awake:
            self._wake("weights")  # the KV cache stays released while new weights stream in
        if self.lora is None:
            stats = weight_sync.sync_weights(self.model_chunks, self.model_cfg, self._load,
                                             bucket_bytes=self.cfg.bucket_bytes)
        else:
            stats = self._sync_lora()
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self._weights_valid = True
        self.last_sync = stats
        if _rank() == 0 and stats.adapter_bytes is None:
            logger.info("weight sync: %.2f GB in %.2f s (%.1f GB/s, %d buckets)",
                        stats.bytes / 1e9, stats.seconds, stats.gbps, stats.buckets)
        elif _rank() == 0:
            logger.info("weight sync: base %.2f GB, adapters %.1f MB (peft folder) in %.2f s",
                        stats.base_bytes / 1e9, stats.adapter_bytes / 1e6, stats.seconds)
        return stats

    def _sync_lora(self):
        """The base if vLLM lacks it, then the adapters in a new peft folder and LoRA request;
        the previous adapter leaves vLLM (while its weights are awake: removing writes to the
        adapter slot) and the disk."""
        stats = None
        if not self._base_valid:
            stats = weight_sync.sync_weights(self.model_chunks, self.model_cfg, self._load_lora_base,
                                             bucket_bytes=self.cfg.bucket_bytes, adapters="exclude")
            self._base_valid = True
        old = self.lora_request
        new_id = (old.lora_int_id if old is not None else 0) + 1
        path = os.path.join(self._lora_dir, f"adapter-{new_id}")
        adapter = weight_sync.sync_adapters(self.model_chunks, self.model_cfg, self.lora, path)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        # the same name and id on every rank (vLLM's TP ranks schedule alike); the path is this rank's
        self.lora_request = self._lora_request_cls(lora_name=f"emapg-policy-{new_id}",
                                                   lora_int_id=new_id, lora_path=path)
        return adapter if stats is None else stats + adapter

    def close(self) -> None:
        """Delete the LoRA adapter folders (nothing to do without LoRA); the engine syncs no more.
        Idempotent; garbage collection does the same."""
        self._closed = True
        self.lora_request = None
        if self._lora_dir is not None:
            self._cleanup()

    def metrics(self) -> dict:
        return self.last_sync.metrics() if self.last_sync is not None else {}

    # --- sampling --------------------------------------------------------------------------
    def _params(self, *, n: int, temperature: float, top_p: float, max_tokens: int,
                stop: Sequence[str] | None, seed: int | None):
        return self._sampling_params_cls(**sampling_kwargs(
            n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stop,
            seed=seed if self.cfg.per_request_seed else None))

    def _run(self, token_histories: Sequence[Sequence[int]], params: list):
        inputs = [{"prompt_token_ids": [int(i) for i in h]} for h in token_histories]
        with self.awake():
            if self.lora is not None and self.lora_request is None:
                raise RuntimeError("VLLMEngine has LoRA on but no adapter: call update_weights first")
            return self.llm.generate(inputs, params, use_tqdm=False, lora_request=self.lora_request)

    def _agree(self, batch: RolloutBatch, episodes: list[Episode] | None = None) -> RolloutBatch:
        """Every rank of the model-parallel group takes its first rank's batch (and episode
        texts, which the rewards score) when the vLLM and trainer layouts differ."""
        if not self.needs_broadcast or not (dist.is_initialized() and ps.model_parallel_is_initialized()):
            return batch  # (no process group: one rank, nothing to agree)
        group = ps.get_model_parallel_group()
        src = dist.get_process_group_ranks(group)[0]
        if episodes is not None:
            texts = [[ep.response_text for ep in episodes]]
            dist.broadcast_object_list(texts, src=src, group=group)
            for ep, text in zip(episodes, texts[0]):
                ep.agreed_text = text
        return broadcast_rollout_batch(batch, src=src, group=group)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int, *, stop: Sequence[str] | None = None, rng_step: int = 0,
                 seq_index: Sequence[int] | None = None) -> RolloutBatch:
        """``n`` samples per prompt, prompt-major. ``seq_index`` is each sequence's index in the
        global batch (as for the Megatron sampler); it keys the per-prompt seeds."""
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.seq_length:
            raise ValueError(f"prompt ({longest}) + --max-new-tokens ({max_new_tokens}) "
                             f"exceeds --seq-length {self.seq_length}")
        prompt_index = ([seq_index[i * n] // n for i in range(len(prompts))] if seq_index is not None
                        else range(len(prompts)))
        params = [self._params(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                               stop=stop, seed=request_seed(self.cfg.seed, rng_step, p))
                  for p in prompt_index]
        responses, logprobs, routed = [], [], []
        for prompt, out in zip(prompts, self._run(prompts, params)):
            for comp in sorted(out.outputs, key=lambda c: c.index):
                ids = [int(t) for t in comp.token_ids]
                responses.append(ids)
                logprobs.append(sampled_logprobs(ids, comp.logprobs))
                routed.append((comp.routed_experts if self.route_dtype is not None else None,
                               len(prompt) + len(ids)))
        batch = build_rollout_batch(prompts, responses, logprobs, self.seq_length, self.pad_id, n)
        if self.route_dtype is not None:  # prompt first, from position 0, as the built-in sampler's
            batch.routes = self._leaders_routes(
                lambda: [vllm_routes(r, fed=fed, model_cfg=self.model_cfg, dtype=self.route_dtype)
                         for r, fed in routed], *batch.tokens.shape)
        return self._agree(batch)

    def _leaders_routes(self, convert, rows: int, width: int) -> torch.Tensor:
        """R3: the batch's routes, ``[S, width, MoE layers, k]``, read from vLLM's arrays
        (``convert()``: each sequence's ``[positions, MoE layers, k]``) on the model-parallel
        group's first rank, whose batch :meth:`_agree` gives every rank (the others hold the
        unrouted fill, never read). A route that does not check out is one RunError line on every
        rank of the group, before any rank goes on."""
        group = ps.get_model_parallel_group() if dist.is_initialized() and ps.model_parallel_is_initialized() else None
        leader = dist.get_process_group_ranks(group)[0] if group is not None else None
        error, routes = None, None
        if group is None or dist.get_rank() == leader:
            try:
                routes = lay_routes(convert(), width)
            except RunError as e:
                error = str(e)
        if group is not None and dist.get_world_size(group) > 1:
            box = [error]
            dist.broadcast_object_list(box, src=leader, group=group)  # our own message, not user data
            error = box[0]
        if error is not None:
            raise agreed(RunError(error))
        if routes is None:  # not the leader: a placeholder of the leader's shape
            unrouted = fill_routes(width, len(self.model_cfg.moe_layers), self.model_cfg.moe_router_topk,
                                   self.route_dtype)
            routes = unrouted.expand(rows, -1, -1, -1).clone()
        return routes

    def continue_histories(self, histories: Sequence[Sequence[int]], *, temperature: float,
                           top_p: float, max_new_tokens: int | Sequence[int],
                           stop: Sequence[str] | None = None,
                           seeds: Sequence[int] | None = None) -> list[Turn]:
        """One continuation per token-id history (prompt + earlier turns + observations)."""
        budgets = ([max_new_tokens] * len(histories) if isinstance(max_new_tokens, int)
                   else list(max_new_tokens))
        seeds = list(seeds) if seeds is not None else [None] * len(histories)
        params = [self._params(n=1, temperature=temperature, top_p=top_p, max_tokens=m, stop=stop,
                               seed=s) for m, s in zip(budgets, seeds)]
        turns = []
        for history, out in zip(histories, self._run(histories, params)):
            comp = out.outputs[0]
            ids = [int(t) for t in comp.token_ids]
            routes = comp.routed_experts if self.route_dtype is not None else None  # read by the leader
            turns.append(Turn(ids, sampled_logprobs(ids, comp.logprobs), comp.text,
                              comp.finish_reason, routes))
        return turns

    def generate_episodes(self, prompts: Sequence[Sequence[int]], n: int, envs: Sequence[Any], *,
                          tokenizer, temperature: float, top_p: float, max_new_tokens: int,
                          stop: Sequence[str] | None = None, rng_step: int = 0,
                          seq_index: Sequence[int] | None = None) -> tuple[RolloutBatch, list[Episode]]:
        """Multi-turn rollouts (see :func:`emapg_megatron.rollout.episodes.run_episodes`)."""

        last = {}  # R3: each episode's last request (its tokens fed and their routes)

        def continue_fn(histories, budgets, active, turn):
            index = seq_index if seq_index is not None else range(len(envs))
            seeds = [request_seed(self.cfg.seed, rng_step, index[s], turn) for s in active]
            turns = self.continue_histories(histories, temperature=temperature, top_p=top_p,
                                            max_new_tokens=budgets, stop=stop, seeds=seeds)
            for s, history, t in zip(active, histories, turns):
                last[s] = (list(history) + t.token_ids, t.routes)
            return turns

        # One vLLM engine spans the model-parallel group: its ranks must feed it the same
        # histories, so they agree on every environment answer (a broadcast batch is agreed later).
        shared = not self.needs_broadcast and ps.model_parallel_is_initialized()
        with self.awake():
            batch, episodes = run_episodes(continue_fn, prompts, n, envs, tokenizer=tokenizer,
                                           top_p=top_p, max_new_tokens=max_new_tokens,
                                           seq_length=self.seq_length, pad_id=self.pad_id,
                                           group=ps.get_model_parallel_group() if shared else None)
        if self.route_dtype is not None:
            def convert():
                out = []
                for s, ep in enumerate(episodes):
                    if s not in last:  # an episode without a request: nothing was fed
                        out.append(None)
                        continue
                    fed, raw = last[s]
                    routes = vllm_routes(raw, fed=len(fed), model_cfg=self.model_cfg, dtype=self.route_dtype)
                    out.append(episode_routes(ep, fed, routes))
                return out
            batch.routes = self._leaders_routes(convert, *batch.tokens.shape)
        return self._agree(batch, episodes), episodes


def episode_routes(episode: Episode, fed: Sequence[int], routes: torch.Tensor | None):
    """An episode's routes from its last request (``fed``: that request's prompt, the whole
    history, and its completion; ``routes``: what vLLM routed them with): the positions where the
    episode's tokens are the ones fed (the environment may cut or rewrite that last turn, or
    append an observation after it); None without a request."""
    if routes is None:
        return None
    kept = episode.history()
    same = next((i for i, (a, b) in enumerate(zip(kept, fed)) if a != b), min(len(kept), len(fed)))
    return routes[:same]


# --- evaluation backend (python -m emapg_megatron.evaluate --load HF_DIR) ---------------------
class VLLMGenerationBackend:
    """The :class:`emapg_megatron.evaluate.GenerationBackend` on a standalone vLLM."""

    def __init__(self, llm, *, temperature: float, top_p: float, max_new_tokens: int, seed: int):
        from vllm import SamplingParams

        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self._sampling_params_cls = SamplingParams
        self.temperature, self.top_p = temperature, top_p
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.calls = 0

    def __call__(self, prompts: list[str], n: int, *, stop: Sequence[str] | None = None,
                 max_new_tokens: int | None = None, **_: Any) -> list[list[str]]:
        params = [self._sampling_params_cls(**sampling_kwargs(
            n=n, temperature=self.temperature, top_p=self.top_p,
            max_tokens=max_new_tokens or self.max_new_tokens, stop=stop,
            seed=request_seed(self.seed, self.calls, i), logprobs=None))
            for i in range(len(prompts))]
        self.calls += 1
        # Prompt strings are already rendered (chat template included): no extra BOS.
        inputs = [{"prompt_token_ids": encode_text(self.tokenizer, p)} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=True)
        return [[c.text for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


def load_generation_backend(ckpt: str, *, temperature: float = 1.0, top_p: float = 1.0,
                            max_new_tokens: int = 1024, seed: int = 0, tensor_parallel_size: int = 1,
                            gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                            dtype: str = "bfloat16", **llm_kwargs) -> VLLMGenerationBackend:
    """vLLM on a Hugging Face directory (a trainer checkpoint goes through
    ``emapg-convert mcore-to-hf`` first)."""
    vllm = import_vllm()
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        raise ConfigError(f"{ckpt} is not a Hugging Face model directory (no config.json); export "
                          f"a trainer checkpoint with `emapg-convert mcore-to-hf` first")
    llm = vllm.LLM(model=ckpt, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                   **llm_kwargs)
    return VLLMGenerationBackend(llm, temperature=temperature, top_p=top_p,
                                 max_new_tokens=max_new_tokens, seed=seed)
