"""topo-align: topology-aware gradient reduction for DeepSpeed and Megatron."""

import ast
from pathlib import Path

from setuptools import find_packages, setup


def megatron_core_requirement() -> str:
    """``megatron-core>=LO,<HI`` from `CORE_RANGE` in topo_integrations/megatron/compat.py, the range
    the adapter's version gate accepts (read as a literal: the package cannot be imported here)."""
    tree = ast.parse((Path(__file__).parent / "topo_integrations" / "megatron" / "compat.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CORE_RANGE"]:
            lo, hi = ast.literal_eval(node.value)
            return f"megatron-core>={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    raise RuntimeError("topo_integrations/megatron/compat.py defines no CORE_RANGE literal")


# Ranges users need; the exact versions CI tests are pinned in constraints.txt.
EXTRAS = {
    "deepspeed": ["deepspeed>=0.17,<0.20"],
    # six and PyYAML: imported at import time by Megatron-LM's training code (pretrain_gpt.py;
    # docs/megatron.md), which users bring; megatron-core itself needs neither.
    "megatron": [megatron_core_requirement(), "six>=1.16", "PyYAML>=6.0"],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        # scripts/test.sh runs the suite on two workers (tests/_lanes.py schedules them).
        "pytest-xdist>=3.6",
        "hypothesis>=6.100",
        # tests/test_lint.py runs `ruff check` with ruff.toml.
        "ruff>=0.17",
        # load_digits (ships inside the package) for the convergence evidence (scripts/convergence.py).
        "scikit-learn>=1.4",
    ],
    "plot": ["matplotlib>=3.8"],
    # Hugging Face Trainer / Accelerate on DeepSpeed with a "topo_align" block (docs/deepspeed.md);
    # the versions the suite tests are pinned in constraints.txt.
    "hf": ["transformers>=5.23,<6", "accelerate>=1.15,<2"],
    # The pretraining scripts' TensorBoard event files (topo_integrations/train/metrics.py).
    "train": ["tensorboard>=2.14"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})
# An optional peer of the benchmark, not in "all": torchft's DiLoCo / LocalSGD (`topo-align bench
# --systems torchft-diloco`, docs/benchmarks.md). Its wheel carries a compiled (Rust) extension, built
# for a few platforms only, and it pulls in OpenTelemetry; the bench skips it, saying so, where absent.
EXTRAS["torchft"] = ["torchft>=0.2,<0.3"]

setup(
    name="topo-align",
    version="0.1.0",
    description="Topology-aware gradient reduction (hierarchical and selective) for DeepSpeed and Megatron",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["topo_integrations", "topo_integrations.*"]),
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "pydantic>=2.7,<3",
        "rich>=13",
        "numpy>=1.24",
    ],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["topo-align=topo_integrations.cli:main"]},
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
