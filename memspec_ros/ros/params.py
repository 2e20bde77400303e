"""The node's ROS parameters: one table, declared with descriptors, validated in one place.

Groups follow llama_ros' dotted style. Three kinds of parameter, by when a change may land:

* ``model.*``, ``drafts.quantization``, ``cache.storage``, ``predictor.path``, ``datastore.path``: they choose
  what configure loads, so they change only while the node is unconfigured (cleanup, set, configure again); a
  change while models are loaded is rejected with that reason.
* ``memspec.*`` (policy, K, N, T, gamma, budget ...) and the other ``drafts.*`` (the registry): applied by the
  runtime controller at the next scheduling point, also in the middle of a running goal.
  Six of them (adaptive_gamma, confidence_stop, context_lookup, remember_answers, reset_cache_per_generation,
  wait_for_initial_draft) shape a goal's session or its start, so they apply from the next goal.
* ``generation.*``, ``action.*``, ``diagnostics.*``, ``diagnostic_updater.period``: read per goal or
  per publication (``diagnostic_updater.use_fqn`` and ``diagnostics.hardware_id`` are read-only): a goal
  takes its ``generation.*`` defaults when it is accepted, so a queued goal runs with those it was checked
  with; ``action.max_goal_seconds`` and ``action.feedback_period`` are read when a goal starts; the rest
  apply at once.

Paths left empty use the bundled zoo (see :func:`default_zoo_dir`): ``drafts.registry_file`` ->
``<zoo>/registry.yaml``, ``model.target_path`` -> the registry's ``target``, ``predictor.path`` ->
``<registry dir>/predictor`` when it exists ("none" disables the predictor), ``datastore.path`` ->
``<registry dir>/datastore.safetensors`` when it exists ("none": no datastore).

Paths are confined (:func:`check_paths`): a path parameter set after the node started, and every path a
registry file it names lists, must resolve (symlinks and ``..`` followed) inside ``model.allowed_roots``
(read-only; [''] = the defaults its own description lists: the bundled zoo, the cache directories, the working
directory where the user owns it and others cannot write to it, and ``$MEMSPEC_ALLOWED_ROOTS``) or inside a
location the node was started with (launch file, params file, command line: the operator's).
``pkg:<package>/<file>`` sources stay allowed: they resolve inside their installed package, which
``model_source.package_file`` enforces.
"""

from __future__ import annotations

import math
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType

from ..runtime import ZOO_ENV, bundled_zoo_dir
from ..runtime.controller import I64, LIMITS, REMEMBERED_TOKENS, RuntimeConfig
from ..runtime.loader import DraftLists, find_datastore, find_predictor, registry_target
from ..runtime.models import DTYPE_CHOICES, QUANTIZATIONS
from ..runtime.policies import NODE_POLICIES
from ..runtime.storage import STORAGE_CHOICES

PACKAGE = "memspec_ros"
ROOTS_ENV = "MEMSPEC_ALLOWED_ROOTS"  # os.pathsep-separated directories added to model.allowed_roots' default

# Where a change lands (see the module docstring).
# ~/cache_state "on change": the node polls the draft cache this often (off the decode thread), so no period below
# it can be delivered (0.05 was accepted and messages still came at 10 Hz)
CACHE_POLL_SECONDS = 0.1

AT_CONFIGURE = "configure"
AT_SCHEDULING_POINT = "scheduling point"
AT_ONCE = "at once"
AT_START = "at start only (read-only)"  # set by a launch file, a params file or -p; read when the node is built
AT_NEXT_GOAL = "next goal"  # memspec.* settings a running goal's session was made with
AT_ACCEPTANCE = "when a goal is accepted"  # generation.*: a goal takes the defaults it was checked with
AT_GOAL_START = "when a goal starts"


QT_INT = 2**31 - 1  # the largest int a Qt widget (rqt_reconfigure's slider and validator) takes


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    description: str
    when: str = AT_ONCE
    int_range: tuple[int, int] | None = None
    float_range: tuple[float, float] | None = None
    choices: tuple[str, ...] = ()
    read_only: bool = False
    runtime_field: str = ""  # RuntimeConfig field it maps onto (memspec.* only)
    # declared by the diagnostics updater, not declare_all: the real diagnostic_updater's Python Updater
    # declares it unconditionally (ParameterAlreadyDeclaredException if the node had)
    updater_declares: bool = False

    def descriptor(self) -> ParameterDescriptor:
        d = ParameterDescriptor(name=self.name, description=self.description, read_only=self.read_only)
        d.type = _ros_type(self.default)
        constraints = []
        if self.choices:
            constraints.append(f"one of: {', '.join(self.choices)}")
        if self.int_range is not None and not (-QT_INT - 1 <= self.int_range[0] and self.int_range[1] <= QT_INT):
            # rqt_reconfigure hands a declared range to a Qt slider, which takes 32-bit ints: past them (a byte
            # budget, a 64-bit seed) PyQt raised OverflowError and the node's panel was not built. Such a range is
            # stated here and checked by the node (check_value), not declared
            constraints.append(f"range: [{self.int_range[0]}, {self.int_range[1]}]")
        elif self.int_range is not None:
            d.integer_range = [IntegerRange(from_value=self.int_range[0], to_value=self.int_range[1], step=0)]
        constraints.append(f"applies: {self.when}")
        d.additional_constraints = "; ".join(constraints)
        if self.float_range is not None:
            d.floating_point_range = [FloatingPointRange(from_value=float(self.float_range[0]),
                                                         to_value=float(self.float_range[1]), step=0.0)]
        return d


def _ros_type(default: Any) -> int:
    if isinstance(default, bool):
        return ParameterType.PARAMETER_BOOL
    if isinstance(default, int):
        return ParameterType.PARAMETER_INTEGER
    if isinstance(default, float):
        return ParameterType.PARAMETER_DOUBLE
    if isinstance(default, str):
        return ParameterType.PARAMETER_STRING
    if isinstance(default, list):
        return ParameterType.PARAMETER_STRING_ARRAY
    raise TypeError(f"no ROS parameter type for {default!r}")


PARAMS: tuple[Param, ...] = (
    # -- what configure loads -------------------------------------------------------------------
    Param("model.target_path", "",
          "Target model directory (Hugging Face format, safetensors). Empty: the registry file's target.",
          AT_CONFIGURE),
    Param("model.tokenizer_path", "", "Tokenizer directory. Empty: the target's directory.", AT_CONFIGURE),
    Param("model.dtype", "fp32",
          "Target weights: fp32, bf16 (bf16 linear layers on CPUs with bf16 matmul), fp16 (GPU), or auto (see"
          " model.quantization). Drafts use it too unless auto (then fp32).",
          AT_CONFIGURE, choices=DTYPE_CHOICES),
    Param("model.quantization", "none",
          "Target forward path: none (the dtype's), int8, int4 (groups of 32, Q4_1's grid), gptq (a GPT-QModel INT4"
          " checkpoint), or auto: time fp32/bf16/int8/int4 for 1 and gamma+1 tokens at configure and keep the fastest"
          " (reported on /diagnostics).",
          AT_CONFIGURE, choices=QUANTIZATIONS),
    # The three defaults below change only speed, never the answer (the target verifies every proposal), and are
    # each faster on the bundled zoo (docs/results/measured-here.md, "Forward paths beside llama.cpp"), so a plain
    # launch gets them.
    Param("drafts.quantization", "int4",
          "Drafts' forward path: none (model.dtype's), int8 or int4 (compact weights in fp32 activations, on the"
          " engine's CPU kernels: set none with model.device cuda; a draft's cost is mostly its head's bytes). The"
          " answer is the target's whatever the drafts compute.",
          AT_CONFIGURE, choices=("none", "int8", "int4")),
    Param("model.device", "cpu", "Device for target and drafts: cpu or cuda[:N].", AT_CONFIGURE),
    Param("model.threads", 0, "torch CPU threads (0: leave torch's default).", AT_CONFIGURE, int_range=(0, 256)),
    Param("model.allowed_roots", [""],
          "Directories every model, tokenizer, predictor, datastore and registry path set after start (and every"
          " path a registry file lists) must resolve into, symlinks and '..' followed; others are refused. [''] or"
          " []: the bundled zoo, the user's cache directory ($XDG_CACHE_HOME or ~/.cache), $MEMSPEC_CACHE_DIR when"
          " set, the working directory when it is the user's own and not writable by every user (not '/', not"
          " /tmp), and $MEMSPEC_ALLOWED_ROOTS. The locations"
          " the node was started with are always allowed, and so are pkg:<package>/<file> sources for the target,"
          " tokenizer and draft paths.",
          AT_START, read_only=True),
    Param("predictor.path", "",
          "Trained predictor directory (memspec-train-predictor). Empty: <registry dir>/predictor (or its"
          " target-hidden / minilm subfolder) if present; 'none': no predictor.",
          AT_CONFIGURE),
    Param("datastore.path", "",
          "Past answers context lookup also searches where the context has no match (memspec-zoo build --stages"
          " datastore; runtime/datastore.py). Empty: <registry dir>/datastore.safetensors if present; 'none': none."
          " Used while memspec.context_lookup is true.",
          AT_CONFIGURE),
    Param("cache.storage", "local",
          "Storage the drafts are read from, cold (page cache dropped) at every load: local (this machine's, unpaced),"
          " or emulated edge media paced to their bandwidth and latency: emmc (eMMC 5.1), sd (UHS-I microSD), nvme"
          " (PCIe Gen3 NVMe). A draft's first load keeps its runtime form, which later loads read, in"
          " $MEMSPEC_RUNTIME_FORMS_DIR (default runtime-drafts in $MEMSPEC_CACHE_DIR, else in"
          " $XDG_CACHE_HOME/memspec_ros, ~/.cache where that is unset). See runtime/storage.py.",
          AT_CONFIGURE, choices=STORAGE_CHOICES),
    # -- the draft registry (scheduling point) --------------------------------------------------
    Param("drafts.registry_file", "",
          "Draft registry YAML (name, path, domain per draft). Empty: the bundled zoo's models/registry.yaml. Ignored"
          " when drafts.names is set. Changed while configured, it swaps the drafts only: a file that brings another"
          " target (or predictor beside it) than configure loaded is refused.",
          AT_SCHEDULING_POINT),
    Param("drafts.names", [""],
          "Draft names (parallel to drafts.paths and drafts.domains); ['']: use drafts.registry_file ([] means the"
          " same at start-up; at run time set [''], since rclpy refuses an untyped []).",
          AT_SCHEDULING_POINT),
    Param("drafts.paths", [""], "Draft model directories, one per name.", AT_SCHEDULING_POINT),
    Param("drafts.domains", [""], "Draft domains, one per name (['']: the names; [] too at start-up).",
          AT_SCHEDULING_POINT),
    # -- MemSpec runtime (scheduling point) -----------------------------------------------------
    Param("memspec.policy", "memspec",
          "Draft-selection policy.",
          AT_SCHEDULING_POINT, choices=NODE_POLICIES,
          runtime_field="policy"),
    Param("memspec.capacity", 2,
          "K: drafts resident at once.",
          AT_SCHEDULING_POINT, int_range=LIMITS["capacity"], runtime_field="capacity"),
    Param("memspec.budget_bytes", 0,
          "Memory budget for resident drafts in bytes (0: only K limits). A draft is accounted at what its last"
          " load occupied; until it has loaded once (or after its files or entry change) at its registry size_bytes,"
          " else its files' size, but at most the budget: a larger estimate is loaded and measured, not refused.",
          AT_SCHEDULING_POINT, int_range=LIMITS["budget_bytes"], runtime_field="budget_bytes"),
    Param("memspec.interval", 4,
          "N: draft-and-verify iterations between scheduling points.",
          AT_SCHEDULING_POINT, int_range=LIMITS["interval"], runtime_field="interval"),
    Param("memspec.recent_tokens", 32,
          "T: recent generated tokens the predictor sees.",
          AT_SCHEDULING_POINT, int_range=LIMITS["recent_tokens"], runtime_field="recent_tokens"),
    Param("memspec.adaptive_gamma", True,
          "Choose each iteration's gamma in 0..memspec.gamma from measured forward costs and the draft's running"
          " acceptance (from the next goal).",
          AT_NEXT_GOAL, runtime_field="adaptive_gamma"),
    Param("memspec.confidence_stop", True,
          "With adaptive_gamma: the draft stops proposing where its own probability that a token is accepted no"
          " longer pays for that token's verify row; off: it proposes the iteration's chosen gamma, for drafts whose"
          " probabilities are not calibrated (from the next goal).",
          AT_NEXT_GOAL, runtime_field="confidence_stop"),
    Param("memspec.context_lookup", True,
          "Where the text's last tokens occurred before, propose the tokens that followed them (no draft"
          " forward; verified like a draft's, so the output is unchanged) (from the next goal).",
          AT_NEXT_GOAL, runtime_field="context_lookup"),
    Param("memspec.remember_answers", 0,
          "With context_lookup: keep this node's last N answers in memory (never on disk; dropped at cleanup; at"
          f" most {REMEMBERED_TOKENS:,} tokens in all, the oldest dropped first, one longer answer kept alone) and"
          " copy from them like from the datastore, so a"
          " request asked again is answered faster (0: none).",
          AT_NEXT_GOAL, int_range=LIMITS["remember_answers"], runtime_field="remember_answers"),
    Param("memspec.prompt_cache", True,
          "Keep the target's and the drafts' KV caches between goals and reuse them for a goal whose tokens start"
          " the same way (a conversation's earlier turns, the system prompt): only the rest is encoded. Outputs are"
          " unchanged; it holds the last goals' KV caches in memory (memspec.prompt_cache_bytes; false: freed at"
          " once, a running goal's at its next scheduling point) (reuse from the next goal).",
          AT_SCHEDULING_POINT, runtime_field="prompt_cache"),
    Param("memspec.prompt_cache_bytes", 128 * 2**20,
          "Bytes the prompt cache may hold in all, the last goal's caches included: older goals' are dropped,"
          " oldest first, until the total fits, so goals that alternate between conversations or system prompts"
          " each continue their own; the last goal's caches are always kept, even above it. The bundled target's KV"
          " cache takes 46,080 bytes per token of buffer (grown by doubling)."
          " 0: only the last goal's.",
          AT_SCHEDULING_POINT, int_range=LIMITS["prompt_cache_bytes"], runtime_field="prompt_cache_bytes"),
    Param("memspec.gamma", 4,
          "Draft tokens proposed per iteration (with adaptive_gamma: the most).",
          AT_SCHEDULING_POINT, int_range=LIMITS["gamma"], runtime_field="gamma"),
    Param("memspec.overlap_prediction", False,
          "Run the predictor on a background thread (its ranking arrives at least one interval late; more when"
          " a ranking outlasts an interval, and a point then uses the latest one finished).",
          AT_SCHEDULING_POINT, runtime_field="overlap_prediction"),
    Param("memspec.general_draft", "general",
          "The draft general-static runs.",
          AT_SCHEDULING_POINT, runtime_field="general_draft"),
    Param("memspec.ucb_c", 2.0,
          "UCB exploration coefficient of the bandit policies.",
          AT_SCHEDULING_POINT, float_range=LIMITS["ucb_c"], runtime_field="ucb_c"),
    Param("memspec.reset_cache_per_generation", False,
          "Empty the draft cache before every goal (the paper's protocol); a robot keeps it warm.",
          AT_NEXT_GOAL, runtime_field="reset_cache_per_generation"),
    Param("memspec.wait_for_initial_draft", False,
          "A goal's first iteration waits until its chosen draft is loaded (memspec.max_load_wait_seconds at most)"
          " even when another draft is resident;"
          " off (default): the non-blocking policies (memspec, memspec-cost-aware, mab-async, prediction-only) run"
          " the best resident draft meanwhile and wait only when none is,"
          " or when the cache has no room for the chosen one beside it (storage as fast as an NVMe SSD loads a draft"
          " within an iteration, where waiting can pay).",
          AT_NEXT_GOAL, runtime_field="wait_for_initial_draft"),
    Param("memspec.max_load_wait_seconds", 30.0,
          "The longest a goal waits for a draft's load where it waits at all (its first draft on a cold cache,"
          " mab-sync, general-static): then it decodes on without that draft (a resident one, or the target alone:"
          " the output is the same, only slower) while the load goes on. 0: no limit.",
          AT_SCHEDULING_POINT, float_range=LIMITS["max_load_wait_seconds"], runtime_field="max_load_wait_seconds"),
    # -- per goal ---------------------------------------------------------------------------------
    Param("generation.max_new_tokens", 128,
          "Default tokens per goal (a goal's max_new_tokens 0 means this).",
          AT_ACCEPTANCE, int_range=(1, 1_000_000)),
    Param("generation.max_prompt_tokens", 1024,
          "Longest prompt accepted, in target tokens (also capped by the target's context).",
          AT_ACCEPTANCE, int_range=(1, 10_000_000)),
    Param("generation.temperature", 0.0,
          "Default sampling temperature (0: greedy, the paper's setting).",
          AT_ACCEPTANCE, float_range=(0.0, 100.0)),
    # ROS ranges are closed: (0, 1] is declared from the smallest positive double, so rclpy refuses 0 as the node does
    Param("generation.top_p", 1.0, "Default nucleus sampling mass in (0, 1]: 0 excluded, 1 no truncation.",
          AT_ACCEPTANCE, float_range=(math.ulp(0.0), 1.0)),
    Param("generation.seed", -1, "Default sampling seed (-1: a fresh random seed per goal).", AT_ACCEPTANCE,
          int_range=(-1, I64)),
    Param("generation.system_prompt", "",
          "System message put first in chat goals (target tokenizer with a chat template, goal not raw, the goal's"
          " messages not starting with a system message). Empty: none, so the template's own default system turn"
          " applies, if it has one.",
          AT_ACCEPTANCE),
    Param("generation.system_prompt_fixed", False,
          "true: goals may not replace generation.system_prompt: a chat goal whose first message is a system message"
          " is rejected, and so is a raw goal (it writes its own turns) on a model with a chat template, so the"
          " robot's own instructions (or, with an empty system prompt, the template's default) always open the"
          " conversation. false (default): a goal's own first system message replaces it for that goal.",
          AT_ACCEPTANCE),
    Param("action.max_queued_goals", 4,
          "Goals accepted but waiting while one runs; more are rejected at once.",
          int_range=(0, 1000)),
    Param("action.result_keep_seconds", 900,
          "Seconds a finished goal's result is kept for a client that asks for it late (rclpy's result_timeout): each"
          " kept one holds its goal and its text, so a node answering many goals holds that many results. Clients"
          " ask as a goal is accepted (memspec_client, bt_example, BehaviorTree.ROS2) and get it as it ends; at least"
          " 10 s, memspec_client's wait before it asks again. (Humble's rcl counts it from the goal's acceptance, not"
          " its end: keep it above the longest goal there.)",
          AT_START, int_range=(10, 86400), read_only=True),
    Param("action.max_goal_seconds", 0.0,
          "Seconds a goal may run (from its start, queue time left out) before it ends ABORTED with its partial text"
          " (0: no limit). An action server cannot see a client that went away: its goal would otherwise run to"
          " max_new_tokens holding the node's one generation. Read when a goal starts.",
          AT_GOAL_START, float_range=(0.0, 86400.0)),
    Param("action.feedback_period", 0.1,
          "Minimum seconds between feedback messages of a goal (0: one per committed chunk; chunks in between are"
          " merged).",
          AT_GOAL_START, float_range=(0.0, 60.0)),
    # -- diagnostics ------------------------------------------------------------------------------
    Param("diagnostic_updater.period", 1.0,
          "Seconds between /diagnostics publications (diagnostic_updater's parameter).",
          float_range=(0.01, 3600.0), updater_declares=True),
    Param("diagnostic_updater.use_fqn", False,
          "Name the /diagnostics statuses with the fully qualified node name, '/ns/name: task' (diagnostic_updater's"
          " parameter).", AT_START, read_only=True),
    Param("diagnostics.hardware_id", "",
          "hardware_id of the diagnostic statuses (empty: the host name).",
          AT_START, read_only=True),
    Param("diagnostics.fallback_warn_fraction", 0.2,
          "WARN when the window's fallback fraction exceeds this.",
          float_range=(0.0, 1.0)),
    Param("diagnostics.window_goals", 20,
          "Finished goals in the throughput window. Each keeps one record per iteration, and every diagnostics"
          " period combines them all: thousands of long goals cost memory and time on every update.",
          int_range=(1, 10_000)),
    Param("diagnostics.cache_state_period", 1.0,
          "Seconds between periodic ~/cache_state messages (also published on change).",
          float_range=(CACHE_POLL_SECONDS, 3600.0)),
)

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
RUNTIME_FIELDS: dict[str, str] = {p.name: p.runtime_field for p in PARAMS if p.runtime_field}
REGISTRY_PARAMS = ("drafts.registry_file", "drafts.names", "drafts.paths", "drafts.domains")


def declare_all(node) -> None:
    """Every parameter but those the diagnostics updater declares (values() reads them once it has).
    Records the locations the path parameters start with (launch values are the operator's: trusted).

    An override of [] (a params file's `names: []`, `-p drafts.names:=[]`) carries no element type, so rclpy
    declared the parameter unset: every read of it raised (configure failed naming no fix, drafts.paths broke the
    constructor) and read-only ones cannot be set after. Every string-array parameter documents [] as meaning
    what its default [''] means, so such an override declares the default (rclpy keeps the overrides in this
    dict on every distribution; a typed [] cannot be declared: rclpy reads an empty list as a byte array)."""
    for p in PARAMS:
        if not p.updater_declares:
            declare(node, p)
    _LAUNCH_ROOTS[node] = launch_roots({n: plain_value(node.get_parameter(n).value) for n in PATH_PARAMS})


def take_int_override_as_double(node, p: Param) -> None:
    """An integer override of a double parameter (``-p diagnostic_updater.period:=2``) made a double in the node's
    overrides: for a parameter the node leaves to another's declare_parameter (the real diagnostic_updater's), which
    raised InvalidParameterTypeException on it; declare() does the same for its own."""
    overrides = getattr(node, "_parameter_overrides", None)
    given = overrides.get(p.name) if isinstance(overrides, dict) else None
    if given is not None:
        [overrides[p.name]] = ints_as_doubles([given])


def ints_as_doubles(parameters: list) -> list:
    """A change that gives a double parameter an integer (``ros2 param set /memspec generation.temperature 0``,
    ``ros2 param load`` of a file with ``ucb_c: 2``) made a double, as at start-up (declare()): rclpy checks the type
    against the descriptor before the node's on_set callback sees it, and refused it as the wrong type. rclpy's
    pre-set callback (Iron and later) runs before that check."""
    from rclpy.parameter import Parameter

    def fixed(given):
        p = BY_NAME.get(given.name)
        if p is not None and type(p.default) is float and given.type_ == Parameter.Type.INTEGER:
            return Parameter(given.name, Parameter.Type.DOUBLE, float(given.value))
        return given

    return [fixed(given) for given in parameters]


def declare(node, p: Param) -> Any:
    """Declare ``p`` on ``node`` (its default, or the launch override); its value.

    Two overrides rclpy would refuse or misread are taken as meant: an untyped [] (declare_all) and an integer
    for a double parameter (a params file's ``ucb_c: 2``, ``-p diagnostic_updater.period:=2``), which raised
    InvalidParameterTypeException out of the node's constructor."""
    from rclpy.parameter import Parameter

    take_int_override_as_double(node, p)
    overrides = getattr(node, "_parameter_overrides", None)
    given = overrides.get(p.name) if isinstance(overrides, dict) else None
    if given is not None and given.type_ == Parameter.Type.NOT_SET and p.default == [""]:
        return node.declare_parameter(p.name, p.default, p.descriptor(), ignore_override=True).value
    return node.declare_parameter(p.name, p.default, p.descriptor()).value


def values(node) -> dict[str, Any]:
    """Current values by name (string arrays as lists)."""
    return {p.name: plain_value(node.get_parameter(p.name).value) for p in PARAMS}


def plain_value(value: Any) -> Any:
    """A parameter value as plain Python: rclpy gives array parameters as array.array, comparisons need lists."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "array":
        return list(value)
    return value


def check_value(name: str, value: Any) -> str:
    """'' if ``value`` is valid for ``name``, else the reason (ranges, choices, types)."""
    p = BY_NAME.get(name)
    if p is None:
        return ""  # undeclared parameters are rclpy's business
    value = plain_value(value)
    if isinstance(p.default, bool) != isinstance(value, bool):
        return f"{name} must be a bool, got {value!r}"
    if isinstance(p.default, list):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return f"{name} must be a list of strings, got {value!r}"
        return ""
    if isinstance(p.default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(p.default):
        return f"{name} must be a {type(p.default).__name__}, got {value!r}"
    if name == "generation.top_p" and not 0.0 < value <= 1.0:  # not the range's message, which shows 5e-324
        return f"generation.top_p must be in (0, 1], got {value}"
    if p.int_range and not p.int_range[0] <= value <= p.int_range[1]:
        return f"{name} must be in [{p.int_range[0]}, {p.int_range[1]}], got {value}"
    if p.float_range and not p.float_range[0] <= value <= p.float_range[1]:
        return f"{name} must be in [{p.float_range[0]}, {p.float_range[1]}], got {value}"
    if p.choices and value not in p.choices:
        return f"{name} must be one of {', '.join(p.choices)}, got {value!r}"
    if name == "generation.system_prompt" and value and value.isspace():  # it replaced the template's default
        # system turn with an empty one, while a goal's whitespace-only system message is refused
        return ("generation.system_prompt is only whitespace: leave it empty for the template's own default system"
                " turn, or give it text")
    if name == "model.device" and not re.fullmatch(r"cpu|cuda(:\d+)?", value):  # 'cuda:x' failed at configure
        return f"model.device must be 'cpu' or 'cuda[:N]', got {value!r}"
    return ""


# -- where the bundled zoo is -------------------------------------------------------------------

def default_zoo_dir() -> Path:
    """The bundled zoo: $MEMSPEC_ZOO_DIR, else <share>/memspec_ros/models (a colcon install that
    ships the zoo), else the source tree's models/ (the dev checkout and symlink installs)."""
    if not os.environ.get(ZOO_ENV):
        try:
            from ament_index_python.packages import PackageNotFoundError, get_package_share_directory

            try:
                share = Path(get_package_share_directory(PACKAGE)) / "models"
                if (share / "registry.yaml").is_file():
                    return share
            except PackageNotFoundError:
                pass
        except ImportError:
            pass
    return bundled_zoo_dir()


def non_empty(items: list[str]) -> list[str]:
    """String-array parameters cannot be declared empty in YAML-less defaults: [''] means none."""
    return [s for s in items if s != ""]


# -- path confinement ----------------------------------------------------------------------------

PATH_PARAMS = ("model.target_path", "model.tokenizer_path", "predictor.path", "datastore.path", "drafts.registry_file",
               "drafts.paths")
_NONE_ALLOWED = ("predictor.path", "datastore.path")  # 'none' is a choice, not a path
PKG_PREFIX = "pkg:"  # runtime/model_source.py: a file inside an installed package, confined to it there
PKG_PATHS = ("model.target_path", "model.tokenizer_path", "drafts.paths")  # the ones loaded through model_source
_LAUNCH_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # node -> locations it started with


def _resolved(path: str | Path) -> Path | None:
    """Where a path really points: every symlink followed, every '..' removed (no '~' expansion: the
    loaders take a path parameter literally, so the check must too); None where it cannot be resolved (a
    symlink loop: Path.resolve raises RuntimeError on Python 3.11)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def _a_root_that_confines(path: Path | None) -> bool:
    """A location that can serve as a root: not the filesystem root (a service started in /, or a registry file
    in /, would otherwise allow every path)."""
    return path is not None and path != Path(path.anchor)


def _only_the_users(path: Path) -> bool:
    """Whether ``path`` is a directory of this user's that not every user can write to: /tmp (where any local user can
    put a model folder for a ROS peer to point the node at) is not. Group write is allowed: with a group per user
    (umask 002) a project folder is group-writable and still the user's alone."""
    try:
        st = path.stat()
    except OSError:
        return False
    return path.is_dir() and st.st_uid == os.geteuid() and not st.st_mode & 0o002


def default_allowed_roots() -> list[Path]:
    """model.allowed_roots' default: the bundled zoo, the user's cache directory (Hugging Face's and the
    GGUF conversions'), the working directory when it is the user's own and not writable by every user (not the
    filesystem root, where a service started in / would allow everything, nor /tmp), $MEMSPEC_CACHE_DIR when set,
    and the directories in $MEMSPEC_ALLOWED_ROOTS."""
    from memspec_ros.runtime.model_source import memspec_cache_dir, user_cache_dir

    # the folders the caches are written in (model_source.cache_root), read as it reads them
    roots = [default_zoo_dir(), user_cache_dir(), *filter(None, [memspec_cache_dir()])]
    cwd = Path.cwd().resolve()
    if _a_root_that_confines(cwd) and _only_the_users(cwd):
        roots.append(cwd)
    roots += [Path(p) for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p]
    return roots


def _registry_paths(registry_file: str | Path) -> list[tuple[str, str]]:
    """(what, path) for the target and each draft a registry file names; [] if it cannot be read (the
    registry's own loading reports that)."""
    from ..runtime.registry import DraftRegistry

    try:
        registry = DraftRegistry.from_yaml(registry_file, validate=False)
    except Exception:
        return []
    found = [(f"draft {e.name!r} in {registry_file}", e.path) for e in registry.entries()]
    if registry.target_path:
        found.append((f"the target named in {registry_file}", registry.target_path))
    return found


def _path_values(v: dict[str, Any]) -> list[tuple[str, str]]:
    """(parameter, path) for every path the values in ``v`` name (path parameters only, empty ones skipped)."""
    found = []
    for name in PATH_PARAMS:
        if name not in v:
            continue
        value = v[name]
        for item in (value if isinstance(value, list) else [value]):
            if item and not (name in _NONE_ALLOWED and item == "none"):
                found.append((name, str(item)))
    return found


def launch_roots(v: dict[str, Any]) -> list[Path]:
    """The locations the path parameters name at start: each path, a registry file's folder and every
    path it lists."""
    roots = []
    for name, path in _path_values(v):
        if path.startswith(PKG_PREFIX):
            continue
        resolved = _resolved(path)
        roots.append(resolved.parent if name == "drafts.registry_file" and resolved is not None else resolved)
        if name == "drafts.registry_file":
            roots += [_resolved(p) for _, p in _registry_paths(path) if not p.startswith(PKG_PREFIX)]
    return [root for root in roots if _a_root_that_confines(root)]


def allowed_roots(node) -> list[Path]:
    """Where the node's path parameters may point: model.allowed_roots (or its default), plus the
    locations the node started with."""
    configured = non_empty(plain_value(node.get_parameter("model.allowed_roots").value))
    roots = [Path(r) for r in configured] if configured else default_allowed_roots()
    resolved = [_resolved(r.expanduser()) for r in roots]
    return [r for r in resolved if r is not None] + list(_LAUNCH_ROOTS.get(node, []))


def path_outside_roots(what: str, path: str, roots: list[Path]) -> str:
    """'' if ``path`` resolves inside one of ``roots`` (or is a pkg: source), else the reason."""
    if path.startswith(PKG_PREFIX):
        return ""
    resolved = _resolved(path)
    if resolved is None:
        return f"{what} {path!r} cannot be resolved (a symlink loop?): point it at the model's real location"
    if any(resolved == root or root in resolved.parents for root in roots):
        return ""
    return (f"{what} {path!r} resolves to {resolved}, outside model.allowed_roots"
            f" ({', '.join(str(r) for r in roots)}): move the model under one of them, or start the node with"
            " model.allowed_roots (read-only) naming its directory")


def paths_in_use(new: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The path values that the parameter values ``new`` (a change, or every value at configure) bring into
    use, on top of ``current``: their path parameters, but the registry file only while drafts.names is
    empty (the node reads it then), and drafts.paths only while drafts.names is set. A drafts.* change
    that makes the node read the registry file brings the file in, even when the file itself is unchanged."""
    merged = {**current, **new}
    uses_file = not non_empty(merged["drafts.names"])
    found = {n: new[n] for n in PATH_PARAMS if n in new and n not in ("drafts.registry_file", "drafts.paths")}
    if any(n in REGISTRY_PARAMS for n in new):
        if uses_file:
            found["drafts.registry_file"] = merged["drafts.registry_file"]
        else:
            found["drafts.paths"] = merged["drafts.paths"]
    return found


def check_paths(v: dict[str, Any], roots: list[Path]) -> str:
    """'' if every path the path parameters in ``v`` name, and every path a registry file among them lists,
    resolves inside ``roots``; else the first reason."""
    for name, path in _path_values(v):
        if path.startswith(PKG_PREFIX) and name not in PKG_PATHS:  # read as a plain path: it was never confined
            return (f"{name} {path!r}: pkg: names a file in an installed package, which only {', '.join(PKG_PATHS)}"
                    f" load; give {name} a path")
        reason = path_outside_roots(name, path, roots)
        if reason:
            return reason
        if name == "drafts.registry_file":
            for what, listed in _registry_paths(path):
                reason = path_outside_roots(what, listed, roots)
                if reason:
                    return reason
    return ""


@dataclass
class ModelPaths:
    registry_file: str  # "" when the registry comes from drafts.names/paths
    target: str
    tokenizer: str
    predictor: str  # "" = no predictor
    datastore: str = ""  # "" = no datastore


def same_path(a: str, b: str) -> bool:
    """Two model paths name the same thing: equal text (pkg: resources, '' for none), the same file, or folders
    whose files are the same files (a colcon --symlink-install share folder holds a link per file)."""
    if a == b:
        return True
    if not a or not b or a.startswith(PKG_PREFIX) or b.startswith(PKG_PREFIX):
        return False
    pa, pb = Path(a), Path(b)
    if pa.resolve() == pb.resolve():
        return True
    if pa.is_dir() and pb.is_dir():
        files = [({f.name: f.resolve() for f in p.rglob("*") if f.is_file()}) for p in (pa, pb)]
        return bool(files[0]) and files[0] == files[1]
    return False


def registry_file_of(v: dict[str, Any]) -> str:
    """The registry file the parameters name: drafts.registry_file, or the bundled zoo's when it is empty."""
    return v["drafts.registry_file"] or str(default_zoo_dir() / "registry.yaml")


def resolve_paths(v: dict[str, Any]) -> ModelPaths:
    """Fill empty paths from the bundled zoo; raises ValueError saying which parameter to set."""
    registry_file = ""
    target = v["model.target_path"]
    if not non_empty(v["drafts.names"]):
        registry_file = registry_file_of(v)
        if not Path(registry_file).is_file():
            raise ValueError(
                f"draft registry {registry_file!r} does not exist: set drafts.registry_file (or drafts.names/paths)"
                + (f", or build a zoo there (memspec-zoo build --out {str(Path(registry_file).parent)!r})"
                   if Path(registry_file).name == "registry.yaml" else "")
            )
    if not target:
        if not registry_file:
            raise ValueError("model.target_path is empty and there is no registry file to take the target from:"
                             " set model.target_path")
        target = registry_target(registry_file)
        if not target:
            raise ValueError(f"{registry_file} names no target: set model.target_path")
    predictor = v["predictor.path"]
    if predictor == "none":
        predictor = ""
    elif not predictor:
        base = Path(registry_file).parent if registry_file else Path(target).parent
        predictor = find_predictor(base / "predictor")
    else:  # the folder memspec-train-predictor wrote (--out) holds its heads in encoder subfolders
        predictor = find_predictor(predictor) or predictor
    datastore = v["datastore.path"]
    if datastore == "none":
        datastore = ""
    elif not datastore and registry_file:
        datastore = find_datastore(Path(registry_file).parent)
    return ModelPaths(registry_file, target, v["model.tokenizer_path"] or target, predictor, datastore)


# The policy a predictor policy (memspec, prediction-only, ...) runs as when configure finds no usable predictor.
PREDICTOR_FALLBACK = "general-static"


def check_general_draft(policy: str, general_draft: str, names: list[str]) -> None:
    """general-static runs memspec.general_draft: ValueError with the reason if the registry lacks it."""
    if policy == "general-static" and general_draft not in names:
        raise ValueError(f"memspec.general_draft {general_draft!r} is not in the draft registry"
                         f" ({', '.join(names) or 'no drafts'}): policy general-static runs that draft; add it to the"
                         " registry or set memspec.general_draft to one of its drafts")


DRAFT_LISTS = ("drafts.names", "drafts.paths", "drafts.domains")  # parallel: one entry per draft


def listed(items: list[str], name: str) -> list[str]:
    """A parallel list parameter's entries: [''] (the declared default) means none; an empty entry among others is
    refused, since dropping it would pair every later name with the next one's path or domain."""
    items = list(items)
    if items == [""]:
        return []
    if "" in items:
        raise ValueError(f"{name} has an empty entry (position {items.index('')}): drafts.names, drafts.paths and"
                         " drafts.domains are read side by side, one entry per draft; remove it or fill it in")
    return items


def draft_lists(v: dict[str, Any]) -> DraftLists | None:
    """The drafts drafts.names/paths/domains give, or None when the registry file holds them."""
    names = listed(v["drafts.names"], "drafts.names")
    if not names:
        return None
    return DraftLists(names, listed(v["drafts.paths"], "drafts.paths"), listed(v["drafts.domains"], "drafts.domains"))


def runtime_config(v: dict[str, Any]) -> RuntimeConfig:
    """The RuntimeConfig the memspec.* parameters describe."""
    return RuntimeConfig(**{field_: v[name] for name, field_ in RUNTIME_FIELDS.items()})


def node_range(name: str):
    """An argparse type holding an option that becomes the node parameter ``name`` (a bench's or the demo's
    --threads, --feedback-period) to that parameter's declared range: the node refused a value past it with a
    traceback once started. A thread count is at least 1 here (the parameter's 0, torch's default, is no count)."""
    from ..argtypes import float_in, int_in

    param = BY_NAME[name]
    if param.int_range:
        parse = int_in(max(param.int_range[0], 1), param.int_range[1])
    else:
        parse = float_in(*param.float_range)
    parse.__name__ = f"{name} (the node's range)"
    return parse
