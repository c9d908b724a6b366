"""Similarity recovery's signals: one class per way of comparing a session's chunks with a new message."""

from kvos.session.recovery.base import RecoverySignal, Similarity
from kvos.session.recovery.factory import SIGNALS, add_signal_argument, signal_class

__all__ = ["SIGNALS", "RecoverySignal", "Similarity", "add_signal_argument", "signal_class"]
