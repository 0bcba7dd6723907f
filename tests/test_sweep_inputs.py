"""`sweep --fit-only` over point.json files that are not sweep points: one line naming the
file and the field, exit code 2; well-formed points fit."""

import json

import pytest

from blockformer.cli import main


def _point(width: int, layers: int, tokens: int) -> dict:
    n = 12 * layers * width**2 + 256 * width
    loss = 1.7 + 400 / n**0.34 + 410 / tokens**0.28
    return {"size": f"{width}x{layers}", "d_model": width, "n_layers": layers, "tokens": tokens, "steps": 10,
            "parameters": n, "non_embedding": 12 * layers * width**2, "flops": 6.0 * n * tokens,
            "val_loss": loss, "run_dir": "nowhere"}


def _sweep(tmp_path, points: list[dict]) -> list:
    files = []
    for p in points:
        d = tmp_path / "points" / f"{p['size']}_{p['tokens']}"
        d.mkdir(parents=True)
        (d / "point.json").write_text(json.dumps(p))
        files.append(d / "point.json")
    return files


def _fit_only(tmp_path) -> int:
    return main(["sweep", "--preset", "stdlib-lm", "--fit-only", "--holdout", "", "--bootstrap", "0",
                 "--out", str(tmp_path)])


GRID = [(w, layers, d) for w, layers in ((32, 1), (64, 2), (96, 2)) for d in (1000, 4000)]


def test_well_formed_points_fit(tmp_path, capsys):
    _sweep(tmp_path, [_point(*g) for g in GRID])
    assert _fit_only(tmp_path) == 0
    out = capsys.readouterr().out
    assert "Kaplan      L(N) = (N_c / N)^alpha_N at D = 4,000" in out
    assert "Chinchilla fit skipped: 6 points" in out


@pytest.mark.parametrize("change, field", [
    (lambda p: p.update(val_loss="low"), "val_loss"),
    (lambda p: p.update(val_loss=float("nan")), "val_loss"),
    (lambda p: p.update(val_loss=float("inf")), "val_loss"),
    (lambda p: p.update(val_loss=-1.0), "val_loss"),
    (lambda p: p.update(tokens=1000.5), "tokens"),
    (lambda p: p.update(tokens=True), "tokens"),
    (lambda p: p.update(parameters=0), "parameters"),
    (lambda p: p.update(flops=None), "flops"),
    (lambda p: p.update(size=3), "size"),
    (lambda p: p.pop("non_embedding"), "missing non_embedding"),
    (lambda p: p.update(extra=1), "unknown field extra"),
], ids=["string-loss", "nan-loss", "inf-loss", "negative-loss", "float-tokens", "bool-tokens",
        "zero-parameters", "null-flops", "int-size", "missing-key", "unknown-key"])
def test_a_bad_field_is_one_line_naming_file_and_field(tmp_path, capsys, change, field):
    points = [_point(*g) for g in GRID]
    change(points[2])
    files = _sweep(tmp_path, points)
    assert _fit_only(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(files[2]) in err and field in err, err


@pytest.mark.parametrize("text, what", [
    ("{not json", "not readable as JSON"),
    ("[1, 2]", "a JSON list"),
    ("", "not readable as JSON"),
    (b"\xff\xfe{}", "not readable as JSON"),
])
def test_a_file_that_is_not_a_json_object_is_one_line(tmp_path, capsys, text, what):
    files = _sweep(tmp_path, [_point(*g) for g in GRID])
    if isinstance(text, bytes):
        files[1].write_bytes(text)
    else:
        files[1].write_text(text)
    assert _fit_only(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(files[1]) in err and what in err, err


def test_a_malformed_metrics_record_of_a_point_does_not_break_the_plot(tmp_path, capsys):
    points = [_point(*g) for g in GRID]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"split": "train", "step": 1}\n'
                                       '{"split": "train", "loss": "x", "step": 2}\n'
                                       '{"split": "train", "step": 3, "loss": 2.5}\n')
    points[0]["run_dir"] = str(run)
    _sweep(tmp_path, points)
    assert _fit_only(tmp_path) == 0
