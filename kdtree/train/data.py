"""Training text for the tiny model: the top-level .py modules of the running Python's standard library.

Available offline wherever Python is. Each file becomes bos + utf-8 bytes + eos (byte tokens 0..255,
bos 256, eos 257). Files are split train / held-out by a hash of the file name (deterministic across
machines), and `provenance()` records the python version, every file with its size and sha256, and
the hash of the whole corpus, so a training run can be traced to its bytes.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

BOS, EOS = 256, 257


def stdlib_files(root: Optional[str] = None) -> List[Path]:
    """Sorted top-level *.py files of the stdlib (no packages, no tests)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def is_heldout(name: str, heldout_mod: int = 12) -> bool:
    return zlib.crc32(name.encode()) % heldout_mod == 0


def encode_doc(data: bytes) -> np.ndarray:
    return np.concatenate([[BOS], np.frombuffer(data, np.uint8).astype(np.int64), [EOS]])


class Corpus:
    """train / heldout token streams (int64) + provenance."""

    def __init__(self, root: Optional[str] = None, heldout_mod: int = 12, max_bytes_per_file: int = 200_000):
        self.root = str(root or sysconfig.get_paths()["stdlib"])
        self.files = stdlib_files(self.root)
        if not self.files:
            raise FileNotFoundError(f"no *.py files under {self.root}; pass a directory of text files")
        self.heldout_mod = heldout_mod
        self.max_bytes_per_file = max_bytes_per_file
        train, held, recs = [], [], []
        whole = hashlib.sha256()
        self.heldout_docs: List[Tuple[str, bytes]] = []
        for p in self.files:
            data = p.read_bytes()[:max_bytes_per_file]
            whole.update(p.name.encode() + b"\0" + data)
            h = is_heldout(p.name, heldout_mod)
            recs.append({"file": p.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "heldout": h})
            (held if h else train).append(encode_doc(data))
            if h:
                self.heldout_docs.append((p.name, data))
        self.train = np.concatenate(train)
        self.heldout = np.concatenate(held)
        self.records = recs
        self.sha256 = whole.hexdigest()

    def provenance(self) -> Dict:
        return {
            "source": "top-level *.py files of the Python standard library (sysconfig stdlib path), sorted by name",
            "python": platform.python_version(),
            "stdlib": self.root,
            "max_bytes_per_file": self.max_bytes_per_file,
            "heldout_rule": f"zlib.crc32(file name) % {self.heldout_mod} == 0",
            "n_files": len(self.records),
            "train_tokens": int(self.train.size),
            "heldout_tokens": int(self.heldout.size),
            "corpus_sha256": self.sha256,
            "files": self.records,
        }

    def batch(self, rng: np.random.Generator, n: int, length: int, split: str = "train") -> np.ndarray:
        """n random windows of length+1 tokens (inputs = [:, :-1], labels = [:, 1:])."""
        s = self.train if split == "train" else self.heldout
        starts = rng.integers(0, s.size - length - 1, n)
        return np.stack([s[i:i + length + 1] for i in starts])

    def prompts(self, rng: np.random.Generator, n: int, length: int, split: str = "train") -> np.ndarray:
        """n prompts of `length` tokens, each starting at a line start and lying inside one document."""
        s = self.train if split == "train" else self.heldout
        starts = np.flatnonzero(s[:-length - 1] == 10) + 1                 # just after a newline
        special = np.concatenate([[0], np.cumsum((s == BOS) | (s == EOS))])   # specials in s[:i]
        starts = starts[special[starts + length] == special[starts]]         # inside one document
        pick = rng.choice(starts, n, replace=False)
        return np.stack([s[i:i + length] for i in pick])
