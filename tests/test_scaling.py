"""Scaling laws: the fits recover known constants; a small sweep runs end to end and resumes."""

import json

import numpy as np
import pytest

from blockformer.cli import main
from blockformer.scaling import fit_chinchilla, fit_kaplan
from blockformer.scaling.sweep import parse_count, parse_sizes

TRUE = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al.'s fitted constants


def synthetic(noise: float = 0.0, seed: int = 0):
    N = np.repeat([1e6, 3e6, 1e7, 3e7, 1e8], 4)
    D = np.tile([1e8, 3e8, 1e9, 3e9], 5)
    L = TRUE["E"] + TRUE["A"] / N ** TRUE["alpha"] + TRUE["B"] / D ** TRUE["beta"]
    return N, D, L * np.exp(np.random.default_rng(seed).normal(0, noise, L.shape))


def test_chinchilla_fit_recovers_known_constants_from_synthetic_losses():
    fit = fit_chinchilla(*synthetic(), bootstrap=0)
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=0.01), name


@pytest.mark.slow  # 30 parametric refits, each from several starts: 10-30 s
def test_chinchilla_fit_with_noise_stays_close_and_its_intervals_bracket_the_fit():
    fit = fit_chinchilla(*synthetic(noise=0.002, seed=1), bootstrap=30)
    assert fit.alpha == pytest.approx(TRUE["alpha"], rel=0.05)
    assert fit.beta == pytest.approx(TRUE["beta"], rel=0.05)
    assert fit.E == pytest.approx(TRUE["E"], rel=0.05)
    for name in ("alpha", "beta"):
        lo, hi = fit.intervals[name]
        assert lo < getattr(fit, name) < hi and hi - lo < 0.2 * TRUE[name], (name, lo, hi)
        assert abs(getattr(fit, name) - TRUE[name]) < 3 * (hi - lo), (name, lo, hi)


def test_compute_optimal_split_minimises_the_fitted_loss_at_fixed_flops():
    fit = fit_chinchilla(*synthetic(), bootstrap=0)
    C = 5.76e23  # Chinchilla's budget
    n_opt, d_opt = fit.compute_optimal(C)
    assert 6 * n_opt * d_opt == pytest.approx(C)
    n = np.geomspace(n_opt / 10, n_opt * 10, 2001)
    numeric = n[np.argmin(fit.predict(n, C / (6 * n)))]
    assert n_opt == pytest.approx(numeric, rel=0.01)
    assert 2e10 < n_opt < 1e11  # Hoffmann's constants put the 5.76e23 optimum near 40B (their 70B used approach 1)


def test_kaplan_fit_recovers_a_power_law():
    N = np.array([1e5, 1e6, 1e7, 1e8])
    fit = fit_kaplan(N, (8.8e13 / N) ** 0.076, bootstrap=0)
    assert fit.alpha_N == pytest.approx(0.076, rel=1e-6) and fit.N_c == pytest.approx(8.8e13, rel=1e-4)


def test_fits_reject_too_few_points():
    with pytest.raises(ValueError, match="2 points; its 5 parameters need at least 8"):
        fit_chinchilla([1, 2], [1, 2], [1, 2])
    with pytest.raises(ValueError, match="1 model sizes; .* expected at least 3"):
        fit_kaplan([5, 5], [1, 2])


def test_sizes_and_counts_parse_and_bad_ones_name_the_option():
    assert parse_sizes("64x2, 128x4") == [(64, 2), (128, 4)]
    assert [parse_count(t, "--tokens") for t in ("500k", "2M", "1.5e3", "7")] == [500_000, 2_000_000, 1500, 7]
    with pytest.raises(Exception, match="--sizes"):
        parse_sizes("64,128")
    with pytest.raises(Exception, match="--tokens"):
        parse_count("lots", "--tokens")


def test_smoke_sweep_two_sizes_by_two_budgets_runs_end_to_end_and_resumes(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i}\n\n" for i in range(200)))
    args = ["sweep", "--preset", "stdlib-lm", "--set", f"data.text={corpus}", "--set", "data.tokenizer=char",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.seq_len=16", "--set",
            "model.max_seq_len=16", "--set", "train.batch_size=4", "--set", "train.precision=fp32",
            "--sizes", "32x1,64x1", "--tokens", "128,256", "--holdout", "", "--bootstrap", "5",
            "--out", str(tmp_path / "sweep")]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert [(p["size"], p["tokens"], p["steps"]) for p in summary["points"]] == [
        ("32x1", 128, 2), ("32x1", 256, 4), ("64x1", 128, 2), ("64x1", 256, 4)]
    assert summary["points"][0]["parameters"] < summary["points"][2]["parameters"]
    assert "Chinchilla fit skipped: 4 points" in out and "Kaplan fit skipped: 2 model sizes" in out
    assert set(summary["skipped"]) == {"chinchilla", "kaplan"}
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 10_000
    stamp = (tmp_path / "sweep" / "points" / "64x1_256" / "point.json").stat().st_mtime_ns
    assert main(args) == 0  # again: nothing retrained
    assert capsys.readouterr().out.count("not retrained") == 4
    assert (tmp_path / "sweep" / "points" / "64x1_256" / "point.json").stat().st_mtime_ns == stamp


def test_sweep_rejects_a_seq2seq_recipe(capsys):
    assert main(["sweep", "--preset", "copy", "--sizes", "32x1", "--tokens", "100"]) == 2
    assert "language-modelling" in capsys.readouterr().err


def test_an_interrupted_point_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    import blockformer.scaling.sweep as sweep
    import blockformer.train.loop as loop
    from blockformer.run_config import load_run_config
    from blockformer.scaling.sweep import ensure_point, point_config, point_name

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"x{i} = {i % 7}\n" for i in range(300)))
    base = load_run_config(preset="stdlib-lm", overrides=[
        f"data.text={corpus}", "data.tokenizer=char", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=16",
        "model.max_seq_len=16", "train.batch_size=4", "train.precision=fp32"])
    cfg = point_config(base, 32, 1, 512)  # 8 steps
    run_dir = tmp_path / "points" / point_name(32, 1, 512)
    loop.train(cfg, run_dir, stop_at=3, log=lambda *a: None)  # interrupted after 3 steps
    seen = []
    real_train = loop.train
    monkeypatch.setattr(sweep, "train", lambda *a, **kw: seen.append(kw.get("resume")) or real_train(*a, **kw))
    point = ensure_point(base, 32, 1, 512, tmp_path / "points", log=lambda *a: None)
    assert seen == [run_dir] and point.steps == 8 and point.tokens == 512


def test_a_resample_that_pushes_a_constant_past_float_range_gives_inf_not_an_error():
    import torch

    from blockformer.scaling.fit import _to_fit

    fit = _to_fit(torch.tensor([800.0, 1.0, 0.0, 2.0, 0.5], dtype=torch.float64), 0.0)
    assert fit.A == float("inf") and fit.B == pytest.approx(2.718281828) and fit.E == 1.0
