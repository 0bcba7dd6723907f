"""The serving engine: whatever the batch, the pool or the cache, each request gets the
tokens it would get alone from ``generate``; blocks are never leaked."""

import random

import pytest
import torch

from blockformer import TransformerConfig, build_model
from blockformer.errors import UsageError
from blockformer.generate import generate, greedy_decode
from blockformer.serve import LLM, Engine, QueueFull, SamplingParams
from blockformer.serve.blocks import BlockManager, BlockTable
from blockformer.serve.runner import ModelRunner, PagedPool, RowInput
from blockformer.tokenizers import EOS_ID
from blockformer.tokenizers.byte import ByteTokenizer

TOK = ByteTokenizer.train(["serve"])
V = TOK.vocab_size
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def make(arch="decoder", **kw):
    base = dict(arch=arch, vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=96, position="rope",
                tie_embeddings=False, init_std=0.5)
    if arch == "encoder-decoder":
        base.update(n_encoder_layers=2, n_decoder_layers=2)
    base.update(kw)
    return build_model(TransformerConfig(**base), seed=0)


def prompts(n=8, shared=0, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(4, V) for _ in range(shared)]
    return [prefix + [rng.randrange(4, V) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def staggered(engine: Engine, ps, params=GREEDY, every=2, source=False):
    """Add a request every ``every`` steps while the others run; each request's ids."""
    out, pending, step = {}, list(enumerate(ps)), 0
    while pending or engine.has_work():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=str(i), source=source)
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        step += 1
    return [out[str(i)] for i in range(len(ps))]


def alone(model, ps, n=16):
    return [generate(model, [p], n, temperature=0, eos_id=None)[0] for p in ps]


VARIANTS = {
    "rope": {}, "learned": {"position": "learned"}, "sinusoidal": {"position": "sinusoidal"},
    "alibi": {"position": "alibi"}, "relative": {"position": "relative"}, "none": {"position": "none"},
    "gqa": {"n_kv_heads": 2}, "mqa-window": {"n_kv_heads": 1, "attention_window": 8},
    "moe": {"ffn_experts": 4, "experts_top_k": 2}, "rope-scaled": {"rope_scaling": "ntk", "rope_scaling_factor": 2.0},
    "post-norm": {"norm_position": "post", "norm": "layer"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_staggered_greedy_requests_equal_generate_alone(variant):
    model, ps = make(**VARIANTS[variant]), prompts()
    engine = Engine(model, TOK, block_size=4, max_num_batched_tokens=20, max_running=5)
    got = staggered(engine, ps)
    assert got == alone(model, ps)
    assert len({t for row in got for t in row}) > 5  # not one repeated token
    assert engine.stats().blocks_used == 0 and engine.stats().steps_total > 16


def test_paged_attention_logits_equal_the_contiguous_cache():
    """Two rows of different lengths, their past in scattered blocks: the logits of the new
    tokens equal a plain forward pass over each whole sequence."""
    model = make(n_kv_heads=2)
    blocks, pool = BlockManager(32, 4), PagedPool(model, 32, 4)
    runner, seqs = ModelRunner(model, pool), prompts(2, seed=3)
    tables = [BlockTable(), BlockTable()]
    blocks.grow(BlockTable(), 9)  # the next blocks are not the first ones
    for t, s in zip(tables, seqs):
        blocks.grow(t, len(s))
    past = [len(s) - 3 for s in seqs]
    runner.run([RowInput(s[:n], 0, blocks.slots(t, 0, 0), blocks.slots(t, 0, n)) for s, t, n in zip(seqs, tables, past)])
    logits, _ = runner.run([RowInput(s[n:], n, blocks.slots(t, 0, n), blocks.slots(t, n, len(s)))
                            for s, t, n in zip(seqs, tables, past)])
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["rope", "alibi", "relative", "mqa-window", "moe"])
def test_a_packed_call_of_decodes_and_prefill_chunks_equals_a_plain_forward(variant):
    """One packed call: two decoding rows, two 3-token chunks (one segment) and a 5-token
    chunk after a past of its own, every row's past in scattered blocks; each row's logits
    equal a plain forward pass over its whole sequence so far."""
    model = make(**VARIANTS[variant])
    blocks, pool = BlockManager(64, 4), PagedPool(model, 64, 4)
    runner, seqs = ModelRunner(model, pool), prompts(5, seed=4)
    seqs = [s + [5, 6, 7, 8, 9] for s in seqs]  # each has at least 6 tokens
    tables = [BlockTable() for _ in seqs]
    blocks.grow(BlockTable(), 9)
    for t, s in zip(tables, seqs):
        blocks.grow(t, len(s))
    new = [1, 3, 1, 5, 3]  # decodes and chunks interleaved: the runner orders them into segments
    past = [len(s) - n for s, n in zip(seqs, new)]
    runner.run_packed([RowInput(s[:n], 0, blocks.slots(t, 0, 0), blocks.slots(t, 0, n))
                       for s, t, n in zip(seqs, tables, past)])
    logits = runner.run_packed([RowInput(s[n:], n, blocks.slots(t, 0, n), blocks.slots(t, n, len(s)))
                                for s, t, n in zip(seqs, tables, past)])
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_a_prefix_cache_hit_skips_prefill_and_changes_no_token():
    model, ps = make(), prompts(6, shared=21)
    llm = LLM(model, TOK, block_size=4)
    engine = llm.engine
    first = llm.generate(ps[:1], GREEDY)[0]
    rest = llm.generate(ps[1:], GREEDY)
    assert first.cached_tokens == 0
    assert [o.cached_tokens for o in rest] == [20] * 5  # 5 full blocks of the 21 shared tokens
    assert [first.token_ids] + [o.token_ids for o in rest] == alone(model, ps)
    assert engine.stats().prefix_hit_tokens == 100
    uncached = LLM(model, TOK, block_size=4, prefix_caching=False).generate(ps, GREEDY)
    assert [o.cached_tokens for o in uncached] == [0] * 6


def test_least_recently_released_cached_block_is_evicted_first():
    blocks = BlockManager(4, 2)
    a, b = BlockTable(), BlockTable()
    for t, toks in ((a, [1, 2, 3, 4]), (b, [5, 6, 7, 8])):
        blocks.grow(t, 4)
        blocks.commit(t, toks, 4)
    kept_a = list(a.blocks)
    blocks.release(a)
    blocks.release(b)
    assert blocks.num_used == 0 and blocks.num_free == 4
    c = BlockTable()
    blocks.grow(c, 2)  # one block: the oldest released (a's second block) goes
    assert c.blocks == [kept_a[1]]
    d = BlockTable()
    assert blocks.match_prefix(d, [1, 2, 3, 4, 9]) == 2  # a's first block is still cached
    assert d.blocks == [kept_a[0]] and blocks.refs[kept_a[0]] == 1


def test_preemption_when_blocks_run_out_changes_no_token():
    model, ps = make(), prompts(8, shared=10, seed=1)
    for caching in (True, False):
        engine = Engine(model, TOK, block_size=4, num_blocks=14, max_num_batched_tokens=16, max_running=8,
                        prefix_caching=caching)
        assert staggered(engine, ps, every=1) == alone(model, ps)
        assert engine.stats().preempted_total > 0 and engine.stats().blocks_used == 0


def test_chunked_prefill_keeps_running_decodes_going():
    """A 80-token prompt arrives while two requests decode: it is fed 8 tokens a step,
    and the two still gain a token at every one of those steps."""
    model = make()
    engine = Engine(model, TOK, block_size=4, max_num_batched_tokens=10)
    short = prompts(2, seed=5)
    for i, p in enumerate(short):
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), request_id=f"s{i}")
    for _ in range(3):
        engine.step()
    long = prompts(1, shared=80, seed=6)[0][:80]
    engine.add_request(long, GREEDY, request_id="long")
    gained = []
    for _ in range(10):
        gained.append(sorted(o.request_id for o in engine.step()))
    assert gained[:9] == [["s0", "s1"]] * 9  # 8 of the budget's 10 tokens a step go to the prompt
    assert "long" in gained[9]
    while engine.has_work():
        engine.step()


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_crowd():
    model, ps = make(), prompts(6)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, seed=11, ignore_eos=True)
    lone = LLM(model, TOK).generate([ps[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (25, 3, 9, 17, 5)]
    crowd = LLM(model, TOK, max_num_batched_tokens=12).generate(ps[1:3] + [ps[0]] + ps[3:], others[:2] + [seeded] + others[2:])
    assert crowd[2].token_ids == lone
    again = LLM(model, TOK).generate([ps[0]], SamplingParams(**{**seeded.__dict__, "seed": 12}))[0].token_ids
    assert again != lone


def test_a_cancelled_request_leaves_no_block_in_use():
    engine = Engine(make(), TOK, block_size=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)) for p in prompts(3)]
    for _ in range(5):
        engine.step()
    assert engine.stats().blocks_used > 0
    out = engine.abort(ids[1])
    assert out.finished and out.finish_reason == "abort"
    engine.abort(ids[0]), engine.abort(ids[2])
    assert engine.stats().blocks_used == 0 and not engine.has_work()


def test_encoder_decoder_requests_equal_greedy_decode():
    model = make("encoder-decoder")
    sources = [p[:20] for p in prompts(6, seed=2)]
    ref = greedy_decode(model, [s + [EOS_ID] for s in sources], max_len=18)
    engine = Engine(model, TOK, block_size=4, max_num_batched_tokens=8)
    got = staggered(engine, sources, SamplingParams(max_tokens=18, temperature=0), every=1, source=True)
    assert got == [[t for t in r if t != EOS_ID] for r in ref]
    assert engine.stats().blocks_used == 0


def test_encoder_embeddings_are_mean_pooled_and_normalised():
    model = make("encoder", position="learned")
    texts = ["a cat", "a much longer sentence than that"]
    vectors, n = Engine(model, TOK).embed(texts)
    for text, v in zip(texts, vectors):
        ids = torch.tensor([[1, *TOK.encode(text), EOS_ID]])
        with torch.no_grad():
            ref = torch.nn.functional.normalize(model.hidden_states(ids).mean(dim=1), dim=-1)[0]
        torch.testing.assert_close(torch.tensor(v), ref, atol=1e-6, rtol=1e-5)
    assert n == sum(len(TOK.encode(t)) + 2 for t in texts)


def test_stops_lengths_and_logprobs():
    model = make()
    p = prompts(1)[0]
    ref = alone(model, [p], 12)[0]
    llm = LLM(model, TOK)
    stop_tok = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[ref[4]]))[0]
    assert stop_tok.token_ids == ref[: ref.index(ref[4])] and stop_tok.finish_reason == "stop"
    text = TOK.decode(ref)
    stop_str = text[len(TOK.decode(ref[:3])):][:2]
    cut = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop=[stop_str]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop_str)]
    long = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert long.finish_reason == "length" and long.token_ids == ref and long.completion_tokens == 12
    with torch.no_grad():
        logp = model(torch.tensor([p + ref[:2]]))[0, -1].log_softmax(-1)
    lp = long.logprobs[2]
    assert lp.token_id == ref[2] and abs(lp.logprob - float(logp[ref[2]])) < 1e-5
    assert [t for t, _ in lp.top] == logp.topk(3).indices.tolist()


def test_eos_ends_a_request_unless_ignored_and_not_before_min_tokens():
    model = make()
    p = prompts(1)[0]
    eos = alone(model, [p], 8)[0][3]  # pretend the 4th greedy token is the end of text
    llm = LLM(model, TOK)
    llm.engine.eos_id = eos
    ended = llm.generate([p], SamplingParams(max_tokens=8, temperature=0))[0]
    held = llm.generate([p], SamplingParams(max_tokens=8, temperature=0, min_tokens=6))[0]
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 3 and ended.completion_tokens == 4
    assert eos not in held.token_ids[:6] and len(held.token_ids) >= 6


def test_bad_requests_fail_with_the_field_named():
    engine = Engine(make(), TOK, max_queued=2, num_blocks=8, block_size=4)
    with pytest.raises(UsageError, match="context of 96"):
        engine.add_request([5] * 90, SamplingParams(max_tokens=10))
    with pytest.raises(UsageError, match="KV blocks"):
        engine.add_request([5] * 20, SamplingParams(max_tokens=20))
    with pytest.raises(UsageError, match="token id 9999"):
        engine.add_request([5, 9999], SamplingParams())
    with pytest.raises(UsageError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(UsageError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(UsageError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(UsageError, match="logprobs"):
        SamplingParams(logprobs=21)
    engine.add_request([5], SamplingParams(max_tokens=4))
    engine.add_request([6], SamplingParams(max_tokens=4))
    with pytest.raises(QueueFull):
        engine.add_request([7], SamplingParams(max_tokens=4))


def test_a_block_is_shared_only_after_the_same_whole_prefix():
    """B's first block holds the tokens of A's second: without its prefix, it is no hit."""
    model = make()
    p, q, r = ([t] * 4 for t in (10, 20, 30))
    a, b = p + q + r + [40], q + r + [50]
    llm = LLM(model, TOK, block_size=4)
    outs = llm.generate([a], GREEDY) + llm.generate([b], GREEDY)
    assert [o.cached_tokens for o in outs] == [0, 0]
    assert [o.token_ids for o in outs] == alone(model, [a, b])
    assert llm.generate([a[:9] + [60]], GREEDY)[0].cached_tokens == 8
