"""Training data: seeded synthetic tokens and packed token files, indexed by global sample.

Both sources are stateless maps `sample(j) -> Sample` over a global sample index
j = 0, 1, 2, ...; step t uses samples [t*gbs, (t+1)*gbs), data-parallel rank r
takes its contiguous gbs/dp share and splits it into micro-batches of mbs. The
data position of a run is therefore just the step, and the same seed gives the
same global batch for every layout (what the parity tests rely on).

Token file format (`write_token_file`): ``NAME.bin`` holds every token of the
corpus, documents back to back, as raw uint16 or uint32; ``NAME.idx.npz`` holds
``offsets`` (int64, n_docs + 1: document d is tokens [offsets[d], offsets[d+1]))
and ``dtype``. Document boundaries come from this index, never from scanning for
an EOS token. The corpus is cut into consecutive chunks of seq_len tokens (the
last one padded); an epoch visits every chunk once in a seeded order, so every
token is delivered as an input exactly once per epoch. Labels never cross a
document boundary (-100 there), attention is masked to the document, and RoPE
positions restart at each document start inside a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from perfmodel.errors import InputError

IGNORE = -100
"""Label of positions without a target (document end, padding): skipped by the loss."""


@dataclass(frozen=True)
class Sample:
    tokens: np.ndarray
    """(T,) int64 inputs."""
    labels: np.ndarray
    """(T,) int64 next tokens, IGNORE where there is none."""
    positions: np.ndarray
    """(T,) int64 RoPE positions."""
    doc_ids: Optional[np.ndarray] = None
    """(T,) int64 document of each position (-1 for padding); None: one document."""
    offset: int = -1
    """Corpus position of the first token (token files; -1 for synthetic data)."""


class SyntheticTokens:
    """Seeded Markov tokens with learnable structure.

    A fixed random permutation `succ` of the vocabulary (from the seed): the next
    token is succ[current] with probability `p_follow`, else uniform. A model can
    learn it, so the loss falls from ln V towards the chain's entropy
    -(p + (1-p)/V) ln(p + (1-p)/V) - (V-1) * ((1-p)/V) ln((1-p)/V).
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int, p_follow: float = 0.8):
        self.vocab_size, self.seq_len, self.seed, self.p_follow = vocab_size, seq_len, seed, p_follow
        self.succ = np.random.default_rng([seed, 0x5EED]).permutation(vocab_size)

    def entropy_nats(self) -> float:
        """Per-token entropy of the chain: the loss floor."""
        v, p = self.vocab_size, self.p_follow
        q_follow = p + (1 - p) / v
        q_other = (1 - p) / v
        return float(-q_follow * np.log(q_follow) - (v - 1) * q_other * np.log(q_other))

    def chain(self, start_B: np.ndarray, follow_BT: np.ndarray, noise_BT: np.ndarray) -> np.ndarray:
        """(B, T+1) tokens: x_0 = start, x_{t+1} = succ[x_t] where follow[t], else noise[t].

        A position d steps after the last restart r (position 0, or t+1 where follow[t] is false)
        holds succ applied d times to the token drawn at r, so the chain is built in as many
        passes as the longest run of follows (about ln(B*T) / ln(1/p_follow), a few dozen),
        each over the positions not yet done: the same tokens as stepping t = 0..T-1 (the
        reference the tests keep), thousands of times fewer numpy calls at T = 4096.
        """
        B, T = follow_BT.shape
        drawn = np.concatenate([start_B[:, None], noise_BT], axis=1)  # the token drawn at each restart
        positions = np.arange(T + 1)
        restart = np.concatenate([np.ones((B, 1), dtype=bool), ~follow_BT], axis=1)
        last = np.maximum.accumulate(np.where(restart, positions, 0), axis=1)
        steps = (positions - last).ravel()  # succ applications after the last restart
        seq = np.take_along_axis(drawn, last, axis=1).ravel()
        todo = np.flatnonzero(steps > 0)
        done = 0
        while todo.size:
            seq[todo] = self.succ[seq[todo]]
            done += 1
            todo = todo[steps[todo] > done]
        return seq.reshape(B, T + 1)

    def batch(self, indices: Sequence[int]) -> list[Sample]:
        T = self.seq_len
        rows = []
        for j in indices:  # each sample from its own stream: independent of batching
            rng = np.random.default_rng([self.seed, int(j)])
            rows.append((rng.integers(self.vocab_size), rng.random(T), rng.integers(self.vocab_size, size=T)))
        follow = np.stack([r[1] for r in rows]) < self.p_follow
        seq = self.chain(np.array([r[0] for r in rows], dtype=np.int64), follow, np.stack([r[2] for r in rows]))
        positions = np.arange(T, dtype=np.int64)
        return [Sample(tokens=s[:-1].copy(), labels=s[1:].copy(), positions=positions) for s in seq]


class TokenFileWriter:
    """Streaming writer of NAME.bin + NAME.idx.npz: `add(document)` one at a time, `close()` renames into place.

    Tokens go to a temp file next to NAME.bin as they come (memory: one document); nothing
    appears under the final names until `close()` (a crash leaves only dot-temp files).
    """

    def __init__(self, path: str | Path, dtype: str = "uint16"):
        if dtype not in ("uint16", "uint32"):
            raise InputError(f"token file dtype {dtype!r}: use uint16 or uint32")
        self.path, self.dtype = Path(path), dtype
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = self.path.with_name(f".{self.path.name}.tmp")
        self._handle = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self.max_token = -1

    def add(self, document: Sequence[int] | np.ndarray) -> None:
        tokens = np.asarray(document, dtype=np.int64)
        if tokens.size == 0:
            raise InputError(f"{self.path}: empty documents cannot be indexed; drop them")
        if tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max:
            raise InputError(f"{self.path}: token ids out of range for {self.dtype}; use uint32")
        tokens.astype(self.dtype).tofile(self._handle)
        self._lengths.append(int(tokens.size))
        self.max_token = max(self.max_token, int(tokens.max()))

    @property
    def n_documents(self) -> int:
        return len(self._lengths)

    @property
    def n_tokens(self) -> int:
        return int(sum(self._lengths))

    def close(self) -> Path:
        import os

        self._handle.close()
        offsets = np.concatenate([[0], np.cumsum(np.asarray(self._lengths, dtype=np.int64))]).astype(np.int64)
        index = index_path(self.path)
        tmp_idx = index.with_name(f".{index.name}.tmp.npz")
        np.savez(tmp_idx, offsets=offsets, dtype=np.asarray(self.dtype), max_token=np.asarray(self.max_token))
        os.replace(self._tmp_bin, self.path)
        os.replace(tmp_idx, index)
        return self.path

    def abort(self) -> None:
        self._handle.close()
        self._tmp_bin.unlink(missing_ok=True)


def write_token_file(path: str | Path, documents: Sequence[Sequence[int]], dtype: str = "uint16") -> Path:
    """Write NAME.bin + NAME.idx.npz (each through a temp file and a rename)."""
    writer = TokenFileWriter(path, dtype)
    try:
        for document in documents:
            writer.add(document)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def index_path(path: str | Path) -> Path:
    path = Path(path)
    stem = path.name[:-4] if path.name.endswith(".bin") else path.name
    return path.with_name(f"{stem}.idx.npz")


class TokenFile:
    """A packed token file read through numpy memmap, cut into seq_len chunks."""

    def __init__(self, path: str | Path, seq_len: int, seed: int):
        self.path, self.seq_len, self.seed = Path(path), seq_len, seed
        index = index_path(self.path)
        if not self.path.is_file():
            raise InputError(f"data: token file {self.path} not found; give NAME.bin written by write_token_file")
        if not index.is_file():
            raise InputError(f"data: index {index} not found; token files need their NAME.idx.npz document index")
        with np.load(index) as meta:
            self.offsets = meta["offsets"].astype(np.int64)
            dtype = str(meta["dtype"])
            self.max_token = int(meta["max_token"])
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        if self.offsets[0] != 0 or self.offsets[-1] != self.tokens.size or (np.diff(self.offsets) <= 0).any():
            raise InputError(f"data: index {index} does not match {self.path} ({self.tokens.size} tokens); rewrite both")
        self.n_tokens = int(self.tokens.size)
        self.n_chunks = -(-self.n_tokens // seq_len)

    def _chunk_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_chunks)

    def sample(self, j: int) -> Sample:
        epoch, slot = divmod(int(j), self.n_chunks)
        return self.sample_chunk(int(self._chunk_order(epoch)[slot]))

    def sample_chunk(self, chunk: int) -> Sample:
        """Chunk number `chunk` (tokens [chunk*T, (chunk+1)*T)), independent of the epoch order."""
        T = self.seq_len
        start = chunk * T
        end = min(start + T, self.n_tokens)
        n = end - start
        pos = np.arange(start, end, dtype=np.int64)
        doc = np.searchsorted(self.offsets, pos, side="right") - 1
        tokens = np.zeros(T, dtype=np.int64)
        tokens[:n] = self.tokens[start:end]
        labels = np.full(T, IGNORE, dtype=np.int64)
        nxt = np.minimum(pos + 1, self.n_tokens - 1)
        same_doc = (pos + 1 < self.n_tokens) & (np.searchsorted(self.offsets, nxt, side="right") - 1 == doc)
        labels[:n] = np.where(same_doc, self.tokens[nxt].astype(np.int64), IGNORE)
        doc_ids = np.full(T, -1, dtype=np.int64)
        doc_ids[:n] = doc
        positions = np.zeros(T, dtype=np.int64)
        segment_start = np.maximum(self.offsets[doc], start)  # document start inside this chunk
        positions[:n] = pos - segment_start
        return Sample(tokens=tokens, labels=labels, positions=positions, doc_ids=doc_ids, offset=start)

    def batch(self, indices: Sequence[int]) -> list[Sample]:
        return [self.sample(j) for j in indices]


def make_source(data: str, vocab_size: int, seq_len: int, seed: int) -> SyntheticTokens | TokenFile:
    if data == "synthetic":
        return SyntheticTokens(vocab_size, seq_len, seed)
    source = TokenFile(data, seq_len, seed)
    if source.max_token >= vocab_size:
        raise InputError(f"data: {data} holds token id {source.max_token} >= vocab_size={vocab_size}; "
                         "use a model with a larger vocabulary")
    return source


def rank_sample_indices(step: int, gbs: int, dp: int, dp_rank: int, mbs: int) -> list[list[int]]:
    """Global sample indices of each micro-batch of `dp_rank` at `step` (0-based)."""
    per_rank = gbs // dp
    base = step * gbs + dp_rank * per_rank
    return [list(range(base + i, base + i + mbs)) for i in range(0, per_rank, mbs)]


def collate(samples: Sequence[Sample]):
    """Stack samples into torch tensors (B, T): tokens, labels, positions, doc_ids (or None)."""
    import torch

    tokens = torch.from_numpy(np.stack([s.tokens for s in samples]))
    labels = torch.from_numpy(np.stack([s.labels for s in samples]))
    positions = torch.from_numpy(np.stack([s.positions for s in samples]))
    doc_ids = None
    if samples[0].doc_ids is not None:
        doc_ids = torch.from_numpy(np.stack([s.doc_ids for s in samples]))
    return tokens, labels, positions, doc_ids
