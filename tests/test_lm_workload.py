"""The language-model workload: a held-out split of whole files, deterministic batches, a causal model."""

from __future__ import annotations

import math

import torch

from potluck.workloads import lm


def fake_stdlib(root, changed: bytes = b""):
    """A standard library of 100 small modules, plus directories the corpus skips."""
    for i in range(100):
        (root / "pkg" if i % 3 else root).mkdir(exist_ok=True)
        path = (root / "pkg" if i % 3 else root) / f"mod{i}.py"
        path.write_bytes(f"# module {i}\nx = {i}\n".encode() + (changed if i == 7 else b""))
    for skipped in ("test", "site-packages", "idlelib"):
        (root / skipped).mkdir(exist_ok=True)
        (root / skipped / "skipped.py").write_bytes(b"SKIPPED\n")
    return root


def test_the_split_holds_out_whole_files_the_same_way_every_time(tmp_path):
    root = fake_stdlib(tmp_path)
    corpus = lm.load_corpus(root)
    files = dict(lm.stdlib_files(root))
    assert not any("skipped" in name for name in files) and len(files) == 100
    assert corpus.val_files and corpus.train_files and not set(corpus.val_files) & set(corpus.train_files)
    assert sorted(corpus.val_files + corpus.train_files) == sorted(files)
    assert all(lm.held_out(name) for name in corpus.val_files)
    # whole files, in sorted order, end to end
    assert bytes(corpus.val.numpy()) == b"".join(files[name].read_bytes() for name in corpus.val_files)
    assert bytes(corpus.train.numpy()) == b"".join(files[name].read_bytes() for name in corpus.train_files)
    again = lm.load_corpus(root)
    assert again.digest == corpus.digest and again.val_files == corpus.val_files
    assert lm.load_corpus(fake_stdlib(root, changed=b"y = 1\n")).digest != corpus.digest
    small = lm.load_corpus(root, max_bytes=len(corpus.train) // 2)  # the cap stops reading files
    assert len(small.train) + len(small.val) <= len(corpus.train) // 2


def test_batches_are_windows_of_the_training_bytes_and_differ_per_rank(tmp_path):
    corpus = lm.load_corpus(fake_stdlib(tmp_path))
    x, y = next(lm.batches(corpus, 4, 8, rank=1, seed=3))
    assert x.shape == y.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    text = bytes(corpus.train.numpy())
    assert all(bytes(row.tolist()) in text for row in x)
    assert torch.equal(x, next(lm.batches(corpus, 4, 8, rank=1, seed=3))[0])
    assert not torch.equal(x, next(lm.batches(corpus, 4, 8, rank=2, seed=3))[0])
    assert torch.equal(lm.validation_sample(corpus, 8, 3)[0], lm.validation_sample(corpus, 8, 3)[0])


def test_the_model_is_causal_and_starts_alike_for_the_same_seed():
    config = lm.LMConfig(d_model=32, layers=2, heads=2, context=16)
    model = lm.make_lm(config)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    later = x.clone()
    later[:, 10] = (later[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(later)
    assert a.shape == (2, 16, 256)
    assert torch.allclose(a[:, :10], b[:, :10]) and not torch.allclose(a[:, 10:], b[:, 10:])
    assert torch.equal(lm.make_lm(config).embed.weight, model.embed.weight)
    # the head is the embedding: no output matrix of its own
    assert [name for name, p in model.named_parameters() if p.shape == (256, 32)] == ["embed.weight"]
    result = lm.evaluate(model, (x, later))
    assert math.isclose(result["bits_per_byte"], result["val_loss"] / math.log(2))
