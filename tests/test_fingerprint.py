"""A model's fingerprint (:mod:`kvos.model.fingerprint`): the same model gives the same digest, and a
change to any projection's bytes, the parts of a fused projection of two types among them, gives another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_files import q5_0_with_q8_0_v

from kvos.model.fingerprint import model_fingerprint
from kvos.model.linear import RowStack, weight_tensors
from kvos.model.loader import load_model
from kvos.model.tokenizer import load_tokenizer

BUILTIN = Path(__file__).resolve().parents[1] / "kvos" / "builtin" / "model"
# The shipped model's digest: saved sessions are restored only under the digest they were saved with, so a
# change here retires every session saved with the built-in model (change it only on purpose).
BUILTIN_FINGERPRINT = "f286673a671620c48ab2cd2d34c52856"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return q5_0_with_q8_0_v(tmp_path_factory.mktemp("mixed"))


def test_the_built_in_models_fingerprint_is_stable() -> None:
    model, tokenizer = load_model(BUILTIN), load_tokenizer(BUILTIN)
    assert model_fingerprint(model, tokenizer) == BUILTIN_FINGERPRINT


@pytest.mark.parametrize("part", [0, 1])
def test_a_byte_of_either_part_of_a_fused_qkv_changes_it(mixed: Path, part: int) -> None:
    """One byte of the Q5_0 q/k part or of the Q8_0 v part of layer 1's QKV, changed: another digest (the
    stack's parts were not hashed before, so a model with retrained q/k/v passed for the old one)."""
    tokenizer = load_tokenizer(BUILTIN)
    model = load_model(mixed)
    before = model_fingerprint(model, tokenizer)
    assert model_fingerprint(load_model(mixed), tokenizer) == before
    qkv = model.layers[1].qkv
    assert isinstance(qkv, RowStack) and len(qkv.parts) == 2
    values = weight_tensors(qkv.parts[part])[0]  # the part's blocks (Q5_0) or repacked values (Q8_0)
    flat = values.view(-1).view(torch.uint8)
    flat[-1] ^= 1
    assert model_fingerprint(model, tokenizer) != before
