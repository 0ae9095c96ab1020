"""Where the Megatron-LM tests find Megatron-LM's training code (``megatron.training``, not in the
megatron-core wheel): ``MEGATRON_LM=DIR`` (a checkout at tag core_v0.16.1), else the vendored
tarball ``vendor/megatron-lm-core_v0.16.1-training.tar.gz`` of the ``shared`` folder next to the
repository (as in CI), unpacked once into the ignored ``.cache/`` folder of the checkout."""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARBALL = ROOT.parent / "shared" / "vendor" / "megatron-lm-core_v0.16.1-training.tar.gz"
CACHE = ROOT / ".cache" / "megatron-lm"
SKIP_REASON = ("no Megatron-LM tree: set MEGATRON_LM to a checkout at tag core_v0.16.1, or put "
               "the vendored megatron-lm-core_v0.16.1-training.tar.gz next to the repository")


def _is_tree(path: Path) -> bool:
    return (path / "pretrain_gpt.py").is_file() and (path / "megatron" / "training").is_dir()


def megatron_lm_tree() -> str | None:
    """The Megatron-LM directory to use, or None when there is none."""
    given = os.environ.get("MEGATRON_LM")
    if given:
        return given if _is_tree(Path(given)) else None
    if not TARBALL.is_file():
        return None
    digest = hashlib.sha256(TARBALL.read_bytes()).hexdigest()[:12]
    dest = CACHE / digest
    if not _is_tree(dest / "megatron-lm"):
        tmp = CACHE / f".unpack-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(TARBALL) as tar:
            tar.extractall(tmp, filter="data")
        try:
            os.replace(tmp, dest)  # atomic: a parallel unpack of the same tarball wins or loses whole
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest / "megatron-lm") if _is_tree(dest / "megatron-lm") else None
