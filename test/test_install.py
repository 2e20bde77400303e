"""After `make setup`, colcon has installed both packages where ROS tools look for them."""

from __future__ import annotations

import os
from pathlib import Path

from ros_helpers import require_ros

require_ros()


def test_ament_index_finds_both_packages():
    from ament_index_python.packages import get_package_prefix, get_package_share_directory

    share = Path(get_package_share_directory("memspec_ros"))
    assert (share / "package.xml").is_file()
    interfaces = Path(get_package_share_directory("memspec_interfaces"))
    assert (interfaces / "action" / "Generate.action").is_file()
    # console scripts live in lib/<package>, where `ros2 run` and launch files look
    scripts = Path(get_package_prefix("memspec_ros")) / "lib" / "memspec_ros"
    for name in ("memspec_node", "memspec_client"):
        assert os.access(scripts / name, os.X_OK), f"{scripts / name} missing: rerun make setup"


def test_memspec_ros_imports_from_the_working_tree():
    import memspec_ros

    root = Path(__file__).resolve().parents[1]
    assert Path(memspec_ros.__file__).resolve() == root / "memspec_ros" / "__init__.py"
