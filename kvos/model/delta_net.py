"""Gated delta-net: the linear-attention layers of hybrid models (Qwen3.5, Qwen3-Next).

Such a layer keeps no K/V. Each sequence carries a state instead, which the layer updates token by token:
a short causal convolution's last ``kernel - 1`` inputs, and per value head a ``[key_dim, value_dim]``
matrix ``S``. For a token with normalised key ``k``, query ``q``, value ``v``, decay ``a = exp(g)`` and
write strength ``beta``::

    S <- a S + k (beta (v - a S^T k))^T        (the delta rule, with a gate on what is kept)
    o  = S^T q

A prompt is read in chunks of :data:`CHUNK` tokens with the same recurrence solved in closed form per
chunk (one triangular solve instead of a loop over tokens); a decode step is the chunk of one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvos.model import delta_kernel
from kvos.model.linear import Weight, matmul
from kvos.model.recurrent import MixerState

CHUNK = 64  # tokens solved together in a prefill
L2_EPS = 1e-6  # the queries' and keys' L2 normalisation, as the reference kernels use


@dataclass
class DeltaNet:
    """A gated delta-net layer's weights.

    in_proj: [conv_dim + value_dim + 2 * value_heads, hidden], the projections of q, k, v (the convolution's
        input, ``conv_dim = 2 * key_heads * key_dim + value_heads * value_dim``), of the output gate z,
        and of beta's and the decay's logits, fused.
    conv: [conv_dim, kernel] depthwise causal convolution (no bias).
    neg_a: float32 [value_heads], ``-exp(A_log)``; dt_bias: float32 [value_heads].
    norm: [value_dim] the gated RMSNorm's weight (applied as is, not as ``1 + w``).
    tiled: value head ``j`` reads key head ``j % key_heads`` (llama.cpp's GGUF files reorder the value heads
        so); else ``j // (value_heads / key_heads)`` (Hugging Face's order).
    The output projection is the layer's ``o``.
    """

    in_proj: Weight
    conv: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    eps: float
    tiled: bool = False

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def empty_state(self) -> MixerState:
        """The state before the first token: zeros."""
        kernel = int(self.conv.shape[1])
        return MixerState(
            torch.zeros(kernel - 1, self.conv_dim, dtype=self.conv.dtype, device=self.conv.device),
            torch.zeros(
                self.value_heads, self.key_dim, self.value_dim, dtype=torch.float32, device=self.conv.device
            ),
        )

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, hidden] (normed) -> the fused projections [n, conv_dim + value_dim + 2 * value_heads]."""
        return matmul(h, self.in_proj)

    def run(self, proj: torch.Tensor, state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """One sequence's ``n`` new rows of :meth:`project` and its state before them -> the layer's output
        before its output projection [n, value_heads * value_dim], and the state after them (new tensors:
        ``state`` is left as it was, so that a failed pass changes nothing)."""
        n, hv, dv = int(proj.shape[0]), self.value_heads, self.value_dim
        c = self.conv_dim
        mixed, z, b, a = proj.split((c, hv * dv, hv, hv), dim=1)
        window = torch.cat((state.conv, mixed))  # [kernel - 1 + n, conv_dim]
        conv = F.conv1d(window.t()[None], self.conv[:, None, :], groups=c)[0].t()  # [n, conv_dim]
        conv = F.silu(conv)
        kernel = int(self.conv.shape[1])
        new_conv = window[window.shape[0] - (kernel - 1) :].clone()
        q, k, v = conv.split((self.key_heads * self.key_dim, self.key_heads * self.key_dim, hv * dv), dim=1)
        q, k = self._heads(q, n), self._heads(k, n)
        q = _l2norm(q) * self.key_dim**-0.5
        k = _l2norm(k)
        beta = torch.sigmoid(b.float())
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        out, ssm = gated_delta_rule(q, k, v.float().view(n, hv, dv), g, beta, state.ssm)
        normed = gated_rms_norm(out, z.view(n, hv, dv), self.norm, self.eps)
        return normed.reshape(n, hv * dv).to(proj.dtype), MixerState(new_conv, ssm)

    def run_decodes(
        self, proj: torch.Tensor, states: list[MixerState]
    ) -> tuple[torch.Tensor, list[MixerState]]:
        """:meth:`run` for ``B`` sequences' decode steps at once: ``proj`` [B, ...] one row of each, their
        states -> outputs [B, value_heads * value_dim] and each one's state after its token (views of the
        step's stacked tensors; :meth:`MixerState.compact` gives a checkpoint its own)."""
        b, hv, dv, c = int(proj.shape[0]), self.value_heads, self.value_dim, self.conv_dim
        mixed, z, beta_in, a = proj.split((c, hv * dv, hv, hv), dim=1)
        window = torch.cat((torch.stack([st.conv for st in states]), mixed[:, None, :]), dim=1)  # [B, K, C]
        conv = F.silu((window * self.conv.t()[None]).sum(1))  # [B, C]
        q, k, v = conv.split((self.key_heads * self.key_dim, self.key_heads * self.key_dim, hv * dv), dim=1)
        q = _l2norm(self._heads(q, b)) * self.key_dim**-0.5  # [B, H, Dk]
        k = _l2norm(self._heads(k, b))
        beta = torch.sigmoid(beta_in.float())  # [B, H]
        decay = (self.neg_a * F.softplus(a.float() + self.dt_bias)).exp()
        if delta_kernel.usable(q):  # each state read twice and written once, no stacking
            values = v.float().reshape(b, hv, dv)
            out, ssms = delta_kernel.steps([st.ssm for st in states], q, k, values, decay, beta)
            normed = gated_rms_norm(out, z.view(b, hv, dv), self.norm, self.eps)
            after = [MixerState(window[i, 1:], ssms[i]) for i in range(b)]
            return normed.reshape(b, hv * dv).to(proj.dtype), after
        # the state is read and written as few times as the algebra allows: it is the step's largest tensor
        ssm = torch.stack([st.ssm for st in states]).view(b * hv, self.key_dim, dv)  # a copy: ours to write
        k_rows, decay = k.reshape(b * hv, 1, self.key_dim), decay.reshape(b * hv, 1, 1)
        remembered = torch.bmm(k_rows, ssm).mul_(decay)  # k . (a S): [B * H, 1, Dv]
        u = beta.reshape(b * hv, 1, 1) * (v.float().reshape(b * hv, 1, dv) - remembered)
        ssm.mul_(decay).baddbmm_(k_rows.transpose(1, 2), u)  # a S + k u^T, in place
        out = torch.bmm(q.reshape(b * hv, 1, self.key_dim), ssm).view(b, hv, dv)
        ssm = ssm.view(b, hv, self.key_dim, dv)
        normed = gated_rms_norm(out, z.view(b, hv, dv), self.norm, self.eps)
        after = [MixerState(window[i, 1:], ssm[i]) for i in range(b)]
        return normed.reshape(b, hv * dv).to(proj.dtype), after

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[n, key_heads * key_dim] -> float32 [n, value_heads, key_dim]: the key head of each value head
        (see :attr:`tiled`)."""
        x = x.float().view(n, self.key_heads, self.key_dim)
        repeat = self.value_heads // self.key_heads
        if repeat == 1:
            return x
        return x.repeat(1, repeat, 1) if self.tiled else x.repeat_interleave(repeat, dim=1)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [n, heads, dim] over dim, scaled by ``weight`` [dim] and gated by ``silu(z)``
    (z [n, heads, dim]), in float32 -> float32 [n, heads, dim]."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * x * F.silu(z.float())


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring over ``n`` tokens, float32 throughout.

    q, k: [n, H, Dk] (normalised, q scaled); v: [n, H, Dv]; g (log decay), beta: [n, H]; s: [H, Dk, Dv] the
    state before them -> outputs [n, H, Dv] and the state after them [H, Dk, Dv].

    Per chunk, with G the running sum of g from the chunk's start and S0 the state before it: the writes
    U [C, Dv] solve ``(I + L) U = beta (V - e^G K S0)`` with ``L[t, s] = beta_t e^(G_t - G_s) k_t.k_s``
    for s < t; then ``O = e^G Q S0 + (e^(G_t - G_s) q_t.k_s)_{s <= t} U`` and
    ``S = e^(G_last) S0 + K^T (e^(G_last - G) U)``.
    """
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, n, D]
    gh, bh = g.t(), beta.t()  # [H, n]
    outs = []
    n = int(q.shape[0])
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        out, s = _chunk(qh[:, lo:hi], kh[:, lo:hi], vh[:, lo:hi], gh[:, lo:hi], bh[:, lo:hi], s)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.transpose(0, 1), s


def _chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of :func:`gated_delta_rule`, heads first: q, k [H, C, Dk], v [H, C, Dv], g, beta [H, C],
    s [H, Dk, Dv] -> out [H, C, Dv], state [H, Dk, Dv]."""
    size = int(q.shape[1])
    if size == 1:  # a decode step: the same algebra without the C x C terms, the state read and written once
        decay = g.exp()[:, :, None]  # [H, 1, 1]
        u = beta[:, :, None] * (v - (k @ s).mul_(decay))  # [H, 1, Dv]
        s = (s * decay).baddbmm_(k.transpose(1, 2), u)  # a new tensor: the state passed in is kept
        return q @ s, s
    cum = g.cumsum(-1)  # [H, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()  # [H, C, C]: e^(G_t - G_s) for s <= t, 0 above the diagonal
    grow = cum.exp()[:, :, None]  # [H, C, 1]
    lower = (beta[:, :, None] * decay * (k @ k.transpose(1, 2))).tril(-1)
    eye = torch.eye(size, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - grow * (k @ s))
    u = torch.linalg.solve_triangular(lower + eye, rhs, upper=False, unitriangular=True)
    out = grow * (q @ s) + (decay * (q @ k.transpose(1, 2))) @ u
    last = cum[:, -1:]  # [H, 1]
    tail = (last - cum).exp()[:, :, None]  # [H, C, 1]
    s = last.exp()[:, :, None] * s + k.transpose(1, 2) @ (tail * u)
    return out, s
