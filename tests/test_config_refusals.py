"""Run-config values that used to pass silently (or fail deep inside torch) are refused
when the config is built, naming the key; a TOML file with a byte-order mark is read; a
Ctrl-C while the command line loads torch ends in one line and exit 130 (issue 21)."""

import pytest

from blockformer import TransformerConfig
from blockformer.cli import main
from blockformer.run_config import load_run_config, read_toml

REFUSED = [
    ("train.seed=-1", "train.seed=-1: expected an integer >= 0"),
    ("train.weight_decay=-0.1", r"train.weight_decay=-0.1: expected a float >= 0"),
    ("train.grad_clip=-1", r"train.grad_clip=-1.0: expected a float >= 0"),
    ("train.samples=-1", "train.samples=-1: expected an integer >= 0"),
    ("train.sample_tokens=-5", "train.sample_tokens=-5: expected an integer >= 0"),
    ("train.beta1=1.5", r"train.beta1=1.5: expected a float in \[0, 1\)"),
    ("train.beta1=-0.1", r"train.beta1=-0.1: expected a float in \[0, 1\)"),
    ("train.beta2=1.0", r"train.beta2=1.0: expected a float in \[0, 1\)"),
    ("train.label_smoothing=nan", "label_smoothing=nan: expected a finite number"),
    ("train.label_smoothing=1.0", r"train.label_smoothing=1.0: expected a float in \[0, 1\)"),
    ("train.label_smoothing=-0.1", r"train.label_smoothing=-0.1: expected a float in \[0, 1\)"),
]


@pytest.mark.parametrize("override, message", REFUSED)
def test_bad_training_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(overrides=[override])


@pytest.mark.parametrize("override", ["train.seed=0", "train.weight_decay=0", "train.grad_clip=0", "train.samples=0",
                                      "train.sample_tokens=0", "train.beta1=0.0", "train.beta2=0.999",
                                      "train.label_smoothing=0.1"])
def test_the_edges_of_those_ranges_are_accepted(override):
    section, rest = override.split(".", 1)
    key, value = rest.split("=")
    assert getattr(load_run_config(overrides=[override]).train, key) == float(value)


def test_the_command_line_refuses_a_bad_beta_in_one_line(capsys):
    assert main(["train", "--set", "train.beta1=1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.beta1=1.5" in err and "Invalid beta" not in err


def test_the_command_line_refuses_a_negative_seed(capsys, tmp_path):
    assert main(["train", "--set", "train.seed=-3"]) == 2
    assert "train.seed=-3: expected an integer >= 0" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path), "--seed", "-1"]) == 2  # refused before any loading
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed -1: expected an integer in [0, 2**63)" in err


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 7\n")
    assert read_toml(path) == {"train": {"steps": 7}}
    assert load_run_config(config=path).train.steps == 7
    model = tmp_path / "model.toml"
    model.write_bytes("\ufeff".encode() + TransformerConfig(d_model=32, n_heads=2).to_toml().encode())
    assert TransformerConfig.from_toml(model).d_model == 32


def test_ctrl_c_while_the_command_loads_is_one_line_and_exit_130(monkeypatch, capsys):
    import blockformer.cli as cli

    def interrupted(name, package=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    try:
        code = main(["train", "--preset", "char-lm-tiny"])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped main(): a traceback")
    assert code == 130
    err = capsys.readouterr().err
    assert err == "blockformer train: interrupted\n"


@pytest.mark.slow
# Both entries: a SIGINT raised inside torch's C++ import could abort the process or be lost
# (the run carried on), about 1 start in 10 on either; the command line now holds it until
# the import ends.
@pytest.mark.parametrize("entry", ["module", "script"])
def test_a_real_ctrl_c_while_torch_imports_is_one_line_and_exit_130(tmp_path, entry):
    """A SIGINT at several moments of start-up (the package, torch, the subcommand loading):
    never a traceback. ``import blockformer`` loads nothing heavy, so torch loads inside the
    command line's handling."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    exe = [sys.executable, "-m", "blockformer"] if entry == "module" else [str(Path(sys.executable).with_name("blockformer"))]
    if entry == "script" and not Path(exe[0]).exists():
        pytest.skip("the blockformer console script is not installed beside this python")
    # PYTHONFAULTHANDLER: a run still going at the timeout is sent SIGABRT, and faulthandler writes
    # where each of its threads was into the failure message (a lost SIGINT was seen once, on a
    # machine loaded twice over, and not since in 150 tries under load; this says where, next time)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    for delay in (0.1, 0.4):  # inside the imports (torch alone takes over a second)
        p = subprocess.Popen([*exe, "train", "--preset", "copy", "--out", str(tmp_path / "run")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            time.sleep(delay)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)
            _, err = p.communicate(timeout=30)
            pytest.fail(f"SIGINT after {delay} s: still running 60 s later; its threads then:\n{err[-4000:]}")
        finally:  # a run that carried on must not outlive the test: it would slow every test after it
            p.kill()
            p.wait()
        assert "Traceback" not in err and len(err.splitlines()) <= 1, (delay, err)
        # 130, or death by SIGINT itself, which a shell reports as 130 too (a signal that lands
        # before Python sets its handler, or while the interpreter is already shutting down)
        assert p.returncode in (130, -signal.SIGINT), (delay, p.returncode, err)
        assert p.returncode == -signal.SIGINT or err.strip().endswith("interrupted"), (delay, err)
