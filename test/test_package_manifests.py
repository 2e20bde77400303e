"""Both package.xml files are valid ROS manifests (catkin_pkg, as rosdep and bloom read them),
declare what the node needs, and agree with setup.py and CMakeLists.txt."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

catkin_pkg_package = pytest.importorskip("catkin_pkg.package")

ROOT = Path(__file__).resolve().parents[1]
INTERFACES = ROOT / "memspec_interfaces"


def parse(package_dir: Path):
    warnings: list[str] = []
    package = catkin_pkg_package.parse_package(package_dir / "package.xml", warnings=warnings)
    package.validate(warnings=warnings)
    assert warnings == [], f"{package_dir / 'package.xml'}: {warnings}"
    return package


def names(dependencies) -> set[str]:
    return {d.name for d in dependencies}


@pytest.mark.parametrize(
    ("package_dir", "name", "build_type"),
    [(ROOT, "memspec_ros", "ament_python"), (INTERFACES, "memspec_interfaces", "ament_cmake")],
)
def test_manifest_is_valid(package_dir, name, build_type):
    package = parse(package_dir)
    assert package.name == name
    assert package.package_format == 3
    assert package.get_build_type() == build_type
    assert package.maintainers and all(m.email for m in package.maintainers)
    assert package.licenses


def test_node_package_declares_its_ros_dependencies():
    package = parse(ROOT)
    runtime = names(package.exec_depends) | names(package.build_export_depends)  # <depend> counts as both
    for needed in ("rclpy", "lifecycle_msgs", "action_msgs", "diagnostic_msgs", "std_msgs", "memspec_interfaces",
                   "diagnostic_updater", "py_trees"):
        assert needed in runtime, f"memspec_ros/package.xml lacks <exec_depend>{needed}</exec_depend>"
    # never let rosdep replace the robot's torch (README: "On a robot")
    assert not any("torch" in dep for dep in runtime)


def test_interface_package_is_a_rosidl_interface_package():
    package = parse(INTERFACES)
    assert "rosidl_interface_packages" in {group.name for group in package.member_of_groups}
    assert "rosidl_default_generators" in names(package.buildtool_depends)
    assert "rosidl_default_runtime" in names(package.exec_depends)


def test_every_interface_file_is_generated():
    cmake = (INTERFACES / "CMakeLists.txt").read_text()
    listed = set(re.findall(r'"((?:msg|srv|action)/\w+\.(?:msg|srv|action))"', cmake))
    on_disk = {
        str(p.relative_to(INTERFACES)) for kind in ("msg", "srv", "action") for p in (INTERFACES / kind).glob("*")
    }
    assert listed == on_disk, "rosidl_generate_interfaces in memspec_interfaces/CMakeLists.txt must list every file"


def test_versions_agree():
    setup_version = re.search(r'version="([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert parse(ROOT).version == parse(INTERFACES).version == setup_version
