"""Data for the workload examples, present on every machine without a download.

- ``digits_images``: scikit-learn's bundled 8x8 digits as 1x8x8 images (1797 of them), with
  ``shift_batch`` for augmentation by one-pixel shifts.
- ``stdlib_corpus``: a fixed selection of the running Python's standard-library source files
  (``CORPUS_FILES``), read as bytes; the last 10% of every file is held out for validation. The
  bytes are the same on every machine with the same Python version (3.11.7: 933,291 bytes;
  ``corpus_summary`` prints the count and a SHA-256 for the version at hand).
"""
import hashlib
import os
import sysconfig

import numpy as np

CORPUS_FILES = (
    "argparse.py", "ast.py", "bisect.py", "calendar.py", "collections/__init__.py", "csv.py",
    "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py",
    "inspect.py", "json/decoder.py", "json/encoder.py", "shlex.py", "statistics.py", "string.py",
    "textwrap.py", "typing.py",
)
HELD_OUT = 0.1


def digits_images(seed=0, test_size=0.25):
    """Train/test split of the digits as float32 arrays (N, 1, 8, 8) in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y.astype(np.int64), test_size=test_size,
                                          random_state=seed, stratify=y)
    return xtr, ytr, xte, yte


def shift_batch(x, rng, max_shift=1):
    """Shift each image (N, C, H, W) by up to ``max_shift`` pixels in each direction, zero fill."""
    n, _, h, w = x.shape
    pad = np.pad(x, ((0, 0), (0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    dy = rng.integers(0, 2 * max_shift + 1, size=n)
    dx = rng.integers(0, 2 * max_shift + 1, size=n)
    out = np.empty_like(x)
    for i in range(n):
        out[i] = pad[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
    return out


def stdlib_corpus(files=CORPUS_FILES, held_out=HELD_OUT):
    """(train bytes, validation bytes) as uint8 arrays: per file, the first 90% / the last 10%."""
    root = sysconfig.get_paths()["stdlib"]
    train, val = [], []
    for name in files:
        path = os.path.join(root, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"corpus file {path} is missing from this Python's standard "
                                    "library; pass another selection (CORPUS_FILES) or use a full "
                                    "CPython install")
        with open(path, "rb") as f:
            data = f.read()
        cut = int(len(data) * (1 - held_out))
        train.append(data[:cut])
        val.append(data[cut:])
    return (np.frombuffer(b"".join(train), dtype=np.uint8),
            np.frombuffer(b"".join(val), dtype=np.uint8))


def corpus_summary(train, val):
    digest = hashlib.sha256(train.tobytes() + val.tobytes()).hexdigest()[:16]
    return (f"corpus: {len(CORPUS_FILES)} stdlib files, {len(train) + len(val):,} bytes "
            f"({len(train):,} train, {len(val):,} held out), sha256 {digest}")
