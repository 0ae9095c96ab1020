"""Pretraining data: a byte-level tokenizer, the bundled corpus, a Megatron indexed dataset, batches.

The pipeline is the one Megatron-LM uses, built from parts that need no download:

1. **Corpus.** By default the source files of the running Python's standard library (``*.py`` under
   ``sysconfig.get_paths()["stdlib"]``, tests and vendored packages excluded), read in sorted path
   order and capped at a few MB. Every machine that runs this package has them, and they are
   distributed under the Python Software Foundation License (PSF-2.0), which permits copying and use
   for this purpose. The text differs between Python versions; the manifest written beside the
   dataset records the version, file count and a SHA-256 of the corpus. A user corpus (a text file or
   a folder of text files) or an existing ``.bin``/``.idx`` prefix can be given instead.
2. **Tokenizer.** :class:`ByteTokenizer`: UTF-8 bytes 0-255, end-of-document 256, padding 257.
3. **Indexed dataset.** One document per file, written with megatron-core's ``IndexedDatasetBuilder``
   (``uint16`` tokens) as ``PREFIX.bin``/``PREFIX.idx``; both launch scripts read the same files.
4. **Samples.** megatron-core's ``GPTDataset`` (via ``BlendedMegatronDatasetBuilder``) cuts the token
   stream into shuffled sequences; the split is 98% train / 2% validation by document.
5. **Batches.** :class:`GlobalBatches`: global batch *b* is samples ``[b*G, (b+1)*G)``, so the data a
   rank sees depends only on (step, rank). A resumed run therefore continues with exactly the batch
   the stopped run would have seen next, without saving any sampler state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

__all__ = [
    "ByteTokenizer",
    "DataError",
    "STDLIB_LICENSE",
    "collect_stdlib_corpus",
    "collect_text_corpus",
    "build_indexed_dataset",
    "prepare_dataset",
    "build_gpt_datasets",
    "GlobalBatches",
]

STDLIB_LICENSE = "PSF-2.0 (Python Software Foundation License), the licence of the Python standard library"
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
# Files above this size are skipped so a few huge generated files (Unicode tables, the pydoc topic
# dump) do not crowd out ordinary code in a corpus capped at a few MB.
MAX_FILE_BYTES = 200 * 1024
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "ensurepip", "encodings", "lib2to3", "turtledemo"}
MANIFEST_FORMAT = "topo-align/dataset/v1"


class DataError(ValueError):
    """A corpus or dataset that cannot be used; the message names the path and what was expected."""


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes are tokens 0-255; 256 ends a document; 257 pads.

    It provides the attributes megatron-core's ``GPTDataset`` reads from a tokenizer (``vocab_size``,
    ``eod``, ``pad``, ``unique_identifiers``), so no tokenizer files are needed.
    """

    eod = 256
    pad = 257
    vocab_size = 258

    def __init__(self) -> None:
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# -- corpus ------------------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, bytes]]:
    """(relative path, UTF-8 bytes) of standard-library ``*.py`` files in sorted order, capped.

    Files are taken whole, in sorted order of their relative paths, until ``max_bytes`` is reached;
    so the same Python version always yields the same corpus.
    """
    root = stdlib_root()
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        paths.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return _take(sorted(paths, key=lambda p: p.relative_to(root).as_posix()), root, max_bytes)


def collect_text_corpus(path: str | os.PathLike[str], max_bytes: int | None = None) -> list[tuple[str, bytes]]:
    """Documents from a user corpus: a text file (one document) or a folder (every UTF-8 file, in
    sorted path order, one document each)."""
    p = Path(path)
    if p.is_file():
        files, root = [p], p.parent
    elif p.is_dir():
        files = sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.relative_to(p).as_posix())
        root = p
    else:
        raise DataError(f"--corpus {str(path)!r}: no such file or folder; give a text file or a folder of text files")
    docs = _take(files, root, max_bytes if max_bytes is not None else sys.maxsize, skip_large=False)
    if not docs:
        raise DataError(f"--corpus {str(path)!r}: holds no non-empty UTF-8 text files")
    return docs


def _take(paths: list[Path], root: Path, max_bytes: int, skip_large: bool = True) -> list[tuple[str, bytes]]:
    docs: list[tuple[str, bytes]] = []
    total = 0
    for path in paths:
        try:
            if skip_large and path.stat().st_size > MAX_FILE_BYTES:
                continue
            raw = path.read_bytes()
            raw.decode("utf-8")  # only text documents; a binary file would be noise
        except (OSError, UnicodeDecodeError):
            continue
        if not raw.strip():
            continue
        docs.append((path.relative_to(root).as_posix(), raw))
        total += len(raw)
        if total >= max_bytes:
            break
    return docs


def corpus_digest(docs: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, raw in docs:
        h.update(name.encode("utf-8") + b"\0" + len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()


# -- indexed dataset ---------------------------------------------------------------------------------

def build_indexed_dataset(prefix: str | os.PathLike[str], docs: list[tuple[str, bytes]],
                          tokenizer: ByteTokenizer | None = None) -> int:
    """Write ``PREFIX.bin``/``PREFIX.idx`` (one document per entry, EOD appended); returns tokens.

    Written under temporary names and renamed, so a killed build never leaves a half-written
    dataset that a later run would trust.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = tokenizer or ByteTokenizer()
    prefix = str(prefix)
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=np.uint16)
    n_tokens = 0
    for _, raw in docs:
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        ids = np.append(ids, np.uint16(tok.eod))
        builder.add_document(torch.from_numpy(ids.astype(np.int64)), [len(ids)])
        n_tokens += len(ids)
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    return n_tokens


def prepare_dataset(out_dir: str | os.PathLike[str], *, corpus: str = "stdlib",
                    max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, dict]:
    """Build the indexed dataset for ``corpus`` under ``out_dir`` unless an identical one exists.

    ``corpus`` is ``"stdlib"`` (the bundled default) or a path to a text file or folder. Returns the
    prefix and the manifest (also written as ``PREFIX.json``). Call on one rank, then barrier.
    """
    if max_bytes <= 0:
        raise DataError(f"--corpus-max-bytes {max_bytes}: must be a positive number of bytes")
    if corpus == "stdlib":
        docs = collect_stdlib_corpus(max_bytes)
        source = {"corpus": "stdlib", "root": str(stdlib_root()), "python": sys.version.split()[0],
                  "license": STDLIB_LICENSE}
        name = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    else:
        docs = collect_text_corpus(corpus, max_bytes)
        source = {"corpus": str(Path(corpus).resolve()), "license": "as given by the user"}
        name = "corpus-" + hashlib.sha256(str(Path(corpus).resolve()).encode()).hexdigest()[:8]
    if not docs:
        raise DataError(f"corpus {corpus!r}: no documents found")
    digest = corpus_digest(docs)
    manifest = {
        "format": MANIFEST_FORMAT, **source, "tokenizer": "ByteTokenizer(vocab=258, eod=256, pad=257)",
        "documents": len(docs), "bytes": sum(len(r) for _, r in docs), "max_bytes": max_bytes,
        "sha256": digest,
    }
    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(str(out_dir), f"{name}-{digest[:12]}")
    mpath = prefix + ".json"
    if os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx") and os.path.exists(mpath):
        try:
            with open(mpath, encoding="utf-8") as fh:
                stored = json.load(fh)
            if stored.get("sha256") == digest:
                return prefix, stored
        except (OSError, ValueError):
            pass
    manifest["tokens"] = build_indexed_dataset(prefix, docs)
    with open(mpath + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2)
    os.replace(mpath + ".tmp", mpath)
    return prefix, manifest


def check_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise DataError(f"--data-path {prefix!r}: {prefix + ext} does not exist; give the prefix of a "
                            "megatron-core indexed dataset (PREFIX.bin and PREFIX.idx)")


def build_gpt_datasets(prefix: str, *, seq_length: int, seed: int, train_samples: int,
                       valid_samples: int, cache_dir: str, split: str = "98,2,0"):
    """megatron-core ``GPTDataset`` train and validation splits over ``prefix`` (collective).

    Communication: every rank of the default group must call this; megatron-core's builder lets
    rank 0 write the index caches first, then (after its barrier) the other ranks read them.
    """
    import logging

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    # megatron-core logs every index it builds at INFO; the progress bar is the user's view here.
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    check_prefix(prefix)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
        path_to_cache=cache_dir, tokenizer=ByteTokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )
    # megatron-core loops forever building a split with no document; refuse it here instead.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    n_docs = len(IndexedDataset(prefix))
    for name, bookends in zip(("train", "validation"), config.split_matrix[:2]):
        if bookends is None or int(round(bookends[1] * n_docs)) - int(round(bookends[0] * n_docs)) < 1:
            raise DataError(f"dataset {prefix!r}: its {n_docs} documents leave the {name} split empty with "
                            f"split {split!r}; use a larger corpus (--corpus-max-bytes) or more documents")
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, None], lambda: True, config).build()
    if train is None or len(train) == 0 or valid is None or len(valid) == 0:
        raise DataError(f"dataset {prefix!r} is too small for sequences of {seq_length} tokens "
                        f"with split {split!r}; use a larger corpus or a shorter --seq-length")
    return train, valid


@dataclass
class GlobalBatches:
    """Deterministic data-parallel batching over a map-style dataset of token samples.

    Global batch ``b`` (one optimizer step) holds samples ``[b*G, (b+1)*G)`` modulo the dataset
    length, ``G = micro_batch * accum * dp_size``. Data-parallel rank ``r`` takes micro-batch ``m``
    = samples ``b*G + (m*dp_size + r)*micro_batch`` onwards, so the union over ranks is the global
    batch whatever the world size, and the batch of a step never depends on what ran before it.
    """

    dataset: object
    micro_batch: int
    dp_size: int
    dp_rank: int
    accum: int = 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.dp_size

    def micro(self, step: int, m: int = 0) -> dict[str, torch.Tensor]:
        start = step * self.global_batch + (m * self.dp_size + self.dp_rank) * self.micro_batch
        n = len(self.dataset)
        items = [self.dataset[(start + i) % n] for i in range(self.micro_batch)]
        return {k: torch.stack([it[k] for it in items]) for k in ("tokens", "labels", "loss_mask")}

    def eval_batches(self, n_batches: int) -> list[dict[str, torch.Tensor]]:
        """The same ``n_batches`` micro-batches every time: validation losses are comparable."""
        return [self.micro(i) for i in range(n_batches)]


def main(argv: list[str] | None = None) -> int:
    """``python -m topo_integrations.train.data [OUT_DIR]``: build the default dataset, print its manifest."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out_dir", nargs="?", default="runs/data")
    ap.add_argument("--corpus", default="stdlib")
    ap.add_argument("--corpus-max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    args = ap.parse_args(argv)
    try:
        prefix, manifest = prepare_dataset(args.out_dir, corpus=args.corpus, max_bytes=args.corpus_max_bytes)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"prefix": prefix, **manifest}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
