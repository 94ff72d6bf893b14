"""The vLLM rollout engine's orchestration, on CPU, against a test double of the ``vllm`` module.

vLLM needs CUDA, so :class:`~emapg_megatron.rollout.vllm_engine.VLLMEngine` (sleep / wake / weight
sync / sampling-parameter plumbing / batch layout) and the evaluation backend are exercised here
against :class:`FakeLLM` and :class:`SamplingParams` below, installed as ``sys.modules["vllm"]``.

The double mirrors the vLLM API the engine uses (the names tools/check_vllm_api.py finds in the
vLLM 0.18 and 0.33 sources):

* ``SamplingParams`` has a strict keyword signature, so a misspelt argument fails;
* ``LLM`` records its constructor kwargs; ``sleep`` / ``wake_up(tags)`` follow the executor's
  bookkeeping (a sleep while anything is still asleep and a wake-up of a tag that is not asleep
  are no-ops with a warning in vLLM; here the warning is an error); level 2 drops the weights' contents; ``sleep`` resets
  the prefix cache itself (as ``LLM.sleep`` does);
* ``collective_rpc(callable, args=...)`` calls ``callable(worker, *args)`` and returns a list;
  ``worker.model_runner.get_model().load_weights(weights=...)`` loads ``(name, tensor)`` pairs;
* ``generate`` refuses to run with weights or KV cache asleep, with stale (never loaded / dropped)
  weights, or on a prefix cache computed with older weights (real vLLM would silently produce
  garbage in all those cases). It returns one ``RequestOutput`` per prompt whose ``outputs`` are
  in *reversed* ``index`` order. The ``n`` samples of a request with ``seed=s`` use ``s + k`` (as
  vLLM's parallel sampling does); a sample's tokens are a deterministic function of the loaded
  weights, the prompt ids and that seed. Each sampled token's log-prob is :func:`fake_logprob`.
* LoRA: ``LLM(enable_lora=, max_lora_rank=, max_loras=)`` validated as vLLM does (a
  ``max_lora_rank`` outside vLLM's allowed values raises); ``vllm.lora.request.LoRARequest`` has
  vLLM's signature and checks; ``generate(..., lora_request=)`` loads an adapter id it has not
  seen from its peft folder on disk (refusing a missing folder, a rank above ``max_lora_rank``,
  tensors that are not peft LoRA names or do not fit the loaded base, as vLLM's loader does),
  evicts the least recently used adapter past ``max_loras`` (recorded in ``llm.evicted``), and the
  samples then also depend on the adapter's tensors and scale. With LoRA on, ``load_weights``
  takes the linears vLLM wraps for LoRA (q/k/v/o/gate/up/down_proj) only under their
  ``base_layer`` names and the plain names are a KeyError, as in vLLM (and the reverse without
  LoRA). ``llm.llm_engine.remove_lora(id)``
  drops an adapter (refused while the weights sleep: vLLM zeroes its slot). Stricter than vLLM:
  a removed id used again fails (vLLM would reload its folder), and so does an adapter whose slot a
  level-2 sleep discarded (vLLM would sample with garbage).
* Routes (R3): ``LLM(enable_return_routed_experts=True)`` reads the model directory's
  ``config.json`` as vLLM does (``num_hidden_layers``, ``num_experts_per_tok``, ``num_experts`` /
  ``num_local_experts``, Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``; a config
  without them fails) and every ``CompletionOutput.routed_experts`` is then vLLM's array: int32
  ``[prompt + completion - 1, num_hidden_layers, top-k]`` (the last sampled token is never fed),
  zeros on a dense layer's rows, on a MoE layer ``k`` distinct expert ids that are a deterministic
  function of the token's prefix and the layer (:func:`fake_routes`). Off, it is None.
  ``llm.mangle_routes`` (a callable on each array) lets a test break them.

The engine's weight export (``weight_sync.sync_weights``) is stubbed by the ``fake_sync`` fixture,
except in the last test: a real tiny Megatron model at TP=2 or PP=2 (two spawned ranks) streams
through the real export into the fake worker, and the engine broadcasts rank 0's batch over the
model-parallel group.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import types
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from emapg_megatron.errors import ConfigError
from emapg_megatron.rollout import weight_sync
from emapg_megatron.rollout.config import VLLMConfig
from emapg_megatron.rollout.vllm_engine import (
    VLLMEngine,
    VLLMGenerationBackend,
    load_generation_backend,
    request_seed,
)
from emapg_megatron.rollout.weight_sync import SyncStats

# A call that vLLM would ignore (sleep while partly asleep: the memory would stay allocated) fails.
pytestmark = pytest.mark.filterwarnings("error:fake vLLM")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "samples", "corpus.jsonl")
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


# ============================================================================================
# A test double of the vllm module (API of vLLM 0.18 - 0.33, CPU only, no model inside)
# ============================================================================================
class CharTokenizer:
    """One token per character (id = code point); what ``FakeLLM.get_tokenizer()`` returns."""

    eos_token_id = None
    pad_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)


def fake_logprob(pos: int, token: int) -> float:
    """The log-prob the fake reports for ``token`` sampled at position ``pos`` of a completion."""
    return -0.01 * (pos + 1) - 0.0001 * token


LETTERS = "abcdefghijklmnopqrstuvwxyz "


class SamplingParams:
    """``vllm.SamplingParams`` restricted to the arguments the engine may use (strict)."""

    def __init__(self, n=1, temperature=1.0, top_p=1.0, max_tokens=16, stop=None,
                 include_stop_str_in_output=False, logprobs=None, seed=None):
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {logprobs}.")
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.logprobs, self.seed = logprobs, seed


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    routed_experts: object = None  # np.ndarray [seq_len, layer_num, topk] (vLLM's field order)
    finish_reason: str | None = None
    stop_reason: str | None = None


def moe_layers_of(hf: dict) -> list[int]:
    """The layers vLLM builds with a routed MoE block (Qwen3-MoE's rule; every layer otherwise)."""
    step, only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or [])
    return [i for i in range(hf["num_hidden_layers"]) if i not in only and (i + 1) % step == 0]


def fake_routes(tokens: list[int], hf: dict):
    """What vLLM returns as ``routed_experts`` for a request that fed ``tokens`` (prompt +
    completion less its last token): int32 ``[len(tokens), num_hidden_layers, top-k]``; a MoE
    layer's ``k`` distinct experts at position p depend on ``tokens[:p + 1]`` and the layer only,
    a dense layer's rows stay 0 (vLLM never writes them)."""
    import numpy as np

    layers, k = hf["num_hidden_layers"], hf["num_experts_per_tok"]
    experts = hf.get("num_experts") or hf["num_local_experts"]
    out = np.zeros((len(tokens), layers, k), dtype=np.int32)
    moe, prefix = moe_layers_of(hf), 0
    for p, tok in enumerate(tokens):
        prefix = (prefix * 1_000_003 + int(tok) + 1) % (1 << 61)
        for layer in moe:
            out[p, layer] = random.Random(f"{prefix}|{layer}").sample(range(experts), k)
    return out


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    prompt_logprobs: None
    outputs: list
    finished: bool = True


class _FakeModel:
    """The worker's model: ``load_weights`` consumes ``(hf_name, tensor)`` pairs."""

    def __init__(self, llm):
        self.llm = llm
        self.params: dict[str, torch.Tensor] = {}
        self.loads: list[dict] = []  # one per load_weights call: names and the memory state
        self.received: list[tuple[str, torch.Tensor]] = []  # everything ever loaded, in order

    def load_weights(self, weights):
        llm = self.llm
        if not llm.weights_awake:
            raise RuntimeError("load_weights into weight memory released by sleep()")
        names = []
        for name, tensor in weights:
            assert isinstance(name, str) and isinstance(tensor, torch.Tensor), (name, type(tensor))
            # with LoRA on, vLLM's wrapped linears hold their weights under base_layer
            if lora_wrapped(name) or needs_wrapping(name):
                if lora_wrapped(name) != llm.enable_lora:  # vLLM: params_dict[name] fails
                    raise KeyError(name)
            self.params[name] = tensor.detach().clone()
            self.received.append((name, self.params[name]))
            names.append(name)
        llm.weights_valid = True
        llm.weights_version += 1
        llm.events.append("load_weights")
        self.loads.append({"names": names, "weights_awake": llm.weights_awake,
                           "kv_awake": llm.kv_awake})
        return set(names)

    def fingerprint(self) -> str:
        return ";".join(f"{n}={float(t.double().sum()):.6f}" for n, t in sorted(self.params.items()))


class _FakeWorker:
    def __init__(self, model):
        self.model_runner = SimpleNamespace(get_model=lambda: model)


MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.10.2 on (later ones add 1)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_wrapped(name: str) -> bool:
    """Whether ``name`` is how a vLLM built with ``enable_lora`` names a weight or bias of the
    linears it wraps in LoRA layers (``...q_proj.base_layer.weight``); True for no other name."""
    module, _, leaf = name.rpartition(".")
    wrapper, _, inner = module.rpartition(".")
    return inner == "base_layer" and wrapper.rpartition(".")[2] in LORA_MODULES


def needs_wrapping(name: str) -> bool:
    """Whether ``name`` is the plain name of such a weight or bias (``...q_proj.weight``)."""
    module, _, leaf = name.rpartition(".")
    return leaf in ("weight", "bias") and module.rpartition(".")[2] in LORA_MODULES


@dataclass
class LoRARequest:
    """``vllm.lora.request.LoRARequest``: its fields and checks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: int | None = None
    base_model_name: str | None = None

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


class _FakeLLMEngine:
    """``LLM.llm_engine``: the adapter registry calls."""

    def __init__(self, llm):
        self.llm = llm

    def remove_lora(self, lora_id: int) -> bool:
        llm = self.llm
        assert lora_id > 0, "lora_id must be greater than 0."
        llm.events.append(f"remove_lora({lora_id})")
        if lora_id not in llm.loras:
            return False
        if not llm.weights_awake:  # deactivating zeroes the adapter's slot in weight memory
            raise RuntimeError("remove_lora while the weights sleep (their memory is released)")
        del llm.loras[lora_id]
        llm.removed.append(lora_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self.llm.loras)


def load_peft_folder(path: str, max_rank: int, base: dict[str, torch.Tensor]) -> dict:
    """An adapter as vLLM's loader reads it: the peft config and safetensors tensors, checked."""
    from safetensors.torch import load_file

    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(config_file) and os.path.isfile(weights_file)):
        raise ValueError(f"Loading lora failed: No adapter found for {path}")
    with open(config_file) as f:
        config = json.load(f)
    rank, alpha = config["r"], config["lora_alpha"]
    if rank > max_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    if config.get("bias", "none") != "none" or config.get("use_dora") or config.get("modules_to_save"):
        raise ValueError(f"unsupported peft config {config}")
    tensors = load_file(weights_file)
    for name, t in tensors.items():
        module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
        if not name.startswith("base_model.model.") or kind not in ("A.weight", "B.weight") \
                or module.rsplit(".", 1)[-1] not in LORA_MODULES:
            raise ValueError(f"unexpected LoRA tensor {name}")
        weight = base.get(f"{module}.base_layer.weight")
        if weight is None:
            raise ValueError(f"LoRA tensor {name}: the model has no {module}")
        want = (rank, weight.shape[1]) if kind == "A.weight" else (weight.shape[0], rank)
        if tuple(t.shape) != want:
            raise ValueError(f"LoRA tensor {name}: shape {tuple(t.shape)}, expected {want}")
    digest = hashlib.sha256(f"{alpha / rank}".encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return {"rank": rank, "alpha": alpha, "tensors": tensors, "hash": digest.hexdigest(),
            "slot_valid": True}


class FakeLLM:
    """``vllm.LLM`` (offline entry point) with the memory bookkeeping of sleep mode."""

    # EngineArgs fields the engine and the evaluation backend pass (a typo fails).
    ENGINE_ARGS = {"tokenizer", "dtype", "seed", "tensor_parallel_size",
                   "distributed_executor_backend", "gpu_memory_utilization", "max_model_len",
                   "enable_sleep_mode", "enforce_eager", "enable_prefix_caching", "load_format",
                   "logprobs_mode", "enable_lora", "max_lora_rank", "max_loras",
                   "enable_return_routed_experts"}

    def __init__(self, model, **kwargs):
        unknown = set(kwargs) - self.ENGINE_ARGS
        if unknown:
            raise TypeError(f"unexpected EngineArgs {sorted(unknown)}")
        self.enable_lora = bool(kwargs.get("enable_lora", False))
        self.max_lora_rank = kwargs.get("max_lora_rank", 16)
        self.max_loras = kwargs.get("max_loras", 1)
        if self.enable_lora:  # vLLM's LoRAConfig
            if self.max_lora_rank not in MAX_LORA_RANKS:
                raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of "
                                 f"{MAX_LORA_RANKS}.")
            if self.max_loras < 1:
                raise ValueError(f"max_loras ({self.max_loras}) must be >= 1")
        self.hf_moe = None  # with enable_return_routed_experts: the MoE entries of config.json
        if kwargs.get("enable_return_routed_experts"):
            with open(os.path.join(model, "config.json")) as f:
                hf = json.load(f)
            need = ("num_hidden_layers", "num_experts_per_tok")
            if any(hf.get(key) is None for key in need) or not (hf.get("num_experts")
                                                                or hf.get("num_local_experts")):
                raise AttributeError(f"fake vLLM: routed experts need a MoE config.json ({need}, "
                                     "num_experts / num_local_experts)")
            self.hf_moe = hf
        self.mangle_routes = None  # optional: routed_experts array -> what the output carries
        self.loras: dict[int, dict] = {}  # registered adapters by id, least recently used first
        self.removed: list[int] = []  # ids removed through llm_engine.remove_lora
        self.evicted: list[int] = []  # ids vLLM's LRU cache dropped to make room
        self.lora_loads: list[dict] = []  # every adapter read from disk
        self.llm_engine = _FakeLLMEngine(self)
        self.kwargs = {"model": model, **kwargs}
        self.env_at_init = os.environ.get(MP_ENV)
        self.tokenizer = CharTokenizer()
        self.model = _FakeModel(self)
        self.worker = _FakeWorker(self.model)
        self.events: list[str] = []
        self.generate_calls: list[dict] = []  # inputs, params and produced outputs of each call
        self.sleeping_tags: set[str] = set()
        self.weights_valid = kwargs.get("load_format", "auto") != "dummy"
        self.weights_version = 0
        self.prefix_cache_version = None  # weights version the cached prefixes were computed with
        self.script = None  # optional: prompt ids -> completion text (else random letters)
        self.drop_logprobs = False  # simulate a vLLM that returns no log-probs
        self._unseeded = random.Random(kwargs.get("seed"))

    # --- state ------------------------------------------------------------------------------
    @property
    def weights_awake(self) -> bool:
        return "weights" not in self.sleeping_tags

    @property
    def kv_awake(self) -> bool:
        return "kv_cache" not in self.sleeping_tags

    def get_tokenizer(self):
        return self.tokenizer

    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.kwargs.get("enable_sleep_mode"):
            raise RuntimeError("Sleep mode is not enabled (LLM(enable_sleep_mode=True))")
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}")
        self.events.append(f"sleep({level})")
        self.prefix_cache_version = None  # LLM.sleep resets the prefix cache first
        if self.sleeping_tags:  # executor: "Executor is already sleeping." (no-op)
            warnings.warn("fake vLLM: sleep() while already sleeping is a no-op")
            return
        self.sleeping_tags = {"weights", "kv_cache"}
        if level == 2:  # the weights' contents are discarded (the adapters' slots with them)
            self.weights_valid = False
            self.model.params = {}
            for lora in self.loras.values():
                lora["slot_valid"] = False

    def wake_up(self, tags=None):
        self.events.append(f"wake_up({','.join(tags) if tags else 'all'})")
        if not self.sleeping_tags:  # executor: "Executor is not sleeping." (no-op)
            warnings.warn("fake vLLM: wake_up() while not sleeping is a no-op")
            return
        if tags and any(t not in self.sleeping_tags for t in tags):  # executor: no-op
            warnings.warn(f"fake vLLM: tags {tags} not all in {self.sleeping_tags}: no-op")
            return
        self.sleeping_tags = self.sleeping_tags - set(tags) if tags else set()

    def reset_prefix_cache(self, device=None) -> bool:
        self.events.append("reset_prefix_cache")
        self.prefix_cache_version = None
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [method(self.worker, *args, **(kwargs or {}))]

    # --- sampling ---------------------------------------------------------------------------
    def _adapter(self, request) -> dict | None:
        """The adapter of ``request`` (loaded from its folder the first time), or None."""
        if request is None:
            return None
        assert isinstance(request, LoRARequest), type(request)
        if not self.enable_lora:
            raise ValueError(f"Got lora_request {request} but LoRA is not enabled!")
        lora_id = request.lora_int_id
        if lora_id in self.removed:
            raise RuntimeError(f"fake vLLM: adapter id {lora_id} was removed (vLLM would reload "
                               f"{request.lora_path}; a new adapter needs a new id)")
        if lora_id in self.loras:
            if not self.loras[lora_id]["slot_valid"]:
                raise RuntimeError(f"fake vLLM: adapter id {lora_id}'s slot was discarded by sleep(2) "
                                   "(vLLM would sample with garbage)")
            lora = self.loras.pop(lora_id)
        else:
            lora = load_peft_folder(request.lora_path, self.max_lora_rank, self.model.params)
            lora.update(name=request.lora_name, path=request.lora_path)
            self.lora_loads.append({"id": lora_id, **lora})
            self.events.append(f"load_lora({lora_id})")
            while len(self.loras) >= self.max_loras:  # vLLM's LRU cache: the oldest goes
                self.evicted.append(next(iter(self.loras)))
                del self.loras[self.evicted[-1]]
        self.loras[lora_id] = lora  # now the most recently used
        return lora

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        if not (self.weights_awake and self.kv_awake):
            raise RuntimeError(f"generate() while asleep: {sorted(self.sleeping_tags)}")
        if not self.weights_valid:
            raise RuntimeError("generate() with dummy / discarded weights (no load_weights since)")
        if self.prefix_cache_version not in (None, self.weights_version):
            raise RuntimeError("generate() on a prefix cache computed with older weights")
        adapter = self._adapter(lora_request)
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and params must be the same.")
        max_len = self.kwargs.get("max_model_len") or 10**9
        outputs = []
        for rid, (prompt, sp) in enumerate(zip(prompts, params)):
            assert isinstance(sp, SamplingParams), type(sp)
            assert set(prompt) == {"prompt_token_ids"}, prompt
            ids = prompt["prompt_token_ids"]
            assert all(type(i) is int for i in ids), "prompt_token_ids must be Python ints"
            if len(ids) > max_len:
                raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the "
                                 f"maximum model length of {max_len}.")
            comps = [self._complete(ids, sp, k, max_len, adapter) for k in range(sp.n)]
            outputs.append(RequestOutput(str(rid), None, list(ids), None, comps[::-1]))
        if self.kwargs.get("enable_prefix_caching"):
            self.prefix_cache_version = self.weights_version
        self.events.append("generate")
        self.generate_calls.append({"prompts": [p["prompt_token_ids"] for p in prompts],
                                    "params": params, "use_tqdm": use_tqdm, "outputs": outputs,
                                    "lora_request": lora_request,
                                    "adapter": adapter["hash"] if adapter else None})
        return outputs

    def _stream(self, ids, seed, adapter=None) -> list[int]:
        if self.script is not None:
            return self.tokenizer.encode(self.script(ids))
        lora = adapter["hash"] if adapter else "base"
        rng = random.Random(f"{self.model.fingerprint()}|{lora}|{','.join(map(str, ids))}|{seed}")
        return [ord(rng.choice(LETTERS)) for _ in range(rng.randint(1, 24))]

    def _complete(self, ids, sp: SamplingParams, index: int, max_len: int,
                  adapter=None) -> CompletionOutput:
        seed = sp.seed + index if sp.seed is not None else self._unseeded.getrandbits(31)
        room = min(sp.max_tokens or max_len, max_len - len(ids))
        out, text, finish, stop_reason = [], "", "stop", None
        for tok in self._stream(ids, seed, adapter):
            if len(out) >= room:
                finish = "length"
                break
            out.append(tok)
            text = self.tokenizer.decode(out)
            hits = [(text.find(s), s) for s in sp.stop if s in text]
            if hits:
                at, stop_reason = min(hits)
                text = text[:at + len(stop_reason)] if sp.include_stop_str_in_output else text[:at]
                break
        lps = [{t: Logprob(fake_logprob(p, t), 1, chr(t))} for p, t in enumerate(out)]
        routes = None
        if self.hf_moe is not None:  # every fed token: the prompt and the completion but its last
            routes = fake_routes((list(ids) + out)[:-1], self.hf_moe)
            if self.mangle_routes is not None:
                routes = self.mangle_routes(routes)
        return CompletionOutput(index, text, out, sum(fake_logprob(p, t) for p, t in enumerate(out)),
                                None if (sp.logprobs is None or self.drop_logprobs) else lps,
                                routed_experts=routes, finish_reason=finish, stop_reason=stop_reason)


def fake_vllm_modules(version: str = "0.18.0") -> dict[str, types.ModuleType]:
    """``vllm`` and the submodules the engine imports, by their ``sys.modules`` names."""
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    mod.LLM = FakeLLM
    mod.SamplingParams = SamplingParams
    mod.lora = types.ModuleType("vllm.lora")
    mod.lora.request = types.ModuleType("vllm.lora.request")
    mod.lora.request.LoRARequest = LoRARequest
    return {"vllm": mod, "vllm.lora": mod.lora, "vllm.lora.request": mod.lora.request}


def make_fake_vllm(version: str = "0.18.0") -> types.ModuleType:
    return fake_vllm_modules(version)["vllm"]


def install_fake_vllm(version: str = "0.18.0") -> types.ModuleType:
    """Put the fake in ``sys.modules`` for good (a spawned rank); returns ``vllm``."""
    modules = fake_vllm_modules(version)
    sys.modules.update(modules)
    return modules["vllm"]


# ============================================================================================
# fixtures and helpers
# ============================================================================================
MODEL_CFG = SimpleNamespace(name="the trainer's ModelConfig")  # only handed on to sync_weights
PAD = 5


@pytest.fixture
def fake_vllm(monkeypatch):
    modules = fake_vllm_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    mod = modules["vllm"]
    # setenv first so that the engine's os.environ.setdefault is undone after the test
    monkeypatch.setenv(MP_ENV, "unset-me")
    monkeypatch.delenv(MP_ENV)
    return mod


def fake_chunks(scale: float) -> list[dict]:
    """Stand-ins for the trainer's model chunks: what the stubbed export streams (HF names)."""
    return [{"model.embed_tokens.weight": torch.full((6, 4), scale),
             "model.norm.weight": torch.full((4,), 2 * scale),
             "lm_head.weight": torch.arange(24.0).reshape(6, 4) * scale}]


@pytest.fixture
def fake_sync(monkeypatch):
    """Replace ``weight_sync.sync_weights`` (the engine calls it through its module)."""
    calls = []

    def sync_weights(model_chunks, model_cfg, load, *, bucket_bytes, adapters="auto"):
        assert adapters == "auto"  # an engine without LoRA exports as the converter does
        pairs = [(n, t) for chunk in model_chunks for n, t in chunk.items()]
        buckets = [pairs[:1], pairs[1:]]
        for bucket in buckets:
            load(bucket)
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        stats = SyncStats(seconds=0.5, load_seconds=0.25, bytes=nbytes, tensors=len(pairs),
                          buckets=len(buckets))
        calls.append(SimpleNamespace(chunks=model_chunks, cfg=model_cfg, bucket_bytes=bucket_bytes,
                                     stats=stats))
        return stats

    monkeypatch.setattr(weight_sync, "sync_weights", sync_weights)
    return calls


def hf_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def make_engine(tmp_path, *, sleep_level=1, seq_length=64, chunks="default", **cfg_kw):
    cfg = VLLMConfig(hf_dir=hf_dir(tmp_path), sleep_level=sleep_level, seed=cfg_kw.pop("seed", 77),
                     weight_sync_bucket_mb=4096 / 2**20, **cfg_kw)
    return VLLMEngine(cfg, MODEL_CFG, seq_length=seq_length, pad_id=PAD, trainer_tp=1,
                      model_chunks=fake_chunks(1.0) if chunks == "default" else chunks)


def events_after(llm: FakeLLM, mark: int) -> list[str]:
    return llm.events[mark:]


PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31]]


# ============================================================================================
# 1. construction
# ============================================================================================
@pytest.mark.parametrize("sleep_level", [0, 1, 2])
def test_construction_llm_kwargs_env_and_initial_sleep(fake_vllm, fake_sync, tmp_path, sleep_level):
    engine = make_engine(tmp_path, sleep_level=sleep_level, seq_length=96, dtype="float16",
                         llm_kwargs={"enforce_eager": True})
    llm = engine.llm
    assert isinstance(llm, FakeLLM)
    kw = llm.kwargs
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["load_format"] == "dummy"
    assert kw["enable_sleep_mode"] is (sleep_level > 0)
    assert kw["max_model_len"] == 96 == engine.seq_length
    assert kw["model"] == kw["tokenizer"] == str(tmp_path)
    assert kw["seed"] == 77 and kw["dtype"] == "float16" and kw["tensor_parallel_size"] == 1
    assert kw["enforce_eager"] is True  # llm_kwargs override the defaults
    # the worker must live in this process: vLLM saw multiprocessing off when it was built
    assert llm.env_at_init == "0" and os.environ[MP_ENV] == "0"
    assert engine.tokenizer is llm.tokenizer
    assert not engine.needs_broadcast
    # asleep right after construction (no sleep call at all for level 0)
    assert llm.events == ([f"sleep({sleep_level})"] if sleep_level else [])
    assert llm.sleeping_tags == ({"weights", "kv_cache"} if sleep_level else set())
    assert fake_sync == []  # nothing synced until needed


def test_construction_keeps_a_preset_multiprocessing_env_and_checks_the_version(
        fake_vllm, fake_sync, tmp_path, monkeypatch):
    monkeypatch.setenv(MP_ENV, "1")
    assert make_engine(tmp_path).llm.env_at_init == "1"
    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm("0.10.1"))
    with pytest.raises(ConfigError, match="too old"):
        make_engine(tmp_path)


# ============================================================================================
# 2. no weights
# ============================================================================================
def test_generate_without_weights_or_model_chunks_raises(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, chunks=None)
    with pytest.raises(RuntimeError, match=r"update_weights"):
        engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert "generate" not in engine.llm.events and fake_sync == []
    # the error is recoverable: after a sync the engine samples
    engine.update_weights(fake_chunks(1.0))
    batch = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert batch.tokens.shape[0] == 6 and len(fake_sync) == 1


# ============================================================================================
# 3. memory state machine
# ============================================================================================
def test_sleep_level_1_syncs_once_then_only_wakes(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, sleep_level=1)
    llm = engine.llm
    first = engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3)
    assert llm.events == ["sleep(1)",
                          "wake_up(weights)", "load_weights", "load_weights", "reset_prefix_cache",
                          "wake_up(kv_cache)", "generate", "sleep(1)"]
    # weights awake, KV cache still released, while the new weights stream in
    assert [(ld["weights_awake"], ld["kv_awake"]) for ld in llm.model.loads] == [(True, False)] * 2
    assert [ld["names"] for ld in llm.model.loads] == [["model.embed_tokens.weight"],
                                                      ["model.norm.weight", "lm_head.weight"]]
    assert len(fake_sync) == 1
    call = fake_sync[0]
    assert call.chunks is engine.model_chunks and call.cfg is MODEL_CFG and call.bucket_bytes == 4096
    assert llm.sleeping_tags == {"weights", "kv_cache"}

    mark = len(llm.events)
    second = engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=3)
    assert events_after(llm, mark) == ["wake_up(weights)", "wake_up(kv_cache)", "generate", "sleep(1)"]
    assert len(fake_sync) == 1  # level 1 kept the weights: no resync
    assert torch.equal(first.tokens, second.tokens)  # same weights, same seeds


def test_sleep_level_2_resyncs_before_every_generate(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, sleep_level=2)
    llm = engine.llm
    per_generate = ["wake_up(weights)", "load_weights", "load_weights", "reset_prefix_cache",
                    "wake_up(kv_cache)", "generate", "sleep(2)"]
    first = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert llm.events == ["sleep(2)"] + per_generate
    mark = len(llm.events)
    second = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert events_after(llm, mark) == per_generate
    assert len(fake_sync) == 2
    assert torch.equal(first.tokens, second.tokens)  # reloaded the same trainer weights


def test_sleep_level_0_never_sleeps_or_wakes(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, sleep_level=0)
    llm = engine.llm
    engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    engine.update_weights(fake_chunks(3.0))  # prefix cache must be reset (the fake checks)
    engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert llm.events == ["load_weights", "load_weights", "reset_prefix_cache", "generate",
                          "generate",
                          "load_weights", "load_weights", "reset_prefix_cache", "generate"]
    assert not any(e.startswith(("sleep", "wake_up")) for e in llm.events)


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_update_weights_with_new_chunks_is_used_by_the_next_generate(fake_vllm, fake_sync, tmp_path,
                                                                     sleep_level):
    engine = make_engine(tmp_path, sleep_level=sleep_level)
    llm = engine.llm
    assert engine.metrics() == {}
    old = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)

    new_chunks = fake_chunks(-2.5)
    mark = len(llm.events)
    stats = engine.update_weights(new_chunks)
    assert events_after(llm, mark) == ["wake_up(weights)", "load_weights", "load_weights",
                                       "reset_prefix_cache"]
    assert stats is fake_sync[-1].stats and engine.last_sync is stats
    assert engine.model_chunks is new_chunks and fake_sync[-1].chunks is new_chunks
    assert all(torch.equal(llm.model.params[n], t) for n, t in new_chunks[0].items())
    m = engine.metrics()
    assert m["weight_sync_s"] == 0.5 and m["weight_sync_load_s"] == 0.25
    assert m["weight_sync_gb"] == pytest.approx(stats.bytes / 1e9) and stats.bytes == (24 + 4 + 24) * 4
    assert m["weight_sync_gbps"] == pytest.approx(stats.bytes / 1e9 / 0.5)

    mark = len(llm.events)
    new = engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    # the weights stayed awake after the sync: only the KV cache wakes, no second sync
    assert events_after(llm, mark) == ["wake_up(kv_cache)", "generate", f"sleep({sleep_level})"]
    assert len(fake_sync) == 2
    assert new.responses != old.responses  # sampled from the new weights


def test_awake_is_reentrant(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, sleep_level=1)
    llm = engine.llm
    engine.update_weights()  # the chunks given at construction
    mark = len(llm.events)
    with engine.awake():
        engine.generate(PROMPTS, 1, 1.0, 1.0, 4)
        with engine.awake():
            engine.generate(PROMPTS, 1, 1.0, 1.0, 4)
        assert llm.sleeping_tags == set()
    assert events_after(llm, mark) == ["wake_up(kv_cache)", "generate", "generate", "sleep(1)"]


def test_missing_logprobs_raise_and_the_engine_sleeps_again(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, sleep_level=1)
    engine.llm.drop_logprobs = True
    with pytest.raises(RuntimeError, match=r"logprobs=0"):  # CompletionOutput.logprobs is None
        engine.generate(PROMPTS, 2, 1.0, 1.0, 8)
    assert engine.llm.events[-2:] == ["generate", "sleep(1)"]
    assert engine.llm.sleeping_tags == {"weights", "kv_cache"}
    engine.llm.drop_logprobs = False
    engine.generate(PROMPTS, 2, 1.0, 1.0, 8)  # and the state machine still works


# ============================================================================================
# 4. generate: layout, log-probs, seeds, sampling parameters
# ============================================================================================
def test_generate_batch_layout_logprobs_and_seeds(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, seq_length=40)
    n, step = 3, 9
    global_prompts = [4, 7, 8]  # this rank's prompts' indices in the global batch
    seq_index = [p * n + k for p in global_prompts for k in range(n)]
    # top_p < 1 is passed through; its off-policy warning is the trainer's, said once a run
    batch = engine.generate(PROMPTS, n, 0.7, 0.9, 12, stop=["</answer>", "zz"], rng_step=step,
                            seq_index=seq_index)
    call = engine.llm.generate_calls[-1]
    assert call["prompts"] == PROMPTS and call["use_tqdm"] is False
    for p, sp in zip(global_prompts, call["params"]):
        assert sp.seed == request_seed(77, step, p)
        assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens) == (n, 0.7, 0.9, 12)
        assert sp.logprobs == 0 and sp.include_stop_str_in_output is True
        assert sp.stop == ["</answer>", "zz"]

    ends = [p + len(r) for p, r in zip(batch.prompt_lengths.tolist(), batch.responses)]
    S, L = len(PROMPTS) * n, min(40, -(-max(ends) // 8) * 8)  # the longest, not --seq-length
    assert batch.tokens.shape == batch.loss_mask.shape == batch.sampling_logprobs.shape == (S, L)
    assert batch.prompt_lengths.tolist() == [len(p) for p in PROMPTS for _ in range(n)]
    for i, out in enumerate(call["outputs"]):
        assert [c.index for c in out.outputs] == list(range(n))[::-1]  # the fake returns reversed
        by_index = sorted(out.outputs, key=lambda c: c.index)
        for k, comp in enumerate(by_index):
            s = i * n + k  # prompt-major, ordered by completion index
            P, R = len(PROMPTS[i]), len(comp.token_ids)
            assert batch.responses[s] == comp.token_ids
            assert batch.tokens[s, :P].tolist() == PROMPTS[i]
            assert batch.tokens[s, P:P + R].tolist() == comp.token_ids
            assert batch.tokens[s, P + R:].tolist() == [PAD] * (L - P - R)
            assert batch.loss_mask[s].tolist() == [0.0] * P + [1.0] * R + [0.0] * (L - P - R)
            expect = [fake_logprob(j, t) for j, t in enumerate(comp.token_ids)]
            assert batch.sampling_logprobs[s, P:P + R].tolist() == pytest.approx(expect, abs=1e-6)
            assert not batch.sampling_logprobs[s, :P].any() and not batch.sampling_logprobs[s, P + R:].any()
    # the samples of a prompt differ (otherwise the ordering checks above would be vacuous)
    assert all(len({tuple(batch.responses[i * n + k]) for k in range(n)}) == n for i in range(3))


def test_generate_without_seq_index_and_without_per_request_seeds(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path)
    engine.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=4)
    assert [sp.seed for sp in engine.llm.generate_calls[-1]["params"]] == [
        request_seed(77, 4, i) for i in range(len(PROMPTS))]

    unseeded = make_engine(tmp_path, per_request_seed=False)
    a = unseeded.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=4, seq_index=list(range(6)))
    assert [sp.seed for sp in unseeded.llm.generate_calls[-1]["params"]] == [None] * len(PROMPTS)
    b = unseeded.generate(PROMPTS, 2, 1.0, 1.0, 8, rng_step=4, seq_index=list(range(6)))
    assert a.responses != b.responses  # vLLM's global generator moves on


def test_generate_too_long_raises_before_anything_runs(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path, seq_length=16)
    before = list(engine.llm.events)
    with pytest.raises(ValueError, match="seq-length"):
        engine.generate([[1] * 4, [2] * 9], 2, 1.0, 1.0, 8)  # 9 + 8 > 16
    assert engine.llm.events == before and fake_sync == []
    engine.generate([[1] * 4, [2] * 8], 2, 1.0, 1.0, 8)  # 8 + 8 == 16 fits


# ============================================================================================
# 5. layout independence
# ============================================================================================
def test_samples_do_not_depend_on_the_data_parallel_split(fake_vllm, fake_sync, tmp_path):
    n, step = 2, 5
    prompts = PROMPTS + [[41, 42]]
    whole = make_engine(tmp_path).generate(prompts, n, 1.0, 1.0, 10, rng_step=step,
                                           seq_index=list(range(len(prompts) * n)))
    halves = [make_engine(tmp_path).generate(prompts[2 * r:2 * r + 2], n, 1.0, 1.0, 10,
                                             rng_step=step,
                                             seq_index=list(range(4 * r, 4 * r + 4)))
              for r in range(2)]
    assert halves[0].responses + halves[1].responses == whole.responses
    for name in ("tokens", "loss_mask", "sampling_logprobs", "prompt_lengths"):
        assert torch.equal(torch.cat([getattr(h, name) for h in halves]), getattr(whole, name)), name
    # control: without the global indices the second rank would sample other sequences
    local = make_engine(tmp_path).generate(prompts[2:], n, 1.0, 1.0, 10, rng_step=step)
    assert local.responses != halves[1].responses


# ============================================================================================
# 7. continue_histories and generate_episodes
# ============================================================================================
def test_continue_histories_passes_budgets_and_seeds(fake_vllm, fake_sync, tmp_path):
    engine = make_engine(tmp_path)
    histories = [[11, 12], [21, 22, 23, 24], [31, 32, 33]]
    turns = engine.continue_histories(histories, temperature=0.8, top_p=1.0, max_new_tokens=[3, 5, 7],
                                      stop=["q"], seeds=[101, 202, 303])
    call = engine.llm.generate_calls[-1]
    assert call["prompts"] == histories
    assert [sp.max_tokens for sp in call["params"]] == [3, 5, 7]
    assert [sp.seed for sp in call["params"]] == [101, 202, 303]
    assert all(sp.n == 1 and sp.logprobs == 0 and sp.stop == ["q"] and sp.temperature == 0.8
               and sp.include_stop_str_in_output for sp in call["params"])
    for turn, out, budget in zip(turns, call["outputs"], [3, 5, 7]):
        comp = out.outputs[0]
        assert turn.token_ids == comp.token_ids and len(turn.token_ids) <= budget
        assert turn.text == comp.text and turn.finish_reason == comp.finish_reason
        assert turn.logprobs == pytest.approx([fake_logprob(j, t) for j, t in enumerate(comp.token_ids)])

    engine.continue_histories(histories, temperature=1.0, top_p=1.0, max_new_tokens=6)
    call = engine.llm.generate_calls[-1]
    assert [sp.max_tokens for sp in call["params"]] == [6, 6, 6]
    assert [sp.seed for sp in call["params"]] == [None, None, None]


SEARCH = "Let me look. <search> eiffel tower </search>"
ANSWER = "<answer> Gustave Eiffel </answer>"


def _script(prompt_ids):
    """The fake model: searches on the first turn, answers once it has seen an observation."""
    seen = "".join(chr(i) for i in prompt_ids)
    return (ANSWER if "<information>" in seen else SEARCH) + " and then it rambles on"


def test_generate_episodes_turn_seeds_budgets_masks_and_one_wake(fake_vllm, fake_sync, tmp_path,
                                                                  retriever):
    from emapg_megatron.tasks.search import SearchConfig, SearchEnv

    tok = CharTokenizer()
    config = SearchConfig(max_turns=4, max_turn_tokens=None, max_obs_tokens=300, topk=2)
    prompts = [tok.encode("Q: who built it?\n"), tok.encode("Question: who designed the tower, please?\n")]
    # size the sequence so that the longer prompt's second turn is capped by the room left
    probe = SearchEnv(retriever, config, tokenizer=tok)
    probe.step(SEARCH, token_ids=tok.encode(SEARCH))
    obs_len = len(probe.segments[1].token_ids)
    max_new = 48
    seq_length = len(prompts[1]) + len(SEARCH) + obs_len + len(ANSWER) + 2
    assert seq_length - len(prompts[0]) - len(SEARCH) - obs_len > max_new  # short one: not capped

    engine = make_engine(tmp_path, seq_length=seq_length)
    llm = engine.llm
    llm.script = _script
    n, step = 2, 6
    seq_index = [10, 11, 14, 15]
    envs = [SearchEnv(retriever, config, tokenizer=tok) for _ in range(len(prompts) * n)]
    mark = len(llm.events)
    batch, episodes = engine.generate_episodes(
        prompts, n, envs, tokenizer=engine.tokenizer, temperature=1.0, top_p=1.0,
        max_new_tokens=max_new, stop=["</search>", "</answer>"], rng_step=step, seq_index=seq_index)

    # one wake-up and one sleep around both turns
    assert events_after(llm, mark) == ["wake_up(weights)", "load_weights", "load_weights",
                                       "reset_prefix_cache", "wake_up(kv_cache)",
                                       "generate", "generate", "sleep(1)"]
    assert len(llm.generate_calls) == 2
    for turn, call in enumerate(llm.generate_calls):
        assert [sp.seed for sp in call["params"]] == [request_seed(77, step, i, turn) for i in seq_index]
        assert [sp.max_tokens for sp in call["params"]] == [min(max_new, seq_length - len(h))
                                                           for h in call["prompts"]]
        assert all(sp.stop == ["</search>", "</answer>"] for sp in call["params"])
    assert len({sp.max_tokens for sp in llm.generate_calls[1]["params"]}) == 2  # some were capped

    expect_turns = [tok.encode(SEARCH), tok.encode(ANSWER)]
    for s, ep in enumerate(episodes):
        assert ep.env.answer == "Gustave Eiffel" and ep.env.queries == ["eiffel tower"]
        assert ep.unaligned_tokens == 0 and not ep.truncated
        P = len(prompts[s // n])
        obs = ep.env.segments[1].token_ids
        layout = [(expect_turns[0], 1), (obs, 0), (expect_turns[1], 1)]
        assert ep.ids == [t for ids, _ in layout for t in ids]
        assert batch.tokens[s, :P].tolist() == prompts[s // n]
        assert batch.tokens[s, P:P + len(ep.ids)].tolist() == ep.ids
        assert batch.tokens[s, P + len(ep.ids):].tolist() == [PAD] * (seq_length - P - len(ep.ids))
        pos = P
        for ids, mask in layout:
            span = slice(pos, pos + len(ids))
            assert batch.loss_mask[s, span].tolist() == [float(mask)] * len(ids)
            expect = ([fake_logprob(j, t) for j, t in enumerate(ids)] if mask else [0.0] * len(ids))
            assert batch.sampling_logprobs[s, span].tolist() == pytest.approx(expect, abs=1e-6)
            pos += len(ids)
        assert batch.loss_mask[s, :P].sum() == 0 and batch.loss_mask[s, pos:].sum() == 0
    assert batch.responses == [ep.ids for ep in episodes]


# ============================================================================================
# 8. the evaluation backend
# ============================================================================================
def test_generation_backend_texts_seeds_and_params(fake_vllm, tmp_path):
    backend = load_generation_backend(hf_dir(tmp_path), temperature=0.6, top_p=1.0,
                                      max_new_tokens=12, seed=3, tensor_parallel_size=2,
                                      max_model_len=256)
    assert isinstance(backend, VLLMGenerationBackend)
    llm = backend.llm
    assert llm.kwargs == {"model": str(tmp_path), "tensor_parallel_size": 2, "dtype": "bfloat16",
                          "seed": 3, "gpu_memory_utilization": 0.9, "max_model_len": 256}
    prompts = ["hello there", "what is it"]
    out = backend(prompts, 3, stop=["x"])
    call = llm.generate_calls[-1]
    assert call["prompts"] == [[ord(c) for c in p] for p in prompts]  # no BOS added
    for i, sp in enumerate(call["params"]):
        assert sp.seed == request_seed(3, 0, i) and sp.logprobs is None
        assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens) == (3, 0.6, 1.0, 12)
        assert sp.stop == ["x"] and sp.include_stop_str_in_output
    assert out == [[c.text for c in sorted(o.outputs, key=lambda c: c.index)] for o in call["outputs"]]
    assert all(len(texts) == 3 and len(set(texts)) == 3 for texts in out)

    backend(prompts[:1], 1, max_new_tokens=5)  # a second call: new seeds, per-call budget
    sp = llm.generate_calls[-1]["params"][0]
    assert sp.seed == request_seed(3, 1, 0) and sp.max_tokens == 5
    assert sp.stop == []  # no stop strings (vLLM turns None into [])


def test_load_generation_backend_needs_config_json(fake_vllm, tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_generation_backend(str(tmp_path))


# ============================================================================================
# the real export stream (tiny Megatron model at TP=2 or PP=2) into the fake worker; the engine's
# batch broadcast over the model-parallel group (vLLM TP 1 < trainer TP 2, or PP 2)
# ============================================================================================
def _megatron_engine_worker(hf: str, tp: int, pp: int, ep: int = 1) -> dict:
    """Runs in a spawned rank: the fake vLLM, a real tiny Megatron model (with 4 experts at
    ``ep`` > 1, each rank holding ``4 / ep``), the real sync_weights."""
    import torch.distributed as dist

    install_fake_vllm()
    from vllm_engine_workers import TINY

    from emapg_megatron.checkpoint.weights import export_hf_weights
    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import build_for_this_rank

    rank = dist.get_rank()
    experts = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48) if ep > 1 else {}
    cfg = ModelConfig(**TINY, **experts)
    model = build_for_this_rank(cfg)
    vllm_cfg = VLLMConfig(hf, sleep_level=2, weight_sync_bucket_mb=20_000 / 2**20, tensor_parallel_size=1)
    engine = VLLMEngine(vllm_cfg, cfg, seq_length=32, pad_id=0, model_chunks=[model], trainer_tp=tp,
                        pipeline_parallel=pp)
    # Each rank's vLLM samples its own prompts; only the broadcast makes the group agree.
    batch = engine.generate([[1 + rank, 2, 3]], 2, 1.0, 1.0, 6)
    llm = engine.llm
    own = [c.token_ids for c in sorted(llm.generate_calls[-1]["outputs"][0].outputs,
                                       key=lambda c: c.index)]
    direct = list(export_hf_weights([model], cfg, bucket_bytes=20_000))
    return {"loads": [ld["names"] for ld in llm.model.loads],
            "load_states": [[ld["weights_awake"], ld["kv_awake"]] for ld in llm.model.loads],
            "received": llm.model.received, "direct": direct, "events": llm.events,
            "stats": [engine.last_sync.buckets, engine.last_sync.tensors, engine.last_sync.bytes],
            "needs_broadcast": engine.needs_broadcast, "own": own, "responses": batch.responses,
            "batch": [batch.tokens, batch.loss_mask, batch.sampling_logprobs, batch.prompt_lengths]}


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "moe-ep2"])
def test_real_megatron_export_reaches_load_weights_and_model_parallel_group_agrees(tmp_path, tp, pp, ep):
    """At EP=2 each rank holds half the experts and its vLLM gets all of them, under the names
    of an HF checkpoint (what vLLM's MoE loaders read from disk); the two data-parallel ranks
    sample their own prompts, as a dense model's do."""
    from emapg_megatron.multiprocess import run_distributed

    results = run_distributed(_megatron_engine_worker, world_size=2, tp=tp, pp=pp, ep=ep,
                              args=(hf_dir(tmp_path), tp, pp, ep), timeout=180)
    if ep > 1:
        names = [name for name, _ in results[0]["direct"]]
        for layer in range(2):
            for e in range(4):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
            assert f"model.layers.{layer}.mlp.gate.weight" in names
    for res in results:
        direct = res["direct"]  # full (TP-gathered) HF tensors
        assert res["events"][:2] == ["sleep(2)", "wake_up(weights)"]
        assert res["events"][-3:] == ["wake_up(kv_cache)", "generate", "sleep(2)"]
        assert res["events"][2:-3] == ["load_weights"] * len(res["loads"]) + ["reset_prefix_cache"]
        assert len(res["loads"]) > 1 and res["stats"][0] == len(res["loads"])
        assert all(state == [True, False] for state in res["load_states"])
        # every exported HF tensor reached load_weights once, in export order, unchanged
        assert [name for names in res["loads"] for name in names] == [name for name, _ in direct]
        assert [name for name, _ in res["received"]] == [name for name, _ in direct]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(res["received"], direct))
        assert res["stats"][1:] == [len(direct), sum(t.numel() * t.element_size() for _, t in direct)]
        if ep > 1:  # data-parallel ranks: no broadcast, each trains on its own samples
            assert not res["needs_broadcast"] and res["responses"] == res["own"]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(res["direct"], results[0]["direct"]))
            continue
        assert res["needs_broadcast"]
        # both ranks train on rank 0's samples
        assert res["responses"] == results[0]["own"]
        assert all(torch.equal(a, b) for a, b in zip(res["batch"], results[0]["batch"]))
    assert results[0]["own"] != results[1]["own"]  # without the broadcast they would differ


class _FailingRetriever:
    calls = 0

    def search(self, query, k):
        _FailingRetriever.calls += 1
        raise TimeoutError("retriever unreachable from this rank")


def _episodes_worker(hf: str, vllm_tp: int = 1) -> dict:
    """TP=2 trainer. vLLM TP 1: each rank's vLLM answers differently; the group must agree.
    vLLM TP 2 (one engine over the group): rank 1's retriever fails; the group must feed the
    engine rank 0's histories."""
    import torch.distributed as dist

    install_fake_vllm()
    from vllm_engine_workers import TINY

    from emapg_megatron.models.config import ModelConfig
    from emapg_megatron.models.gpt import build_for_this_rank
    from emapg_megatron.tasks.retriever import BM25Retriever
    from emapg_megatron.tasks.search import SearchConfig, SearchEnv

    rank = dist.get_rank()
    cfg = ModelConfig(**TINY)
    engine = VLLMEngine(VLLMConfig(hf, sleep_level=1, tensor_parallel_size=vllm_tp), cfg, seq_length=400,
                        pad_id=PAD, model_chunks=[build_for_this_rank(cfg)], trainer_tp=2)
    answer = ANSWER if rank == 0 or vllm_tp == 2 else "<answer> someone else </answer>"
    engine.llm.script = lambda ids: (answer if "<information>" in "".join(map(chr, ids)) else SEARCH)
    tok = CharTokenizer()
    retriever = BM25Retriever(CORPUS) if rank == 0 or vllm_tp == 1 else _FailingRetriever()
    envs = [SearchEnv(retriever, SearchConfig(max_turns=3, max_obs_tokens=200, topk=1), tokenizer=tok)
            for _ in range(2)]
    batch, episodes = engine.generate_episodes(
        [tok.encode("Q: who built it?\n")], 2, envs, tokenizer=tok, temperature=1.0, top_p=1.0,
        max_new_tokens=40, stop=["</search>", "</answer>"])
    return {"texts": [ep.response_text for ep in episodes],
            "own": [ep.env.response_text for ep in episodes], "tokens": batch.tokens,
            "failing_retriever_calls": _FailingRetriever.calls}


@pytest.mark.slow
def test_multi_turn_rewards_score_the_broadcast_episodes(tmp_path):
    """With the batch broadcast, the texts the rewards score come from the same rank as the
    tokens trained on (otherwise rank 1 would score its own, different answers)."""
    pytest.importorskip("bm25s")
    from emapg_megatron.multiprocess import run_distributed

    r0, r1 = run_distributed(_episodes_worker, world_size=2, tp=2, args=(hf_dir(tmp_path),),
                             timeout=180)
    assert all("Gustave Eiffel" in t for t in r0["texts"])
    assert r1["texts"] == r0["texts"] and torch.equal(r1["tokens"], r0["tokens"])
    assert all("someone else" in t for t in r1["own"])  # what rank 1's vLLM itself produced


@pytest.mark.slow
def test_one_engine_over_the_group_gets_the_same_histories_when_an_environment_fails(tmp_path):
    """vLLM TP = trainer TP: one engine spans the group, so its ranks must send it the same
    histories. Only rank 0 steps the environments (rank 1's retriever, which would fail, is
    never called) and every rank takes its answers after every turn."""
    pytest.importorskip("bm25s")
    from emapg_megatron.multiprocess import run_distributed

    r0, r1 = run_distributed(_episodes_worker, world_size=2, tp=2, args=(hf_dir(tmp_path), 2),
                             timeout=180)
    assert all("Gustave Eiffel" in t for t in r0["texts"])
    assert r1["texts"] == r0["texts"] and torch.equal(r1["tokens"], r0["tokens"])
    assert r1["failing_retriever_calls"] == 0 and r1["own"] != r0["own"]  # never stepped there


def test_rank_env_for_external_launcher_without_torchrun(fake_vllm, monkeypatch, tmp_path):
    """vLLM's external launcher reads RANK / LOCAL_RANK; a plain `python` launch lacks them."""
    import torch.distributed as dist

    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "unset-me")
        monkeypatch.delenv(name)  # the engine's setdefault is undone after the test
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        make_engine(tmp_path)
        assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("0", "0")
    finally:
        dist.destroy_process_group()
