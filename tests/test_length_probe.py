"""The length probe: its table and rows, and the direction of its claim on a small run."""

import json

import pytest

from blockformer.errors import UsageError
from blockformer.probes import run_probe


def test_length_probe_reports_every_factor_and_a_cannot_extrapolate_row_for_learned(tmp_path):
    result = run_probe("length", schemes="learned,rope", train_len=8, factors="1,2", steps=3, d_model=16,
                       n_heads=2, n_layers=1, batch_size=2, text_kb=20, eval_windows=2)
    rows = {r[0]: r for r in result.rows}
    assert set(rows) == {"learned", "rope", "rope+linear", "rope+ntk", "rope+window"}
    assert rows["learned"][2] is None and rows["learned"][-1] == "cannot extrapolate"
    assert all(isinstance(v, float) and 3.0 < v < 8.0 for v in rows["rope"][1:3])  # ~ln 256 = 5.5 untrained
    assert rows["rope+linear"][1] == rows["rope"][1]  # factor 1: the model itself
    assert rows["rope+linear"][2] != rows["rope"][2]
    data = json.loads(result.to_json())["data"]
    assert len(data["runs"]["rope"]["curves"]["2"]) == 16  # 2 x T positions
    assert result.save_plot(tmp_path / "length.png").stat().st_size > 1000


def test_length_probe_rejects_too_little_text():
    with pytest.raises(UsageError, match="text-kb"):
        run_probe("length", schemes="rope", train_len=64, factors="1,8", steps=1, text_kb=1)


@pytest.mark.slow
def test_alibi_holds_its_loss_at_4x_the_training_context_and_sinusoidal_does_not():
    """300 steps at T=32 (seed 0), the same held-out bytes: alibi 2.122 at 1x and 2.107 at 4x,
    sinusoidal 2.203 -> 2.726 (+24%)."""
    result = run_probe("length", schemes="alibi,sinusoidal", train_len=32, factors="1,4", steps=300,
                       text_kb=400, extensions=False)
    loss = {r[0]: r[1:3] for r in result.rows}
    assert loss["alibi"][1] < 1.1 * loss["alibi"][0], loss
    assert loss["sinusoidal"][1] > 1.15 * loss["sinusoidal"][0], loss
    assert loss["sinusoidal"][1] > loss["alibi"][1] + 0.2, loss


def test_length_probe_has_command_line_help(capsys):
    from blockformer.cli import main

    assert main(["probe", "length", "--help"]) == 0
    assert "--train-len" in capsys.readouterr().out


def test_length_probe_options_out_of_range_are_one_line_errors(capsys):
    from blockformer.cli import main

    assert main(["probe", "length", "--steps", "0"]) == 2
    assert "--steps 0: expected an integer >= 1" in capsys.readouterr().err
