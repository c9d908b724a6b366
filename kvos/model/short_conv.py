"""Gated short convolutions: the recurrent layers of LFM2 (Liquid's hybrid of convolutions and attention).

Such a layer projects each token to three rows ``B``, ``C``, ``x`` [hidden] each, convolves ``B * x`` over the
last ``kernel`` tokens (depthwise, causal) and gates the result by ``C``. Its state per sequence is the last
``kernel - 1`` inputs of the convolution: a few rows, whatever the sequence's length, carried as a
:class:`~kvos.model.recurrent.MixerState` with an empty ``ssm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvos.model.linear import Weight, matmul
from kvos.model.recurrent import MixerState


@dataclass
class ShortConv:
    """A short convolution layer's weights: ``in_proj`` [3 * hidden, hidden] (B, C, x), ``conv`` [hidden,
    kernel], ``bias`` [hidden] or None. The output projection is the layer's ``o``."""

    in_proj: Weight
    conv: torch.Tensor
    bias: torch.Tensor | None

    @property
    def hidden(self) -> int:
        return int(self.conv.shape[0])

    def empty_state(self) -> MixerState:
        """The state before the first token: zeros."""
        kernel = int(self.conv.shape[1])
        zeros = torch.zeros(kernel - 1, self.hidden, dtype=self.conv.dtype, device=self.conv.device)
        return MixerState(zeros, zeros.new_empty(0))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, hidden] (normed) -> B, C, x side by side [n, 3 * hidden]."""
        return matmul(h, self.in_proj)

    def run(self, proj: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One sequence's ``n`` rows of :meth:`project` and its state -> the output before the output
        projection [n, hidden], and the state after them (new tensors)."""
        b, c, x = proj.chunk(3, dim=1)
        window = torch.cat((state.conv, b * x))  # [kernel - 1 + n, hidden]
        conv = F.conv1d(window.t()[None], self.conv[:, None, :], self.bias, groups=self.hidden)[0].t()
        kernel = int(self.conv.shape[1])
        after = MixerState(window[window.shape[0] - (kernel - 1) :].clone(), state.ssm)
        return c * conv, after

    def run_decodes(
        self, proj: torch.Tensor, states: list[MixerState]
    ) -> tuple[torch.Tensor, list[MixerState]]:
        """:meth:`run` for ``B`` sequences' decode steps: ``proj`` [B, 3 * hidden] -> [B, hidden] and each
        one's state after its token."""
        b, c, x = proj.chunk(3, dim=1)
        window = torch.cat((torch.stack([st.conv for st in states]), (b * x)[:, None, :]), dim=1)  # [B, K, H]
        conv = (window * self.conv.t()[None]).sum(1)
        if self.bias is not None:
            conv = conv + self.bias
        return c * conv, [MixerState(window[i, 1:], st.ssm) for i, st in enumerate(states)]
