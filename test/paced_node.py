"""Run a memspec_node executable (argv[1], its arguments after it) with node_helpers' pacing of long goals.

test_node_process signals a node process while a goal runs: unpaced, a CPU fast enough finished the goal first
(node_helpers.PACED_FROM says why the in-process tests pace theirs). Only the pacing differs from running the
executable itself: the same entry point, its own signal handling and exit status. MEMSPEC_TEST_CONFIGURE_SECONDS
makes configure load that much longer."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_helpers import paced_step  # noqa: E402

from memspec_ros.runtime.speculative import SpeculativeSession  # noqa: E402

SpeculativeSession.step = paced_step(SpeculativeSession.step)

if os.environ.get("MEMSPEC_TEST_CONFIGURE_SECONDS"):  # a configure that loads for that long (a slow card, a GGUF)
    from memspec_ros.ros.node import MemSpecNode  # noqa: E402

    _load = MemSpecNode._load

    def _slow_load(self):
        print("paced_node: configure loading", flush=True)  # what test_node_process waits for
        time.sleep(float(os.environ["MEMSPEC_TEST_CONFIGURE_SECONDS"]))
        return _load(self)

    MemSpecNode._load = _slow_load
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
