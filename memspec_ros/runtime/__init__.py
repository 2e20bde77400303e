"""The runtime: engine, cache, predictor, policies (it never imports rclpy).

Kept free of imports: the command lines read ``bundled_zoo_dir`` for their defaults before any model loads.
"""

from __future__ import annotations

import os
from pathlib import Path

ZOO_ENV = "MEMSPEC_ZOO_DIR"


def bundled_zoo_dir(module_file: str | Path = __file__) -> Path:
    """The bundled zoo's folder for the command lines, wherever they run: $MEMSPEC_ZOO_DIR, else the source
    tree's models/ (a dev checkout, a symlink or editable install), else <prefix>/share/memspec_ros/models beside a
    package installed into <prefix>/lib/pythonX.Y/site-packages (a colcon install that copies it). Absolute: a
    default of 'models' meant the working directory's, and failed elsewhere. The node also asks ament for its
    share folder (ros/params.default_zoo_dir). Where neither holds a registry, the source tree's path is returned,
    for the error that names it."""
    env = os.environ.get(ZOO_ENV)
    if env:
        return Path(env)
    package = Path(module_file).resolve().parents[1]  # .../memspec_ros
    source = package.parent / "models"
    installed = package.parents[3] / "share" / package.name / "models" if len(package.parents) > 3 else source
    for candidate in (source, installed):
        if (candidate / "registry.yaml").is_file():
            return candidate
    return source
