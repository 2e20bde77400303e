"""The zoo build's own error: a setup problem the user fixes (a missing source package, too few requests on this
machine, a checkpoint of another run), which `memspec-zoo` reports as one line instead of a traceback."""


class ZooSetupError(RuntimeError):
    """A build input or setting that has to change before the stage can run; the message says how."""
