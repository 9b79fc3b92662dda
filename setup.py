from setuptools import find_packages, setup


def version() -> str:
    with open("ucp_deepspeed/__init__.py") as f:
        return next(line.split('"')[1] for line in f if line.startswith("__version__"))


setup(
    name="ucp_deepspeed",
    version=version(),
    description="Universal Checkpointing for DeepSpeed: resume on any DP/TP/PP size or ZeRO stage",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ucp_deepspeed", "ucp_deepspeed.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.5", "deepspeed>=0.16", "safetensors>=0.4", "pydantic>=2", "tqdm", "isal>=1.6"],
    extras_require={"megatron": ["megatron-core>=0.16"], "test": ["pytest>=8", "hypothesis>=6", "megatron-core>=0.16", "transformers>=4.45", "accelerate>=1.1", "matplotlib>=3.7"]},
    entry_points={"console_scripts": ["ucp=ucp_deepspeed.cli:main"]},
)
