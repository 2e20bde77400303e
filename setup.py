"""ament_python package memspec_ros.

Built two ways from this one file: `colcon build` (ROS workspaces; scripts land in
lib/memspec_ros, data under share/memspec_ros) and `pip install -e . --no-deps` (the dev venv;
scripts land in the venv's bin/). Dependencies are deliberately not listed in install_requires:
ROS packages come from package.xml/rosdep or the ROS wheels, the Python libraries from
requirements.txt, and torch is never installed from here (see README.md).
"""

import os
from glob import glob

from setuptools import find_packages, setup

package_name = "memspec_ros"


def zoo_data_files(root: str = "models") -> list[tuple[str, list[str]]]:
    """The bundled zoo under share/memspec_ros/models, keeping its folder layout (the node's default)."""
    entries = []
    for folder, _, names in sorted(os.walk(root)):
        # colcon's --symlink-install builds from links to the sources: a file removed from models/ leaves a link to
        # nothing in build/, which setuptools cannot copy (os.path.isfile follows the link)
        files = sorted(os.path.join(folder, f) for f in names if os.path.isfile(os.path.join(folder, f)))
        if files:
            entries.append((os.path.join("share", package_name, folder), files))
    return entries


setup(
    name=package_name,
    version="0.1.0",
    packages=find_packages(include=[package_name, f"{package_name}.*"]),
    # the engine's CPU kernels are compiled from this source on the machine that runs them (runtime/cpu_kernels.py)
    package_data={f"{package_name}.runtime": ["cpu_kernels.c"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{package_name}"]),
        (f"share/{package_name}", ["package.xml"]),
        (f"share/{package_name}/launch", sorted(glob("launch/*.launch.py"))),
        (f"share/{package_name}/config", sorted(glob("config/*.yaml"))),
        *zoo_data_files(),
    ],
    install_requires=["setuptools"],
    zip_safe=False,  # cpu_kernels.c must be a real file for the compiler
    maintainer="memspec_ros maintainers",
    maintainer_email="maintainers@users.noreply.a-seed-c56185d9.example",
    description="ROS 2 LLM generation node with MemSpec memory-aware multi-draft speculative decoding",
    license="Apache-2.0",
    python_requires=">=3.10",
    extras_require={"test": ["pytest"]},
    entry_points={
        "console_scripts": [
            "memspec_node = memspec_ros.ros.node:main",
            "memspec_client = memspec_ros.ros.client:main",
            "memspec-bench = memspec_ros.bench.cli:main",
            "memspec-zoo = memspec_ros.zoo.cli:main",
            "memspec-train-predictor = memspec_ros.zoo.predictor_training:main",
        ],
    },
)
