#!/usr/bin/env python3
"""Carry megatron-core, Transformer Engine and vLLM to the lent GPU machine and install them there.

The lent machine (one H100/H200, Python 3.12, torch 2.11.0+cu130, nvcc) has no network and none of
megatron-core, Transformer Engine (TE) or vLLM. Each call to it carries the repo plus at most
~64 MiB, so this tool lays what it lacks out as git-ignored folders of at most 56 MiB each:

    python3 tools/gpu_install/kit.py prepare [--only mcore,te,vllm]      # here, with PyPI
    python3 tools/gpu_install/kit.py check                                # there, after each transfer
    python3 tools/gpu_install/kit.py build-te --background                # there, once .gpukit-te1 is in
    python3 tools/gpu_install/kit.py install [--only ...] [--dry-run]     # there, once all arrived
    python3 tools/gpu_install/kit.py keep-built DIR                       # here, the TE wheel built there

Groups: ``mcore`` (megatron-core at setup.py's pin, pydantic, datasets, ...), ``te`` (the TE core
wheel for CUDA 13 split in parts, the TE meta wheel and the torch extension's source, compiled
there for sm_90), ``vllm`` (vLLM at setup.py's pin, slimmed for a dense-model H100 run, the
import-time dependencies the image lacks, an ``xgrammar`` stand-in). ``te`` and ``vllm`` need
``mcore``. Every folder ``.gpukit-<group>[N]/`` holds a manifest (``gpukit.json``) naming every
part of its group, the folder each part travels in, sizes, sha256 and the setup.py pins it was
prepared from. ``install`` checks all of it (every part present, sizes and sha256, pins equal to
setup.py's) before it reassembles or installs anything; a failure there is one line
``error: ...`` naming the part, exit status 2 (3: a background TE build still runs; 1: pip, the
compile or an import failed afterwards). Needs Python >= 3.10 and ``packaging``.
See docs/dev/gpu_kit.md (the kit, for maintainers; the versions are docs/gpu.md's table).
"""

from __future__ import annotations

import argparse
import ast
import base64
import csv
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import (
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

FORMAT = 1
KIT = "emapg-gpukit"
MiB = 1 << 20
# One call carries the repo (7 MiB on 2026-11-27) and one folder within 64 MiB.
PART_LIMIT = 54 * MiB  # one carried file at most
FOLDER_LIMIT = 56 * MiB  # one carried folder, manifest included
OUT_PART_LIMIT = 15 * MiB  # files coming back from the machine's $OUT: 16 MiB each at most
TRANSFER_LIMIT = 64 * MiB  # the repo plus what one call carries
PREFIX = ".gpukit-"
MANIFEST = "gpukit.json"
BUILT_DIR = ".gpukit-built"
BUILT_MANIFEST = "gpukit-built.json"
CACHE_DIR = ".gpukit-cache"
STAMP = ".gpukit-installed.json"
REPO = Path(__file__).resolve().parents[2]

GROUPS = ("mcore", "te", "vllm")
NEEDS = {"mcore": (), "te": ("mcore",), "vllm": ("mcore",)}
# The setup.py pin each group is built from: the gpu extra's (for megatron-core the release checked
# on a GPU, inside install_requires' range).
PINNED = {"mcore": "megatron-core", "te": "transformer-engine", "vllm": "vllm"}
TE_EXTRAS = ["core_cu13", "pytorch"]  # the only TE extras this kit knows how to carry

# The target: the lent machine's image.
PYTHON = (3, 12)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (35, 34, 31, 28, 27, 26, 24, 17, 12, 5)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64"]
# Packages in the image ('cuda', read 2026-11-17; /work/.library/device/KINDS.md) and the versions
# one session's pip list showed. A requirement met by neither the image nor a carried wheel is
# reported by prepare (vLLM declares many it never imports on this path).
IMAGE_PACKAGES = set(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split())
IMAGE_VERSIONS = {"torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "triton": "3.6.0",
                  "transformers": "5.17.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
                  "numpy": "2.5.2", "huggingface-hub": "1.33.0", "onnx": "1.23.1", "onnxscript": "0.7.2",
                  "accelerate": "1.15.0"}

# What each group carries besides its pinned package: exact versions, checked to download for
# cp312/manylinux x86-64 on 2026-11-25. Each name in one group only.
DEPS = {
    "mcore": [
        # TE's core and vLLM import pydantic; the image has none.
        "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
        "typing-extensions==4.16.0",  # pydantic 2.14.3 needs >= 4.16.0; the image's version is unread
        # emapg_megatron/tasks/data.py imports datasets; the image has none (nor multiprocess, dill).
        "datasets==5.2.0", "multiprocess==0.70.19", "dill==0.4.1",
    ],
    "te": [],  # the TE wheels and source follow setup.py's pin
    "vllm": [
        # vLLM's import-time dependencies missing from the image (the reference kit's list, found by
        # importing vLLM's engine, worker, model runner, Qwen2/Llama and loader modules on CPU).
        "msgspec==0.22.0", "pyzmq==27.3.0", "openai==3.54.0", "jiter==0.19.0", "distro==1.9.0",
        "sniffio==1.3.1", "pybase64==1.5.1", "cachetools==8.0.1", "cbor2==6.3.0", "openai-harmony==0.0.8",
        "llguidance==1.7.6", "fastapi==0.136.3", "starlette==1.10.0", "partial-json-parser==0.2.1.1.post7",
        "compressed-tensors==0.17.0", "loguru==0.7.3", "blake3==1.0.11", "setproctitle==1.3.8",
        "depyf==0.20.0", "astor==0.8.1", "diskcache==5.6.3", "lark==1.2.2",
        # openai 3.54 imports httpx2 at import (not in the reference list): httpx2 needs these two.
        "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5",
    ],
}
# Files dropped from the vLLM wheel (238 MiB -> ~101 MiB): kernels a dense Qwen2/Llama bf16 run on
# an H100 does not load (FA2: Hopper uses FA3; MoE; MLA; qutlass; the whole vendored deep_gemm
# package, so that vLLM finds none rather than a broken one), the Rust tool parser and server
# binary, images and the swagger bundle.
VLLM_DROP = re.compile(r"(_vllm_fa2_C|_moe_C|third_party/deep_gemm/|_flashmla|_qutlass_C|/vllm-rs$"
                       r"|_rust_tool_parser|swagger-ui|\.jpg$|\.png$)")
STANDINS = {"xgrammar"}  # carried as a stand-in (version 0.0.0) on purpose: no requirement check
XGRAMMAR_STUB = '''"""xgrammar stand-in carried by tools/gpu_install (the real wheel is ~43 MiB): vLLM imports
it for structured output, which this project never uses. Any use raises."""
__version__ = "0.0.0"


class _Stub:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("xgrammar is a stand-in here (tools/gpu_install): structured output is unavailable")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Stub,), {})
'''
# What install imports afterwards, per group (PYTHONPATH=target).
IMPORT_CHECKS = {
    "mcore": "import megatron.core, pydantic, datasets; print('megatron-core', megatron.core.__version__)",
    "te": "import transformer_engine as t, transformer_engine.pytorch; print('transformer-engine', t.__version__)",
    "vllm": "import vllm, vllm.entrypoints.llm; print('vllm', vllm.__version__)",
}


class KitError(Exception):
    """A failure reported as one line ``error: ...`` (exit status 2)."""


# --------------------------------------------------------------------------------------------
# small helpers


def sha256_file(path: Path, offset: int = 0, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            buf = f.read(MiB if left is None else min(MiB, left))
            if not buf:
                break
            h.update(buf)
            if left is not None:
                left -= len(buf)
    return h.hexdigest()


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", str(text), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 58M, 4K, 1000)")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": MiB, "G": 1 << 30}[m.group(2).upper()])


def mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def groups_arg(text: str | None) -> list[str]:
    if not text:
        return list(GROUPS)
    out = []
    for g in re.split(r"[,\s]+", text.strip()):
        if g not in GROUPS:
            raise KitError(f"--only: unknown group {g!r} (groups: {', '.join(GROUPS)})")
        if g not in out:
            out.append(g)
    return out


def with_needs(groups: list[str]) -> list[str]:
    out: list[str] = []
    for g in groups:
        for n in (*NEEDS[g], g):
            if n not in out:
                out.append(n)
    return [g for g in GROUPS if g in out]


def run_command(cmd: list[str], env: dict | None = None, log: Path | None = None) -> int:
    """Runs a command (pip, the TE build); tests replace this function."""
    if log is None:
        return subprocess.run(cmd, env=env).returncode
    with open(log, "wb") as f:
        return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


# --------------------------------------------------------------------------------------------
# setup.py's pins


@dataclass
class Pin:
    name: str  # canonical
    extras: list[str]
    spec: str  # normalised specifier, e.g. "==2.11.*"
    where: str  # install_requires or extras_require['gpu']

    @property
    def text(self) -> str:
        return self.name + (f"[{','.join(self.extras)}]" if self.extras else "") + self.spec


def read_pins(setup_py: Path) -> dict[str, Pin]:
    """megatron-core's, TE's and vLLM's pins from the ``gpu`` extra (parsed with ast: setup.py is
    not imported); a package named in both takes the extra's pin."""
    try:
        tree = ast.parse(Path(setup_py).read_text(encoding="utf-8"), str(setup_py))
    except (OSError, SyntaxError) as exc:
        raise KitError(f"{setup_py}: cannot read ({exc})") from None
    call = next((n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) == "setup"), None)
    if call is None:
        raise KitError(f"{setup_py}: no setup(...) call")
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    try:
        install = ast.literal_eval(kw["install_requires"]) if "install_requires" in kw else []
        extras = ast.literal_eval(kw["extras_require"]) if "extras_require" in kw else {}
    except ValueError:
        raise KitError(f"{setup_py}: install_requires/extras_require are not literals") from None
    found: dict[str, Pin] = {}
    for where, reqs in (("install_requires", install), ("extras_require['gpu']", extras.get("gpu", []))):
        for s in reqs:
            try:
                r = Requirement(s)
            except InvalidRequirement as exc:
                raise KitError(f"{setup_py}: {where}: {exc}") from None
            found[canonicalize_name(r.name)] = Pin(canonicalize_name(r.name), sorted(r.extras),
                                                   str(r.specifier), where)
    pins = {}
    for name in PINNED.values():
        want = "extras_require['gpu']"
        pin = found.get(name)
        if pin is None or pin.where != want:
            raise KitError(f"{setup_py}: no {name} in {want}")
        if not pin.spec:
            raise KitError(f"{setup_py}: {name} has no version pin")
        pins[name] = pin
    te = pins["transformer-engine"]
    if te.extras != TE_EXTRAS:
        raise KitError(f"{setup_py}: transformer-engine extras {te.extras}; this kit carries {TE_EXTRAS}")
    return pins


# --------------------------------------------------------------------------------------------
# distributions in the download cache


@functools.lru_cache(maxsize=None)
def supported_tags() -> frozenset:
    return frozenset({str(t) for t in cpython_tags(PYTHON, platforms=PLATFORMS)}
                     | {str(t) for t in compatible_tags(PYTHON, platforms=PLATFORMS)})


def dist_info(path: Path):
    """(canonical name, Version, is_wheel) of a wheel or sdist file name, or None."""
    try:
        if path.name.endswith(".whl"):
            name, version, _, tags = parse_wheel_filename(path.name)
            if not {str(t) for t in tags} & supported_tags():
                return None
            return name, version, True
        if path.name.endswith(".tar.gz"):
            name, version = parse_sdist_filename(path.name)
            return name, version, False
    except Exception:  # noqa: BLE001 - any unparsable name is simply not a candidate
        return None
    return None


def find_dist(cache: Path, name: str, spec: str, wheel: bool = True) -> Path | None:
    """The highest version of ``name`` in ``cache`` that ``spec`` allows (wheel or sdist)."""
    name, sset, best = canonicalize_name(name), SpecifierSet(spec), None
    for p in sorted(Path(cache).glob("*")) if Path(cache).is_dir() else []:
        info = dist_info(p)
        if info and info[0] == name and info[2] == wheel and sset.contains(info[1], prereleases=True):
            if best is None or info[1] > best[0]:
                best = (info[1], p)
    return None if best is None else best[1]


def pip_download(cache: Path, specs: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", ".".join(map(str, PYTHON)), "--implementation", "cp", "-d", str(cache)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if run_command(cmd + specs) != 0:
        raise KitError(f"pip download failed for {' '.join(specs)}")


def index_url() -> str:
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    for key in ("global.index-url", "download.index-url", "install.index-url"):
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    return "https://pypi.org/simple/"


def fetch_sdist(cache: Path, project: str, version: str) -> Path:
    """An sdist straight from the index's simple API (``pip download`` of the TE torch extension
    fails: preparing its metadata needs torch and CUDA), checked against the index's sha256."""
    fname = f"{project.replace('-', '_')}-{version}.tar.gz"
    dest = Path(cache) / fname
    if dest.is_file():
        return dest
    page = index_url().rstrip("/") + f"/{canonicalize_name(project)}/"
    req = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            body, ctype = r.read(), r.headers.get("Content-Type", "")
    except OSError as exc:
        raise KitError(f"{fname}: index page {page} unreachable ({exc})") from None
    url = digest = None
    if "json" in ctype:
        for f in json.loads(body)["files"]:
            if f["filename"] == fname:
                url, digest = urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256")
    else:
        m = re.search(r'href="([^"]*/' + re.escape(fname) + r')(?:#sha256=([0-9a-f]{64}))?"', body.decode())
        if m:
            url, digest = urllib.parse.urljoin(page, m.group(1)), m.group(2)
    if url is None:
        raise KitError(f"{fname}: not on {page}")
    tmp = dest.with_suffix(".part")
    try:
        with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
    except OSError as exc:
        raise KitError(f"{fname}: download failed ({exc})") from None
    if digest and sha256_file(tmp) != digest:
        tmp.unlink()
        raise KitError(f"{fname}: sha256 differs from the index's")
    tmp.rename(dest)
    return dest


# --------------------------------------------------------------------------------------------
# wheels: metadata, the slimmed vLLM, the xgrammar stand-in


def wheel_requires(path: Path) -> list[str]:
    """Requires-Dist lines of a wheel that apply on the target without extras."""
    try:
        with zipfile.ZipFile(path) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode("utf-8", "replace") if meta else ""
    except zipfile.BadZipFile:
        raise KitError(f"{path.name}: not a wheel (bad zip)") from None
    env = default_environment()
    env.update(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
               platform_machine="x86_64", sys_platform="linux", platform_system="Linux", os_name="posix",
               platform_python_implementation="CPython", extra="")
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            r = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            continue
        if r.marker is None or r.marker.evaluate(env):
            out.append(str(r))
    return out


def requirement_report(wheels: dict[str, tuple[Version, Path]], installed: dict[str, str]):
    """(conflicts, missing): a carried wheel's requirement that a carried or known image version
    breaks; (wheel, requirement) pairs neither carried nor in the image."""
    conflicts, missing = [], []
    for name, (version, path) in sorted(wheels.items()):
        for text in wheel_requires(path):
            r = Requirement(text)
            dep = canonicalize_name(r.name)
            if dep in STANDINS:
                continue
            have = str(wheels[dep][0]) if dep in wheels else installed.get(dep)
            if have is not None:
                if not r.specifier.contains(have, prereleases=True):
                    conflicts.append(f"{name} {version} needs {text}, carried/image has {have}")
            elif dep not in IMAGE_PACKAGES:
                missing.append((name, text))
    return conflicts, missing


def slim_wheel(src: Path, dest: Path, drop: re.Pattern) -> list[tuple[str, int]]:
    """A copy of wheel ``src`` without the members ``drop`` matches (returned with their compressed
    sizes); RECORD loses their lines."""
    dropped = []
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        infos = z.infolist()
        for info in infos:
            if drop.search(info.filename):
                dropped.append((info.filename, info.compress_size))
        gone = {name for name, _ in dropped}
        for info in infos:
            if info.filename in gone:
                continue
            data = z.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [row for row in csv.reader(io.StringIO(data.decode())) if row and row[0] not in gone]
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                data = buf.getvalue().encode()
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, data)
    tmp.replace(dest)
    return dropped


def stub_wheel(dest_dir: Path, name: str = "xgrammar", version: str = "0.0.0", code: str = XGRAMMAR_STUB) -> Path:
    """A pure-Python wheel holding ``name/__init__.py`` (deterministic bytes)."""
    files = {f"{name}/__init__.py": code.encode(),
             f"{name}-{version}.dist-info/METADATA": (
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                 f"Summary: stand-in carried by emapg-megatron's tools/gpu_install\n").encode(),
             f"{name}-{version}.dist-info/WHEEL": (
                 b"Wheel-Version: 1.0\nGenerator: emapg-gpukit\nRoot-Is-Purelib: true\nTag: py3-none-any\n")}
    record = f"{name}-{version}.dist-info/RECORD"
    lines = []
    for fn, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{fn},sha256={digest},{len(data)}")
    files[record] = ("\n".join(lines + [f"{record},,"]) + "\n").encode()
    path = Path(dest_dir) / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for fn, data in files.items():
            z.writestr(zipfile.ZipInfo(fn, (1980, 1, 1, 0, 0, 0)), data)
    return path


# --------------------------------------------------------------------------------------------
# prepare: artifacts -> parts -> folders with manifests


@dataclass
class Artifact:
    name: str
    path: Path
    kind: str  # wheel | sdist
    use: str  # install (pip) | build (the TE torch extension's source)
    source: str
    note: str = ""
    size: int = 0
    sha256: str = ""
    parts: list = field(default_factory=list)

    def measure(self) -> Artifact:
        self.size, self.sha256 = self.path.stat().st_size, sha256_file(self.path)
        return self


def folder_names(group: str, n: int) -> list[str]:
    return [f"{PREFIX}{group}"] if n == 1 else [f"{PREFIX}{group}{i}" for i in range(1, n + 1)]


def manifest_for(group, folder, folders, artifacts, pins, versions, extra) -> dict:
    body = {
        "kit": KIT, "format": FORMAT, "group": group, "needs": list(NEEDS[group]),
        "setup_py_pins": {PINNED[group]: pins[PINNED[group]].text},
        "versions": versions, "python": ".".join(map(str, PYTHON)), "platforms": PLATFORMS,
        "folders": folders,
        "artifacts": [{"name": a.name, "kind": a.kind, "use": a.use, "size": a.size, "sha256": a.sha256,
                       "source": a.source, **({"note": a.note} if a.note else {}), "parts": a.parts}
                      for a in artifacts],
        **extra,
    }
    build = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {"folder": folder, "build": build, **body}


def pack(group: str, artifacts: list[Artifact], out_dir: Path, pins: dict[str, Pin], versions: dict,
         part_limit: int = PART_LIMIT, folder_limit: int = FOLDER_LIMIT, extra: dict | None = None) -> list[Path]:
    """Splits artifacts over ``part_limit`` into parts, packs parts into as few folders of at most
    ``folder_limit`` bytes (manifest included) as first-fit decreasing finds, writes the folders
    under ``out_dir`` (replacing this group's old ones) and returns them."""
    extra = extra or {}
    if part_limit <= 0 or folder_limit < part_limit:
        raise KitError(f"limits: part {part_limit} must be > 0 and <= folder {folder_limit}")
    items = []  # (size, name, artifact, offset)
    for a in artifacts:
        a.measure()
        if a.size <= part_limit:
            items.append((a.size, a.name, a, 0))
        else:
            for i, off in enumerate(range(0, a.size, part_limit)):
                items.append((min(part_limit, a.size - off), f"{a.name}.part{i:02d}", a, off))
    if len({it[1] for it in items}) != len(items) or any(it[1] == MANIFEST for it in items):
        raise KitError(f"{group}: two carried files share a name")
    # Room for the manifest: one rendered with every part in a folder of the longest name, + slack.
    for a in artifacts:
        a.parts = [{"name": it[1], "folder": f"{PREFIX}{group}99", "size": it[0], "sha256": "0" * 64}
                   for it in items if it[2] is a]
    probe = manifest_for(group, f"{PREFIX}{group}99", folder_names(group, 99)[:len(items)], artifacts, pins,
                         versions, extra)
    reserve = len(json.dumps(probe, indent=1).encode()) + 1024
    capacity = folder_limit - reserve
    if capacity < max((it[0] for it in items), default=0):
        raise KitError(f"{group}: folder limit {folder_limit} leaves {capacity} bytes beside the manifest, "
                       f"less than the part limit {part_limit}")
    bins: list[list] = []  # [free, [items]]
    # First fit decreasing; the TE extension's source first, so that it travels in the first folder
    # and its compile can start (build-te --background) while the other folders travel.
    for it in sorted(items, key=lambda it: (it[2].use != "build", -it[0], it[1])):
        slot = next((b for b in bins if b[0] >= it[0]), None)
        if slot is None:
            slot = [capacity, []]
            bins.append(slot)
        slot[0] -= it[0]
        slot[1].append(it)
    names = folder_names(group, max(1, len(bins)))
    where = {it[1]: names[i] for i, b in enumerate(bins) for it in b[1]}
    out_dir = Path(out_dir)
    for old in sorted(out_dir.glob(f"{PREFIX}{group}*")):
        if re.fullmatch(re.escape(PREFIX + group) + r"\d*", old.name) and old.is_dir():
            shutil.rmtree(old)
    for n in names:
        (out_dir / n).mkdir(parents=True)
    for a in artifacts:
        a.parts = []
    for size, name, a, off in sorted(items, key=lambda it: (it[2].name, it[3])):
        dest = out_dir / where[name] / name
        h = hashlib.sha256()
        with open(a.path, "rb") as src, open(dest, "wb") as f:
            src.seek(off)
            left = size
            while left:
                buf = src.read(min(MiB, left))
                if not buf:
                    raise KitError(f"{a.name}: changed while being split")
                f.write(buf)
                h.update(buf)
                left -= len(buf)
        a.parts.append({"name": name, "folder": where[name], "size": size, "sha256": h.hexdigest()})
    folders = []
    for n in names:
        m = manifest_for(group, n, names, artifacts, pins, versions, extra)
        (out_dir / n / MANIFEST).write_text(json.dumps(m, indent=1) + "\n", encoding="utf-8")
        total = sum(p.stat().st_size for p in (out_dir / n).iterdir())
        if total > folder_limit:
            raise KitError(f"{n}: {total} bytes, over the folder limit {folder_limit}")
        folders.append(out_dir / n)
    return folders


def collect(group: str, pins: dict[str, Pin], cache: Path, offline: bool) -> tuple[list[Artifact], dict, dict]:
    """Downloads (unless offline) and returns the group's artifacts, resolved versions, extra manifest data."""
    cache.mkdir(parents=True, exist_ok=True)
    pin = pins[PINNED[group]]
    deps = DEPS[group]

    def need(name, spec, wheel=True):
        p = find_dist(cache, name, spec, wheel)
        if p is None:
            raise KitError(f"{name}{spec}: no {'wheel' if wheel else 'sdist'} in {cache}"
                           + ("" if not offline else " (run prepare without --offline)"))
        return p

    if not offline:
        pip_download(cache, [f"{pin.name}{pin.spec}"] + deps)
    main = need(pin.name, pin.spec)
    version = str(dist_info(main)[1])
    versions = {pin.name: version}
    arts: list[Artifact] = []
    extra: dict = {}
    if group == "te":
        core = "transformer-engine-cu13"
        if not offline:
            pip_download(cache, [f"{core}=={version}"])
            fetch_sdist(cache, "transformer-engine-torch", version)
        arts.append(Artifact(main.name, main, "wheel", "install", f"PyPI {pin.name}=={version} (meta package)"))
        arts.append(Artifact((p := need(core, f"=={version}")).name, p, "wheel", "install",
                             f"PyPI {core}=={version} (the core library; extra core_cu13)"))
        arts.append(Artifact((p := need("transformer-engine-torch", f"=={version}", wheel=False)).name, p,
                             "sdist", "build", f"PyPI transformer-engine-torch=={version} (source only; "
                             "compiled on the GPU machine; extra pytorch)"))
        versions[core] = versions["transformer-engine-torch"] = version
    elif group == "vllm":
        slim_dir = cache / "slim"
        slim_dir.mkdir(exist_ok=True)
        slim = slim_dir / main.name
        stamp = slim_dir / (main.name + ".json")
        src_sha = sha256_file(main)
        info = json.loads(stamp.read_text()) if stamp.is_file() else {}
        if (not slim.is_file() or info.get("source_sha256") != src_sha or info.get("drop") != VLLM_DROP.pattern
                or "dropped_large" not in info):
            t0 = time.time()
            dropped = slim_wheel(main, slim, VLLM_DROP)
            info = {"source_sha256": src_sha, "source_size": main.stat().st_size, "drop": VLLM_DROP.pattern,
                    "dropped_files": len(dropped), "dropped_bytes": sum(n for _, n in dropped),
                    "dropped_large": sorted(f for f, n in dropped if n >= 64 << 10),
                    "seconds": round(time.time() - t0, 1)}
            stamp.write_text(json.dumps(info, indent=1))
        arts.append(Artifact(slim.name, slim, "wheel", "install", f"PyPI vllm=={version}, slimmed",
                             note=f"{info['dropped_files']} files dropped ({mib(info['dropped_bytes'])} "
                                  "compressed; see vllm_slim)"))
        extra["vllm_slim"] = {k: info[k] for k in ("source_sha256", "source_size", "drop", "dropped_files",
                                                   "dropped_bytes", "dropped_large")}
        stub = stub_wheel(slim_dir)
        arts.append(Artifact(stub.name, stub, "wheel", "install", "generated by tools/gpu_install",
                             note="xgrammar stand-in: import works, any use raises"))
    else:
        arts.append(Artifact(main.name, main, "wheel", "install", f"PyPI {pin.name}=={version}"))
    for spec in deps:
        r = Requirement(spec)
        p = need(r.name, str(r.specifier))
        versions[canonicalize_name(r.name)] = str(dist_info(p)[1])
        arts.append(Artifact(p.name, p, "wheel", "install", f"PyPI {r.name}{r.specifier}"))
    return arts, versions, extra


def repo_travel_bytes(root: Path) -> int | None:
    """Bytes of what travels with every call: tracked and untracked-not-ignored files."""
    r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True)
    if r.returncode != 0:
        return None
    total = 0
    for name in r.stdout.decode(errors="replace").split("\0"):
        p = root / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def cmd_prepare(args) -> int:
    root = Path(args.root).resolve()
    out_dir = Path(args.out_dir or root).resolve()
    cache = Path(args.cache or root / CACHE_DIR).resolve()
    pins = read_pins(Path(args.setup or root / "setup.py"))
    groups = groups_arg(args.only)
    print(f"setup.py pins: {', '.join(p.text for p in pins.values())}")
    collected = {}
    for g in groups:
        collected[g] = collect(g, pins, cache, args.offline)
    # Consistency: the carried wheels' requirements against each other and the image.
    wheels, installed = {}, dict(IMAGE_VERSIONS)
    for g in groups:
        for a in collected[g][0]:
            if a.kind == "wheel":
                name, version, _, _ = parse_wheel_filename(a.path.name)
                wheels[name] = (version, a.path)
    conflicts, missing = requirement_report(wheels, installed)
    te_version = collected.get("te", [None, {}])[1].get("transformer-engine")
    if "megatron-core" in wheels and te_version:  # megatron-core's accepted TE range (its dev extra)
        with zipfile.ZipFile(wheels["megatron-core"][1]) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:") and re.match(r"Requires-Dist:\s*transformer.engine\b", line):
                    r = Requirement(line.split(":", 1)[1].strip())
                    if not r.specifier.contains(te_version, prereleases=True):
                        conflicts.append(f"megatron-core accepts {r.name}{r.specifier}, carried {te_version}")
    if conflicts:
        raise KitError(f"requirement conflict: {conflicts[0]}" + (f" (+{len(conflicts) - 1} more)" if len(conflicts) > 1 else ""))
    written = []
    for g in groups:
        arts, versions, extra = collected[g]
        mine = {parse_wheel_filename(a.path.name)[0] for a in arts if a.kind == "wheel"}
        extra = dict(extra, requirements_not_carried=[f"{n}: {t}" for n, t in missing if n in mine])
        written += pack(g, arts, out_dir, pins, versions, args.part_limit, args.folder_limit, extra)
    travel = repo_travel_bytes(root)
    print(f"{'folder':<18} {'files':>5} {'size':>10}")
    for f in written:
        files = [p for p in f.iterdir()]
        print(f"{f.name:<18} {len(files):>5} {mib(sum(p.stat().st_size for p in files)):>10}")
    if missing:
        print(f"note: {len(missing)} requirements neither carried nor in the image (unused on this path, or "
              f"unchecked): " + "; ".join(f"{n}: {t}" for n, t in missing[:8]) + (" ..." if len(missing) > 8 else ""))
    if travel is not None:
        big = max((sum(p.stat().st_size for p in f.iterdir()) for f in written), default=0)
        print(f"repo travels with every call: {mib(travel)}; with the largest folder: {mib(travel + big)} "
              f"(limit {mib(TRANSFER_LIMIT)})")
        if travel + big > TRANSFER_LIMIT:
            print("warning: the repo plus one folder exceeds one transfer; lower --folder-limit", file=sys.stderr)
        for f in written:
            if f.parent == root and subprocess.run(["git", "-C", str(root), "check-ignore", "-q", f.name]).returncode:
                print(f"warning: {f.name} is not git-ignored: it would travel with every call", file=sys.stderr)
    print("transfers, one folder per call: " + " ".join(f.name for f in written))
    return 0


# --------------------------------------------------------------------------------------------
# install: verify everything, then reassemble, build TE's extension, pip install


@dataclass
class GroupPlan:
    group: str
    build: str
    manifest: dict
    root: Path


def load_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KitError(f"{path.parent.name}/{path.name}: unreadable ({type(exc).__name__})") from None
    if m.get("kit") != KIT or m.get("format") != FORMAT:
        raise KitError(f"{path.parent.name}/{path.name}: not a format-{FORMAT} {KIT} manifest")
    return m


def group_folders(root: Path, group: str) -> list[Path]:
    pat = re.compile(re.escape(PREFIX + group) + r"\d*")
    return sorted(p for p in root.glob(f"{PREFIX}{group}*") if p.is_dir() and pat.fullmatch(p.name))


def check_part(root: Path, part: dict, artifact: str) -> None:
    where = f"{part['folder']}/{part['name']}"
    p = root / part["folder"] / part["name"]
    if not p.is_file():
        raise KitError(f"missing part {where} (of {artifact}): carry folder {part['folder']} (again)")
    size = p.stat().st_size
    if size != part["size"]:
        raise KitError(f"part {where}: {size} bytes, the manifest says {part['size']} (of {artifact})")
    if sha256_file(p) != part["sha256"]:
        raise KitError(f"part {where}: bad sha256 (of {artifact}; corrupted, or from another prepare)")


def verify_group(root: Path, group: str, pins: dict[str, Pin]) -> GroupPlan:
    """Every manifest of the group agrees, its pin equals setup.py's, every part is present with
    its size and sha256. Raises KitError naming the part; reads only."""
    folders = group_folders(root, group)
    if not folders:
        raise KitError(f"{group}: no folder {PREFIX}{group}*/ in {root}: run prepare here, carry its folders")
    manifests = {}
    for f in folders:
        if not (f / MANIFEST).is_file():
            raise KitError(f"missing part {f.name}/{MANIFEST}: carry folder {f.name} again")
        manifests[f.name] = load_manifest(f / MANIFEST)
    ref_name, ref = next(iter(manifests.items()))
    for name, m in manifests.items():
        if m.get("folder") != name or m.get("group") != group:
            raise KitError(f"{name}/{MANIFEST}: written for {m.get('folder')} ({m.get('group')}), found in {name}")
        if m["build"] != ref["build"]:
            raise KitError(f"{name}/{MANIFEST}: from another prepare than {ref_name} "
                           f"(build {m['build']} vs {ref['build']}): carry all folders of one prepare")
        for pname, text in m.get("setup_py_pins", {}).items():
            cur = pins.get(pname)
            if cur is None or cur.text != text:
                raise KitError(f"{name}/{MANIFEST}: pin {text} disagrees with setup.py's "
                               f"{cur.text if cur else 'nothing'}: run prepare again")
        if PINNED[group] not in m.get("setup_py_pins", {}):
            raise KitError(f"{name}/{MANIFEST}: records no pin for {PINNED[group]}")
    for a in ref["artifacts"]:
        if not a["parts"] or sum(p["size"] for p in a["parts"]) != a["size"]:
            raise KitError(f"{ref_name}/{MANIFEST}: parts of {a['name']} do not add up to its size")
        for p in a["parts"]:
            check_part(root, p, a["name"])
    return GroupPlan(group, ref["build"], ref, root)


def verify_built(folder: Path) -> dict | None:
    """The manifest of a built TE torch-extension wheel in ``folder``, parts checked; None if absent."""
    mpath = folder / BUILT_MANIFEST
    if not folder.is_dir():
        return None
    if not mpath.is_file():
        raise KitError(f"missing part {folder.name}/{BUILT_MANIFEST}")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
        wheel = m["wheel"]
    except (OSError, ValueError, KeyError) as exc:
        raise KitError(f"{folder.name}/{BUILT_MANIFEST}: unreadable ({type(exc).__name__})") from None
    for p in wheel["parts"]:
        part = dict(p, folder=folder.name)
        check_part(folder.parent, part, wheel["name"])
    if sum(p["size"] for p in wheel["parts"]) != wheel["size"]:
        raise KitError(f"{folder.name}/{BUILT_MANIFEST}: parts do not add up to {wheel['name']}")
    return m


def reassemble(root: Path, parts: list[dict], name: str, size: int, sha: str, dest_dir: Path) -> Path:
    if len(parts) == 1 and parts[0]["name"] == name:
        return root / parts[0]["folder"] / name  # carried whole; its sha256 is checked
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / name
    h = hashlib.sha256()
    with open(out, "wb") as f:
        for p in parts:
            with open(root / p["folder"] / p["name"], "rb") as src:
                while buf := src.read(MiB):
                    f.write(buf)
                    h.update(buf)
    if out.stat().st_size != size or h.hexdigest() != sha:
        raise KitError(f"{name}: reassembled bytes differ from the manifest's sha256")
    return out


def split_to(path: Path, dest: Path, limit: int, meta: dict) -> dict:
    """Writes ``path`` as parts of at most ``limit`` bytes plus BUILT_MANIFEST into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    parts = []
    with open(path, "rb") as src:
        for i, off in enumerate(range(0, max(size, 1), limit)):
            data = src.read(limit)
            name = f"{path.name}.part{i:02d}"
            (dest / name).write_bytes(data)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    m = dict(meta, wheel={"name": path.name, "size": size, "sha256": sha256_file(path), "parts": parts})
    (dest / BUILT_MANIFEST).write_text(json.dumps(m, indent=1) + "\n", encoding="utf-8")
    return m


def device_facts(python: str = sys.executable) -> dict:
    """The interpreter's tag and torch version (tests replace this)."""
    r = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return {"python": f"cp{sys.version_info[0]}{sys.version_info[1]}",
            "torch": r.stdout.strip() if r.returncode == 0 else None}


def built_usable(m: dict, te: dict, sdist_sha: str, facts: dict, archs: str) -> tuple[bool, str]:
    checks = [("te_version", te["versions"]["transformer-engine"]), ("sdist_sha256", sdist_sha),
              ("python", facts["python"]), ("torch", facts["torch"]), ("cuda_archs", archs)]
    for key, want in checks:
        if m.get(key) != want:
            return False, f"built with {key} {m.get(key)}, here {want}"
    return True, f"TE {m['te_version']}, torch {m['torch']}, {m['python']}, sm_{m['cuda_archs']}"


def te_build_env(archs: str, jobs: int) -> tuple[dict, list[str]]:
    """The TE build's environment: the headers of torch's nvidia-* wheels (cuDNN's cudnn.h, and
    cusparse.h & co. where the CUDA toolkit lacks them) on CPATH, CUDA_HOME, TE's switches."""
    env = dict(os.environ)
    notes = []
    roots = [Path(s, "nvidia") for s in sys.path if s and os.path.isdir(os.path.join(s, "nvidia"))]
    incs = [d for r in roots for d in sorted(r.glob("*/include")) if d.is_dir()]
    hits = [p for d in incs for p in [d / "cudnn.h"] if p.is_file()]
    if not hits:
        hits = [Path(p) for p in ("/usr/include/cudnn.h", "/usr/local/cuda/include/cudnn.h") if os.path.isfile(p)]
    if hits:
        incs = [hits[0].parent] + [d for d in incs if d != hits[0].parent]
        notes.append(f"cudnn.h: {hits[0]}")
    else:
        notes.append("cudnn.h: not found")
    if incs:
        env["CPATH"] = os.pathsep.join([str(d) for d in incs] + ([env["CPATH"]] if env.get("CPATH") else []))
        libs = [str(d.parent / "lib") for d in incs if (d.parent / "lib").is_dir()]
        env["LIBRARY_PATH"] = os.pathsep.join(libs + ([env["LIBRARY_PATH"]] if env.get("LIBRARY_PATH") else []))
        notes.append(f"CPATH: {len(incs)} nvidia include folders")
    if "CUDA_HOME" not in env:  # TE's build looks in CUDA_HOME, then beside nvcc
        if os.path.isfile("/usr/local/cuda/bin/nvcc"):
            env["CUDA_HOME"] = "/usr/local/cuda"
        elif shutil.which("nvcc"):
            env["CUDA_HOME"] = str(Path(shutil.which("nvcc")).resolve().parent.parent)
    nvcc = Path(env.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc")
    notes.append(f"CUDA_HOME={env.get('CUDA_HOME')} (nvcc {'found' if nvcc.is_file() else 'NOT found'})")
    env.update(NVTE_PYTORCH_FORCE_BUILD="TRUE", NVTE_FRAMEWORK="pytorch", NVTE_CUDA_ARCHS=archs,
               MAX_JOBS=str(jobs), NVTE_BUILD_MAX_JOBS=str(jobs))
    return env, notes


BUILD_STATE = "te-build.json"  # in the stage: the state of a build (running in the background, ok, failed)


def build_state(stage: Path) -> dict:
    try:
        st = json.loads((stage / BUILD_STATE).read_text())
    except (OSError, ValueError):
        return {}
    if st.get("state") == "running":
        try:
            os.kill(int(st["pid"]), 0)
        except (OSError, ValueError, KeyError):
            st["state"] = "died"  # the process is gone without writing its end
    return st


def wait_for_background_build(stage: Path, wait_s: float) -> dict:
    st, t0, said = build_state(stage), time.time(), 0.0
    while st.get("state") == "running" and time.time() - t0 < wait_s:
        if time.time() - said >= 30:
            print(f"te: waiting for the background build (pid {st['pid']}, "
                  f"{round(time.time() - st.get('started', t0))} s so far)", flush=True)
            said = time.time()
        time.sleep(min(5.0, max(0.0, wait_s - (time.time() - t0))))
        st = build_state(stage)
    return st


def export_built(stage: Path, out: str | None) -> None:
    """Copies the wheel in STAGE/built to OUT/gpukit-built/ in parts that come back from $OUT."""
    m = verify_built(stage / "built") if out else None
    if not m:
        return
    w = m["wheel"]
    wheel = reassemble(stage, [dict(p, folder="built") for p in w["parts"]], w["name"], w["size"], w["sha256"],
                       stage / "files")
    meta = {k: v for k, v in m.items() if k != "wheel"}
    dest = Path(out) / "gpukit-built"
    if dest.exists():
        shutil.rmtree(dest)
    split_to(wheel, dest, OUT_PART_LIMIT, meta)
    print(f"te: the built wheel is in $OUT/gpukit-built/ (parts of <= {mib(OUT_PART_LIMIT)}); here: "
          f"python3 tools/gpu_install/kit.py keep-built <files_at>/gpukit-built")


def compile_te(args, stage: Path, te: dict, sdist: tuple[Path, str], facts: dict) -> Path | int | None:
    """Builds the TE torch-extension wheel from its sdist into STAGE/built (with BUILT_MANIFEST).
    Returns the wheel, an exit status on failure, or None in a dry run."""
    env, notes = te_build_env(args.archs, args.jobs)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", "--no-build-isolation",
           "-w", str(stage / "wheelhouse"), str(sdist[0])]
    print("te: " + "; ".join(notes))
    print(f"te: compiling the torch extension (NVTE_CUDA_ARCHS={args.archs}, MAX_JOBS={args.jobs}): "
          + " ".join(cmd), flush=True)
    if args.dry_run:
        return None
    if "cudnn.h: not found" in notes:
        raise KitError("te: cudnn.h not found (nvidia-cudnn-cu13 in the image?): cannot compile")
    if (stage / "wheelhouse").exists():
        shutil.rmtree(stage / "wheelhouse")
    (stage / "wheelhouse").mkdir(parents=True)
    log = stage / "te-build.log"
    t0 = time.time()
    rc = run_command(cmd, env=env, log=log)
    secs = round(time.time() - t0)
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        if log.is_file():
            shutil.copy(log, Path(args.out) / "te-build.log")
    built = sorted((stage / "wheelhouse").glob("transformer_engine_torch-*.whl"))
    if rc != 0 or not built:
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.is_file() else []
        print("\n".join(tail), file=sys.stderr)
        print(f"error: te: the torch extension did not build (exit {rc}, {secs} s; log {log})", file=sys.stderr)
        return 1
    wheel = built[-1]
    print(f"te: compiled in {secs} s: {wheel.name} ({mib(wheel.stat().st_size)})")
    meta = {"kit": KIT, "format": FORMAT, "kind": "te-built", "te_version": te["versions"]["transformer-engine"],
            "sdist_sha256": sdist[1], "python": facts["python"], "torch": facts["torch"],
            "cuda_archs": args.archs, "jobs": args.jobs, "seconds": secs}
    if (stage / "built").exists():
        shutil.rmtree(stage / "built")
    split_to(wheel, stage / "built", FOLDER_LIMIT, meta)
    return wheel


def te_extension(args, root: Path, stage: Path, te: dict, sdist: tuple[Path, str], built_carried: dict | None):
    """The TE torch-extension wheel to install: the carried one (.gpukit-built), one built on this
    machine before (STAGE/built, a background build waited for), else compiled now."""
    facts = device_facts()
    st = wait_for_background_build(stage, args.wait) if not args.dry_run else build_state(stage)
    if st.get("state") == "running":
        print(f"error: te: the background build (pid {st['pid']}) still runs after {args.wait:.0f} s: "
              f"run install again (log {stage / 'te-build.log'})", file=sys.stderr)
        return 3
    if st.get("state") in ("failed", "died"):
        print(f"te: the background build {st['state']} (log {stage / 'te-build.log'}); compiling here")
    try:
        local = verify_built(stage / "built")
    except KitError as exc:
        print(f"te: ignoring {stage / 'built'}: {exc}")
        local = None
    for folder, m in ((root / BUILT_DIR, built_carried), (stage / "built", local)):
        if not m:
            continue
        ok, why = built_usable(m, te, sdist[1], facts, args.archs)
        if not ok or args.no_reuse:
            print(f"te: not reusing {folder}: {why if not ok else '--no-reuse'}")
            continue
        w = m["wheel"]
        wheel = reassemble(folder.parent, [dict(p, folder=folder.name) for p in w["parts"]],
                           w["name"], w["size"], w["sha256"], stage / "files")
        print(f"te: reusing the built {w['name']} from {folder} ({why}): no compile")
        if folder == stage / "built" and not args.dry_run:
            export_built(stage, args.out)
        return wheel
    wheel = compile_te(args, stage, te, sdist, facts)
    if isinstance(wheel, Path):
        export_built(stage, args.out)
    return wheel


def cmd_build_te(args) -> int:
    """There: compile TE's torch extension as soon as the folder with its source has arrived, in the
    foreground or detached (--background: it outlives the call; install waits for it)."""
    root, stage = Path(args.root).resolve(), Path(args.stage)
    pins = read_pins(Path(args.setup or root / "setup.py"))
    folders = group_folders(root, "te")
    present = [f for f in folders if (f / MANIFEST).is_file()]
    if not present:
        raise KitError(f"te: no folder {PREFIX}te*/{MANIFEST} in {root}: carry the one with the source first")
    m = load_manifest(present[0] / MANIFEST)
    for pname, text in m["setup_py_pins"].items():
        cur = pins[pname].text if pname in pins else "nothing"
        if cur != text:
            raise KitError(f"{present[0].name}/{MANIFEST}: pin {text} disagrees with setup.py's {cur}: run prepare again")
    src = next((a for a in m["artifacts"] if a["use"] == "build"), None)
    if src is None:
        raise KitError(f"{present[0].name}/{MANIFEST}: no source of the TE torch extension listed")
    for p in src["parts"]:
        check_part(root, p, src["name"])
    st = build_state(stage)
    if st.get("state") == "running" and st.get("pid") != os.getpid():
        print(f"te: a build already runs (pid {st['pid']}); log {stage / 'te-build.log'}")
        return 0
    facts = device_facts()
    for folder in (root / BUILT_DIR, stage / "built"):  # nothing to do if a fitting wheel is here
        try:
            bm = verify_built(folder)
        except KitError:
            bm = None
        if bm and built_usable(bm, m, src["sha256"], facts, args.archs)[0]:
            print(f"te: {folder} already holds a fitting {bm['wheel']['name']}: nothing to build")
            return 0
    stage.mkdir(parents=True, exist_ok=True)
    if args.background:
        cmd = [sys.executable, str(Path(__file__).resolve()), "build-te", "--root", str(root), "--stage", str(stage),
               "--archs", args.archs, "--jobs", str(args.jobs)] + (["--setup", args.setup] if args.setup else [])
        with open(stage / "te-build.out", "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        (stage / BUILD_STATE).write_text(json.dumps({"state": "running", "pid": proc.pid, "started": time.time()}))
        print(f"te: building in the background (pid {proc.pid}, own session: it outlives this call); "
              f"output: {stage / 'te-build.out'}, {stage / 'te-build.log'}; install waits for it")
        return 0
    sdist = (reassemble(root, src["parts"], src["name"], src["size"], src["sha256"], stage / "files"), src["sha256"])
    t0 = time.time()
    (stage / BUILD_STATE).write_text(json.dumps({"state": "running", "pid": os.getpid(), "started": t0}))
    ok = False
    try:
        args.dry_run = False
        wheel = compile_te(args, stage, m, sdist, facts)
        ok = isinstance(wheel, Path)
    finally:
        (stage / BUILD_STATE).write_text(json.dumps({"state": "ok" if ok else "failed", "pid": os.getpid(),
                                                     "started": t0, "ended": time.time()}))
    return 0 if ok else 1


def cmd_install(args) -> int:
    root = Path(args.root).resolve()
    target, stage = Path(args.target), Path(args.stage)
    pins = read_pins(Path(args.setup or root / "setup.py"))
    asked = groups_arg(args.only)
    stamp_path = target / STAMP
    try:
        stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else {}
    except ValueError:
        stamp = {}
    todo = []
    for g in with_needs(asked):
        if g not in asked and g in stamp and not args.force:
            print(f"{g}: already installed in {target} (build {stamp[g]})")
            continue
        todo.append(g)
    # 1. Verify everything (reads only).
    plans = {g: verify_group(root, g, pins) for g in todo}
    built_carried = verify_built(root / BUILT_DIR) if "te" in plans else None
    for g, p in plans.items():
        print(f"{g}: verified {sum(len(a['parts']) for a in p.manifest['artifacts'])} parts in "
              f"{', '.join(p.manifest['folders'])} (build {p.build}; {p.manifest['setup_py_pins'][PINNED[g]]})")
    if built_carried:
        print(f"te: verified the carried built wheel {built_carried['wheel']['name']} in {BUILT_DIR}")
    skip = [g for g in plans if stamp.get(g) == plans[g].build and not args.force]
    for g in skip:
        print(f"{g}: build {plans[g].build} already installed in {target}")
        del plans[g]
    if not plans:
        print(f"nothing to install; export PYTHONPATH={target}")
        return 0
    # 2. Reassemble (into the stage, not the target).
    wheels, sdist = [], None
    for g, p in plans.items():
        for a in p.manifest["artifacts"]:
            path = reassemble(root, a["parts"], a["name"], a["size"], a["sha256"], stage / "files")
            if a["use"] == "build":
                sdist = (path, a["sha256"])
            else:
                wheels.append(path)
    if "te" in plans and sdist is None:
        raise KitError(f"{plans['te'].manifest['folders'][0]}/{MANIFEST}: no source of the TE torch extension listed")
    print(f"{len(wheels) + (sdist is not None)} files ready in {stage / 'files'} or in place (sha256 match)")
    # 3. TE's torch extension: a carried or earlier built wheel, else compile.
    if "te" in plans:
        te_wheel = te_extension(args, root, stage, plans["te"].manifest, sdist, built_carried)
        if isinstance(te_wheel, int):
            return te_wheel
        if te_wheel is not None:
            wheels.append(te_wheel)
    # 4. One pip call for everything: pip --target --upgrade replaces a top-level folder that a
    # later call installs again, so TE's core and its extension (both under transformer_engine/)
    # must go in together.
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target)] + [str(w) for w in wheels]
    if args.dry_run:
        print(f"dry run: would run {' '.join(cmd[:10])} ... ({len(wheels)} wheels); nothing installed")
        return 0
    target.mkdir(parents=True, exist_ok=True)
    if run_command(cmd) != 0:
        print(f"error: pip install into {target} failed", file=sys.stderr)
        return 1
    stamp.update({g: p.build for g, p in plans.items()})
    stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")
    bad = []
    if not args.no_import_check:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
        for g in plans:
            r = subprocess.run([sys.executable, "-c", IMPORT_CHECKS[g]], env=env, capture_output=True, text=True)
            lines = (r.stdout if r.returncode == 0 else r.stderr).strip().splitlines()
            print(f"{g}: import {'ok' if r.returncode == 0 else 'FAILED'}: {lines[-1] if lines else ''}")
            if r.returncode:
                bad.append(g)
    print(f"installed {', '.join(plans)} into {target}; export PYTHONPATH={target}")
    if bad:
        print(f"error: installed but does not import: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def cmd_check(args) -> int:
    """Per folder, for the transfers: which have arrived, intact. Exit 2 if one present is bad."""
    root = Path(args.root).resolve()
    pins = read_pins(Path(args.setup or root / "setup.py"))
    bad = 0
    for g in groups_arg(args.only):
        folders = group_folders(root, g)
        if not folders:
            print(f"{g}: no folder here yet")
            continue
        expected, seen = None, []
        for f in folders:
            try:
                if not (f / MANIFEST).is_file():
                    raise KitError(f"missing part {f.name}/{MANIFEST}")
                m = load_manifest(f / MANIFEST)
                expected = expected or m["folders"]
                for pname, text in m["setup_py_pins"].items():
                    cur = pins[pname].text if pname in pins else "nothing"
                    if cur != text:
                        raise KitError(f"{f.name}/{MANIFEST}: pin {text} disagrees with setup.py's {cur}")
                n = 0
                for a in m["artifacts"]:
                    for p in a["parts"]:
                        if p["folder"] == f.name:
                            check_part(root, p, a["name"])
                            n += 1
                print(f"{f.name}: ok ({n} parts, build {m['build']})")
                seen.append(f.name)
            except KitError as exc:
                print(f"{f.name}: error: {exc}")
                bad += 1
        for name in expected or []:
            if name not in seen and not (root / name).is_dir():
                print(f"{name}: not here yet")
    try:
        m = verify_built(root / BUILT_DIR)
        if m:
            print(f"{BUILT_DIR}: ok ({m['wheel']['name']}, torch {m.get('torch')}, sm_{m.get('cuda_archs')})")
    except KitError as exc:
        print(f"{BUILT_DIR}: error: {exc}")
        bad += 1
    st = build_state(Path(args.stage))
    if st:
        since = st.get("ended", time.time()) - st.get("started", st.get("ended", time.time()))
        print(f"TE build in {args.stage}: {st['state']}" + (f" (pid {st['pid']}, {since:.0f} s)"
                                                             if st["state"] == "running" else ""))
        if st["state"] in ("failed", "died"):
            log = Path(args.stage) / "te-build.log"
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
            print("\n".join(tail))
    return 2 if bad else 0


def cmd_keep_built(args) -> int:
    """Here: checks a built wheel that came back from $OUT/gpukit-built/ and keeps it in .gpukit-built/."""
    src = Path(args.src)
    m = verify_built(src)
    if m is None:
        raise KitError(f"{src}: no such folder")
    total = sum(p["size"] for p in m["wheel"]["parts"])
    if total > FOLDER_LIMIT:
        raise KitError(f"{m['wheel']['name']}: {total} bytes, more than one carried folder holds")
    dest = Path(args.root).resolve() / BUILT_DIR
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for p in m["wheel"]["parts"]:
        shutil.copy(src / p["name"], tmp / p["name"])
    shutil.copy(src / BUILT_MANIFEST, tmp / BUILT_MANIFEST)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    print(f"kept {m['wheel']['name']} ({mib(total)}, torch {m.get('torch')}, sm_{m.get('cuda_archs')}) in "
          f"{dest}: carry it with the te folders and install reuses it instead of compiling")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kit.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--root", default=str(REPO), help="project root holding the carried folders (default: this repo)")
        p.add_argument("--setup", help="setup.py to read the pins from (default: ROOT/setup.py)")
        p.add_argument("--only", help=f"comma list of groups ({','.join(GROUPS)}; default: all)")

    p = sub.add_parser("prepare", help="here: download, split, write the carried folders")
    common(p)
    p.add_argument("--out-dir", help="where the folders go (default: ROOT)")
    p.add_argument("--cache", help=f"download cache (default: ROOT/{CACHE_DIR})")
    p.add_argument("--offline", action="store_true", help="use the cache only, download nothing")
    p.add_argument("--part-limit", type=parse_size, default=PART_LIMIT, help="largest carried file (54M)")
    p.add_argument("--folder-limit", type=parse_size, default=FOLDER_LIMIT, help="largest folder (56M)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("install", help="there: verify, reassemble, compile TE's extension, pip install")
    common(p)
    p.add_argument("--target", default=os.environ.get("GPUKIT_SITE", "/tmp/site"),
                   help="pip --target (default /tmp/site; then export PYTHONPATH=/tmp/site)")
    p.add_argument("--stage", default="/tmp/gpukit", help="scratch: reassembled files, the TE build")
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="copy the built TE wheel here in parts (default: $OUT when set)")
    p.add_argument("--archs", default="90", help="NVTE_CUDA_ARCHS (default 90: H100/H200)")
    p.add_argument("--jobs", type=int, default=16, help="MAX_JOBS for the TE build (default 16)")
    p.add_argument("--dry-run", action="store_true", help="verify and reassemble; no compile, no pip")
    p.add_argument("--force", action="store_true", help="install again what the target already has")
    p.add_argument("--no-reuse", action="store_true", help="compile TE's extension even if a built wheel fits")
    p.add_argument("--no-import-check", action="store_true")
    p.add_argument("--wait", type=float, default=480,
                   help="seconds to wait for a background TE build (build-te --background) to end (480)")
    p.set_defaults(func=cmd_install)

    p = sub.add_parser("build-te", help="there: compile TE's torch extension once its source has arrived")
    p.add_argument("--root", default=str(REPO))
    p.add_argument("--setup", help="setup.py to read the pins from (default: ROOT/setup.py)")
    p.add_argument("--stage", default="/tmp/gpukit")
    p.add_argument("--archs", default="90")
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--background", action="store_true", help="detach (own session); install waits for it")
    p.set_defaults(func=cmd_build_te)

    p = sub.add_parser("check", help="there: which folders have arrived intact")
    common(p)
    p.add_argument("--stage", default="/tmp/gpukit", help="where a background TE build runs")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("keep-built", help="here: keep the TE wheel built there (from $OUT/gpukit-built)")
    p.add_argument("src", help="the folder that came back, e.g. <files_at>/gpukit-built")
    p.add_argument("--root", default=str(REPO))
    p.set_defaults(func=cmd_keep_built)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
