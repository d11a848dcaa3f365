"""A language model on real text that every machine has: the Python standard library's source.

The corpus is the bytes of the standard library's own `.py` files (no download): sorted by
relative path, without third-party packages, tests and the IDLE/2to3 sources, read up to
`MAX_CORPUS_BYTES`. Whole files are held out for validation, chosen by a hash of their relative
path, so the split is the same on every machine with the same Python; another Python version has
other files and gives another corpus (`Corpus.digest` tells them apart; reports record it).

The model is a small byte-level GPT: a byte embedding, pre-LN transformer blocks with causal
self-attention (`scaled_dot_product_attention`) and a head tied to the embedding. Its default size
(0.44M parameters) gets below the unigram entropy in about a hundred steps on one CPU core.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

# Directories of the standard library left out: installed packages are not the standard library
# (and differ between machines), and the test suites, IDLE and lib2to3 are large and repetitive
# enough to dominate the corpus.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
# The most bytes read from the standard library (CPython 3.11's is about 11 MB without the skipped
# directories): a bound on memory and start-up time on an unusual installation.
MAX_CORPUS_BYTES = 32 << 20
# Files whose path hash falls below this (out of 1000) are held out for validation: about 5%.
HELD_OUT_PER_MILLE = 50
# Bytes of held-out text the validation loss is measured on: windows at fixed places, enough for
# a stable figure (about +-0.01 nats) and cheap enough to evaluate every few seconds on a CPU.
VALIDATION_WINDOWS = 64
VOCAB = 256  # bytes


@dataclass(frozen=True)
class Corpus:
    """The training and held-out bytes (uint8 tensors; files joined end to end)."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    digest: str  # sha256 of the file names and bytes, in order: equal corpora on two machines

    def describe(self) -> dict:
        """What a report records about the data."""
        return {"corpus": "python-stdlib", "corpus_digest": self.digest, "train_bytes": len(self.train),
                "val_bytes": len(self.val), "train_files": len(self.train_files), "val_files": len(self.val_files)}


def held_out(relative_path: str) -> bool:
    """Whether a file (by its path relative to the standard library, with '/') is a validation file."""
    h = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:4], "big")
    return h % 1000 < HELD_OUT_PER_MILLE


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of the corpus's files, sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if not SKIPPED_DIRS.intersection(relative.parts[:-1]) and path.is_file():
            files.append((relative.as_posix(), path))
    return sorted(files)


def load_corpus(root: Path | None = None, max_bytes: int = MAX_CORPUS_BYTES) -> Corpus:
    """Read the corpus (deterministic: the same files and bytes for the same standard library)."""
    train, val, train_names, val_names = [], [], [], []
    digest = hashlib.sha256()
    total = 0
    for relative, path in stdlib_files(root):
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        digest.update(relative.encode() + b"\0" + data + b"\0")
        (val if held_out(relative) else train).append(data)
        (val_names if held_out(relative) else train_names).append(relative)
    if not train or not val:
        raise ValueError(f"the standard library at {root} is too small for a training and a held-out split")
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), tuple(train_names), tuple(val_names), digest.hexdigest())


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets (int64, shape (len(starts), context)) of windows at `starts`."""
    index = starts[:, None] + torch.arange(context + 1)
    chunk = data[index].long()
    return chunk[:, :-1], chunk[:, 1:]


def batches(corpus: Corpus, batch_size: int, context: int, rank: int = 0, seed: int = 0
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random training windows, a different endless stream for every (seed, rank)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    while True:
        starts = torch.randint(0, len(corpus.train) - context - 1, (batch_size,), generator=generator)
        yield windows(corpus.train, starts, context)


def validation_sample(corpus: Corpus, context: int, count: int = VALIDATION_WINDOWS
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out windows every run is measured on (same places for the same corpus)."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(corpus.val) - context - 1, (count,), generator=generator)
    return windows(corpus.val, starts, context)


def unigram_entropy(corpus: Corpus) -> float:
    """Nats per byte of the training bytes' own frequencies: what a model that ignores context
    reaches at best. A model that learned anything from context is below it."""
    counts = torch.bincount(corpus.train.long(), minlength=VOCAB).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LMConfig:
    """The default learns fastest per CPU second of the sizes tried (4 layers or 128-byte
    windows learned less per second on a 2-core machine)."""

    d_model: int = 128
    layers: int = 2
    heads: int = 4
    context: int = 64


class _Block(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.heads = config.heads
        self.norm1, self.norm2 = nn.LayerNorm(config.d_model), nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.norm2(h))


class ByteGPT(nn.Module):
    """A byte-level decoder: logits (batch, time, 256) for the next byte at every position."""

    def __init__(self, config: LMConfig = LMConfig()):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.d_model)
        self.position = nn.Parameter(torch.zeros(config.context, config.d_model))
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.d_model)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[:x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.norm(h) @ self.embed.weight.T  # the head is the embedding (tied)


def make_lm(config: LMConfig = LMConfig(), seed: int = 0) -> ByteGPT:
    """The model with the same initial weights for the same seed (every peer starts alike)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ByteGPT(config)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats."""
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def evaluate(model: nn.Module, sample: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Validation loss (nats per byte) and bits per byte on a fixed held-out sample."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = float(lm_loss(model, *sample))
    model.train(was_training)
    return {"val_loss": loss, "bits_per_byte": loss / math.log(2)}


__all__ = ["ByteGPT", "Corpus", "LMConfig", "batches", "evaluate", "held_out", "lm_loss", "load_corpus", "make_lm",
           "stdlib_files", "unigram_entropy", "validation_sample"]
