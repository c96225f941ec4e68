"""Data: every token of a packed file exactly once per epoch; seeded, layout-independent batches."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic.trainer.data import IGNORE, SyntheticTokens, TokenFile, index_path, rank_sample_indices, write_token_file
from perfmodel.errors import InputError


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 40, size=23)  # documents shorter and longer than a chunk
    docs = [rng.integers(0, 70000, size=n) for n in lengths]
    path = write_token_file(tmp_path / "corpus.bin", docs, dtype="uint32")
    return path, docs


@pytest.mark.parametrize("seq_len", [16, 7])
def test_every_token_delivered_exactly_once_per_epoch(corpus, seq_len):
    path, docs = corpus
    flat = np.concatenate(docs)
    doc_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
    data = TokenFile(path, seq_len=seq_len, seed=3)
    assert data.n_tokens == flat.size
    for epoch in range(2):
        seen = np.zeros(flat.size, dtype=int)
        for j in range(epoch * data.n_chunks, (epoch + 1) * data.n_chunks):
            s = data.sample(j)
            real = s.doc_ids >= 0
            for t in np.flatnonzero(real):
                p = s.offset + t
                seen[p] += 1
                assert s.tokens[t] == flat[p]
                assert s.doc_ids[t] == doc_of[p]
                doc_start = int(np.flatnonzero(doc_of == doc_of[p])[0])
                assert s.positions[t] == p - max(doc_start, s.offset)  # RoPE restarts at a document start
                has_next = p + 1 < flat.size and doc_of[p + 1] == doc_of[p]
                assert s.labels[t] == (flat[p + 1] if has_next else IGNORE)  # never across documents
            assert (s.labels[~real] == IGNORE).all()
        assert (seen == 1).all(), f"epoch {epoch}: tokens delivered {np.bincount(seen)} times"


def test_epochs_visit_chunks_in_different_seeded_orders(corpus):
    path, _ = corpus
    a, b = TokenFile(path, 16, seed=3), TokenFile(path, 16, seed=3)
    first = [a.sample(j).tokens.tolist() for j in range(a.n_chunks)]
    second = [a.sample(j).tokens.tolist() for j in range(a.n_chunks, 2 * a.n_chunks)]
    assert first == [b.sample(j).tokens.tolist() for j in range(b.n_chunks)]
    assert first != second and sorted(first) == sorted(second)


def test_token_file_errors_name_the_file(tmp_path, corpus):
    path, _ = corpus
    with pytest.raises(InputError, match="not found"):
        TokenFile(tmp_path / "absent.bin", 16, 0)
    index_path(path).unlink()
    with pytest.raises(InputError, match="idx.npz"):
        TokenFile(path, 16, 0)
    with pytest.raises(InputError, match="uint32"):
        write_token_file(tmp_path / "big.bin", [[70000]], dtype="uint16")


def test_synthetic_samples_depend_on_index_only_and_are_learnable():
    data = SyntheticTokens(vocab_size=64, seq_len=32, seed=5)
    together = data.batch([3, 4, 5])
    apart = [data.batch([j])[0] for j in (5, 3, 4)]
    for x, y in zip(together, [apart[1], apart[2], apart[0]]):
        assert (x.tokens == y.tokens).all() and (x.labels == y.labels).all()
    s = together[0]
    assert (s.tokens[1:] == s.labels[:-1]).all()
    follows = np.mean([(d.labels == data.succ[d.tokens]).mean() for d in data.batch(range(50))])
    assert 0.75 < follows < 0.85  # p_follow = 0.8 (+ 1/V chance)
    assert 0 < data.entropy_nats() < np.log(64)


def _chain_step_by_step(succ, start, follow, noise):
    """The chain's definition, one position at a time (the loop SyntheticTokens.chain replaces)."""
    seq = np.empty((len(start), follow.shape[1] + 1), dtype=np.int64)
    seq[:, 0] = start
    for t in range(follow.shape[1]):
        seq[:, t + 1] = np.where(follow[:, t], succ[seq[:, t]], noise[:, t])
    return seq


@pytest.mark.parametrize("vocab,T,p", [(64, 32, 0.8), (50304, 4096, 0.8), (7, 100, 0.99), (16, 20, 1.0), (16, 20, 0.0)])
def test_synthetic_chain_equals_stepping_it_position_by_position(vocab, T, p):
    data = SyntheticTokens(vocab_size=vocab, seq_len=T, seed=3, p_follow=p)
    rng = np.random.default_rng(11)
    start = rng.integers(vocab, size=3)
    follow = rng.random((3, T)) < p
    noise = rng.integers(vocab, size=(3, T))
    assert (data.chain(start, follow, noise) == _chain_step_by_step(data.succ, start, follow, noise)).all()


@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 2), (4, 1), (4, 2)])
def test_ranks_split_the_global_batch_exactly(dp, mbs):
    gbs, step = 8, 3
    indices = [j for r in range(dp) for mb in rank_sample_indices(step, gbs, dp, r, mbs) for j in mb]
    assert indices == list(range(step * gbs, (step + 1) * gbs))
    assert all(len(mb) == mbs for mb in rank_sample_indices(step, gbs, dp, 0, mbs))
