"""The Appendix G study (tools/kl_estimator_study.py) at a tiny size: its closed forms and the three
properties Figure 4 illustrates."""

import csv
import importlib.util
import math
import os

import pytest
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PATH = os.path.join(_REPO, "tools", "kl_estimator_study.py")


@pytest.fixture(scope="module")
def study_mod():
    spec = importlib.util.spec_from_file_location("kl_estimator_study", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(study_mod):
    return study_mod.run_study(vocab=2000, m_targets=(0.5, 0.9), ks=(4, 32), bs=(1, 16, 256, 4096, 32768),
                               n_tasks=2, seed=3)


def test_closed_forms_match_library_autograd(study_mod):
    assert study_mod.closed_form_check(vocab=40, k=5, seed=2) < 1e-12


def test_calibration_hits_target_mass(study_mod):
    z = torch.randn(3000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for m in (0.2, 0.9):
        s = study_mod.calibrate_scale(z, m)
        assert abs(study_mod.top_mass(s * z) - m) < 1e-9


def test_unbiased_beats_sampled_everywhere(tiny):
    idx = {(r["estimator"], r["M"], r["K"], r["B"]): r["rel_rmse"] for r in tiny["rows"]}
    cfg = tiny["config"]
    for m in cfg["M"]:
        for k in cfg["K"]:
            for b in cfg["B"]:
                assert idx[("topk_unbiased", m, k, b)] < idx[("sampled", m, k, b)]


def test_truncated_floor_and_unbiased_root_b_decay(study_mod, tiny):
    idx = {(r["estimator"], r["M"], r["K"], r["B"]): r["rel_rmse"] for r in tiny["rows"]}
    cfg = tiny["config"]
    bs = cfg["B"]
    for m in cfg["M"]:
        for k in cfg["K"]:
            tr = [idx[("truncated", m, k, b)] for b in bs]
            ub = [idx[("topk_unbiased", m, k, b)] for b in bs]
            pa = [idx[("topk_paper", m, k, b)] for b in bs]
            # truncated: a bias floor, flat in B
            assert tr[-1] > 0 and max(tr) - min(tr) <= 1e-12 * tr[0]
            # unbiased Top-k keeps falling like 1/sqrt(B)
            for (b0, u0), (b1, u1) in zip(zip(bs, ub), zip(bs[1:], ub[1:])):
                assert math.log(u1 / u0) / math.log(b1 / b0) == pytest.approx(-0.5, abs=1e-9)
            # ... so past the critical sample size it beats truncated
            assert ub[-1] < tr[-1]
            # Algorithm 1 as printed flattens out at its own bias floor (grad m)
            assert pa[-1] > 1.5 * ub[-1]
    checks = study_mod.check_properties(tiny)
    assert checks["unbiased_below_sampled_everywhere"]


def test_cli_writes_outputs(study_mod, tmp_path):
    summary = study_mod.main(["--out", str(tmp_path), "--quick", "--vocab", "1000", "--tasks", "1"])
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == ["estimator", "M", "K", "B", "rel_rmse"]
    assert len(rows) == 4 * len(study_mod.QUICK_K) * len(study_mod.QUICK_B) * len(study_mod.ESTIMATORS)
    assert (tmp_path / "critical_sample_size.csv").exists()
    assert (tmp_path / "kl_study.png").stat().st_size > 10_000
    assert summary["checks"]["unbiased_below_sampled_everywhere"]
