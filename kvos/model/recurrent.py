"""A sequence's recurrent state: what a hybrid model's recurrent layers (gated delta-nets, short
convolutions) carry instead of K/V.

A forward pass reads :attr:`RecurrentState.layers` and leaves the states after its tokens in
:attr:`RecurrentState.pending`; whoever ran the pass commits them when it succeeded and discards them when
it failed, so that a failed pass leaves the sequence as it was (as the page tables' all-or-nothing
appends do for K/V).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MixerState:
    """One sequence's state in one recurrent layer: ``conv`` [kernel - 1, channels] (the last inputs of its
    causal convolution, oldest first) and, for a gated delta-net, ``ssm`` float32 [value_heads, key_dim,
    value_dim] (empty for a short convolution). Never written in place (a pass makes a new one), so that
    checkpoints may share it."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def compact(self) -> MixerState:
        """This state in tensors of its own where it is a view of a larger one (a batched step's), so that
        keeping it (a checkpoint) does not keep the other sequences' states alive; itself otherwise."""
        if all(t.untyped_storage().nbytes() == t.nbytes for t in (self.conv, self.ssm)):
            return self
        return MixerState(self.conv.clone(), self.ssm.clone())


@dataclass
class RecurrentState:
    """Per recurrent layer (model layer index) the state after :attr:`tokens` tokens."""

    layers: dict[int, MixerState] = field(default_factory=dict)
    tokens: int = 0
    pending: dict[int, MixerState] = field(default_factory=dict)
    pending_tokens: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the committed states."""
        return sum(s.nbytes for s in self.layers.values())

    def stage(self, layer: int, state: MixerState, tokens: int) -> None:
        """Keep ``layer``'s state after a pass over ``tokens`` new tokens until :meth:`commit`."""
        self.pending[layer] = state
        self.pending_tokens = tokens

    def commit(self) -> None:
        """The pass succeeded: its states become the sequence's."""
        if self.pending:
            self.layers.update(self.pending)
            self.tokens += self.pending_tokens
        self.discard()

    def discard(self) -> None:
        """The pass failed (or was only looked at): forget its states."""
        self.pending = {}
        self.pending_tokens = 0

    def copy(self) -> RecurrentState:
        """The committed states, as a new object (a checkpoint, or a branch's own). Nothing is copied: a
        pass never writes into a :class:`MixerState`'s tensors, it makes new ones; a state that is a view of
        a batched step's tensors gets its own (:meth:`MixerState.compact`)."""
        return RecurrentState({i: s.compact() for i, s in self.layers.items()}, self.tokens)
