"""The zoo build's own error: a setup problem the user fixes (a missing source package, too few requests on this
machine, a checkpoint of another run), which `memspec-zoo` reports as one line instead of a traceback."""


class ZooSetupError(RuntimeError):
    """A build input or setting that has to change before the stage can run; the message says how."""


def head_split_error(flag: str, hidden: int, heads: int, multiple: int = 0) -> str:
    """'' if a ``hidden``-wide model splits into ``heads`` attention heads of an even width, else why not: transformers
    refuses an uneven split only when the stage builds the model (after hours of earlier stages), and an odd head
    width fails inside the rotary embedding (it rotates pairs of channels) at the model's first forward.
    ``multiple``: the widths that always split (default 2 * heads, for a fixed head count)."""
    if heads < 1 or hidden % heads or (hidden // heads) % 2:
        return (f"{flag} {hidden} does not split into {heads} attention heads of an even width: use a multiple of"
                f" {multiple or 2 * max(heads, 1)}")
    return ""
