"""The lent GPU machine's whole command sequence rehearsed on the CPU (tools/run_gpu_checks.py
--phase mcore|te|vllm --rehearse): every stage's CPU stand-in runs, the bundle the machine returns
is written, and a kit that did not arrive stops its phase in one logged stage.

Not marked ``mcore`` (nothing here imports megatron-core; the stand-ins run as programs): the
suite runs it on megatron-core 0.16.1 only, the release the GPU kit carries (tools/gpu_install).
"""

import importlib.util
import json
import os
import sys

import pytest

pytestmark = pytest.mark.one_suite("mcore016")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checks():
    spec = importlib.util.spec_from_file_location("_tool_run_gpu_checks",
                                                  os.path.join(REPO, "tools", "run_gpu_checks.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_every_phase_rehearses_on_the_cpu_and_bundles_its_results(checks, tmp_path, capsys):
    """The lent machine's whole sequence (docs/dev/gpu_kit.md), each stage's CPU stand-in: the
    decode benchmark on a tiny model, the GPU tests collected, the trainer benchmarks' dry runs;
    each phase leaves summary_<phase>.json (every stage inline) and <phase>.tar.gz in the bundle."""
    import tarfile

    bundle = tmp_path / "bundle"
    for phase in ("mcore", "te", "vllm"):
        assert checks.main([str(tmp_path / phase), "--phase", phase, "--rehearse", "--bundle", str(bundle)]) == 0
        summary = json.loads((bundle / f"summary_{phase}.json").read_text())
        plan = [s.name for s in checks.phase_stages(phase)]
        assert [e["stage"] for e in summary["stages"]] == plan and plan[:2] == ["install", "env"]
        assert summary["ok"] and summary["rehearsal"] and summary["phase"] == phase
        assert summary["stages"][0]["returncode"] == checks.NOT_REHEARSED  # nothing installed here
        with tarfile.open(bundle / f"{phase}.tar.gz") as t:
            assert f"{phase}/summary.json" in t.getnames()
    mcore = json.loads((bundle / "summary_mcore.json").read_text())["stages"]
    decode = next(e for e in mcore if e["stage"] == "bench_decode")
    assert [r["path"] for r in decode["data"]["rows"]] == ["graphs", "fixed", "lockstep"]
    assert decode["data"]["complete"] and [r["batch"] for r in decode["data"]["step_ms"]] == [1, 4]
    assert decode["data"]["same_tokens_as_fixed"] == {"graphs": True, "lockstep": True}  # fp32, eager
    tests = next(e for e in mcore if e["stage"] == "test_graphs")
    assert "test_replayed_graph_samples_what_the_eager_step_samples" in open(tests["log"]).read()
    assert len(list(bundle.iterdir())) <= 8  # the machine returns at most 8 files
    capsys.readouterr()


def test_a_failed_install_skips_the_stages_that_need_it(checks, tmp_path, monkeypatch, capsys):
    """A kit that did not arrive (or fails its checks) stops its phase after one logged stage:
    every later stage is skipped saying why, and the summary says the phase failed."""
    monkeypatch.setattr(checks, "KIT", os.path.join("tools", "gpu_install", "no_such_kit.py"))
    assert checks.main([str(tmp_path / "out"), "--phase", "te", "--budget", "60"]) == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    install, *rest = summary["stages"]
    assert install["returncode"] != 0 and not install["ok"]
    assert json.loads((tmp_path / "out" / "install.json").read_text())["returncode"] == install["returncode"]
    assert rest and all(e["returncode"] == "skipped: the te install failed" and not e["ok"] for e in rest)
    capsys.readouterr()
