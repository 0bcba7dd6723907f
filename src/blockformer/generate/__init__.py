"""Generation: decoder-only sampling and greedy decoding (plain, or speculative with a draft
model); encoder-decoder greedy and beam search; streaming text. All decoding runs on the
model's preallocated KV cache."""

from .batching import PromptBatch, pad_batch, positions_from_mask, prepare_prompts
from .beam import Hypothesis, beam_search, length_penalty
from .causal import generate
from .packed import PackedLinear, pack_linears
from .quantize import Int4Linear, Int8Linear, prepare_for_decoding, quantize
from .sampling import Sampling, choose, process_logits, sample, top_k_filter, top_p_filter
from .speculative import SpeculativeOutput, speculative_accept, speculative_generate
from .seq2seq import greedy_decode, target_limits
from .stream import TextStream
from .translate import translate

__all__ = [
    "generate",
    "speculative_generate",
    "speculative_accept",
    "SpeculativeOutput",
    "greedy_decode",
    "beam_search",
    "translate",
    "quantize",
    "prepare_for_decoding",
    "Int8Linear",
    "Int4Linear",
    "pack_linears",
    "PackedLinear",
    "Hypothesis",
    "length_penalty",
    "TextStream",
    "Sampling",
    "choose",
    "process_logits",
    "sample",
    "top_k_filter",
    "top_p_filter",
    "pad_batch",
    "positions_from_mask",
    "prepare_prompts",
    "PromptBatch",
    "target_limits",
]
