"""Decoder-only generation: the cache changes nothing, padding changes nothing, and each
sampling control does exactly what it says."""


import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.generate import (
    TextStream,
    generate,
    positions_from_mask,
    process_logits,
    sample,
    Sampling,
    top_k_filter,
    top_p_filter,
)

from fixed_logits import Bigram

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "relative"]
V = 50
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]


def make(position="rope", **kw):
    # A large init and untied head keep greedy outputs varied (not one repeated token).
    base = dict(arch="decoder", vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                position=position, tie_embeddings=False, init_std=0.5)
    base.update(kw)
    return build_model(TransformerConfig(**base), seed=0)


# ------------------------------------------------------------------ the cache and padding
@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("position", POSITIONS)
def test_cached_and_uncached_greedy_give_the_same_tokens(position, n_kv_heads):
    model = make(position, n_kv_heads=n_kv_heads)
    cached = generate(model, PROMPTS, 12, temperature=0)
    uncached = generate(model, PROMPTS, 12, temperature=0, use_cache=False)
    assert cached == uncached
    assert all(len(row) == 12 for row in cached)
    assert len({t for row in cached for t in row}) > 3  # not one repeated token


def test_one_new_token_that_sees_every_cached_slot_attends_without_a_mask():
    """Eager decoding at the end of an unpadded cache skips the all-True mask; a padded row,
    a prompt of several tokens, or a token rewritten behind the end keeps it."""
    model = make("rope").eval()
    cache = model.new_cache(2, 16)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7]] * 2), cache=cache, cache_pos=torch.arange(3))
        assert not cache.sees_every_slot(torch.arange(3))  # the prompt's tokens see only their past
        assert cache.sees_every_slot(torch.tensor([2]))
        model(torch.tensor([[8], [8]]), positions=torch.tensor([[3], [3]]), cache=cache, cache_pos=torch.tensor([3]))
        assert cache.sees_every_slot(torch.tensor([3]))
        assert not cache.sees_every_slot(torch.tensor([1]))  # slots 2 and 3 lie after it

        # A token rewritten at slot 1 (as after a rejected draft) must not see slots 2 and 3:
        # its logits equal those of the same 2 tokens decoded from a fresh cache.
        fresh = model.new_cache(2, 16)
        model(torch.tensor([[5, 6]] * 2), cache=fresh, cache_pos=torch.arange(2))
        step = torch.tensor([[9], [9]]), torch.tensor([[2], [2]])
        want = model(step[0], positions=step[1], cache=fresh, cache_pos=torch.tensor([2]))
        model(torch.tensor([[5, 6]] * 2), cache=cache, cache_pos=torch.arange(2))
        got = model(step[0], positions=step[1], cache=cache, cache_pos=torch.tensor([2]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

        padded = model.new_cache(2, 16)
        model(torch.tensor([[0, 6, 7], [5, 6, 7]]), attention_mask=torch.tensor([[False, True, True], [True] * 3]),
              positions=torch.tensor([[0, 0, 1], [0, 1, 2]]), cache=padded, cache_pos=torch.arange(3))
        assert not padded.sees_every_slot(torch.tensor([2]))


@pytest.mark.parametrize("use_cache", [True, False])
def test_only_each_rows_last_position_reaches_the_lm_head(use_cache):
    """The prompt's other positions need no logits: the head multiplies B rows a step, and the
    tokens are those of the full forward's last position, greedy by hand."""
    model = make()
    seen = []
    hook = model.head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        tokens = generate(model, PROMPTS, 6, temperature=0, use_cache=use_cache)
    finally:
        hook.remove()
    assert [s[:-1].numel() for s in seen] == [3] * 6  # the prefill's and 5 steps': B rows each
    for prompt, row in zip(PROMPTS, tokens):
        seq = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert row == seq[len(prompt):]


@pytest.mark.parametrize("position", POSITIONS)
def test_left_padded_batch_gives_each_prompt_its_own_tokens(position):
    model = make(position, n_kv_heads=2)
    batch = generate(model, PROMPTS, 10, temperature=0)
    alone = [generate(model, [p], 10, temperature=0)[0] for p in PROMPTS]
    assert batch == alone
    assert batch[0] != batch[1]


def test_tensor_prompts_with_a_left_padding_mask_match_lists():
    model = make("learned")
    tokens = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = tokens != 0
    assert generate(model, tokens, 6, temperature=0, attention_mask=mask) == generate(
        model, [[5, 6, 7], [8, 9, 10, 11, 12]], 6, temperature=0
    )


def test_positions_count_from_each_rows_first_real_token():
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]


def test_generation_restores_training_mode():
    model = make().train()
    generate(model, PROMPTS, 2, temperature=0)
    assert model.training


# ------------------------------------------------------------------ logit filters
def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, 2.0, 2.0, 1.0]])
    out = top_k_filter(logits, 2)
    inf = float("-inf")
    assert out.tolist() == [[inf, 5.0, inf, 4.0, inf], [inf, inf, 2.0, 2.0, inf]]
    assert top_k_filter(logits, 1)[1].tolist() == [inf, inf, 2.0, 2.0, inf]  # ties are kept


@pytest.mark.parametrize("p, kept", [(0.5, {3}), (0.75, {3, 0}), (0.8, {3, 0, 1}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    probs = torch.tensor([[0.25, 0.125, 0.125, 0.5]])  # exact in binary: no rounding at the edges
    out = top_p_filter(probs.log(), p)
    assert {i for i in range(4) if out[0, i] > float("-inf")} == kept
    assert torch.equal(out[0, list(kept)], probs.log()[0, list(kept)])  # kept logits unchanged


def test_temperature_divides_the_logits_before_the_filters():
    logits = torch.tensor([[2.0, 4.0, 1.0]])
    out = process_logits(logits, Sampling(temperature=0.5, top_k=2))
    assert out.tolist() == [[4.0, 8.0, float("-inf")]]
    assert process_logits(logits, Sampling(temperature=0.0)).tolist() == logits.tolist()  # greedy: untouched


def test_exponential_race_samples_with_the_given_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7]).expand(40000, 4)
    draws = sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / 40000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.0, 0.7]), atol=0.01, rtol=0)
    assert freq[2] == 0  # a filtered token is never drawn


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_settings_are_usage_errors(bad):
    with pytest.raises(UsageError):
        generate(make(), PROMPTS, 2, **bad)


# ------------------------------------------------------------------ sampling through generate
def test_same_seed_same_samples_and_another_seed_differs():
    model = make("rope")
    a = generate(model, PROMPTS, 20, temperature=1.0, seed=123)
    b = generate(model, PROMPTS, 20, temperature=1.0, seed=123)
    c = generate(model, PROMPTS, 20, temperature=1.0, seed=124)
    assert a == b
    assert a != c


def test_top_k_one_and_do_sample_false_are_greedy():
    model = make("alibi")
    greedy = generate(model, PROMPTS, 10, temperature=0)
    assert generate(model, PROMPTS, 10, top_k=1, seed=0) == greedy
    assert generate(model, PROMPTS, 10, do_sample=False) == greedy


# ------------------------------------------------------------------ stopping
CHAIN = Bigram({2: {2: 1.0}, 3: {4: 1.0}, 4: {5: 1.0}, 5: {2: 1.0}, 6: {7: 1.0}, 7: {6: 1.0}, 9: {2: 0.6, 9: 0.4}})


def test_eos_ends_its_row_and_the_others_go_on():
    out = generate(CHAIN, [[3], [6]], 6, temperature=0, eos_id=2)
    assert out == [[4, 5], [7, 6, 7, 6, 7, 6]]
    assert generate(CHAIN, [[3], [6]], 6, temperature=0) == [[4, 5, 2, 2, 2, 2], [7, 6, 7, 6, 7, 6]]


def test_min_new_tokens_blocks_eos():
    assert generate(CHAIN, [[9]], 8, temperature=0, eos_id=2) == [[]]
    assert generate(CHAIN, [[9]], 8, temperature=0, eos_id=2, min_new_tokens=3) == [[9, 9, 9]]


def test_stop_sequences_end_a_row_and_are_returned():
    out = generate(CHAIN, [[6], [3]], 8, temperature=0, eos_id=2, stop_sequences=[[6, 7, 6]])
    assert out == [[7, 6, 7, 6], [4, 5]]


def test_streamed_tokens_are_the_returned_tokens_whatever_stopped_the_row():
    seen = {0: [], 1: [], 2: []}
    out = generate(CHAIN, [[6], [3], [9]], 8, temperature=0, eos_id=2, min_new_tokens=2,
                   stop_sequences=[[7, 6, 7]], on_token=lambda r, t: seen[r].append(t))
    assert out == [[7, 6, 7], [4, 5], [9, 9]]
    assert [seen[r] for r in range(3)] == out


def test_on_token_streams_the_kept_tokens_in_order():
    seen = []
    out = generate(CHAIN, [[3], [6]], 4, temperature=0, eos_id=2, on_token=lambda r, t: seen.append((r, t)))
    assert out == [[4, 5], [7, 6, 7, 6]]
    assert [t for r, t in seen if r == 0] == [4, 5] and [t for r, t in seen if r == 1] == [7, 6, 7, 6]


def test_text_stream_holds_back_a_possible_stop_string_and_stops_at_it():
    letters = {4: "ab", 5: "c", 6: "d", 7: "e"}
    chain = Bigram({3: {4: 1.0}, 4: {5: 1.0}, 5: {6: 1.0}, 6: {7: 1.0}, 7: {4: 1.0}})
    written = []
    stream = TextStream(lambda ids: "".join(letters[i] for i in ids), lambda r, s: written.append(s), ["cd"])
    out = generate(chain, [[3]], 8, temperature=0, on_token=stream.on_token, stop=stream.stop)
    assert out == [[4, 5, 6]]  # the token that completed the stop string is the last
    assert stream.text(0) == "ab"
    assert written == ["ab"]  # "c" was held back (it might start "cd"), then dropped


def test_text_stream_writes_everything_when_no_stop_string_appears():
    written = []
    stream = TextStream(lambda ids: "".join(chr(96 + i) for i in ids), lambda r, s: written.append(s), ["zz"])
    for t in [1, 26, 2]:
        stream.on_token(0, t)
    assert written == ["a", "zb"]  # "z" waited one token: it could have begun "zz"
    stream.finish()
    assert "".join(written) == stream.text(0) == "azb"


# ------------------------------------------------------------------ user errors
@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_fixed_position_tables_slide_a_window_past_max_seq_len(position):
    """Past a learned/sinusoidal table, each token is predicted from the last max_seq_len
    tokens re-encoded from position 0 (nanoGPT's crop): checked step by step by hand."""
    model = make(position, max_seq_len=8).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    out = generate(model, prompts, 12, temperature=0)
    assert [len(o) for o in out] == [12, 12]
    for prompt, new in zip(prompts, out):
        seq = list(prompt)
        for t in new:
            window = torch.tensor([seq[-8:]])
            assert int(model(window)[0, -1].argmax()) == t
            seq.append(t)
    assert len(generate(make("rope"), [[5]], 70, temperature=0)[0]) == 70  # rope extrapolates, no window


def test_empty_prompt_and_bad_counts_are_usage_errors():
    with pytest.raises(UsageError, match=r"prompts\[1\]"):
        generate(make(), [[5], []], 2)
    with pytest.raises(UsageError, match="max_new_tokens"):
        generate(make(), PROMPTS, -1)
    assert generate(make(), PROMPTS, 0) == [[], [], []]


# ------------------------------------------------------------------ the compiled step
@pytest.mark.slow
def test_compiled_step_gives_the_same_tokens_and_compiles_once():
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    model = make("rope", n_kv_heads=2)
    eager = generate(model, PROMPTS, 20, temperature=0)
    assert generate(model, PROMPTS, 20, temperature=0, compile=True) == eager
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1  # one graph for the step, replayed for every token
    assert generate(model, PROMPTS, 20, temperature=0, compile=True) == eager  # a second call reuses it
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_cpu_step_calls_its_kernels_from_cpp_unless_a_mode_is_given(monkeypatch):
    from blockformer.generate import step as step_module

    seen = []

    def compile(fn, **kw):
        seen.append((kw["mode"], kw["options"]))
        return fn  # the step runs eagerly: only the choice is under test here

    monkeypatch.setattr(step_module, "_COMPILED", {})
    monkeypatch.setattr(step_module.torch, "compile", compile)
    model, eager = make(), generate(make(), PROMPTS, 4, temperature=0)
    assert generate(model, PROMPTS, 4, temperature=0, compile=True) == eager
    assert generate(model, PROMPTS, 4, temperature=0, compile=True, compile_mode="default") == eager
    assert generate(model, PROMPTS, 4, temperature=0, compile=True) == eager  # built once: reused
    assert seen == [(None, {"cpp_wrapper": True}), ("default", None)]


def test_the_compiled_step_checks_its_guards_on_the_first_token_of_each_generation_only(monkeypatch):
    from torch._dynamo.eval_frame import _is_skip_guard_eval_unsafe_stance

    from blockformer.generate import step as step_module

    skipped = []

    def compile(fn, **kw):
        def recording(*args):
            skipped.append(_is_skip_guard_eval_unsafe_stance())
            return fn(*args)

        return recording

    monkeypatch.setattr(step_module, "_COMPILED", {})
    monkeypatch.setattr(step_module.torch, "compile", compile)
    model, eager = make(), generate(make(), PROMPTS, 4, temperature=0)
    assert generate(model, PROMPTS, 4, temperature=0, compile=True) == eager  # 3 steps after the prefill
    assert generate(model, PROMPTS, 4, temperature=0, compile=True) == eager
    assert skipped == [False, True, True] * 2
    skipped.clear()
    with torch.compiler.set_stance("force_eager"):  # a stance the user set is kept
        assert generate(model, PROMPTS, 4, temperature=0, compile=True) == eager
    assert skipped == [False, False, False]


@pytest.mark.slow
def test_a_compiled_step_with_unchecked_guards_still_follows_each_generations_shapes():
    torch.compiler.reset()
    model = make("rope", n_kv_heads=2)
    runs = [(PROMPTS, 8), (PROMPTS, 12), (PROMPTS[:1], 8), (PROMPTS, 8)]  # other cache lengths, batch sizes
    for prompts, n in runs:
        assert generate(model, prompts, n, temperature=0, compile=True) == generate(model, prompts, n, temperature=0)


@pytest.mark.slow
def test_cuda_graph_mode_reuses_one_static_cache_per_model():
    # On CPU the CUDA graph itself is skipped, but the static-cache bookkeeping runs.
    model = make("alibi")
    eager = generate(model, PROMPTS, 12, temperature=0)
    fast = dict(temperature=0, compile=True, compile_mode="reduce-overhead")
    assert generate(model, PROMPTS, 12, **fast) == eager
    cache = model.static_decode_cache
    assert generate(model, [[3, 4]], 12, **fast) == generate(model, [[3, 4]], 12, temperature=0)
    assert model.static_decode_cache is not cache  # another shape: another cache
    assert generate(model, PROMPTS[::-1], 12, **fast) == eager[::-1]
    cache = model.static_decode_cache
    assert cache.valid.shape == (3, 6 + 12)
    assert generate(model, PROMPTS, 12, **fast) == eager
    assert model.static_decode_cache is cache  # the same shape: the same tensors, reused
