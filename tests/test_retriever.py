"""The "learned" recovery signal: layer-0 queries computed from the tokens alone are the model's own, a
chunk's code does not depend on where it sat, the score is the mean over the queries of their best key,
a planted chunk is found, files round-trip and refuse other models, calibration and the session compute
the same scores, and on the built-in model (with the retriever it ships) the signal brings back a fact the
question shares no word with, before the question is prefilled and with no forward pass."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
from test_relevance import buried_fact_session

from kvos.builtin import builtin_model_path
from kvos.builtin.corpus import heldout_sessions
from kvos.builtin.knowledge import KNOWLEDGE_SEED, knowledge_sessions
from kvos.cli.calibrate_retrieval import (
    CALIBRATION_LEAD,
    CALIBRATION_SEED,
    PROBE_TOKENS,
    calibration_chats,
    calibration_session,
    default_corpus,
)
from kvos.cli.calibrate_retriever import (
    above_threshold,
    chunk_scores,
    fact_rank,
    fit,
    recorded_sessions,
    session_features,
    spread_layers,
)
from kvos.engine.engine import Engine
from kvos.engine.sampling import SamplingParams
from kvos.errors import ConfigError
from kvos.model import catalogue
from kvos.model.catalogue import CatalogueEntry, shipped_retriever
from kvos.model.loader import load_model
from kvos.model.rope import Rope
from kvos.model.tokenizer import load_tokenizer
from kvos.policy.chunks import ChunkState
from kvos.policy.digest import unrotate
from kvos.policy.retriever import Retriever, find_retriever, retriever_path
from kvos.session.config import SessionConfig
from kvos.session.embedder import HiddenStateEmbedder, TokenEmbedder
from kvos.session.manager import MemoryManager
from kvos.session.recovery.learned import learned_scores


def random_retriever(
    query_width: int, key_layers: tuple[int, ...], key_width: int, rank: int = 8
) -> Retriever:
    g = torch.Generator().manual_seed(1)
    return Retriever(
        key_layers,
        torch.randn(query_width, generator=g),
        torch.rand(query_width, generator=g) + 0.5,
        torch.randn(key_width, generator=g),
        torch.rand(key_width, generator=g) + 0.5,
        torch.randn(query_width, rank, generator=g),
        torch.randn(key_width, rank, generator=g),
        lexical_weight=3.0,
        threshold=0.25,
        info={"sessions": 1},
    )


def test_first_queries_are_the_prefills_layer_0_queries(model_dir: Path) -> None:
    """What the signal reads before a prefill is what the prefill computes: the tapped layer-0 queries of
    the same tokens at any position, rotated back to position 0."""
    engine = Engine(load_model(model_dir), block_size=8)
    tokens = [5, 17, 33, 64, 65, 66, 90, 12, 3]
    seq = engine.new_sequence()
    engine.extend(seq, [7, 8, 9, 10], list(range(4)))  # some context in front: layer 0 does not see it
    taps: dict[int, torch.Tensor] = {}
    positions = torch.arange(300, 300 + len(tokens))
    engine.extend(seq, tokens, positions.tolist(), query_layers=frozenset({0}), queries=taps)
    tapped = unrotate(taps[0], positions, engine.model.ropes[0])
    first = engine.model.first_queries(torch.tensor(tokens))
    assert first.shape == (len(tokens), 4, 16) and first.dtype == torch.float32
    assert torch.allclose(first, tapped, atol=1e-5)


def test_scores_are_the_mean_over_queries_of_their_best_key() -> None:
    g = torch.Generator().manual_seed(0)
    r = random_retriever(8, (0,), 8, rank=5)
    queries = torch.randn(6, 5, generator=g)
    codes = [torch.randn(n, 5, generator=g).half() for n in (1, 7, 3, 12)]
    expected = torch.stack([(queries @ c.float().T).amax(dim=1).mean() for c in codes])
    assert torch.allclose(r.scores(queries, codes), expected, atol=1e-5)
    assert r.scores(queries, []).numel() == 0
    assert torch.allclose(r.combine(expected, torch.ones(4)), expected + 3.0)


def test_a_planted_chunk_is_found() -> None:
    """Twenty chunks of unrelated keys and one holding a key along a query: the planted chunk scores
    highest, by a clear margin (projections that keep the features as they are)."""
    g = torch.Generator().manual_seed(0)
    dim = 16
    r = Retriever(
        (0,),
        torch.zeros(dim),
        torch.ones(dim),
        torch.zeros(dim),
        torch.ones(dim),
        torch.eye(dim),
        torch.eye(dim),
    )
    queries = torch.randn(4, 1, dim, generator=g)  # [n, heads, head_dim]
    chunks = [torch.randn(1, 10, 1, dim, generator=g) for _ in range(20)]  # [layers, n, kv, D]
    planted = 7
    chunks[planted][0, 3, 0] = 3 * queries[2, 0] / queries[2, 0].norm() * dim**0.5
    scores = r.scores(r.project_queries(queries), [r.code(c) for c in chunks])
    assert int(scores.argmax()) == planted
    others = scores[torch.arange(20) != planted]
    assert scores[planted] - others.max() > 0.5 * (others.max() - others.min())


def test_a_chunks_code_does_not_depend_on_where_it_sat() -> None:
    rope = Rope(16, 10000.0)
    g = torch.Generator().manual_seed(2)
    content = torch.randn(2, 9, 2, 16, generator=g)  # [layers, n, kv, D] at position 0
    r = random_retriever(32, (0, 1), 2 * 2 * 16)
    codes = []
    for start in (0, 4000):
        positions = torch.arange(start, start + 9)
        cos, sin = rope.cos_sin(positions, torch.float32, torch.device("cpu"))
        stored = torch.stack([Rope.apply(content[i], cos, sin) for i in range(2)])
        codes.append(r.code(torch.stack([unrotate(stored[i], positions, rope) for i in range(2)])))
    assert codes[0].dtype == torch.float16 and codes[0].shape == (9, 8)
    assert torch.allclose(codes[0].float(), codes[1].float(), rtol=1e-2, atol=1e-2)


def test_files_round_trip_and_refuse_what_they_are_not(tmp_path: Path) -> None:
    r = random_retriever(64, (0, 2, 3), 3 * 2 * 16)
    path = tmp_path / "r.safetensors"
    r.save(path)
    back = Retriever.load(path)
    assert back.key_layers == (0, 2, 3) and back.lexical_weight == 3.0 and back.threshold == 0.25
    assert back.info == {"sessions": 1} and back.rank == 8
    for name in ("q_mean", "q_std", "k_mean", "k_std", "w_q", "w_k"):
        assert torch.equal(getattr(back, name), getattr(r, name))
    back.check_model(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="another model"):
        back.check_model(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="another model"):
        back.check_model(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file of tensors")
    with pytest.raises(ConfigError, match="not a kvos retriever"):
        Retriever.load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"w_q": torch.zeros(2, 2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="not a kvos retriever"):
        Retriever.load(tmp_path / "other.safetensors")


def test_a_models_retriever_is_found_beside_it(tmp_path: Path) -> None:
    model_file = tmp_path / "m.gguf"
    assert retriever_path(model_file) == tmp_path / "m.gguf.retriever.safetensors"
    assert retriever_path(tmp_path) == tmp_path / "retriever.safetensors"
    assert find_retriever(model_file) is None
    random_retriever(8, (0,), 8).save(retriever_path(model_file))
    assert find_retriever(model_file) is not None
    assert find_retriever(model_file, "none") is None


def test_the_signal_needs_a_retriever_and_auto_picks_it() -> None:
    with pytest.raises(ConfigError, match="needs a retriever"):
        SessionConfig(recovery_signal="learned")
    assert SessionConfig().signal == "lexical"  # no retriever: words
    r = random_retriever(8, (0,), 8)
    assert SessionConfig(retriever=r).signal == "learned"
    assert SessionConfig(retriever=r).min_similarity() == 0.25
    assert SessionConfig(retriever=r, recovery_signal="answer").signal == "answer"


def test_the_built_in_model_ships_its_retriever() -> None:
    path = builtin_model_path()
    r = find_retriever(path)
    assert r is not None and r.rank == 8
    c = load_model(path).config
    r.check_model(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim)
    info = r.info or {}
    assert info["seed"] == CALIBRATION_SEED and info["probes_measured"] >= 50
    # its codes: 8 float16 numbers per token against 4 layers x K and V x 2 KV heads x 64 float32
    saved_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    assert 2 * r.rank / saved_per_token < 0.005


def test_calibration_and_the_session_score_alike() -> None:
    """What calibration records is what the session reads, and the scores :func:`fit` optimises (raw keys
    through the key projection, in float32) are the session's (codes stored in float16), to float16
    rounding; fitting a few sessions runs and learns a threshold."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    layers = (0, 1, 2, 3)
    found = [session_features(manager, chat, 0.25, layers) for chat in heldout_sessions(6, CALIBRATION_SEED)]
    messages = [p for f in found for p in f]
    probes = [p for p in messages if p.is_probe]
    assert len(probes) >= 4 and len(messages) - len(probes) >= 6  # the probe and two other messages each
    assert all(sum(p.is_probe for p in f) <= 1 and len(f) <= 3 for f in found)
    for p in messages:
        assert len(p.keys) == len(p.lexical) == len(p.exchange) == len(p.fact)
        assert p.queries.shape[1] == 4 * 64 and p.keys[0].shape[1] == 4 * 2 * 64
    r = fit(messages, layers, rank=4, epochs=2)
    assert r.rank == 4 and r.threshold != 5.0  # the threshold moved from where fitting starts it
    for p in messages:
        codes = [r.project_keys(k).half() for k in p.keys]
        session_way = r.combine(r.scores(r.project_queries(p.queries), codes), p.lexical)
        assert torch.allclose(chunk_scores(r, p), session_way, rtol=1e-2, atol=5e-2)
        assert above_threshold(r, p) == bool(chunk_scores(r, p).max() > r.threshold)
    for p in probes:
        assert 0 <= fact_rank(r, p) < len(set(p.exchange))


def test_calibration_sessions_take_the_benchmark_embedder() -> None:
    """``kvos calibrate --embedder tokens`` plays its sessions as ``kvos bench recall --embedder tokens``
    does (the eviction order, and so the candidates, depend on it); tokens by default, as kvos serve."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    chat = heldout_sessions(1, CALIBRATION_SEED)[0]
    for name, kind in (("tokens", TokenEmbedder), ("hidden", HiddenStateEmbedder)):
        s = calibration_session(manager, chat, 0.25, PROBE_TOKENS, "lexical", name)  # type: ignore[arg-type]
        assert s.config.embedder == name and isinstance(s.embed, kind)
        assert s.config.recovery_signal == "lexical"
        manager.close(s.session_id)
    s = calibration_session(manager, chat, 0.25, PROBE_TOKENS, "lexical")
    assert isinstance(s.embed, TokenEmbedder) and s.config.embedder == SessionConfig().embedder


def test_key_layers_spread_over_the_model() -> None:
    assert spread_layers(30, 8) == (0, 4, 8, 12, 17, 21, 25, 29)  # SmolLM2-135M
    assert spread_layers(4, 8) == (0, 1, 2, 3)  # the built-in model: every layer
    assert spread_layers(30, 2) == (0, 29) and spread_layers(30, 1) == (0,)
    with pytest.raises(ConfigError):
        spread_layers(30, 0)


def test_recorded_calibration_sessions_are_read_back_for_the_same_recipe(tmp_path: Path) -> None:
    """``--features FILE``: the sessions' recorded inputs are written once and read back as they were
    (fitting again plays nothing); a file recorded for other sessions is refused, not silently reused."""
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    cache = tmp_path / "features.pt"
    args = argparse.Namespace(
        corpus="builtin",
        sessions=2,
        seed=CALIBRATION_SEED,
        fillers=None,
        lead=6,
        budget_frac=0.25,
        embedder="tokens",
        features=str(cache),
    )
    info = {"path": str(path)}
    played = recorded_sessions(manager, args, (0, 3), info)
    assert cache.exists() and len(played) == 2
    read = recorded_sessions(None, args, (0, 3), info)  # type: ignore[arg-type]  # no manager: nothing played
    assert len(read) == 2 and sum(map(len, read)) == sum(map(len, played)) > 0
    for a, b in zip((p for f in played for p in f), (p for f in read for p in f), strict=True):
        assert torch.equal(a.queries, b.queries) and torch.equal(a.lexical, b.lexical)
        assert torch.equal(a.fact, b.fact) and a.exchange == b.exchange
        assert all(torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True))
        assert a.keys[0].shape[1] == 2 * 2 * 64  # layers 0 and 3, 2 KV heads of 64
    args.sessions = 3
    with pytest.raises(ConfigError, match="other sessions"):
        recorded_sessions(None, args, (0, 3), info)  # type: ignore[arg-type]
    args.sessions, args.corpus = 2, "knowledge"
    with pytest.raises(ConfigError, match="other sessions"):
        recorded_sessions(None, args, (0, 3), info)  # type: ignore[arg-type]
    args.corpus, args.lead = "builtin", 0  # other places for the facts: other sessions
    with pytest.raises(ConfigError, match="other sessions"):
        recorded_sessions(None, args, (0, 3), info)  # type: ignore[arg-type]


def test_a_gguf_chat_model_is_calibrated_on_knowledge_sessions() -> None:
    """``kvos calibrate --retriever`` on a .gguf model plays the sessions ``kvos bench recall`` measures it
    on (knowledge: questions, the fact, questions, the probe), drawn from the calibration seed, never the
    benchmark's, with the fact after 0, 1, 2, .. questions in turn (a retriever that saw facts only at turn
    1 learns their place, not their words); the fact's exchange (the planting message and its
    acknowledgement) is what a probe marks."""
    assert default_corpus("m.gguf") == "knowledge" and default_corpus(builtin_model_path()) == "builtin"
    chats = calibration_chats("knowledge", 3, CALIBRATION_SEED, 4)
    bench = knowledge_sessions(3, KNOWLEDGE_SEED, 4)
    assert [c.messages for c in chats] != [c.messages for c in bench]
    assert [c.probes[0].plant_index for c in chats] == [1, 3, 5]  # after 0, 1, 2 questions
    for lead, chat in enumerate(chats):  # system; lead questions, the fact, 4 questions, the probe
        assert len(chat.messages) == 1 + 2 * (lead + 1 + 4 + 1)
    firsts = calibration_chats("knowledge", 3, CALIBRATION_SEED, 4, lead=0)
    assert [c.probes[0].plant_index for c in firsts] == [1, 1, 1]
    with pytest.raises(ConfigError, match="unknown calibration corpus"):
        calibration_chats("wiki", 3, CALIBRATION_SEED, 4)
    path = builtin_model_path()
    manager = MemoryManager(Engine(load_model(path)), load_tokenizer(path))
    found = [session_features(manager, chat, 0.25, (0, 3)) for chat in chats]
    probes = [p for f in found for p in f if p.is_probe]
    assert probes, "no probe had its fact among the candidates"
    for chat, recorded in zip(chats, found, strict=True):
        for p in recorded:
            if p.is_probe:  # the fact's exchange: the planting message and its reply
                plant = chat.probes[0].plant_index
                assert {e for e, f in zip(p.exchange, p.fact.tolist(), strict=True) if f} == {plant}


def test_kvos_ships_a_retriever_for_a_catalogue_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A catalogue model's file (its catalogue name and size, wherever it is kept) finds the retriever kvos
    ships for it; a retriever beside the file comes first; another file of the same name does not."""
    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    random_retriever(8, (0,), 8).save(shipped_dir / "m.safetensors")
    entry = CatalogueEntry(
        "m",
        "m.gguf",
        1000,
        "0" * 64,
        (),
        "a test model",
        retriever=True,
        urls=("https://127.0.0.1:9/m.gguf",),
    )
    monkeypatch.setattr(catalogue, "CATALOGUE", {"m": entry})
    monkeypatch.setattr(catalogue, "RETRIEVERS", shipped_dir)
    model = tmp_path / "models" / "m" / "m.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"x" * 999)
    assert shipped_retriever(model) is None and find_retriever(model) is None  # not the catalogue's size
    model.write_bytes(b"x" * 1000)
    assert shipped_retriever(model) == shipped_dir / "m.safetensors"
    found = find_retriever(model)
    assert found is not None and found.rank == 8
    assert find_retriever(model, "none") is None
    own = random_retriever(8, (0,), 8, rank=4)
    own.save(retriever_path(model))
    beside = find_retriever(model)
    assert beside is not None and beside.rank == 4  # the user's own calibration wins
    monkeypatch.setattr(catalogue, "CATALOGUE", {"m": dataclasses.replace(entry, retriever=False)})
    retriever_path(model).unlink()
    assert find_retriever(model) is None


def test_the_learned_signal_brings_back_a_fact_without_shared_words() -> None:
    """The built-in model with its own retriever: "What is my job?" brings back "For a living I work as a
    translator." (no content word in common: the lexical signal cannot, test_relevance.py), before the
    question is prefilled (so no second prefill), and the scoring runs no forward pass."""
    path = builtin_model_path()
    manager, s, fact = buried_fact_session("learned", check=False, retriever=find_retriever(path))
    exchange = [c for c in s.chunks.values() if c.message_index in (1, 2)]  # the fact and its reply
    s.memory.page_out([c for c in exchange if c.resident])  # a filler turn may have brought it back
    assert all(c.state is ChunkState.SAVED and c.key_code is not None for c in exchange)
    passes = 0
    real = s.engine.model.forward_batch

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal passes
        passes += 1
        return real(*args, **kwargs)

    s.engine.model.forward_batch = counted  # type: ignore[method-assign]
    during: list[int] = []
    real_recover = s.signal.before_message

    def recover(ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        before = passes
        scores = learned_scores(s.memory, ids)
        best = max(scores, key=lambda i: scores[i])
        assert s.chunks[best].message_index in (fact[0].message_index, fact[0].message_index + 1)
        real_recover(ids, *args, **kwargs)
        during.append(passes - before)

    s.signal.before_message = recover  # type: ignore[method-assign]
    question = s.add_message("user", "What is my job?")
    assert during == [0]  # scoring and restoring: no forward pass
    events = [e for e in s.memory.journal.events if e["turn"] == s.history.turn]
    restored = [e["chunk"] for e in events if e["event"] == "restore"]
    assert {c.chunk_id for c in fact} <= set(restored)
    order = s.pager.order()
    assert order[-len(question) :] == [c.chunk_id for c in question]  # prefilled once, behind the fact
    reply = s.generate(SamplingParams(max_tokens=16))[0]
    assert "translator" in reply
    manager.close(s.session_id)


def test_chunks_without_codes_are_coded_from_the_pool_and_the_store() -> None:
    """A session restored from a state directory keeps no codes: the saved chunks' are made from the store,
    the resident ones' from the pool, and the scores are those of the codes made at write time (to float16
    rounding)."""
    path = builtin_model_path()
    manager, s, _ = buried_fact_session("learned", check=False, retriever=find_retriever(path))
    ids = s.tokenizer.encode("<|im_start|>user\nWhat is my job?<|im_end|>\n")
    before = learned_scores(s.memory, ids)
    states = {c.state for c in s.chunks.values() if c.chunk_id in before}
    assert states == {ChunkState.SAVED, ChunkState.RESIDENT}  # both kinds of candidate
    for c in s.chunks.values():
        c.key_code = None
    after = learned_scores(s.memory, ids)
    assert after.keys() == before.keys()
    for chunk_id, score in before.items():
        assert abs(after[chunk_id] - score) < 1e-2 * max(1.0, abs(score))
    manager.close(s.session_id)


def test_the_shipped_retrievers_are_the_catalogue_models_own() -> None:
    """Every retriever a catalogue entry names is in the package, was fitted on the recall benchmark's kind
    of sessions (knowledge, from the calibration seed, never the benchmark's, with the fact at several places
    of the conversation, not only first), for that entry's file, and fits its model's shape; with the file
    pulled, the pulled file finds it (tests/test_qwen_gguf.py's models are 0.5-1.1 GB: that part skips
    without them)."""
    shipped = [e for e in catalogue.CATALOGUE.values() if e.retriever]
    assert shipped, "no catalogue model ships a retriever"
    for entry in shipped:
        r = Retriever.load(catalogue.RETRIEVERS / f"{entry.name}.safetensors")
        info = r.info or {}
        model = info["model"]
        assert model["path"] == entry.file and info["corpus"] == "knowledge"
        assert info["seed"] == CALIBRATION_SEED != KNOWLEDGE_SEED and info["probes_measured"] >= 10
        assert info["lead"] == CALIBRATION_LEAD > 0
        r.check_model(model["layers"], model["heads"], model["kv_heads"], model["head_dim"])
        assert r.threshold < float("inf") and r.rank == 8
        if catalogue.is_pulled(entry):
            found = find_retriever(catalogue.model_file(entry))
            assert found is not None and torch.equal(found.w_q, r.w_q)
