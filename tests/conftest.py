import os
import sys
from pathlib import Path

import pytest

from kvos.model.random_init import PRESETS, build_random_model

sys.path.insert(0, str(Path(__file__).parent))

SHARED = Path(__file__).resolve().parents[2] / "shared"

# Q5_0 matrices load as their blocks in every test and every server a test starts, whatever this CPU's rule
# (kvos.model.gguf.repacks_q5_0 repacks them on a CPU without the 512-bit Q5_0 path): the tests that check
# which kernel a weight lands in hold on any machine, and tests/test_q5_repack.py forces each way itself.
os.environ["KVOS_Q5_0"] = "blocks"

import sequence_checks  # noqa: E402  (after the path above)

sequence_checks.install()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"../shared not present at {SHARED}: shared models and data are needed for this test")
    return SHARED


# A small random Llama with kvos's byte-level tokenizer and ChatML template: fast enough for end-to-end tests
# of sessions, the server and the benchmarks, built once per test run.
SMALL = {
    **PRESETS["tiny"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("small"), SMALL, seed=3)


@pytest.fixture(scope="session")
def head_calibration(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`kvos calibrate`'s JSON for the small model (its entropies measured on three random texts), for
    sessions with per-head entropy budgets."""
    import json

    import torch

    from kvos.engine.engine import Engine
    from kvos.model.loader import load_model
    from kvos.policy.calibration import calibrate
    from kvos.policy.entropy import summarize

    model = load_model(model_dir)
    texts = [
        torch.randint(3, 250, (96,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)
    ]
    entropies = calibrate(Engine(model), texts, show_progress=False)
    path = tmp_path_factory.mktemp("calibration") / "entropy.json"
    path.write_text(json.dumps(summarize(entropies, model.config.group_size)))
    return path
