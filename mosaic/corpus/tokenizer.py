"""An offline byte-level BPE tokenizer trained on the corpus itself (HuggingFace `tokenizers`).

Byte-level pre-tokenisation (GPT-2's) over an initial alphabet of all 256 bytes, so every
text encodes without unknown tokens, then BPE merges learnt from the training split up to
`vocab_size` (Sennrich et al. 2016; `tokenizers.trainers.BpeTrainer`). Nothing is downloaded:
the model is learnt here and saved as ``tokenizer.json`` beside the token files.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from perfmodel.errors import InputError

MIN_VOCAB = 257     # the 256 byte symbols and at least one merge


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise InputError("data prepare needs the 'tokenizers' package: pip install 'mosaic-planner[data]'") from None
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` learnt from `texts`."""
    tk = _tokenizers()
    if vocab_size < MIN_VOCAB:
        raise InputError(f"--vocab-size {vocab_size}: byte-level BPE needs >= {MIN_VOCAB} (256 bytes + merges)")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


def load(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--tokenizer {path}: no such file; give a tokenizer.json written by `mosaic data prepare`")
    try:
        return _tokenizers().Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type for a bad file
        raise InputError(f"--tokenizer {path}: not a tokenizers JSON file ({exc})") from None


__all__ = ["MIN_VOCAB", "load", "train_bpe"]
