"""The Python API checks its arguments: errors name the argument, nothing runs on bad input,
and the checks stay out of compiled graphs and decode loops."""

import warnings

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.generate import generate, greedy_decode
from blockformer.models import checks
from blockformer.tokenizers import ByteTokenizer, CharTokenizer, load_tokenizer, train_tokenizer

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
    calls.clear()
    s2s = model("encoder-decoder", "rope")
    for use_cache in (True, False):  # the source once, no target step
        greedy_decode(s2s, [[4, 5, 6]], max_len=6, eos_id=V + 1, use_cache=use_cache)
        beam_search(s2s, [[4, 5, 6]], beam_size=2, max_len=6, use_cache=use_cache)
    assert calls == [torch.Size([1, 3])] * 4


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
    # the targets= checks too: metadata in the graph, the id range only outside it
    torch.testing.assert_close(compiled(x, targets=x, label_smoothing=0.1), m(x, targets=x, label_smoothing=0.1))


# ---------------------------------------------------------------------- the fuzz table
# Each public function with each bad input an outside fuzz campaign tried (issue 21):
# the exception is a TypeError (wrong type) or a ValueError (wrong value; UsageError is
# one), raised before any work, and its message starts with the argument's name.

from blockformer import count_parameters, flops_per_token, from_hf, memory_estimate, to_hf  # noqa: E402
from blockformer.generate import (  # noqa: E402
    Sampling, TextStream, beam_search, choose, length_penalty, pack_linears, positions_from_mask, prepare_for_decoding,
    process_logits, quantize, sample, speculative_generate, top_k_filter, top_p_filter, translate,
)
from blockformer.run_config import RunConfig  # noqa: E402

DEC = model("decoder", "rope")
ENC = model("encoder", "rope")
S2S = model("encoder-decoder", "rope")
X = torch.tensor([[4, 5, 6, 7]])
LOGITS = torch.randn(2, V)


def cfg(**kw):
    return TransformerConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=32, **kw)


BAD_CALLS = {
    # build_model: the config and the seed
    "build_model cfg=dict": (lambda: build_model({"arch": "decoder"}), TypeError, "cfg: a dict; expected a TransformerConfig"),
    "build_model cfg=RunConfig": (lambda: build_model(RunConfig()), TypeError, r"cfg: a RunConfig; .*run.model"),
    "build_model cfg=None": (lambda: build_model(None), TypeError, "cfg: None; expected a TransformerConfig"),
    "build_model seed=1.5": (lambda: build_model(cfg(), seed=1.5), TypeError, "seed: 1.5; expected an integer"),
    "build_model seed='0'": (lambda: build_model(cfg(), seed="0"), TypeError, "seed: '0'; expected an integer"),
    "build_model seed=-1": (lambda: build_model(cfg(), seed=-1), ValueError, r"seed: -1; expected an integer in \[0"),
    # targets= and label_smoothing= of every forward
    "decoder targets float": (lambda: DEC(X, targets=X.float()), TypeError, "targets: dtype torch.float32"),
    "decoder targets shape": (lambda: DEC(X, targets=X[:, :3]), ValueError, r"targets: shape \(1, 3\); expected \(1, 4\)"),
    "decoder targets id V": (lambda: DEC(X, targets=X + V), ValueError, f"targets: id {V + 7} is outside"),
    "decoder targets id -1": (lambda: DEC(X, targets=X - 8), ValueError, "targets: id -4 is outside"),
    "decoder targets list": (lambda: DEC(X, targets=[[1, 2, 3, 4]]), TypeError, "targets: a list"),
    "decoder label_smoothing nan": (lambda: DEC(X, targets=X, label_smoothing=float("nan")), ValueError,
                                    r"label_smoothing: nan; expected a float in \[0, 1\)"),
    "decoder label_smoothing 1": (lambda: DEC(X, targets=X, label_smoothing=1.0), ValueError, "label_smoothing: 1.0"),
    "decoder label_smoothing -0.1": (lambda: DEC(X, targets=X, label_smoothing=-0.1), ValueError, "label_smoothing: -0.1"),
    "decoder label_smoothing str": (lambda: DEC(X, targets=X, label_smoothing="0.1"), TypeError, "label_smoothing: '0.1'"),
    "encoder targets shape": (lambda: ENC(X, targets=X[:, :2]), ValueError, r"targets: shape \(1, 2\)"),
    "encoder targets id V": (lambda: ENC(X, targets=X * 0 + V), ValueError, f"targets: id {V} is outside"),
    "encoder label_smoothing nan": (lambda: ENC(X, targets=X, label_smoothing=float("nan")), ValueError, "label_smoothing: nan"),
    # the encoder-decoder's two inputs and its memory
    "s2s batch mismatch": (lambda: S2S(X.expand(2, 4), X.expand(3, 4)), ValueError, "tgt: batch of 3; expected 2 like src"),
    "s2s targets shape": (lambda: S2S(X, X, targets=X[:, :2]), ValueError, r"targets: shape \(1, 2\); expected \(1, 4\)"),
    "s2s targets id -1": (lambda: S2S(X, X, targets=X * 0 - 1), ValueError, "targets: id -1 is outside"),
    "s2s label_smoothing nan": (lambda: S2S(X, X, targets=X, label_smoothing=float("nan")), ValueError, "label_smoothing: nan"),
    "decode memory width": (lambda: S2S.decode(X, torch.zeros(1, 4, 8)), ValueError,
                            r"memory: shape \(1, 4, 8\); expected \(batch, length, d_model=16\)"),
    "decode memory batch": (lambda: S2S.decode(X, torch.zeros(2, 4, 16)), ValueError, "memory: batch of 2; expected 1 like tgt"),
    "decode memory 2-d": (lambda: S2S.decode(X, torch.zeros(4, 16)), ValueError, r"memory: shape \(4, 16\)"),
    "decode memory list": (lambda: S2S.decode(X, [[0.0] * 16]), TypeError, "memory: a list; expected a float tensor"),
    "decode memory long": (lambda: S2S.decode(X, torch.zeros(1, 4, 16, dtype=torch.long)), TypeError,
                           "memory: dtype torch.int64"),
    "decode src_mask shape": (lambda: S2S.decode(X, torch.zeros(1, 4, 16), torch.ones(1, 3, dtype=torch.bool)), ValueError,
                              r"src_mask: shape \(1, 3\); expected \(1, 4\)"),
    # the KV cache
    "new_cache batch -1": (lambda: DEC.new_cache(-1, 8), ValueError, "batch_size: -1; expected an integer >= 1"),
    "new_cache max_len 5.5": (lambda: DEC.new_cache(1, 5.5), TypeError, "max_len: 5.5; expected an integer"),
    "decoder cache str": (lambda: DEC(X, cache="c", cache_pos=torch.arange(4)), TypeError, "cache: a str; expected a KVCache"),
    "decoder cache_pos float": (lambda: DEC(X, cache=DEC.new_cache(1, 8), cache_pos=torch.arange(4.0)), TypeError,
                                "cache_pos: dtype torch.float32"),
    "decoder cache_pos shape": (lambda: DEC(X, cache=DEC.new_cache(1, 8), cache_pos=torch.arange(3)), ValueError,
                                r"cache_pos: shape \(3,\); expected \(4,\)"),
    "decoder cache batch": (lambda: DEC(X, cache=DEC.new_cache(2, 8), cache_pos=torch.arange(4)), ValueError,
                            "tokens: batch of 1; expected 2 like the cache"),
    "decode cache batch": (lambda: S2S.decode(X, torch.zeros(1, 4, 16), cache=S2S.new_cache(3, 8), cache_pos=torch.arange(4)),
                           ValueError, "tgt: batch of 1; expected 3 like the cache"),
    # generate: the model, the sampling parameters, the limits, the special ids, the stops
    "generate model=str": (lambda: generate("gpt2", [[1]], 3), TypeError, "model: a str; expected a blockformer model"),
    "generate encoder-decoder": (lambda: generate(S2S, [[1]], 3), TypeError,
                                 "model: an encoder-decoder model; expected a decoder"),
    "generate encoder": (lambda: generate(ENC, [[1]], 3), TypeError, "model: an encoder model; expected a decoder"),
    "generate temperature str": (lambda: generate(DEC, [[1]], 3, temperature="1"), TypeError, "temperature: '1'"),
    "generate temperature -1": (lambda: generate(DEC, [[1]], 3, temperature=-1.0), ValueError, "temperature: -1.0"),
    "generate top_k 2.5": (lambda: generate(DEC, [[1]], 3, top_k=2.5), TypeError, "top_k: 2.5; expected an integer"),
    "generate top_k True": (lambda: generate(DEC, [[1]], 3, top_k=True), TypeError, "top_k: True"),
    "generate top_k 0": (lambda: generate(DEC, [[1]], 3, top_k=0), ValueError, "top_k: 0"),
    "generate top_p str": (lambda: generate(DEC, [[1]], 3, top_p="0.9"), TypeError, "top_p: '0.9'"),
    "generate top_p nan": (lambda: generate(DEC, [[1]], 3, top_p=float("nan")), ValueError, "top_p: nan"),
    "generate top_p 0": (lambda: generate(DEC, [[1]], 3, top_p=0.0), ValueError, "top_p: 0.0"),
    "generate min_p": (lambda: generate(DEC, [[1]], 3, min_p=0.1), TypeError, "min_p"),
    "generate max_new_tokens -1": (lambda: generate(DEC, [[1]], -1), ValueError, "max_new_tokens: -1"),
    "generate max_new_tokens 2.0": (lambda: generate(DEC, [[1]], 2.0), ValueError, "max_new_tokens: 2.0"),
    "generate min > max": (lambda: generate(DEC, [[1]], 3, min_new_tokens=5, eos_id=2), ValueError,
                           "min_new_tokens: 5 exceeds max_new_tokens=3"),
    "generate seed -1": (lambda: generate(DEC, [[1]], 3, seed=-1), ValueError, r"seed: -1; expected an integer in \[0"),
    "generate seed 1.5": (lambda: generate(DEC, [[1]], 3, seed=1.5), TypeError, "seed: 1.5"),
    "generate generator": (lambda: generate(DEC, [[1]], 3, generator=0), TypeError, "generator: an int; expected a torch.Generator"),
    "generate eos_id V": (lambda: generate(DEC, [[1]], 3, eos_id=V), ValueError, f"eos_id: {V} is outside \\[0, {V}\\)"),
    "generate eos_id -1": (lambda: generate(DEC, [[1]], 3, eos_id=-1), ValueError, "eos_id: -1 is outside"),
    "generate eos_id 2.0": (lambda: generate(DEC, [[1]], 3, eos_id=2.0), TypeError, "eos_id: 2.0; expected an integer"),
    "generate pad_id V": (lambda: generate(DEC, [[1], [1, 2]], 3, pad_id=V + 5), ValueError, f"pad_id: {V + 5} is outside"),
    "generate pad_id -1": (lambda: generate(DEC, [[1], [1, 2]], 3, pad_id=-1), ValueError, "pad_id: -1 is outside"),
    "generate stop_sequences str": (lambda: generate(DEC, [[1]], 3, stop_sequences="ab"), TypeError,
                                    "stop_sequences: a str; expected a list of token-id lists"),
    "generate stop_sequences [str]": (lambda: generate(DEC, [[1]], 3, stop_sequences=["ab"]), TypeError,
                                      r"stop_sequences\[0\]: 'ab'; expected a list of token ids"),
    "generate stop_sequences float": (lambda: generate(DEC, [[1]], 3, stop_sequences=[[1.5]]), TypeError,
                                      r"stop_sequences\[0\]: expected integer token ids"),
    "generate stop not callable": (lambda: generate(DEC, [[1]], 3, stop="END"), TypeError, "stop: a str; expected a function"),
    "generate on_token": (lambda: generate(DEC, [[1]], 3, on_token=3), TypeError, "on_token: an int; expected a function"),
    "generate check_every 0": (lambda: generate(DEC, [[1]], 3, check_every=0), ValueError, "check_every: 0"),
    "generate check_every 1.5": (lambda: generate(DEC, [[1]], 3, check_every=1.5), TypeError, "check_every: 1.5"),
    "generate mask list": (lambda: generate(DEC, X, 3, attention_mask=[[True] * 4]), TypeError,
                           "attention_mask: a list; expected a bool tensor"),
    "speculative draft=str": (lambda: speculative_generate(DEC, "small", [[1]], 3), TypeError, "draft: a str"),
    "speculative seed -1": (lambda: speculative_generate(DEC, DEC, [[1]], 3, seed=-1), ValueError, "seed: -1"),
    "speculative eos_id V": (lambda: speculative_generate(DEC, DEC, [[1]], 3, eos_id=V), ValueError, f"eos_id: {V}"),
    # encoder-decoder decoding
    "greedy_decode decoder": (lambda: greedy_decode(DEC, [[4, 5]]), TypeError,
                              "model: a decoder model; expected an encoder-decoder"),
    "beam_search decoder": (lambda: beam_search(DEC, [[4, 5]]), TypeError, "model: a decoder model; expected an encoder-decoder"),
    "beam_search str": (lambda: beam_search(None, [[4, 5]]), TypeError, "model: None; expected a blockformer model"),
    "greedy_decode check_every 0": (lambda: greedy_decode(S2S, [[4, 5]], check_every=0), ValueError, "check_every: 0"),
    "greedy_decode bos_id V": (lambda: greedy_decode(S2S, [[4, 5]], bos_id=V), ValueError, f"bos_id: {V} is outside"),
    "greedy_decode eos_id -1": (lambda: greedy_decode(S2S, [[4, 5]], eos_id=-1), ValueError, "eos_id: -1 is outside"),
    "beam_search beam > vocab": (lambda: beam_search(S2S, [[4, 5]], beam_size=V + 1, n_best=1), ValueError,
                                 f"beam_size: {V + 1} exceeds the model's vocab_size={V}"),
    "beam_search alpha str": (lambda: beam_search(S2S, [[4, 5]], alpha="0.6"), TypeError, "alpha: '0.6'"),
    "beam_search bos_id -1": (lambda: beam_search(S2S, [[4, 5]], bos_id=-1), ValueError, "bos_id: -1 is outside"),
    "beam_search src_mask list": (lambda: beam_search(S2S, X, [[True] * 4]), TypeError, "src_mask: a list"),
    "translate beam 0": (lambda: translate(S2S, [[4, 5]], beam_size=0), ValueError, "beam_size: 0"),
    "translate decoder": (lambda: translate(DEC, [[4, 5]], beam_size=1), TypeError, "model: a decoder model"),
    # sampling pieces
    "Sampling temperature str": (lambda: Sampling(temperature="0.8"), TypeError, "temperature: '0.8'"),
    "top_k_filter k=0": (lambda: top_k_filter(LOGITS, 0), ValueError, "k: 0; expected an integer >= 1"),
    "top_k_filter k=1.5": (lambda: top_k_filter(LOGITS, 1.5), TypeError, "k: 1.5"),
    "top_p_filter p=0": (lambda: top_p_filter(LOGITS, 0.0), ValueError, r"p: 0.0; expected a float in \(0, 1\]"),
    "top_p_filter p=nan": (lambda: top_p_filter(LOGITS, float("nan")), ValueError, "p: nan"),
    "process_logits sampling": (lambda: process_logits(LOGITS, "greedy"), TypeError, "sampling: a str; expected a Sampling"),
    "choose sampling None": (lambda: choose(LOGITS, None), TypeError, "sampling: None; expected a Sampling"),
    "choose logits list": (lambda: choose([[0.0, 1.0]], Sampling()), TypeError, "logits: a list"),
    "sample list": (lambda: sample([[0.5, 0.5]]), TypeError, "probs: a list; expected a float tensor"),
    "length_penalty str": (lambda: length_penalty("5", 0.6), TypeError, "length: '5'; expected an integer"),
    "positions_from_mask list": (lambda: positions_from_mask([[True]]), TypeError, "mask: a list; expected a bool tensor"),
    "quantize str": (lambda: quantize("model", "int8"), TypeError, "model: a str; expected a blockformer model"),
    "prepare_for_decoding None": (lambda: prepare_for_decoding(None), TypeError, "model: None; expected a blockformer model"),
    "pack_linears None": (lambda: pack_linears(None), TypeError, "model: None"),
    "pack_linears rows str": (lambda: pack_linears(model(), rows="1"), TypeError, "rows: '1'; expected an integer"),
    "pack_linears rows 0": (lambda: pack_linears(model(), rows=0), ValueError, "rows: 0; expected an integer >= 1"),
    # streaming text
    "TextStream stop_strings str": (lambda: TextStream(str, None, "END"), TypeError, "stop_strings: a str; expected a list"),
    "TextStream stop_strings int": (lambda: TextStream(str, None, [3]), TypeError, r"stop_strings\[0\]: 3"),
    "TextStream decode": (lambda: TextStream("utf-8"), TypeError, "decode: a str; expected a function"),
    "TextStream write": (lambda: TextStream(str, "stdout"), TypeError, "write: a str; expected a function"),
    # tokenizers: text in, ids out
    "encode None": (lambda: CharTokenizer("abc").encode(None), TypeError, "text: None; expected a str"),
    "encode bytes": (lambda: ByteTokenizer().encode(b"ab"), TypeError, r"text: a bytes; expected a str \(bytes: "),
    "encode list": (lambda: ByteTokenizer().encode(["ab"]), TypeError, r"text: a list; expected a str \(many texts"),
    "bpe encode int": (lambda: train_tokenizer("bpe", ["ab ab"] * 5, 300).encode(7), TypeError, "text: an int"),
    "bpe encode_batch str": (lambda: train_tokenizer("bpe", ["ab ab"] * 5, 300).encode_batch("ab"), TypeError, "texts: a str"),
    "encode_batch str": (lambda: CharTokenizer("abc").encode_batch("ab"), TypeError, "texts: a str; expected a list"),
    "decode str": (lambda: ByteTokenizer().decode("abc"), TypeError, "ids: a str; expected a list of token ids"),
    "decode None": (lambda: CharTokenizer("abc").decode(None), TypeError, "ids: None"),
    "train_tokenizer None": (lambda: train_tokenizer("char", None), TypeError, "texts: None; expected an iterable"),
    "load_tokenizer None": (lambda: load_tokenizer(None), TypeError, "path: None; expected a path"),
    # other formats and sizes
    "memory_estimate dict": (lambda: memory_estimate({"d_model": 16}, 1, 8), TypeError, "cfg: a dict; expected a TransformerConfig"),
    "from_hf None": (lambda: from_hf(None), TypeError, "source: None; expected a Hugging Face model directory"),
    "from_hf Linear": (lambda: from_hf(torch.nn.Linear(2, 2)), TypeError, "source: a Linear; expected a Hugging Face"),
    "from_hf our model": (lambda: from_hf(DEC), TypeError, "source: a DecoderModel; expected a Hugging Face"),
    "to_hf None": (lambda: to_hf(None, "out"), TypeError, "source: None; expected a blockformer checkpoint"),
    "to_hf Linear": (lambda: to_hf(torch.nn.Linear(2, 2), "out"), TypeError, "source: a Linear; expected a blockformer"),
    "to_hf out None": (lambda: to_hf(DEC, None), TypeError, "out: None; expected a directory path"),
    "to_hf tokenizer str": (lambda: to_hf(DEC, "out", tokenizer="char"), TypeError, "tokenizer: a str; expected a Tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_public_functions_refuse_bad_arguments_naming_them(case):
    thunk, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message) as caught:
        thunk()
    if error is TypeError:  # a wrong type is not also a wrong value
        assert not isinstance(caught.value, ValueError), caught.value


def test_the_checks_let_good_arguments_through():
    """Every argument the table refuses has a neighbour that works."""
    assert DEC(X, targets=X, label_smoothing=0.1).ndim == 0
    assert S2S(X.expand(2, 4), X.expand(2, 4), targets=X.expand(2, 4)).ndim == 0
    assert S2S.decode(X, torch.zeros(1, 4, 16), torch.ones(1, 4, dtype=torch.bool)).shape == (1, 4, V)
    assert len(generate(DEC, [[1], [1, 2]], 3, min_new_tokens=3, eos_id=2, seed=0, pad_id=0, stop_sequences=[[5]],
                        stop=lambda r, ids: False, on_token=lambda r, t: None, top_k=3, top_p=0.9)) == 2
    assert len(beam_search(S2S, [[4, 5]], beam_size=V, max_len=3)) == 1
    assert greedy_decode(S2S, [[4, 5]], max_len=3, check_every=1) is not None
    assert len(build_model(cfg(), seed=2**63).state_dict()) > 0


@pytest.mark.parametrize("thunk, message", [
    (lambda: count_parameters("gpt2"), "model: a str; expected a blockformer model"),
    (lambda: flops_per_token({"d_model": 16}), "cfg: a dict; expected a TransformerConfig"),
    (lambda: count_parameters(None), "model: None; expected a blockformer model"),
    (lambda: memory_estimate(TransformerConfig(), "8", 16), "batch_size: '8'; expected an integer"),
])
def test_size_functions_refuse_what_is_not_a_model_or_config(thunk, message):
    with pytest.raises(TypeError, match=message):
        thunk()
