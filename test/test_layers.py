"""Layers import only downwards: every module's imports (nested ones too) are parsed with ``ast`` and checked.

    bench      benchmarks and their command line        may import zoo, ros (the action and soak benches only),
                                                        testing, runtime
    ros, zoo   the ROS 2 layer; the zoo's build          may import testing, runtime; never each other
    testing    tiny generated models and zoos (fixtures)  may import runtime
    runtime    engine, cache, predictor, policies         imports nothing of memspec_ros above it, and no ROS

The ROS layer is the only one that imports rclpy, ROS messages or ament, except the action and soak benches,
whose subject is the ROS node itself. Nothing in runtime/ reaches for a fixture, a benchmark or a tool, and no
module imports another's private (_underscored) names.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memspec_ros"

# Which layers each layer may import (its own included).
ALLOWED = {
    "runtime": {"runtime"},
    "testing": {"testing", "runtime"},
    "ros": {"ros", "testing", "runtime"},
    "zoo": {"zoo", "testing", "runtime"},
    "bench": {"bench", "zoo", "testing", "runtime"},
}
# Modules whose subject is the ROS layer itself: they may import it and ROS.
ROS_BENCHES = {"memspec_ros/bench/action_bench.py", "memspec_ros/bench/soak_bench.py"}
ROS_MODULES = {"rclpy", "rcl_interfaces", "ament_index_python", "diagnostic_updater", "launch", "launch_ros"}
# Modules outside the layer folders, with the layer they belong to: every layer's command lines use argtypes, so
# it may import nothing above the runtime (a node parameter's range lives in ros/params.py, not here)
TOP_LEVEL = {"memspec_ros.argtypes": "runtime"}
# Imports waiting for a move, each with the reason; the test fails once one is no longer needed.
PENDING: dict[tuple[str, str], str] = {}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ("memspec_ros", "bench")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                if node.module:
                    out.append((node.lineno, f"{base}.{node.module}"))
                else:  # ``from . import params``: the names are modules of that package
                    out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def _layer(module: str) -> str | None:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    return parts[1] if parts[0] == "memspec_ros" and len(parts) > 1 and parts[1] in ALLOWED else None


def _is_ros(module: str) -> bool:
    top = module.split(".")[0]
    return top in ROS_MODULES or top.endswith(("_msgs", "_srvs", "_interfaces"))


def _violations() -> list[tuple[str, int, str, str]]:
    """(file, line, imported module, its layer or 'ROS') for every import from a layer above."""
    found = []
    for path in _modules():
        name = str(path.relative_to(PACKAGE.parent))
        layer = _layer(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if layer is None:
            continue  # memspec_ros/__init__.py (argtypes.py: TOP_LEVEL)
        allowed = ALLOWED[layer] | ({"ros"} if name in ROS_BENCHES else set())
        for line, module in _imports(path):
            target = _layer(module)
            if target is not None and target not in allowed:
                found.append((name, line, module, target))
            elif _is_ros(module) and layer != "ros" and name not in ROS_BENCHES:
                found.append((name, line, module, "ROS"))
    return found


def test_the_import_parser_resolves_relative_imports():
    bench = PACKAGE / "bench" / "cli.py"
    names = {m for _, m in _imports(bench)}
    assert "memspec_ros.runtime.loader" in names and "memspec_ros.testing.tiny_models" in names
    assert {m for _, m in _imports(PACKAGE / "ros" / "node.py")} >= {"memspec_ros.ros.params", "rclpy"}


def test_no_module_imports_from_a_layer_above():
    found = _violations()
    unexpected = [f"{f}:{line} imports {m} ({layer})" for f, line, m, layer in found if (f, layer) not in PENDING]
    assert not unexpected, "imports from a higher layer:\n" + "\n".join(unexpected)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_names():
    """``from x import _name`` reaches into x, and so does ``x._name`` on a project module imported as ``x``:
    a name another module needs is public there."""
    found = []
    for path in _modules():
        package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
        tree = ast.parse(path.read_text(), str(path))
        module_aliases = set()  # names bound to project modules (``from . import params as P``)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = f"{base}.{node.module}" if base and node.module else (node.module or base)
                if module.startswith("memspec_ros"):
                    found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {a.name} from {module}"
                              for a in node.names if _private(a.name)]
                    if (PACKAGE.parent / module.replace(".", "/")).is_dir():  # ``from pkg import module``
                        module_aliases |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                module_aliases |= {a.asname or a.name.split(".")[0] for a in node.names
                                   if a.name.startswith("memspec_ros")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def test_each_pending_exception_is_still_needed():
    # a plain loop, not a parametrization: an empty PENDING would be a skip, and strict mode fails skips
    current = {(f, layer) for f, _, _, layer in _violations()}
    fixed = [key for key in sorted(PENDING) if key not in current]
    assert not fixed, f"{fixed} are fixed: remove them from PENDING"
