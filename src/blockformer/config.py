"""Model architecture (TransformerConfig, in config.json with the weights); run: run_config; plumbing: schema.

Three modules, three jobs: this one describes a model and nothing else (what a checkpoint's
reader or ``from_hf`` needs); ``run_config`` describes a whole training run, whose
``[model]`` section is this class; ``schema`` is the dataclass <-> dict/TOML machinery both use.

Every architectural choice is a small enum or number here, validated when the config is
built, so a bad value fails with a message that names the field instead of deep inside a
forward pass. The same config is saved next to the weights (``config.json``) and can be
written to or read from TOML for the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .schema import check_types, checked_kwargs, dumps_toml, read_if_path
from .textformats import loads_json, loads_toml

Arch = Literal["encoder", "decoder", "encoder-decoder"]
Norm = Literal["layer", "rms", "none"]
NormPosition = Literal["pre", "post"]
FFN = Literal["relu", "gelu", "silu", "swiglu", "geglu"]
Residual = Literal["plain", "scaled", "gated", "none"]
ResidualTarget = Literal["branch", "trunk"]
Position = Literal["none", "sinusoidal", "learned", "rope", "alibi", "relative"]
GeluApprox = Literal["none", "tanh"]
SinusoidLayout = Literal["interleaved", "split"]
RopeScaling = Literal["none", "linear", "ntk"]

GATED_FFNS = ("swiglu", "geglu")
ADDITIVE_POSITIONS = ("sinusoidal", "learned")  # added to the token embeddings
BIAS_POSITIONS = ("alibi", "relative")  # added to the attention scores
Input = Literal["tokens", "patches", "frames"]
PatchPosition = Literal["learned", "sinusoidal", "none"]


@dataclass
class TransformerConfig:
    """The architecture of a blockformer model.

    ``None`` in a size field means "derive it": ``n_kv_heads`` -> ``n_heads``,
    ``d_ff`` -> ``4 * d_model`` (``8/3 * d_model`` rounded up to a multiple of 8 for the
    gated FFNs, which keeps the parameter count of the ungated one), encoder/decoder depths
    -> ``n_layers``, ``scale_embeddings`` -> whether ``position == "sinusoidal"``. Derived values are filled in when the config is built, so a saved
    config states every size explicitly.
    """

    arch: Arch = "decoder"
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # < n_heads: grouped-query; 1: multi-query attention
    d_ff: int | None = None
    max_seq_len: int = 512
    dropout: float = 0.0  # on embeddings and on each residual branch (Vaswani et al. 2017)
    attention_dropout: float = 0.0  # on attention weights; > 0 leaves the flash kernel
    n_encoder_layers: int | None = None  # encoder-decoder only
    n_decoder_layers: int | None = None  # encoder-decoder only
    src_vocab_size: int | None = None  # encoder-decoder: None = source shares vocab_size
    norm: Norm = "layer"
    norm_bias: bool = True  # LayerNorm only: False gives LayerNorm without the beta shift
    norm_eps: float = 1e-5
    norm_position: NormPosition = "pre"
    ffn: FFN = "gelu"
    residual: Residual = "plain"
    residual_scale: float | None = None  # "scaled": None = derived from depth (DeepNet)
    residual_scale_target: ResidualTarget = "branch"
    residual_gate_init: float = 0.1  # "gated": initial per-channel gate (LayerScale)
    position: Position = "rope"
    rope_base: float = 10000.0
    relative_buckets: int = 32  # "relative": T5 bucket count and the distance they span
    relative_max_distance: int = 128
    bias: bool = True  # biases in the attention and FFN projections
    tie_embeddings: bool = True
    scale_embeddings: bool | None = None  # x sqrt(d_model) as in the paper; None: iff sinusoidal
    init_std: float = 0.02
    # ---- details of published families (GPT-2, BERT, T5, BART, Marian); any model may use them
    gelu_approximate: GeluApprox = "none"  # "tanh": GELU's tanh approximation (GPT-2, T5 v1.1)
    attention_scale: float | None = None  # scores times this; None = 1/sqrt(head_dim); T5: 1.0
    rope_interleaved: bool = False  # rope rotates pairs (2i, 2i+1) (GPT-J, Meta's Llama) not (i, i+d/2)
    sinusoid_layout: SinusoidLayout = "interleaved"  # "split": sines then cosines (Marian)
    position_offset: int = 0  # "learned": position p reads row p + offset (BART: 2)
    n_token_types: int = 0  # > 0: a segment-embedding table; type 0 is added everywhere (BERT)
    embedding_norm: bool = False  # a norm after embeddings + positions (BERT, BART)
    head_transform: bool = False  # dense + activation + norm before the output head (BERT MLM)
    head_bias: bool = False  # a bias on the output head (BERT MLM, BART/Marian final_logits_bias)
    output_scale: float = 1.0  # multiplies the final hidden states before the head (T5: d_model^-0.5)
    pooler: bool = False  # encoder: dense + tanh on the first position, ``model.pool`` (BERT)
    # --- mixture-of-experts FFN (nn/moe.py); ffn_experts=0 keeps the dense FFN
    ffn_experts: int = 0  # E experts per block, each an FFN of kind `ffn` and width expert_d_ff
    experts_top_k: int = 2  # experts each token is routed to (token choice, top-k renormalised)
    expert_d_ff: int | None = None  # None: d_ff
    shared_experts: int = 0  # experts every token also passes through (one FFN of that many widths)
    expert_capacity_factor: float = 0.0  # training: slots per expert = factor * tokens * k / E; 0 = dropless
    router_aux_coef: float = 0.01  # load-balancing loss E * sum_e f_e P_e (Switch, Fedus et al. 2021)
    router_z_coef: float = 0.001  # router z-loss mean(logsumexp(logits)^2) (ST-MoE, Zoph et al. 2022)
    # --- context length (nn/position.py, nn/stack.py)
    rope_scaling: RopeScaling = "none"  # extend a trained rope model: "linear" interpolation or "ntk"-aware
    rope_scaling_factor: float = 1.0  # the context's growth factor s the scaling targets
    attention_window: int = 0  # > 0: each query sees the last `attention_window` positions; KV cache bounded

    # --- other inputs (models/inputs.py): what the encoder reads instead of token ids
    input: Input = "tokens"  # patches: images (B, C, H, W); frames: real vectors (B, T, frame_dim)
    image_height: int = 8  # patches: the largest image; narrower images are padded (and masked)
    image_width: int = 8
    image_channels: int = 1
    patch_size: int = 2  # P x P pixels per patch
    patch_position: PatchPosition = "learned"  # 2-D (row, column) signal; the patch stack gets no 1-D one
    frame_dim: int = 1  # frames: features per frame; their positions follow `position`
    cls_token: bool = False  # a learned vector before the patches/frames, for `cls` pooling

    def __post_init__(self) -> None:
        check_types(self)
        self._validate()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.scale_embeddings is None:
            # Unit-amplitude sinusoids would drown 0.02-scale embeddings: scale them up, as the
            # paper does (embeddings init at d_model^-0.5, times sqrt(d_model)).
            self.scale_embeddings = self.position == "sinusoidal"
        if self.d_ff is None:
            self.d_ff = (
                _round_up(8 * self.d_model // 3, 8) if self.ffn in GATED_FFNS else 4 * self.d_model
            )
        if self.ffn_experts and self.expert_d_ff is None:
            self.expert_d_ff = self.d_ff
        if self.arch == "encoder-decoder":
            self.n_encoder_layers = self.n_encoder_layers or self.n_layers
            self.n_decoder_layers = self.n_decoder_layers or self.n_layers

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        """Each check names the field and what it expects; the first failing one is reported,
        in this order."""
        self._validate_sizes()
        self._validate_details()
        self._validate_attention()
        self._validate_residual()
        self._validate_experts()
        self._validate_context()
        self._validate_input()
        self._validate_arch()

    def _validate_sizes(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _require(self, name, getattr(self, name) >= 1, "an integer >= 1")
        for name in ("n_kv_heads", "d_ff", "n_encoder_layers", "n_decoder_layers", "src_vocab_size"):
            value = getattr(self, name)
            _require(self, name, value is None or value >= 1, "an integer >= 1 or None")
        for name in ("dropout", "attention_dropout"):
            _require(self, name, 0.0 <= getattr(self, name) < 1.0, "a float in [0, 1)")
        _require(self, "norm_eps", self.norm_eps > 0, "a float > 0")
        _require(self, "init_std", self.init_std > 0, "a float > 0")

    def _validate_details(self) -> None:
        """Scales, positions and the details of published families."""
        _require(self, "rope_base", self.rope_base > 1, "a float > 1")
        if self.attention_scale is not None:
            _require(self, "attention_scale", self.attention_scale > 0, "a float > 0 or None")
        _require(self, "output_scale", self.output_scale > 0, "a float > 0")
        _require(self, "n_token_types", self.n_token_types >= 0, "an integer >= 0")
        _require(
            self,
            "position_offset",
            self.position_offset >= 0 and (self.position_offset == 0 or self.position == "learned"),
            "an integer >= 0, and 0 unless position='learned'",
        )
        _require(self, "pooler", not self.pooler or self.arch == "encoder", "False unless arch='encoder'")
        _require(
            self, "rope_interleaved", not self.rope_interleaved or self.position == "rope", "False unless position='rope'"
        )
        _require(self, "relative_buckets", self.relative_buckets >= 2, "an integer >= 2")
        _require(
            self,
            "relative_max_distance",
            self.relative_max_distance > self.relative_buckets // 2,
            f"an integer > relative_buckets // 2 = {self.relative_buckets // 2}",
        )

    def _validate_attention(self) -> None:
        """Heads: the width splits into them, key/value heads group them, rope rotates pairs."""
        _require(
            self,
            "d_model",
            self.d_model % self.n_heads == 0,
            f"a multiple of n_heads={self.n_heads}",
        )
        if self.n_kv_heads is not None:
            _require(
                self,
                "n_kv_heads",
                self.n_heads % self.n_kv_heads == 0,
                f"a divisor of n_heads={self.n_heads}",
            )
        if self.position == "rope":
            _require(
                self,
                "d_model",
                (self.d_model // self.n_heads) % 2 == 0,
                "such that the head size d_model / n_heads is even (rope rotates pairs)",
            )

    def _validate_residual(self) -> None:
        if self.residual == "scaled" and self.residual_scale is not None:
            _require(self, "residual_scale", self.residual_scale > 0, "a float > 0 or None")
        if (
            self.residual == "scaled"
            and self.residual_scale_target == "trunk"
            and self.norm_position == "pre"
        ):
            raise ValueError(
                "residual_scale_target='trunk' needs norm_position='post': DeepNet's trunk "
                "scale alpha > 1 compounds through depth without a norm after each sum; "
                "use residual_scale_target='branch' with pre-norm"
            )

    def _validate_context(self) -> None:
        """Context length: the attention window and rope scaling."""
        _require(self, "attention_window", self.attention_window >= 0, "an integer >= 0 (0: no window)")
        _require(self, "rope_scaling_factor", self.rope_scaling_factor >= 1.0, "a float >= 1")
        if self.rope_scaling != "none":
            _require(self, "rope_scaling", self.position == "rope", "'none' unless position='rope'")

    def _validate_arch(self) -> None:
        if self.arch != "encoder-decoder":
            for name in ("n_encoder_layers", "n_decoder_layers", "src_vocab_size"):
                _require(self, name, getattr(self, name) is None, "None unless arch='encoder-decoder'")

    def _validate_experts(self) -> None:
        _require(self, "ffn_experts", self.ffn_experts >= 0, "an integer >= 0 (0: dense FFN)")
        _require(self, "shared_experts", self.shared_experts >= 0, "an integer >= 0")
        _require(self, "expert_capacity_factor", self.expert_capacity_factor >= 0, "a float >= 0 (0: dropless)")
        for name in ("router_aux_coef", "router_z_coef"):
            _require(self, name, getattr(self, name) >= 0, "a float >= 0")
        _require(self, "expert_d_ff", self.expert_d_ff is None or self.expert_d_ff >= 1, "an integer >= 1 or None")
        if self.ffn_experts:
            _require(self, "experts_top_k", 1 <= self.experts_top_k <= self.ffn_experts,
                     f"an integer in [1, ffn_experts={self.ffn_experts}]")

    def _validate_input(self) -> None:
        for name in ("image_height", "image_width", "image_channels", "patch_size", "frame_dim"):
            _require(self, name, getattr(self, name) >= 1, "an integer >= 1")
        if self.input == "tokens":
            _require(self, "cls_token", not self.cls_token, "False with input='tokens' (the text has <s>)")
            return
        _require(self, "arch", self.arch != "decoder",
                 f"'encoder' or 'encoder-decoder' with input={self.input!r} (the encoder reads it)")
        if self.input == "patches":
            for name in ("image_height", "image_width"):
                _require(self, name, getattr(self, name) % self.patch_size == 0,
                         f"a multiple of patch_size={self.patch_size}")
            if self.patch_position != "none":
                _require(self, "d_model", self.d_model % 4 == 0,
                         "a multiple of 4 with 2-D patch positions (half the width each for row and column)")
            grid = (self.image_height // self.patch_size) * (self.image_width // self.patch_size)
            _require(self, "max_seq_len", self.max_seq_len >= grid + self.cls_token,
                     f">= the {grid} patches{' + the class token' if self.cls_token else ''}")

    @property
    def n_patches(self) -> int:
        """Patches of the largest image (patches only)."""
        return (self.image_height // self.patch_size) * (self.image_width // self.patch_size)

    # ------------------------------------------------------------------ derived values
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def causal(self) -> bool:
        """Whether the model's own (non-encoder) stack is causal."""
        return self.arch != "encoder"

    @property
    def total_layers(self) -> int:
        if self.arch == "encoder-decoder":
            return self.n_encoder_layers + self.n_decoder_layers
        return self.n_layers

    def resolved_residual_scale(self, n_layers: int) -> float:
        """The constant of ``residual="scaled"`` for a stack of ``n_layers`` blocks.

        Trunk (DeepNet, Wang et al. 2022): ``y = Norm(alpha * x + F(x))`` with
        ``alpha = (2N)^(1/4)``. Branch: ``y = x + beta * F(x)`` with ``beta = 1/sqrt(2N)``,
        which keeps the residual stream's variance bounded at any depth.
        """
        if self.residual_scale is not None:
            return self.residual_scale
        if self.residual_scale_target == "trunk":
            return (2 * n_layers) ** 0.25
        return 1.0 / math.sqrt(2 * n_layers)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransformerConfig":
        return cls(**checked_kwargs(cls, data))

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "TransformerConfig":
        return cls.from_dict(loads_json(read_if_path(text_or_path)))

    def to_toml(self, path: str | Path | None = None) -> str:
        text = dumps_toml(self.to_dict())
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_toml(cls, text_or_path: str | Path) -> "TransformerConfig":
        return cls.from_dict(loads_toml(read_if_path(text_or_path)))


# ---------------------------------------------------------------------- helpers
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _require(cfg: Any, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{type(cfg).__name__}.{name}={getattr(cfg, name)!r}: expected {allowed}")
