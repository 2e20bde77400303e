"""The runtime: engine, cache, predictor, policies (it never imports rclpy).

Kept free of imports: the command lines read ``bundled_zoo_dir`` for their defaults before any model loads.
"""

from __future__ import annotations

import os
from pathlib import Path

ZOO_ENV = "MEMSPEC_ZOO_DIR"


def bundled_zoo_dir() -> Path:
    """The bundled zoo's folder for the command lines, wherever they run: $MEMSPEC_ZOO_DIR, else the source
    tree's models/ (an absolute path: a default of 'models' meant the working directory's, and failed elsewhere).
    The node also looks in its ROS share folder first (ros/params.default_zoo_dir)."""
    env = os.environ.get(ZOO_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"
