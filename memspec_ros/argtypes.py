"""argparse types for the command lines (benchmarks, zoo build): a bad count is refused by the parser, with its
name, instead of slicing from the end or failing deep inside a stage."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A count of at least 1: 0 or fewer ran nothing and then failed on an empty median."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means 'all' or 'none': a negative one sliced that many from the end."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def group_size(text: str) -> int:
    """GPTQ's group size: a positive number of input columns per scale, or -1 for one group per row. GPT-QModel
    refuses anything else only once the calibration answers were made (minutes), with a traceback."""
    value = int(text)
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a positive group size, or -1 for one group per row")
    return value


def int_in(lo: int, hi: int):
    """An integer in [lo, hi] (e.g. a controller limit): one the engine would refuse after minutes of tracing, or
    that ran nothing, is refused by the parser instead."""

    def parse(text: str) -> int:
        value = int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not in [{lo}, {hi}]")
        return value

    parse.__name__ = f"{lo} to {hi}"  # argparse names the type in "invalid ... value"
    return parse


def float_in(lo: float, hi: float):
    """A number in [lo, hi] (e.g. a node parameter's range): one the node would refuse when it starts is refused by
    the parser instead."""

    def parse(text: str) -> float:
        value = float(text)
        if not lo <= value <= hi:  # nan fails this too
            raise argparse.ArgumentTypeError(f"{value} is not in [{lo:g}, {hi:g}]")
        return value

    parse.__name__ = f"{lo:g} to {hi:g}"
    return parse


def non_negative_float(text: str) -> float:
    """A period or a share where 0 is meaningful ('every time'): a negative one, or nan, is refused."""
    value = float(text)
    if not value >= 0:  # nan fails this too
        raise argparse.ArgumentTypeError(f"{value} is not a non-negative number")
    return value


def thread_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of thread counts ('1,2'), each at least 1."""
    try:
        counts = tuple(positive_int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers") from None
    if not counts:
        raise argparse.ArgumentTypeError("no thread count given")
    if len(set(counts)) < len(counts):  # '1,1' ran the whole bench twice, the second row over the first
        raise argparse.ArgumentTypeError(f"{text!r} names a thread count more than once")
    return counts


def controller_limit(name: str):
    """An integer within the controller's own limit for ``name`` (runtime/controller.py LIMITS): a value the engine
    would refuse after minutes of tracing is refused by the parser. The controller (and torch with it) is
    imported only when an option is read, so building a parser stays cheap."""

    def parse(text: str) -> int:
        from .runtime.controller import LIMITS

        return int_in(*LIMITS[name])(text)

    parse.__name__ = f"{name} (the controller's bounds)"
    return parse


def positive_float(text: str) -> float:
    """A time budget or a learning rate: 0 or less trained nothing and exported untrained weights ('inf': no cap)."""
    value = float(text)
    if not value > 0:  # nan fails too
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def message_text(text: str) -> str:
    """A chat message's text (``--system``): one that is empty or only whitespace, which the node rejects (every
    turn of a --chat session then), is refused by the parser instead."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the text is empty or only whitespace (leave the option out instead)")
    return text


def prompt_text(text: str) -> str:
    """A prompt argument: one that is empty or only whitespace, which the node rejects (the answer then lists every
    possible reason), is refused by the parser instead."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty or only whitespace: give some text")
    return text


def unwritable(path) -> str:
    """'' if ``path`` can be made or written: the nearest of it and its parents that exists is a folder this process
    may write to; else that location (checked before a long run that would write ``path`` at its end)."""
    import os
    from pathlib import Path

    existing = next(p for p in (Path(path), *Path(path).absolute().parents) if p.exists())
    return "" if existing.is_dir() and os.access(existing, os.W_OK) else str(existing)


def output_file(text: str) -> str:
    """A file to write a result to (``--json``): a folder, or a path under an existing file, failed only once the
    run had finished, and the result of minutes of work was lost. The folder is made at the write if missing."""
    import os
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("no file named")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: name a file in it")
    blocked = unwritable(path.parent)
    if blocked and not Path(blocked).is_dir():
        raise argparse.ArgumentTypeError(f"{blocked} is a file, so {text} cannot be made")
    if blocked and not (path.exists() and os.access(path, os.W_OK)):  # (a writable file there: /dev/null, say)
        # a folder this process may not write in: found at the write, after the run
        raise argparse.ArgumentTypeError(f"cannot write in {blocked}, so {text} cannot be made")
    return text


def json_output_file(text: str) -> str:
    """``--json`` of a run that also writes a plot beside it (the same name, .png): a .png name would be overwritten
    by that plot."""
    text = output_file(text)
    if text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"{text}: the plot is written beside the JSON as .png; name the JSON .json")
    return text


def torch_device(text: str) -> str:
    """``cpu`` or ``cuda[:N]`` that this machine has: 'gpu', or a CUDA index past the last device, failed in torch
    (a traceback) once the target had loaded and a stage had run."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is no device: use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{text}: torch sees no CUDA device on this machine")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s), 0 to {count - 1}")
    return text


def name_list(text: str) -> list[str]:
    """A comma list of names (``--stages``): an empty one ran nothing and exited 0."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no name given")
    return names
