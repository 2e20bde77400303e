"""A Generate goal's bounds (Generate.action documents them), in one place: the node's goal checks
(goal_runner.py) refuse a goal past them, and memspec_client refuses the same values before sending, naming the
limit. A module of its own so that the client does not import the runtime.

Stop strings are matched against the text at every committed chunk, so their number and length are bounded;
temperatures above the parameter's range are refused; top_p is a probability mass."""

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000
MAX_TEMPERATURE = 100.0
MAX_TOP_P = 1.0

# every rejection for the prompt's length names this (goal_runner.py); memspec_client --chat drops its oldest
# exchange only for such a rejection
LENGTH_LIMITS = "generation.max_prompt_tokens / the target's context"


def is_length_rejection(reason: str) -> bool:
    """Whether a goal was rejected for its prompt's length (so a shorter conversation may be taken)."""
    return LENGTH_LIMITS in reason
