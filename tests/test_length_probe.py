"""The length probe: its table and rows, and the direction of its claim on a small run."""

import json

import pytest

from blockformer.probes import run_probe


def test_length_probe_reports_every_factor_and_a_cannot_extrapolate_row_for_learned(tmp_path):
    result = run_probe("length", schemes="learned,rope", train_len=8, factors="1,2", steps=3, d_model=16,
                       n_heads=2, n_layers=1, batch_size=2, max_bytes=20_000, eval_windows=2)
    rows = {r[0]: r for r in result.rows}
    assert set(rows) == {"learned", "rope", "rope+linear", "rope+ntk", "rope+window"}
    assert rows["learned"][2] is None and rows["learned"][-1] == "cannot extrapolate"
    assert all(isinstance(v, float) and 3.0 < v < 8.0 for v in rows["rope"][1:3])  # ~ln 256 = 5.5 untrained
    assert rows["rope+linear"][1] == rows["rope"][1]  # factor 1: the model itself
    assert rows["rope+linear"][2] != rows["rope"][2]
    data = json.loads(result.to_json())["data"]
    assert len(data["runs"]["rope"]["curves"]["2"]) == 16
    assert result.save_plot(tmp_path / "length.png").stat().st_size > 1000


def test_length_probe_rejects_too_little_text():
    with pytest.raises(ValueError, match="max-bytes"):
        run_probe("length", schemes="rope", train_len=64, factors="1,8", steps=1, max_bytes=1000)


@pytest.mark.slow
def test_alibi_holds_its_loss_at_4x_the_training_context_and_sinusoidal_does_not():
    """300 steps at T=32 (seed 0): alibi 2.14 -> 2.28 at 4x (+6%), sinusoidal 2.23 -> 2.79 (+25%)."""
    result = run_probe("length", schemes="alibi,sinusoidal", train_len=32, factors="1,4", steps=300,
                       max_bytes=400_000, extensions=False)
    loss = {r[0]: r[1:3] for r in result.rows}
    assert loss["alibi"][1] < 1.1 * loss["alibi"][0], loss
    assert loss["sinusoidal"][1] > 1.15 * loss["sinusoidal"][0], loss
    assert loss["sinusoidal"][1] > loss["alibi"][1] + 0.2, loss


def test_length_probe_has_command_line_help(capsys):
    from blockformer.cli import main

    assert main(["probe", "length", "--help"]) == 0
    assert "--train-len" in capsys.readouterr().out
