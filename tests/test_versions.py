"""One version table for the GPU stack, and every file agrees with it (issue 39, item 10).

The table is the "Versions" section of docs/gpu.md: one row per package, one column per install
route (a fresh node with ``pip install -e '.[gpu]'``, and the Docker image). These tests check
that ``setup.py``'s ``gpu`` extra, ``docker/Dockerfile``, ``docker/requirements-gpu.txt``,
``docker/README.md`` and the GPU install kit (``tools/gpu_install``) name the table's versions;
that no other file pins another version of one of its packages or another NGC image; and that no
page of the docs names another vLLM or NGC release in prose. Not scanned: ``tests/`` (its fixtures
pin made-up versions on purpose) and ``BENCHMARKS.md`` (a dated record of what ran with what).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_DOC = os.path.join("docs", "gpu.md")
ROUTES = ("pip", "image")
PACKAGES = ("python", "cuda", "torch", "megatron-core", "transformer-engine", "vllm", "flash-attn", "ngc")


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def version_table() -> dict[str, dict[str, str]]:
    """``{package: {"pip": version, "image": version}}`` from docs/gpu.md's "## Versions"."""
    text = read(TABLE_DOC)
    m = re.search(r"^## Versions\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE)
    assert m, f"{TABLE_DOC} has no '## Versions' section"
    table = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        values = [re.fullmatch(r"`([^`]*)`", c) for c in cells[:3]]
        assert all(values), f"{TABLE_DOC}: a version row needs `package` | `pip` | `image`: {line}"
        name, pip, image = (v.group(1) for v in values)
        table[name] = {"pip": pip, "image": image}
    return table


def gpu_extra() -> dict[str, str]:
    """``{distribution: specifier}`` of setup.py's ``gpu`` extra (read with ast, not imported)."""
    tree = ast.parse(read("setup.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "gpu":
                    pins = {}
                    for req in ast.literal_eval(value):
                        name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?(.*)", req).groups()
                        pins[name.lower()] = spec
                    return pins
    raise AssertionError("setup.py has no 'gpu' extra")


def dockerfile_args() -> dict[str, str]:
    args = {}
    for line in read("docker/Dockerfile").splitlines():
        m = re.match(r"ARG (\w+)=(.*)$", line.strip())
        if m:
            args[m.group(1)] = m.group(2).strip().strip('"')
    return args


def tracked_text_files() -> list[str]:
    """The repository's text files that say anything about installing (all but tests/ and
    BENCHMARKS.md), as paths relative to the root."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        out = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            out += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files]
    keep = []
    for rel in out:
        if not rel or rel.startswith(("tests/", ".")) or rel == "BENCHMARKS.md":
            continue
        text = rel.endswith((".md", ".py", ".sh", ".txt", ".yaml", ".yml", ".toml", ".cfg"))
        if (text or os.path.basename(rel) == "Dockerfile") and os.path.isfile(os.path.join(ROOT, rel)):
            keep.append(rel)
    return sorted(keep)


# --------------------------------------------------------------------------------------------
def test_the_table_names_every_package_of_the_gpu_stack():
    table = version_table()
    assert set(PACKAGES) <= set(table), f"missing rows: {sorted(set(PACKAGES) - set(table))}"
    # torch: the two routes share a minor (vLLM's wheel pins one torch release).
    assert Version(table["torch"]["pip"]).release[:2] == Version(table["torch"]["image"]).release[:2]
    assert table["vllm"]["pip"] == table["vllm"]["image"]
    assert table["megatron-core"]["pip"] == table["megatron-core"]["image"]
    # The fresh node's TE release is inside the range the image accepts (megatron-core's).
    te = table["transformer-engine"]["pip"].replace("*", "0")
    assert SpecifierSet(table["transformer-engine"]["image"]).contains(Version(te), prereleases=True)


def test_gpu_extra_and_docker_image_install_the_same_vllm():
    """The issue's own case: the ``gpu`` extra pinned vLLM 0.25.1 while the image built 0.18.0."""
    assert gpu_extra()["vllm"] == f"=={dockerfile_args()['VLLM_VERSION']}"


def test_gpu_extra_pins_the_table():
    table, extra = version_table(), gpu_extra()
    assert extra == {"megatron-core": f"=={table['megatron-core']['pip']}",
                     "transformer-engine": f"=={table['transformer-engine']['pip']}",
                     "vllm": f"=={table['vllm']['pip']}"}


def test_dockerfile_and_its_requirements_pin_the_table():
    table, args = version_table(), dockerfile_args()
    assert args["NGC_TAG"] == table["ngc"]["image"]
    assert args["VLLM_VERSION"] == table["vllm"]["image"]
    assert table["torch"]["image"].startswith(args["TORCH_MINOR"] + ".")
    assert table["torch"]["pip"].startswith(args["TORCH_MINOR"] + ".")
    assert SpecifierSet(args["TE_SPEC"]) == SpecifierSet(table["transformer-engine"]["image"])
    reqs = [ln.strip() for ln in read("docker/requirements-gpu.txt").splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert f"megatron-core=={table['megatron-core']['image']}" in reqs


def test_docker_readme_names_the_tables_versions():
    table, text = version_table(), read("docker/README.md")
    rows = {c[0]: c[1] for c in (
        [x.strip() for x in line.strip().strip("|").split("|")] for line in text.splitlines()
        if line.startswith("|")) if len(c) > 1}
    assert rows["base"].startswith(f"`nvcr.io/nvidia/pytorch:{table['ngc']['image']}-py3`")
    assert rows["vLLM"].startswith(table["vllm"]["image"])
    assert rows["megatron-core"].startswith(table["megatron-core"]["image"])


def test_the_lent_machines_torch_is_the_fresh_node_torch():
    """tools/gpu_install carries the gpu extra's pins (read from setup.py) to a machine whose
    image has its own torch: that torch is the table's."""
    tree = ast.parse(read("tools/gpu_install/kit.py"))
    image = next(ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "IMAGE_VERSIONS" for t in n.targets))
    assert image["torch"] == version_table()["torch"]["pip"]


PIN = re.compile(r"(?<![\w.-])(vllm|megatron[-_]core|transformer[-_]engine(?:[-_]torch)?(?:\[[\w,]*\])?|torch)"
                 r"==(\d[\w.*+]*)", re.IGNORECASE)
NGC_IMAGE = re.compile(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3")
NGC_PROSE = re.compile(r"\bNGC\s+(\d\d\.\d\d)\b")
VLLM_PROSE = re.compile(r"\bvLLM\s+v?(\d+\.\d+(?:\.\d+)?)\b")


def allowed(table: dict) -> dict[str, set[str]]:
    return {
        "vllm": {table["vllm"]["pip"], table["vllm"]["image"]},
        "megatron-core": {table["megatron-core"]["pip"], table["megatron-core"]["image"]},
        "transformer-engine": {table["transformer-engine"]["pip"]},
        "torch": {table["torch"]["pip"]},
        "ngc": {table["ngc"]["image"]},
    }


def canonical(package: str) -> str:
    package = re.sub(r"\[.*\]", "", package.lower()).replace("_", "-")
    return "transformer-engine" if package.startswith("transformer-engine") else package


def find_disagreements(texts: dict[str, str], table: dict) -> list[str]:
    """``path:line: ...`` for every version in ``texts`` ({path: text}) the table does not name."""
    ok, bad = allowed(table), []
    for rel, text in texts.items():
        # Prose ("vLLM 0.18.0", "NGC 25.12") counts where users read it: the docs, setup.py and the
        # Dockerfile. Code comments elsewhere may name the release that introduced an API.
        prose = rel.endswith(".md") or rel in ("setup.py", "docker/Dockerfile")
        for n, line in enumerate(text.splitlines(), 1):
            found = [(canonical(m.group(1)), m.group(2)) for m in PIN.finditer(line)]
            found += [("ngc", m.group(1)) for m in NGC_IMAGE.finditer(line)]
            if prose:
                found += [("ngc", m.group(1)) for m in NGC_PROSE.finditer(line)]
                found += [("vllm", m.group(1)) for m in VLLM_PROSE.finditer(line)]
            for package, version in found:
                if version not in ok[package]:
                    bad.append(f"{rel}:{n}: {package} {version} (the table: "
                               f"{' / '.join(sorted(ok[package]))}): {line.strip()[:120]}")
    return bad


def test_no_file_names_another_version():
    files = tracked_text_files()
    assert "docker/Dockerfile" in files and "setup.py" in files and TABLE_DOC in files
    bad = find_disagreements({rel: read(rel) for rel in files}, version_table())
    assert not bad, "versions that disagree with docs/gpu.md's table:\n" + "\n".join(bad)


@pytest.mark.parametrize("line", [
    "ARG VLLM_VERSION=0.18.0  # vllm==0.18.0",
    "RUN pip install 'transformer-engine[core_cu13,pytorch]==2.12.0'",
    "FROM nvcr.io/nvidia/pytorch:25.12-py3",
    "The image builds vLLM 0.18.0 from source.",
    "built on NGC 25.12",
    'pip install "torch==2.10.0"',
])
def test_the_scan_catches_another_version(line):
    """The scan itself: each line names one version the table does not (the first through its
    pin; an ARG line alone is the Dockerfile test's)."""
    table = version_table()
    bad = find_disagreements({"doc.md": f"fine: vllm=={table['vllm']['pip']}\n{line}\n"}, table)
    assert len(bad) == 1 and bad[0].startswith("doc.md:2:"), bad
