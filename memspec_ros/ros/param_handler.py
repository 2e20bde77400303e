"""Parameter changes: every value checked against params.py's table, then applied where it lands.

* ``model.*``, ``drafts.quantization``, ``cache.storage``, ``predictor.path``, ``datastore.path`` choose what
  configure loads: refused while models are loaded (cleanup, set, configure again);
* ``memspec.*``: ``RuntimeController.reconfigure``, which a running goal sees at its next scheduling point;
* the other ``drafts.*``: a registry built from the new values, whose entries replace the live registry's;
* ``diagnostic_updater.period``, ``diagnostics.window_goals``: the setters the node registers;
* the rest are read per goal or per publication.

A change is all or nothing: it is refused with the reason, and nothing applied, unless every value is valid
and the runtime takes it. Everything is checked before anything is applied; a step that still fails while
applying (a setter raising) undoes the steps before it, so the runtime keeps the values `ros2 param get` shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rcl_interfaces.msg import SetParametersResult

from ..runtime.chat import ChatError, has_chat_template, prompt_ids
from . import params as P

# what a configure reads into the models and the runtime it builds (the rest are read per goal or applied by their
# setters, so a value stored after the configure read them is still the one in use)
CONFIGURED_PREFIXES = ("model.", "drafts.", "predictor.", "datastore.", "cache.", "memspec.")


def _to_unconfigured(state: str) -> str:
    """The transitions that take a node in ``state`` back to unconfigured (an inactive one refuses deactivate)."""
    return "cleanup" if state == "inactive" else "deactivate and cleanup"

class Refused(Exception):
    """A parameter change refused with its reason; nothing was applied."""


def registry_from_params(v: dict[str, Any], fingerprint: str, vocab_size: int):
    """The draft registry the parameters describe: drafts.names/paths/domains if set, else the registry file (the
    bundled zoo's when drafts.registry_file is empty, as configure resolves it); its drafts checked against the
    target's tokenizer ``fingerprint`` and ``vocab_size``."""
    from ..runtime.loader import open_registry

    return open_registry(P.registry_file_of(v), P.draft_lists(v), fingerprint=fingerprint, vocab_size=vocab_size)


LENGTH_PARAMS = frozenset({"generation.system_prompt", "generation.max_prompt_tokens", "generation.max_new_tokens"})


def length_refusal(values: dict[str, Any], tokenizer, max_positions: int, max_token_chars: int) -> str:
    """Why these defaults would refuse every goal that relies on them ('' if they would not): checked at a run-time
    change of any of LENGTH_PARAMS and at configure, where a params file sets them together. A chat goal relies on
    them when it sends max_new_tokens 0 and no system message of its own."""
    new_tokens = int(values["generation.max_new_tokens"])
    if max_positions and new_tokens >= max_positions:
        return (f"generation.max_new_tokens {new_tokens} leaves no room for a prompt in the target's context of"
                f" {max_positions} tokens: every goal with max_new_tokens 0 would be refused; lower it")
    system = str(values["generation.system_prompt"])
    if not has_chat_template(tokenizer):  # plain continuation: no template turns, no system prompt
        return ""
    limit = int(values["generation.max_prompt_tokens"])
    limit = min(limit, max_positions - 1) if max_positions else limit
    if system and len(system) >= limit * max_token_chars:  # the goal's own text takes a character more
        return (f"generation.system_prompt has {len(system)} characters, more than the {limit} tokens of"
                f" generation.max_prompt_tokens (or the target's context) can hold ({max_token_chars} characters"
                " per token at most for this tokenizer): every chat goal would be refused; shorten it or raise"
                " generation.max_prompt_tokens")
    # the characters bound it from below only: a text of few characters per token passed that test and then
    # refused every chat goal. The shortest chat goal (one token of its own) is rendered and counted; the template's
    # turns take tokens of their own too, so a max_new_tokens just under the context refused every chat goal
    try:
        shortest = len(prompt_ids(tokenizer, "x", system_prompt=system))
    except ChatError as exc:  # the template fails on it: so would every chat goal
        if not system:
            return ""  # the model's own template: each goal is refused with the template's error, as before
        return f"generation.system_prompt cannot be rendered by the model's chat template: {exc}"
    if shortest > limit:  # the system prompt, or the template's own turns (its default system turn included)
        return (f"generation.system_prompt takes {shortest} tokens in the shortest chat goal, more than the"
                f" {limit} tokens of generation.max_prompt_tokens (or the target's context): every chat goal"
                " would be refused; shorten it or raise generation.max_prompt_tokens" if system else
                f"generation.max_prompt_tokens {limit} (or the target's context) is less than the {shortest} tokens"
                " the chat template makes of the shortest chat goal: every chat goal would be refused; raise it")
    if max_positions and shortest + new_tokens > max_positions:
        with_system = " with generation.system_prompt" if system else ""
        return (f"generation.max_new_tokens {new_tokens} leaves {max_positions - new_tokens} of the target's"
                f" {max_positions} context tokens for the prompt, and the shortest chat goal{with_system} takes"
                f" {shortest}: every chat goal with max_new_tokens 0 would be refused; lower it to at most"
                f" {max_positions - shortest}")
    return ""


class ParameterHandler:
    """The node's on-set-parameters callback. ``loaded()`` gives what configure loaded (None when
    unconfigured); ``runner`` says whether a goal runs and holds one back while the registry changes."""

    def __init__(self, node, loaded: Callable[[], Any], runner, transitioning) -> None:
        self._node, self._loaded, self._runner = node, loaded, runner
        # held by a lifecycle transition while it runs: a change then is refused, not applied under it (the lifecycle
        # services have their own callback group, so parameter calls are answered during a transition)
        self._transitioning = transitioning
        self._setters: dict[str, Callable[[Any], None]] = {}
        self._configured: dict[str, Any] = {}  # the values the last configure read
        if hasattr(node, "add_pre_set_parameters_callback"):  # Iron and later; Humble refuses an int for a double
            node.add_pre_set_parameters_callback(P.ints_as_doubles)
        node.add_on_set_parameters_callback(self.on_set)

    def apply_at_once(self, name: str, setter: Callable[[Any], None]) -> None:
        """``setter(value)`` applies a valid change of ``name``."""
        self._setters[name] = setter

    def checked_values(self) -> dict[str, Any]:
        """Every parameter's value (configure); ValueError with the first invalid one's reason."""
        v = self._configured = P.values(self._node)
        for name in P.BY_NAME:
            reason = P.check_value(name, v[name])
            if reason:
                raise ValueError(reason)
        reason = P.check_paths(P.paths_in_use(v, v), P.allowed_roots(self._node))  # model.allowed_roots
        if reason:
            raise ValueError(reason)
        return v

    def changed_since_configure_read(self) -> list[str]:
        """Parameters whose value is not the one configure read. on_set releases the transition lock as it returns,
        and rclpy stores the values only after every callback has returned: a set racing a configure could pass
        on_set while unconfigured and land after the configure read the old value (the node then ran the old
        target while `ros2 param get` showed the new one). A configure checks this once its models are loaded."""
        now = P.values(self._node)
        return [name for name, value in self._configured.items()
                if name.startswith(CONFIGURED_PREFIXES) and now.get(name) != value]

    def on_set(self, changed) -> SetParametersResult:
        """Check everything first; apply only if all is valid; refuse while a lifecycle transition runs."""
        if not self._transitioning.acquire(blocking=False):
            reason = ("a lifecycle transition is in progress (a configure loading the models, a deactivate or cleanup"
                      " waiting for the running goal): set it again once it has ended")
            self._node.get_logger().warning(f"parameter change rejected: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        try:
            return self._set(changed)
        finally:
            self._transitioning.release()

    def _set(self, changed) -> SetParametersResult:
        new = {p.name: p.value for p in changed}
        lo = self._loaded()
        try:
            self._check(new, lo)
            registry = self._registry(new, lo)
            self._check_general_draft(new, lo, registry)
            runtime = self._check_runtime(new, lo, registry)
        except Refused as exc:
            self._node.get_logger().warning(f"parameter change rejected: {exc}")
            return SetParametersResult(successful=False, reason=str(exc))
        try:
            self._apply(new, lo, registry, runtime)
        except Exception as exc:  # rclpy's parameter service catches none: `ros2 param set` got no answer at all
            self._node.get_logger().error(f"parameter change failed while being applied: {type(exc).__name__}: {exc}")
            return SetParametersResult(successful=False, reason=(
                f"applying it failed ({type(exc).__name__}: {exc}); the steps applied before it were undone, except"
                " any the node's log names"))
        self._repaired({n for n in new if n in P.RUNTIME_FIELDS})
        if runtime or registry is not None:
            running, _ = self._runner.counts()
            self._node.get_logger().info(f"parameters set: {', '.join(f'{k}={v!r}' for k, v in new.items())}"
                                         + (" (applied at the next scheduling point)" if running else ""))
        return SetParametersResult(successful=True)

    def _apply(self, new: dict[str, Any], lo, registry, runtime: dict[str, Any]) -> None:
        """A checked change, applied: each setter, then the controller's settings, or the registry and those settings
        in one step (RuntimeController.replace_registry: a running goal takes both at one scheduling point). That
        last step applies whole or not at all; one that raises undoes the setters before it (each given its old
        value) and the exception goes on. Once the registry is swapped the change is in force, and what follows it
        (the removed drafts leaving the cache, the files' recheck) is logged if it fails, not undone."""
        undo: list[tuple[str, Callable[[], Any]]] = []
        before = lo.controller.next_config if lo is not None else None
        try:
            for name, value in new.items():
                if name in self._setters:
                    old = self._node.get_parameter(name).value  # stored only once every callback has returned
                    self._setters[name](value)
                    undo.append((name, lambda setter=self._setters[name], old=old: setter(old)))
            if registry is not None:
                with self._runner.no_goal_starting():
                    # the swap (built and checked already: nothing is read here, while goals are held back); with
                    # no generation running the removed drafts leave the draft and prompt caches in it, else as the
                    # generation takes it (the controller's own idea of "running" decides: this runner's flag is set
                    # from a goal's acceptance to its end, a little longer than the generation)
                    lo.controller.replace_registry(registry, **runtime)
                    try:
                        # a resident draft whose files were restored or replaced is read again when the next goal
                        # starts, on that goal's thread (evict_changed must not run beside a generation, and its
                        # stat of every draft's files, slow on failing storage, must not run here holding the
                        # runner's lock, which every goal callback and the diagnostics wait for)
                        lo.controller.recheck_files_later()
                        lo.controller.cache.clear_failed()  # a draft that failed is tried again (files fixed?)
                    except Exception as exc:  # the new registry is in force, as the parameters say
                        self._mismatch(f"the draft registry was replaced, but updating the draft cache after it"
                                       f" failed ({type(exc).__name__}: {exc}); the next goal's scheduling points"
                                       " sync it")
            elif lo is not None and runtime:
                lo.controller.reconfigure(**runtime)
        except Exception:
            for name, step in reversed(undo):
                try:
                    step()
                except Exception as exc:  # logged by name: the reply says the log names what was not undone
                    self._mismatch(f"undoing {name} failed, so the runtime keeps the new value while the parameter"
                                   f" keeps the old: {type(exc).__name__}: {exc}")
            if before is not None:  # the controller's step undoes itself; where even that failed, it is said here
                moved = [n for n, f in P.RUNTIME_FIELDS.items() if getattr(lo.controller.next_config, f)
                         != getattr(before, f)]
                if moved:
                    self._mismatch(f"{', '.join(moved)} could not be put back, so the runtime keeps the new value"
                                   " while the parameter keeps the old", moved)
            raise

    def _mismatch(self, text: str, params: Sequence[str] = ()) -> None:
        """Logged as an error and kept for /diagnostics (the target model's status, WARN): a log line alone left the
        status OK while the runtime and its parameters disagreed. ``params``: the memspec.* parameters whose runtime
        value is not theirs; setting them again repairs it (_check_runtime applies them, though unchanged), and the
        warning goes once every one is repaired. Others (a draft cache's update) hold until the next configure."""
        self._node.get_logger().error(f"parameter change: {text}")
        self._node.parameter_mismatch = text
        self._node.mismatched_params = set(params)

    def _repaired(self, runtime_params: set[str]) -> None:
        """After a change applied whole: the mismatched parameters it set again are in force now."""
        left = self._node.mismatched_params - runtime_params
        if self._node.mismatched_params and not left:
            self._node.get_logger().info("parameter change: the runtime is on its parameters' values again")
            self._node.parameter_mismatch = ""
        self._node.mismatched_params = left

    def _check(self, new: dict[str, Any], lo) -> None:
        if "" in new:  # rclpy would declare a parameter without a name (found by test_node_fuzz)
            raise Refused("a parameter name cannot be empty")
        for name, value in new.items():
            reason = P.check_value(name, value)
            if reason:
                raise Refused(reason)
        # a value set again as it is is no change (`ros2 param load` of a dumped file sets every parameter)
        at_configure = [n for n in new if n in P.BY_NAME and P.BY_NAME[n].when == P.AT_CONFIGURE
                        and P.plain_value(new[n]) != P.plain_value(self._node.get_parameter(n).value)]
        if at_configure and lo is not None:
            state = self._node.lifecycle_state
            raise Refused(f"{', '.join(at_configure)} can change only while unconfigured (the models are loaded,"
                          f" state {state}): {_to_unconfigured(state)}, set it, then configure again")
        if lo is not None and LENGTH_PARAMS & set(new):  # any of them: each bounds what the others leave
            values = {n: new.get(n, self._node.get_parameter(n).value) for n in LENGTH_PARAMS}
            reason = length_refusal(values, lo.tokenizer, lo.max_positions, lo.max_token_chars)
            if reason:
                raise Refused(reason)
        changed = {n: P.plain_value(v) for n, v in new.items()}
        if any(n in P.PATH_PARAMS or n in P.REGISTRY_PARAMS for n in changed):  # model.allowed_roots
            current = {n: P.plain_value(self._node.get_parameter(n).value) for n in P.REGISTRY_PARAMS}
            reason = P.check_paths(P.paths_in_use(changed, current), P.allowed_roots(self._node))
            if reason:  # a path outside the roots, also one a registry file brought into use lists
                raise Refused(reason)

    def _registry(self, new: dict[str, Any], lo):
        """The registry a drafts.* change asks for, built before anything is applied; None if none changed."""
        if lo is None or not any(n in P.REGISTRY_PARAMS for n in new):
            return None
        merged = {**P.values(self._node), **new}
        try:
            registry = registry_from_params(merged, lo.fingerprint, lo.target.vocab_size)
        except Exception as exc:  # a missing or mismatched draft: the change is refused with the cause
            alone = [n for n in P.DRAFT_LISTS if n in new]
            hint = ("; the three lists are read side by side, so change them together in one"
                    " ~/set_parameters_atomically call (`ros2 param set` and `ros2 param load` set one parameter at a"
                    " time), or point drafts.registry_file at a registry YAML" if 0 < len(alone) < len(P.DRAFT_LISTS)
                    else "")
            raise Refused(f"draft registry not changed: {exc}{hint}") from exc
        if not P.non_empty(merged["drafts.names"]):
            self._check_same_models(merged, lo, _to_unconfigured(self._node.lifecycle_state))
        return registry

    @staticmethod
    def _check_same_models(merged: dict[str, Any], lo, steps: str) -> None:
        """A registry file brings its target, and its predictor beside it where predictor.path is empty; configure
        loaded them, and a run-time change swaps only the drafts. One that would bring others is refused: kept
        silently, a predictor ranked drafts it was not trained for."""
        try:
            wanted = P.resolve_paths(merged)
        except ValueError as exc:
            raise Refused(f"draft registry not changed: {exc}") from exc
        # only what configure did load can be contradicted: a node running without a predictor stays without one
        # (its /diagnostics says so), and the datastore holds past answers, whatever the drafts
        # (a predictor configure found but could not load is not loaded: the node runs without one)
        loaded_predictor = lo.paths.predictor if lo.predictor is not None else ""
        moved = [f"{name} {now or 'none'!r} (loaded: {was!r})"
                 for name, was, now in (("model.target_path", lo.paths.target, wanted.target),
                                        ("predictor.path", loaded_predictor, wanted.predictor))
                 if was and not P.same_path(was, now)]
        if moved:
            raise Refused(f"draft registry not changed: {wanted.registry_file} brings {'; '.join(moved)}, which"
                          f" configure loads: {steps}, set drafts.registry_file, then configure again (or give a"
                          " registry beside the loaded target and predictor)")

    def _check_general_draft(self, new: dict[str, Any], lo, registry) -> None:
        """A change that leaves general-static without its draft (the registry, the policy or the name) is refused."""
        if lo is None or not {"memspec.policy", "memspec.general_draft", *P.REGISTRY_PARAMS} & set(new):
            return
        # the policy that runs, which is general-static where a predictor policy had no predictor at configure
        current = {"memspec.policy": lo.controller.next_config.policy,
                   "memspec.general_draft": self._node.get_parameter("memspec.general_draft").value}
        merged = {**current, **new}
        try:
            P.check_general_draft(merged["memspec.policy"], merged["memspec.general_draft"],
                                  (registry or lo.registry).names())
            if registry is not None:  # a policy change alone is checked by reconfigure, against the registry in use
                lo.controller.check_ranking(merged["memspec.policy"], registry)
        except ValueError as exc:
            raise Refused(str(exc)) from exc

    def _check_runtime(self, new: dict[str, Any], lo, registry) -> dict[str, Any]:
        """memspec.* changes as the controller's fields, checked by it (nothing applied yet) against ``registry``
        where the same change replaces the drafts (None: the registry in use). _apply hands them to it (at the
        next scheduling point if a goal runs). A value set again as it is is no change, as for the configure-time
        parameters: `ros2 param load` of a dumped file set memspec.policy 'memspec' again on a node that fell back to
        general-static (no predictor), and the controller refused it, failing the whole file."""
        # (a parameter whose runtime value is not its own, after a change that went part of the way, is applied
        # though unchanged: setting its own value again repairs the runtime)
        runtime = {P.RUNTIME_FIELDS[n]: v for n, v in new.items() if n in P.RUNTIME_FIELDS
                   and (n in self._node.mismatched_params
                        or P.plain_value(v) != P.plain_value(self._node.get_parameter(n).value))}
        if lo is not None and runtime:
            try:
                lo.controller.check_reconfigure(for_registry=registry, **runtime)
            except Exception as exc:  # ValueError / PolicyError naming the field
                raise Refused(str(exc)) from exc
        return runtime
