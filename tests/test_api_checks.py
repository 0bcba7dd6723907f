"""The Python API checks its arguments: errors name the argument, nothing runs on bad input,
and the checks stay out of compiled graphs and decode loops."""

import warnings

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.generate import generate, greedy_decode
from blockformer.models import checks
from blockformer.tokenizers import CharTokenizer

V = 20


def model(arch="decoder", position="learned", **kw):
    cfg = TransformerConfig(arch=arch, vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8,
                            position=position, **kw)
    return build_model(cfg, seed=0).eval()


def call(m, tokens, **kw):
    return m(tokens, tokens, **kw) if m.cfg.arch == "encoder-decoder" else m(tokens, **kw)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder-decoder"])
@pytest.mark.parametrize("bad, error, message", [
    (torch.tensor([[1, 2, V]]), ValueError, f"id {V} is outside \\[0, {V}\\)"),
    (torch.tensor([[1, -1, 2]]), ValueError, "id -1 is outside"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "dtype torch.float32; expected integer token ids"),
    (torch.tensor([[True, False]]), TypeError, "dtype torch.bool"),
    (torch.tensor([1, 2, 3]), ValueError, r"shape \(3,\); expected \(batch, length\)"),
    ([[1, 2, 3]], TypeError, "a list; expected a torch.long tensor"),
    (torch.ones(1, 9, dtype=torch.long), ValueError, "length 9 exceeds max_seq_len=8"),
])
def test_bad_token_arguments_name_the_argument(arch, bad, error, message):
    with pytest.raises(error, match=message):
        call(model(arch), bad)


def test_positions_are_checked_and_masks_cannot_pass_as_positions():
    m = model("decoder", "learned")
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"positions: 8 is outside \[0, 8\)"):
        m(x, positions=torch.tensor([[6, 7, 8]]))
    with pytest.raises(ValueError, match="positions: -1 is outside"):
        m(x, positions=torch.tensor([[-1, 0, 1]]))
    with pytest.raises(TypeError, match="masks go in attention_mask="):
        m(x, positions=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError):  # masks and positions are keyword-only in every model
        model("decoder", "rope")(x, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError):
        model("encoder")(x, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError):
        model("encoder-decoder")(x, x, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask: shape \(1, 2\); expected \(1, 3\)"):
        m(x, attention_mask=torch.ones(1, 2, dtype=torch.bool))
    rope = model("decoder", "rope")  # no table: any length and position
    assert rope(torch.ones(1, 20, dtype=torch.long), positions=torch.arange(100, 120)[None]).shape == (1, 20, V)


def test_an_encoder_decoder_source_longer_than_the_table_is_a_value_error_not_an_index_error():
    m = model("encoder-decoder", "sinusoidal")
    with pytest.raises(ValueError, match="src: length 12 exceeds max_seq_len=8"):
        greedy_decode(m, [[3] * 12])
    with pytest.raises(ValueError, match="src: id 25 is outside"):
        greedy_decode(m, [[3, 25]])


def test_generate_refuses_prompts_with_unknown_ids_or_the_wrong_type():
    m = model("decoder", "rope")
    with pytest.raises(UsageError, match=f"prompts: id {V + 1} is outside"):
        generate(m, [[1, V + 1]], 3)
    with pytest.raises(UsageError, match="prompts: id -2 is outside"):
        generate(m, torch.tensor([[1, -2]]), 3)
    with pytest.raises(UsageError, match="prompts: dtype torch.float32"):
        generate(m, torch.tensor([[1.0, 2.0]]), 3)
    with pytest.raises(UsageError, match=r"prompts\[0\]: 'abc'; expected a list of token ids"):
        generate(m, ["abc"], 3)
    with pytest.raises(UsageError, match=r"prompts\[0\]: expected integer token ids"):
        generate(m, [[1.5, 2]], 3)


def test_checks_run_once_per_generate_call_not_per_step(monkeypatch):
    m = model("decoder", "rope")
    calls = []
    original = checks.torch.aminmax

    def counting(t, *a, **k):
        calls.append(t.shape)
        return original(t, *a, **k)

    monkeypatch.setattr(checks.torch, "aminmax", counting)
    generate(m, [[1, 2, 3]], 12, temperature=0)
    generate(m, [[1, 2, 3]], 12, temperature=0, use_cache=False)
    # one check per call (of the prompts' real tokens), none per step of the 12
    assert calls == [torch.Size([3]), torch.Size([3])]
    m(torch.tensor([[1, 2]]))
    assert calls[-1] == torch.Size([1, 2])


def test_translate_warns_when_it_cuts_sources():
    from blockformer.cli.translate import translate_texts

    tok = CharTokenizer("abcdefghij")
    m = build_model(TransformerConfig(arch="encoder-decoder", vocab_size=tok.vocab_size, d_model=16, n_layers=1,
                                      n_heads=2, d_ff=32, max_seq_len=8, position="learned"), seed=0).eval()
    with pytest.warns(UserWarning, match=r"1 of 2 sources are longer .* \(7 tokens \+ eos, max_seq_len=8\)"):
        out = translate_texts(m, tok, ["abc", "abcdefghij"], beam_size=1, max_len_b=4)
    assert len(out) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        translate_texts(m, tok, ["abc"], beam_size=1, max_len_b=4)  # nothing cut: no warning


def test_checks_do_not_break_a_fullgraph_compile():
    m = model("decoder", "learned")
    x = torch.tensor([[1, 2, 3, 4]])
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), m(x))
