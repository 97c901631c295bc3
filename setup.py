from setuptools import find_packages, setup

setup(
    name="dynamo_dist",
    version="0.1.0",
    description="A torch.compile backend that turns single-device PyTorch plus sharding "
                "annotations into an SPMD program",
    python_requires=">=3.11",
    packages=find_packages(include=["dynamo_dist", "dynamo_dist.*", "inductor_passes",
                                    "inductor_passes.*"]),
    install_requires=["torch>=2.11,<2.14", "rich>=13", "scipy>=1.11"],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "transformers==5.24.0", "expecttest"],
        "bench": ["transformers>=5.0", "matplotlib>=3.8"],
        "gpu": ["triton"],
    },
    entry_points={"torch_dynamo_backends": ["dist = dynamo_dist.backend:dist_backend"]},
)
