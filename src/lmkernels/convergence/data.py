"""Training data for the convergence runs, with no network access.

The corpus is tiny Shakespeare (public domain), shipped in `lmkernels/convergence/data/` and read
as one UTF-8 string (the same text `datasets`' "text" builder with sample_by="document" gives,
without its cache in the user's home or its progress output). The tokenizer is a byte-level BPE trained on the corpus
at run time with the `tokenizers` package (about a second), so nothing comes from a hub; it and
the token ids are cached in memory for the process. Training is deterministic (same merges on
every run), but another `tokenizers` version may merge differently: each comparison tokenizes
once and feeds the same batches to every run, so that cannot affect a verdict.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmkernels.registry import LMKernelsError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DEFAULT_VOCAB_SIZE = 512
EVAL_FRACTION = 0.1  # the last 10% of the token stream is held out for evaluation


def corpus_path() -> Path:
    return Path(str(resources.files("lmkernels.convergence") / "data" / "tinyshakespeare.txt"))


@functools.lru_cache(maxsize=4)
def load_text(path: str | None = None) -> str:
    """The corpus as one string, newlines included (local file, no hub access, no cache)."""
    path = str(path or corpus_path())
    if not Path(path).is_file():
        raise LMKernelsError(f"path: corpus file {path!r} does not exist")
    return Path(path).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=4)
def tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, path: str | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the corpus (every byte is in the vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet):
        raise LMKernelsError(
            f"vocab_size: expected at least {len(alphabet)} (the byte alphabet), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([load_text(path)], trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def token_ids(vocab_size: int = DEFAULT_VOCAB_SIZE, path: str | None = None) -> torch.Tensor:
    tok = tokenizer(vocab_size, path)
    # One encode per line (in parallel, rust side) is much faster than one 1 MB string; the
    # newlines are kept at the line ends so the stream is the whole text.
    lines = load_text(path).splitlines(keepends=True)
    ids = [i for enc in tok.encode_batch(lines) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int64)


@dataclasses.dataclass
class Batches:
    """Fixed token batches (B, T): labels are the input ids (the model shifts them)."""

    train: list[torch.Tensor]
    eval: list[torch.Tensor]
    vocab_size: int


def make_batches(
    steps: int,
    batch_size: int,
    seq_len: int,
    eval_batches: int = 2,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    path: str | None = None,
) -> Batches:
    """`steps` training batches of random windows (seeded), and `eval_batches` fixed windows
    from the held-out tail of the corpus."""
    for name, value in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("eval_batches", eval_batches),
    ):
        if not isinstance(value, int) or value < 1:
            raise LMKernelsError(f"{name}: expected a positive int, got {value!r}")
    ids = token_ids(vocab_size, path)
    split = int(len(ids) * (1 - EVAL_FRACTION))
    train_ids, eval_ids = ids[:split], ids[split:]
    if len(eval_ids) < eval_batches * batch_size * seq_len:
        raise LMKernelsError(
            f"seq_len: {eval_batches} eval batches of {batch_size} x {seq_len} tokens need more than "
            f"the {len(eval_ids)} held-out tokens"
        )
    g = torch.Generator().manual_seed(seed)
    train = []
    for _ in range(steps):
        starts = torch.randint(0, len(train_ids) - seq_len, (batch_size,), generator=g)
        train.append(torch.stack([train_ids[s : s + seq_len] for s in starts.tolist()]))
    windows = eval_ids[: eval_batches * batch_size * seq_len].view(eval_batches, batch_size, seq_len)
    return Batches(train=train, eval=list(windows), vocab_size=tokenizer(vocab_size, path).get_vocab_size())
