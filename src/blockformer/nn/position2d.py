"""Two-dimensional position signals for image patches: where a patch sits, as (row, column).

Both schemes are factorised: half of the ``d_model`` channels say the row, the other half
the column, and the two halves are concatenated (the "2-D" variant of Dosovitskiy et al.
2021, ViT, appendix D.4; MAE's fixed 2-D sin-cos table, He et al. 2022). A patch's vector
is added to its projected pixels, as the 1-D absolute schemes of ``position.py`` are added
to token embeddings:

- ``learned``: a table of rows and a table of columns, ``d_model / 2`` wide each;
- ``sinusoidal``: ``sinusoidal_table`` (Vaswani et al.) of the row, then of the column.

Without any signal (``none``) attention cannot tell patches apart by place: permuting the
patches permutes the outputs (``tests/test_inputs.py`` checks both directions).
"""

from __future__ import annotations

import torch
from torch import nn

from .position import sinusoidal_table


class Position2d(nn.Module):
    """(row, column) ids ``(B, N)`` each -> vectors ``(B, N, d_model)``."""

    def __init__(self, kind: str, d_model: int, max_rows: int, max_cols: int) -> None:
        super().__init__()
        if kind not in ("learned", "sinusoidal"):
            raise ValueError(f"patch_position={kind!r}: expected 'learned' or 'sinusoidal'")
        self.kind, half = kind, d_model // 2
        if kind == "learned":
            self.rows = nn.Embedding(max_rows, half)
            self.cols = nn.Embedding(max_cols, half)
        else:
            # A function of the config: not saved in checkpoints.
            self.register_buffer("row_table", sinusoidal_table(max_rows, half), persistent=False)
            self.register_buffer("col_table", sinusoidal_table(max_cols, half), persistent=False)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        if self.kind == "learned":
            return torch.cat([self.rows(rows), self.cols(cols)], dim=-1)
        return torch.cat([self.row_table[rows], self.col_table[cols]], dim=-1)
