"""The draft registry: the candidate draft set D, by name, with path, domain and size.

The registry only says what *could* be loaded; the cache manager decides what is
resident. It is read from a YAML file (paths relative to that file) or from plain
parallel lists (ROS parameters cannot hold a list of mappings). Drafts can be
added or removed while a generation runs: the controller reads :attr:`version`
at every scheduling point, so a change takes effect there and never mid-iteration.

YAML shape (``drafts`` may also be a mapping name -> {path, domain}):

.. code-block:: yaml

    target: {path: target}          # optional, used for the tokenizer check
    drafts:
      - {name: general, path: drafts/general, domain: general}
      - {name: code, path: drafts/code, domain: code}
"""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from .lookup import LOOKUP_DRAFT
from .model_source import is_model_source, relative_to, resolve_model_path
from .models import (
    ModelDirectoryError,
    TokenizerMismatchError,
    load_tokenizer,
    read_config,
    scored_width,
    tokenizer_fingerprint,
    width_mismatch,
)

# the keys a registry file may hold: any other (a misspelt 'domian', say) was ignored. 'tokenizer' is read by
# nothing (the target's tokenizer is used) but zoos built before session 37 wrote it: they keep loading.
REGISTRY_KEYS = ("target", "drafts", "tokenizer")
DRAFT_KEYS = ("name", "path", "domain", "size_bytes")
TARGET_KEYS = ("path",)


def _known_keys(mapping: dict, known: Sequence[str], where: str) -> None:
    unknown = [str(k) for k in mapping if k not in known]
    if unknown:
        raise RegistryError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                            f" (a registry entry here has {', '.join(known)}): fix the name or remove it")


class RegistryError(ValueError):
    """The draft registry (YAML or parameter lists) is malformed; the message says what to fix."""


class DuplicateDraftError(RegistryError):
    """Two drafts share one name; names identify drafts in the cache, the policies and ROS messages."""


class UnknownDraftError(RegistryError, KeyError):
    """A draft name that is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class _RefusedYamlError(Exception):
    """What a registry file may not hold: a key twice in one mapping, an alias (the message says which and where)."""


def _unique_mapping(loader, node, deep: bool = False) -> dict:
    """SafeLoader's mapping, refusing a key given twice: PyYAML keeps the last silently, so a registry listing
    ``drafts: {code: d1, code: d2}`` dropped d1 unseen (DuplicateDraftError never saw it), and an entry with two
    ``path:`` keys loaded the second."""
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            repeated = key in seen
            seen.add(key)
        except TypeError:  # an unhashable key: SafeLoader's own construct_mapping reports it
            continue
        if repeated:
            raise _RefusedYamlError(
                f"line {key_node.start_mark.line + 1}: the key {key!r} appears twice in one mapping (YAML would keep"
                " only the last): give each draft a unique name and each field once")
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader (safe constructors only), with duplicate mapping keys and aliases refused."""

    def compose_node(self, parent, index):
        # aliases nested a few levels deep expand exponentially (a 476-byte file became a 2.8 GB value, and an error
        # message quoting it): a registry has no use for them
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise _RefusedYamlError(f"line {mark.line + 1}: an alias (*name): a registry file takes none, write"
                                     " the value out")
        return super().compose_node(parent, index)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _text(value: object, where: str) -> str:
    """A name, path or domain from the YAML: a non-empty string (a number is taken as its text). A null field
    (``name:`` with nothing after it) was the string 'None', a path '<registry dir>/None'. A path given in code may
    be any os.PathLike."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RegistryError(f"{where} is {_quoted(value)}: give it a string" + (
            " (the field is empty: write a value after the colon, or remove the key)" if value is None else ""))
    text = str(value)
    if not text.strip():
        raise RegistryError(f"{where} is empty: give it a value")
    return text


# far past any registry's size (the bundled one: under 1 KB); parsed in pure Python, a 3.5 MB file took 8 s and
# 207 MB, in a parameter callback any ROS participant can make
MAX_REGISTRY_BYTES = 1 << 20


def _quoted(value: object) -> str:
    """``value``'s repr, cut to a line: it goes into the parameter reply, the log and /diagnostics."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


MAX_SIZE_BYTES = 2**63 - 1  # what ~/cache_state's uint64 and the budget parameter (an int64) can carry


def _size(value: object, where: str) -> int:
    """``size_bytes``: a whole number of bytes (absent, null or 0: estimated from the safetensors files)."""
    if value is None:
        return 0
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:  # numpy's ints too
        raise RegistryError(f"{where} is {_quoted(value)}: give a whole number of bytes (7607384, not 7.6MB), or 0 to"
                            " estimate it from the safetensors files")
    value = int(value)
    if value > MAX_SIZE_BYTES:  # a typo: every ~/cache_state message then failed to build, 10 times a second
        raise RegistryError(f"{where} is {value}, more than any memory ({MAX_SIZE_BYTES}): give the draft's size"
                            " in bytes, or 0 to estimate it from the safetensors files")
    return value


@dataclass(frozen=True)
class DraftEntry:
    """One candidate draft: where it lives on storage and what it costs in fast memory."""

    name: str
    path: str
    domain: str = "general"
    size_bytes: int = 0  # estimated from the safetensors files when 0


def weights_bytes(path: str | Path) -> int:
    """Bytes of a directory's safetensors files: the memory a load will reserve (before it starts)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class DraftRegistry:
    """Thread-safe set of :class:`DraftEntry`, validated on every add."""

    def __init__(
        self,
        entries: Sequence[DraftEntry] = (),
        *,
        target_path: str | Path | None = None,
        target_fingerprint: str | None = None,
        validate: bool = True,
        target_vocab_size: int = 0,
    ) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, DraftEntry] = {}
        self._version = 0
        self.validate = validate
        self.target_path = str(target_path) if target_path is not None else None
        if target_fingerprint is None and target_path is not None and validate:
            target_fingerprint = tokenizer_fingerprint(load_tokenizer(target_path))
        self.target_fingerprint = target_fingerprint
        # the token ids the target scores (0: not checked): a draft of the same tokenizer but another width (a
        # sibling model with padded rows) was accepted here and refused at each load, with the goals run without it
        self.target_vocab_size = target_vocab_size
        for entry in entries:
            self.add(entry)

    # -- construction -----------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, *, target_fingerprint: str | None = None,
                  validate: bool = True, target_vocab_size: int = 0) -> DraftRegistry:
        """Read a registry file; relative paths resolve from the file's directory."""
        file = Path(path)
        if file.is_dir():
            raise RegistryError(f"draft registry {str(file)!r} is a directory: name its registry file (e.g."
                                f" {str(file / 'registry.yaml')!r})")
        if not file.is_file():
            raise RegistryError(
                f"draft registry {str(file)!r} does not exist: check the path (e.g. models/registry.yaml)"
            )
        if file.stat().st_size > MAX_REGISTRY_BYTES:  # a tokenizer.json named by mistake took seconds a parse
            raise RegistryError(f"{file} has {file.stat().st_size} bytes, more than a registry file's"
                                f" {MAX_REGISTRY_BYTES}: name the zoo's registry.yaml")
        try:
            data = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}  # a SafeLoader
        except UnicodeDecodeError as exc:  # the codec's message named no file
            raise RegistryError(f"{file} is not UTF-8 text (byte {exc.object[exc.start]:#x} at offset {exc.start}):"
                                " save it as UTF-8") from None
        except _RefusedYamlError as exc:
            raise RegistryError(f"{file}: {exc}") from exc
        except yaml.YAMLError as exc:
            # where, not what: the error goes back to whoever set drafts.registry_file, and PyYAML's message quotes
            # the file's text (a credentials file named by mistake would be echoed in the reply and the log)
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise RegistryError(f"{file} is not valid YAML{at}: fix the syntax") from None
        if not isinstance(data, dict) or "drafts" not in data:
            raise RegistryError(f"{file} has no 'drafts' key: list drafts as `drafts: [{{name, path, domain}}]`")
        _known_keys(data, REGISTRY_KEYS, str(file))
        base = file.parent
        raw = data["drafts"]
        if isinstance(raw, dict):
            # the mapping's key is the name: a 'name' inside the entry too would have replaced it silently
            for name, spec in raw.items():
                if isinstance(spec, dict) and "name" in spec and spec["name"] != name:
                    raise RegistryError(f"drafts.{name} in {file} also names itself {spec['name']!r}: in the mapping"
                                        " form the key is the draft's name; drop 'name' or make them equal")
            raw = [{**(spec if isinstance(spec, dict) else {"path": spec}), "name": name} for name, spec in raw.items()]
        if not isinstance(raw, list):
            raise RegistryError(f"'drafts' in {file} must be a list of {{name, path, domain}} mappings")
        entries = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or "name" not in item or "path" not in item:
                got = f"keys {', '.join(map(str, item))}" if isinstance(item, dict) else f"a {type(item).__name__}"
                raise RegistryError(f"drafts[{i}] in {file} needs at least 'name' and 'path' (got {got})")
            where = f"drafts[{i}] in {file}"
            name = _text(item["name"], f"{where}: 'name'")
            where = f"drafts[{i}] ({name!r}) in {file}"
            twin = next((j for j, e in enumerate(entries) if e.name == name), None)
            if twin is not None:  # add() said "already registered: remove it first", with no file or entry named
                raise RegistryError(f"{where} has the name of drafts[{twin}]: each draft needs a name of its own")
            _known_keys(item, DRAFT_KEYS, where)
            entries.append(
                DraftEntry(
                    name=name,
                    path=relative_to(base, _text(item["path"], f"{where}: 'path'")),  # a pkg: resource as it is
                    domain=_text(item["domain"], f"{where}: 'domain'") if "domain" in item else name,
                    size_bytes=_size(item.get("size_bytes"), f"{where}: 'size_bytes'"),
                )
            )
        target = data.get("target")
        target_path = None
        if "target" in data and target is None:  # `target:` with nothing after it: skipped, configure then asked
            raise RegistryError(f"'target' in {file} is empty: write its path after the colon, or remove the key")
        if isinstance(target, dict):  # a misspelt key first: "{pth: target}" was reported as "not a dict"
            _known_keys(target, TARGET_KEYS, f"'target' in {file}")
        if target is not None and not (isinstance(target, str) and target) and not (
                isinstance(target, dict) and isinstance(target.get("path"), str) and target["path"]):
            # ignored, it left configure to say "names no target: set model.target_path", the wrong fix
            inner = target.get("path") if isinstance(target, dict) else target  # its keys are known by now
            what = "an empty one" if inner in ("", None) or target == {} else "a " + type(inner).__name__
            raise RegistryError(f"'target' in {file} must be a path (a string) or {{path: ...}}, not {what}")
        if isinstance(target, dict) and target.get("path"):
            target_path = relative_to(base, str(target["path"]))
        elif isinstance(target, str):
            target_path = relative_to(base, target)
        if target_fingerprint is not None or not validate:
            target_path_arg = None
        else:
            target_path_arg = target_path
        registry = cls(entries, target_path=target_path_arg, target_fingerprint=target_fingerprint, validate=validate,
                       target_vocab_size=target_vocab_size)
        registry.target_path = str(target_path) if target_path is not None else None
        return registry

    @classmethod
    def from_lists(
        cls,
        names: Sequence[str],
        paths: Sequence[str],
        domains: Sequence[str] = (),
        *,
        base_dir: str | Path | None = None,
        target_fingerprint: str | None = None,
        validate: bool = True,
        target_vocab_size: int = 0,
    ) -> DraftRegistry:
        """From ROS parameters ``drafts.names``, ``drafts.paths``, ``drafts.domains`` (parallel lists)."""
        for label, given in (("names", names), ("paths", paths), ("domains", domains)):
            if isinstance(given, (str, bytes, Path)):  # a string is a sequence too: one draft per character
                raise RegistryError(f"drafts.{label} must be a list, got one {type(given).__name__} {given!r}:"
                                    f" pass [{given!r}]")
        if len(names) != len(paths):
            raise RegistryError(
                f"drafts.names has {len(names)} entries but drafts.paths has {len(paths)}: give one path per name"
            )
        if domains and len(domains) != len(names):
            raise RegistryError(
                f"drafts.domains has {len(domains)} entries for {len(names)} names: give one domain per name or none"
            )
        for i, p in enumerate(paths):  # an empty one resolved to the registry's folder, named in no error
            _text(p, f"drafts.paths[{i}]")
        seen: set[str] = set()
        for i, raw in enumerate(names):
            name = _text(raw, f"drafts.names[{i}]")  # as the YAML's: an empty name or domain is refused
            if domains:
                _text(domains[i], f"drafts.domains[{i}] ({name!r})")
            if name in seen:  # (the registry's own message, "already registered: remove it first", named no list)
                raise RegistryError(f"drafts.names lists {name!r} twice: give each draft one name")
            seen.add(name)
        base = Path(base_dir) if base_dir is not None else None
        entries = [
            DraftEntry(
                name=str(name),
                path=relative_to(base, p) if base is not None and not Path(p).is_absolute() else str(p),
                domain=str(domains[i]) if domains else str(name),
            )
            for i, (name, p) in enumerate(zip(names, paths, strict=True))
        ]
        return cls(entries, target_fingerprint=target_fingerprint, validate=validate,
                   target_vocab_size=target_vocab_size)

    # -- validation -------------------------------------------------------------
    def _checked(self, entry: DraftEntry) -> DraftEntry:
        if isinstance(entry.name, str) and not entry.name.strip():
            raise RegistryError(f"a draft at {entry.path!r} has an empty name: give every draft a unique name")
        # an entry made in code gets the YAML's checks: a negative size was taken for "estimate", a name of 3 or a
        # pathlib.Path failed in .strip() or .startswith() with an AttributeError
        name = _text(entry.name, "a draft's name")
        entry = DraftEntry(name, _text(entry.path, f"draft {name!r}: path"),
                           _text(entry.domain, f"draft {name!r}: domain"),
                           _size(entry.size_bytes, f"draft {name!r}: size_bytes"))
        if entry.name == LOOKUP_DRAFT:  # statistics tell copies from the context by this name
            raise RegistryError(f"the draft name {LOOKUP_DRAFT!r} is reserved for copies from the context"
                                f" (memspec.context_lookup): rename the draft at {entry.path!r}")
        local = Path(entry.path)  # the directory loads read: a GGUF file or pkg: resource's conversion
        if self.validate:
            if is_model_source(entry.path):
                local = resolve_model_path(entry.path)  # converted once, cached (runtime/model_source.py)
            config = read_config(local)  # ModelDirectoryError: missing directory or config.json
            if not any(local.glob("*.safetensors")):
                raise ModelDirectoryError(f"draft {entry.name!r}: no *.safetensors weights in {local}")
            if self.target_fingerprint is not None:
                if tokenizer_fingerprint(load_tokenizer(local)) != self.target_fingerprint:
                    raise TokenizerMismatchError(
                        f"draft {entry.name!r} in {entry.path} has a different tokenizer from the target:"
                        " speculative decoding needs one shared vocabulary;"
                        " use a draft trained with the target's tokenizer"
                    )
            if self.target_vocab_size and (width := scored_width(local, config)) != self.target_vocab_size:
                raise width_mismatch(entry.name, entry.path, width, self.target_vocab_size)
        if entry.size_bytes <= 0 and local.is_dir():
            entry = DraftEntry(entry.name, entry.path, entry.domain, weights_bytes(local))
        return entry

    # -- mutation (takes effect at the next scheduling point) ---------------------
    def add(self, entry: DraftEntry) -> DraftEntry:
        with self._lock:
            if entry.name in self._entries:
                raise DuplicateDraftError(
                    f"a draft named {entry.name!r} is already registered: choose another name or remove it first"
                )
        entry = self._checked(entry)  # outside the lock: reading a tokenizer takes a while
        with self._lock:
            if entry.name in self._entries:
                raise DuplicateDraftError(
                    f"a draft named {entry.name!r} is already registered: choose another name or remove it first"
                )
            self._entries[entry.name] = entry
            self._version += 1
        return entry

    def check_replacement(self, other: DraftRegistry) -> None:
        """ValueError unless ``other`` checked its drafts as this registry would (replace_with's only refusal)."""
        if self.validate and (not other.validate or other.target_fingerprint != self.target_fingerprint
                              or other.target_vocab_size != self.target_vocab_size):
            raise ValueError("the replacing registry did not check its drafts against this registry's target")

    def replace_with(self, other: DraftRegistry) -> list[DraftEntry]:
        """Take ``other``'s entries in one step (a running generation sees the new set at its next scheduling point,
        never half of it); returns the entries that left or changed. ``other`` checked them when it was built, so
        they are not read again (a tokenizer each: about 0.4 s a draft in a reviewer's run on a loaded machine, which
        callers holding a lock made every goal callback wait for); it must have checked them as this registry would."""
        self.check_replacement(other)
        want = {e.name: e for e in other.entries()}
        with self._lock:
            gone = [e for name, e in self._entries.items() if want.get(name) != e]
            if gone or list(want) != list(self._entries):
                self._entries = want
                self._version += 1
        return gone

    def remove(self, name: str) -> DraftEntry:
        with self._lock:
            if name not in self._entries:
                raise UnknownDraftError(
                    f"no draft named {name!r} is registered (registered: {', '.join(self._entries) or 'none'})"
                )
            self._version += 1
            return self._entries.pop(name)

    # -- queries ------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Bumped by every add/remove, so a controller notices changes at its next scheduling point."""
        with self._lock:
            return self._version

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def entries(self) -> list[DraftEntry]:
        with self._lock:
            return list(self._entries.values())

    def get(self, name: str) -> DraftEntry:
        with self._lock:
            try:
                return self._entries[name]
            except KeyError:
                raise UnknownDraftError(
                    f"no draft named {name!r} is registered (registered: {', '.join(self._entries) or 'none'})"
                ) from None

    def by_domain(self, domain: str) -> list[DraftEntry]:
        return [e for e in self.entries() if e.domain == domain]

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def __iter__(self) -> Iterator[DraftEntry]:
        return iter(self.entries())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
