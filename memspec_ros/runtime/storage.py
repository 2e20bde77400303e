"""The storage tier drafts are loaded from: real reads, paced to an edge medium's bandwidth and latency.

The paper's premise is an edge device whose drafts live on slow storage, so that
loading a non-resident draft costs several decoding iterations. This machine's
disk and page cache are much faster than an edge robot's storage, so a draft
load here reads the weights for real, cold, and paces that read to a medium:

1. ``posix_fadvise(POSIX_FADV_DONTNEED)`` drops the file from the page cache, so
   the bytes come from the disk and not from an earlier load (the fraction of the
   file still cached afterwards is measured with ``mincore`` and recorded: a
   filesystem that cannot drop, such as tmpfs, shows up there);
2. the file is read in requests of ``request_bytes``; after each request the
   reader sleeps until ``requests * request_latency + bytes / bandwidth`` has
   passed since the first byte, so a read of N bytes takes at least
   ``N / bandwidth + ceil(N / request_bytes) * latency`` (a lower bound by
   construction; a slower real disk makes it slower, never faster);
3. the model is built from those bytes (``safetensors.torch.load``: no pickle, no
   second read of the file). The first load of a draft builds it from its own files and
   writes its runtime form (:class:`RuntimeForm`: the built tensors, packed as the forward
   path keeps them); later loads read that file, so a load is a read and a few ms of assembly,
   not a ~25 ms build whose CPU work slows the decoding on the other core.

``local`` does steps 1 and 3 and reads unpaced: this machine's disk as it is. The
other media are emulated; every figure and results page says so.

The media (sources in the comments): each request costs ``request_latency`` on
top of the transfer; the latency is derived from the medium's rated 4 KiB random
read IOPS as ``1 / IOPS - 4096 / bandwidth`` (one request's service time minus
its transfer), which is what a request costs beyond its bytes.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .atomic_write import mark_used, safetensors_io_error
from .draft_vocab import VOCAB_FILE
from .models import LoadedModel, ModelSpec

log = logging.getLogger(__name__)

KIB, MB = 1024, 1_000_000
REQUEST_BYTES = 512 * KIB  # one read request: a common Linux max_sectors_kb for MMC and NVMe block devices


def _latency(iops: float, bandwidth: float) -> float:
    """A request's cost beyond its bytes, from the rated 4 KiB random read IOPS (queue depth 1 where rated)."""
    return 1.0 / iops - 4 * KIB / bandwidth


@dataclass(frozen=True)
class StorageMedium:
    """Where draft weights come from: sustained read bandwidth and a fixed cost per read request."""

    name: str
    read_bytes_per_second: float  # 0: unpaced (this machine's storage as it is)
    request_latency_seconds: float
    request_bytes: int = REQUEST_BYTES
    emulated: bool = True
    source: str = ""

    def min_read_seconds(self, nbytes: int) -> float:
        """The least time a read of ``nbytes`` takes on this medium (what the pacing enforces)."""
        requests = math.ceil(nbytes / self.request_bytes) if nbytes > 0 else 0
        return self._due(nbytes, requests)

    def _due(self, nbytes: int, requests: int) -> float:
        if self.read_bytes_per_second <= 0:
            return 0.0
        return requests * self.request_latency_seconds + nbytes / self.read_bytes_per_second

    def effective_read_bytes_per_second(self) -> float:
        """What a long read gets: each request pays its latency beside its bytes, so less than the rated
        sequential bandwidth (NVMe about 74% of its 3,500 MB/s, eMMC and SD about 96%; the rated figures are for
        deep queues, the loader reads one request at a time). 0: unpaced."""
        if self.read_bytes_per_second <= 0:
            return 0.0
        return self.request_bytes / self._due(self.request_bytes, 1)

    def describe(self) -> dict:
        return {**asdict(self), "effective_read_bytes_per_second": round(self.effective_read_bytes_per_second())}


MEDIA: dict[str, StorageMedium] = {
    "local": StorageMedium("local", 0.0, 0.0, emulated=False,
                           source="this machine's own storage, read cold and unpaced"),
    # eMMC 5.1 (JEDEC JESD84-B51, HS400 bus: 400 MB/s at most). Samsung's first eMMC 5.1 parts (64 GB),
    # announced with the standard in Feb 2015: up to 250 MB/s sequential read and 11,000 IOPS random read
    # (https://cdrinfo.com/d7/content/samsung-develops-first-emmc-51-flash-memory). Latency 1/11000 - 4 KiB/250 MB/s.
    "emmc": StorageMedium("emmc", 250 * MB, _latency(11_000, 250 * MB),
                          source="eMMC 5.1: 250 MB/s sequential read, 11,000 random read IOPS (Samsung eMMC 5.1"
                                 " 64 GB, 2015; JEDEC JESD84-B51 HS400 bus 400 MB/s)"),
    # UHS-I microSD card: the UHS-I bus (SD Physical Layer 3.01, SDR104) carries 104 MB/s at most
    # (http://www.panasonic.net/avc/sdcard/industrial_sd/performance.html). SanDisk Extreme A2 microSD on UHS-I:
    # up to 90 MB/s sequential read; A2 (SD 6.0 App Performance Class 2) guarantees >= 4,000 random read IOPS
    # (AnandTech article 13441, "SanDisk Unveils Extreme microSD Cards with A2 Spec";
    # https://www.custompcreview.com/news/sd-association-introduces-a2-memory-card-specification/).
    # Latency 1/4000 - 4 KiB/90 MB/s. The Jetson Orin Nano developer kit boots from such a card.
    "sd": StorageMedium("sd", 90 * MB, _latency(4_000, 90 * MB),
                        source="UHS-I microSD (A2): 90 MB/s sequential read (SanDisk Extreme A2 on UHS-I; bus"
                               " 104 MB/s SDR104), 4,000 random read IOPS (A2 minimum, SD 6.0)"),
    # NVMe SSD on PCIe Gen3 x4 (the Jetson Orin Nano developer kit's M.2 Key M slot). Samsung 970 EVO Plus
    # 500 GB / 1 TB: 3,500 MB/s sequential read, 19,000 IOPS 4 KiB random read at QD1
    # (https://www.cdrinfo.com/d7/content/samsung-sets-new-performance-levels-consumer-nvme-ssds-970-evo-plus,
    # https://digit.in/reviews/general/samsung-970-evo-plus-nvme-m-2-ssd-250-gb-review-177943.html, the spec table
    # of Samsung's datasheet). Latency 1/19000 - 4 KiB/3500 MB/s.
    "nvme": StorageMedium("nvme", 3500 * MB, _latency(19_000, 3500 * MB),
                          source="NVMe SSD, PCIe Gen3 x4: 3,500 MB/s sequential read, 19,000 random read IOPS at"
                                 " QD1 (Samsung 970 EVO Plus 500 GB/1 TB datasheet)"),
}
STORAGE_CHOICES = tuple(MEDIA)


def storage_medium(medium: str | StorageMedium) -> StorageMedium:
    """A preset by name (local, emmc, sd, nvme), or the medium given."""
    if isinstance(medium, StorageMedium):
        return medium
    try:
        return MEDIA[medium]
    except KeyError:
        raise ValueError(f"unknown storage medium {medium!r}: use one of {', '.join(STORAGE_CHOICES)}") from None


# -- the page cache ------------------------------------------------------------------------------

def drop_page_cache(fd: int) -> None:
    """Ask the kernel to drop the file's clean pages from the page cache (the next read goes to the disk). Where the
    OS has no posix_fadvise (macOS), nothing is dropped, said once: every draft load failed on the AttributeError.
    The read's ``cached_after_drop`` still says how much came from the page cache."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        _warn_no_fadvise()
        return
    fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@functools.lru_cache(maxsize=1)
def _warn_no_fadvise() -> None:
    log.warning("this OS has no posix_fadvise: draft loads cannot drop their files from the page cache first, so a"
                " 'cold' load may read from memory (the load records say how much did)")


def cached_fraction(fd: int, size: int) -> float | None:
    """Fraction of the file's pages in the page cache now (mincore); None where it cannot be asked."""
    if size <= 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        import mmap

        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None


# -- reading -----------------------------------------------------------------------------------------

@dataclass
class FileRead:
    """One cold, paced read of a whole file."""

    path: str
    nbytes: int
    requests: int
    seconds: float
    cached_after_drop: float | None  # page-cache fraction right after the drop (0: a true cold read)


def read_cold(path: str | Path, medium: StorageMedium) -> tuple[bytes, FileRead]:
    """The file's bytes, read after dropping it from the page cache, paced to ``medium``."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        drop_page_cache(fd)
        cached = cached_fraction(fd, size)
        buf = bytearray(size)
        view = memoryview(buf)
        done = requests = 0
        t0 = time.perf_counter()
        while done < size:
            n = os.readv(fd, [view[done:done + medium.request_bytes]])
            if n <= 0:
                raise OSError(f"{path}: file ended after {done} of {size} bytes")
            done += n
            requests += 1
            wait = t0 + medium._due(done, requests) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)  # releases the GIL, as a blocked read does
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return bytes(buf), FileRead(str(path), size, requests, seconds, cached)


# -- building a draft from bytes ---------------------------------------------------------------------

def build_model(spec: ModelSpec, blobs: Sequence[bytes]) -> LoadedModel:
    """A draft built from its safetensors bytes, as :func:`models.load_model` builds it from the directory.

    Covers what draft loading uses: plain weights on the CPU forward paths (fp32, bf16, int8, int4) or fp16,
    reduced-vocabulary drafts included. Quantized checkpoints and ``auto`` are refused (load those with
    models.load_model).
    """
    from safetensors.torch import load as load_safetensors
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .draft_vocab import wrap_if_reduced
    from .forward_paths import PATHS, apply_path
    from .models import (
        ModelDirectoryError,
        check_architecture,
        check_loading_info,
        forward_path_for,
        parameter_bytes,
        prepare_off_lean_forward,
        read_config,
        resolve_device,
    )

    raw = read_config(spec.path)
    # as load_model: a config transformers cannot build as a causal LM (t5, a vision model) is named as such, not
    # reported as a failed build of "<class T5Config>" (the KeyError of the mapping below)
    check_architecture(raw, spec.path, trust_remote_code=False)
    path = forward_path_for(spec)
    quantized = raw.get("quantization_config")
    if quantized or path not in (*PATHS, "fp16"):
        method = quantized.get("quant_method") if isinstance(quantized, dict) else None
        what = repr(method) if method else "a quantization_config" if quantized else repr(path)
        raise ValueError(f"{spec.path}: the storage loader builds plain drafts (fp32, bf16, fp16, int8, int4),"
                         f" not {what}")
    state: dict[str, torch.Tensor] = {}
    # as load_model: damaged bytes (a shard rewritten after its header was checked) and a config.json value of the
    # wrong type or a missing key (TypeError, AttributeError, KeyError) are this folder's to fix, named with their type
    try:
        for blob in blobs:
            state.update(load_safetensors(blob))
        config = AutoConfig.from_pretrained(spec.path, local_files_only=True, trust_remote_code=False)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        dtype = torch.float16 if path == "fp16" else torch.float32
        model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                  output_loading_info=True)
    except MemoryError:  # not the folder's fault
        raise
    except Exception as exc:
        raise ModelDirectoryError(f"could not build the model in {spec.path} from its weights:"
                                  f" {type(exc).__name__}: {exc}") from exc
    check_loading_info(info, spec.path)  # as load_model: a tensor missing from the weights is refused, not random
    model = model.to(resolve_device(spec.device))
    model.eval()
    model.requires_grad_(False)
    if path in PATHS:
        apply_path(model, path)
    prepared = prepare_off_lean_forward(model, path, spec.path)  # as load_model: a recurrent draft is refused
    model, vocab_size = wrap_if_reduced(model, spec.path)
    return LoadedModel(model=model, spec=spec, size_bytes=parameter_bytes(model), vocab_size=vocab_size,
                       max_positions=int(getattr(model.config, "max_position_embeddings", 0) or 0),
                       forward_path=path, prepared=prepared)


RUNTIME_FORM_DIR = "runtime-drafts"  # under the cache root (model_source.cache_root)
SOURCE_METADATA = "memspec_source"  # a runtime form's header metadata: the weights files it was built from


@dataclass
class RuntimeForm:
    """A draft as the engine holds it in fast memory, kept on disk so that a load is a read.

    Building a draft from its safetensors (transformers' ``from_pretrained``, the forward path's quantization and
    packing) costs ~25 ms of CPU per bundled draft, and on a 2-core machine that work on the loader thread slows the
    decoding beside it by ~1.4x while it lasts (scripts/load_interference.py). So the first load builds it, and
    writes every tensor of the built model (on the int4 path: packed int4 weights, the int8 head, the embedding; the
    runtime's own form, as an edge device would store them) to ``file``; ``skeleton`` is the model with every tensor
    slot emptied, ``slots`` says which tensor fills each. Later loads read ``file`` cold through the medium and put
    its tensors into a copy of the skeleton: the same tensors, so the same numbers. The file is written by this
    process at its first load of the draft (never trusted from another run: the packed layout is this machine's
    kernels' choice)."""

    file: Path
    skeleton: torch.nn.Module
    slots: list[tuple[str, str, bool, str]]  # (module path, slot name, is a parameter, tensor key in the file)
    record: LoadedModel  # the first load's record without its model: vocabulary size, positions, forward path
    widened: frozenset[str] = frozenset()  # fp32 tensors the file holds as fp16 (exactly): widened back on build
    source: tuple = ()  # the weights files it was built from (source_identity)
    # every tensor's shape and dtype as written: a file changed since (tampered with, or damaged) is refused, since the
    # C kernels take the tensors' sizes on trust (a shrunk one was read past its end, and corrupted the heap)
    layout: dict = field(default_factory=dict)

    @classmethod
    def write(cls, loaded: LoadedModel, file: Path, source: tuple = ()) -> RuntimeForm:
        """The runtime form of a freshly built draft, its tensors written to ``file`` (atomically, synced)."""
        import copy
        import tempfile

        from safetensors import SafetensorError
        from safetensors.torch import save_file

        from .forward_paths import fp16_exact

        tensors: dict[str, torch.Tensor] = {}
        keys: dict[int, str] = {}
        slots = []
        widened: set[str] = set()
        for path, module in loaded.model.named_modules():
            for is_parameter, table in ((True, module._parameters), (False, module._buffers)):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    key = keys.get(id(tensor))
                    if key is None:  # a tied tensor is stored once and fills every slot it filled
                        key = keys[id(tensor)] = f"{path}.{name}" if path else name
                        tensor = tensor.detach().contiguous()
                        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                            tensor = tensor.clone()  # a view of fused weights: safetensors refuses shared storage
                        half = fp16_exact(tensor)  # fp32 that fp16 holds exactly is stored at half the bytes
                        if half is not None:
                            tensor = half
                            widened.add(key)
                        tensors[key] = tensor
                    slots.append((path, name, is_parameter, key))
        file.parent.mkdir(parents=True, exist_ok=True)
        # not *.safetensors until complete, so that another process's prune_stale_forms leaves it alone
        with tempfile.NamedTemporaryFile(dir=file.parent, suffix=".partial", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            try:
                save_file(tensors, str(partial), metadata={SOURCE_METADATA: json.dumps(source)})
            except SafetensorError as error:  # safetensors' I/O errors (a full disk) are no OSError: raised as one,
                if not safetensors_io_error(error):  # so the caller keeps the draft it built, loading without a form
                    raise
                raise OSError(str(error)) from error
            with open(partial, "rb+") as handle:
                os.fsync(handle.fileno())  # written back, so a cold read's page-cache drop really drops it
            os.replace(partial, file)
        finally:
            partial.unlink(missing_ok=True)
        prune_stale_forms(file)
        # the skeleton without its weights: a deep copy with them held the whole draft twice, beside the blob it was
        # built from, at its first load (every slot's tensor is copied as None)
        empty: dict[int, None] = {id(table[name]): None for path, module in loaded.model.named_modules()
                                  for is_parameter, table in ((True, module._parameters), (False, module._buffers))
                                  for name in table if table[name] is not None}
        skeleton = copy.deepcopy(loaded.model, empty)
        modules = dict(skeleton.named_modules())
        for path, name, is_parameter, _ in slots:
            (modules[path]._parameters if is_parameter else modules[path]._buffers)[name] = None
        layout = {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}
        return cls(file, skeleton, slots, replace(loaded, model=None), frozenset(widened), source, layout)

    def build(self, blob: bytes) -> LoadedModel:
        """The draft from the bytes of ``file`` (its record, sizes included, is the first load's: same tensors)."""
        import copy

        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(blob)
        found = {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}
        if self.layout and found != self.layout:
            changed = sorted(k for k in set(found) | set(self.layout) if found.get(k) != self.layout.get(k))
            raise ValueError(f"{self.file} changed since this process wrote it ({', '.join(changed[:3])}"
                             f"{'...' if len(changed) > 3 else ''} differ): not loaded; remove it to build it again")
        for key in self.widened:
            tensors[key] = tensors[key].float()
        model = copy.deepcopy(self.skeleton)
        modules = dict(model.named_modules())
        parameters: dict[str, torch.nn.Parameter] = {}
        for path, name, is_parameter, key in self.slots:
            if is_parameter:
                if key not in parameters:
                    parameters[key] = torch.nn.Parameter(tensors[key], requires_grad=False)
                modules[path]._parameters[name] = parameters[key]
            else:
                modules[path]._buffers[name] = tensors[key]
        return replace(self.record, model=model)


FORM_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{16}\.safetensors")  # runtime_form_file's names
PARTIAL_STALE_SECONDS = 3600.0  # a form's write takes seconds: a .partial this old was left by a killed process
FORM_RETRY_SECONDS = 600.0  # a form the cache folder refused (full, read-only) is not written again before this


# Besides its weights, what a draft's build reads from its folder: the architecture (config.json), a reduced-vocabulary
# draft's id map (draft_vocab.VOCAB_FILE) and a sharded checkpoint's index. An edit to any of them must rebuild the
# draft (a new runtime form, the cache manager's change detection), as a new weights file does.
BUILD_FILES = ("config.json", VOCAB_FILE)


def build_inputs(root: str | Path) -> list[Path]:
    """The files of a model directory other than the weights that its build depends on, those present."""
    folder = Path(root)
    named = [folder / name for name in BUILD_FILES] + sorted(folder.glob("*.safetensors.index.json"))
    return [f for f in named if f.is_file()]


def source_identity(files: Sequence[Path]) -> tuple:
    """What tells a draft's files (weights, and the build inputs beside them) apart from their next version
    (model_source.file_version: path, size, modification time, inode and change time): a file replaced at the same
    size and modification time (``cp -p``, tools that fix mtimes) kept the old weights' runtime form."""
    from .model_source import file_version

    return tuple(file_version(f) for f in files)


def weights_identity(path: str | Path) -> tuple:
    """:func:`source_identity` of a model directory's safetensors files and :func:`build_inputs` (or of one file: a
    GGUF, or the file a pkg: resource names); ("missing",) if unreadable."""
    from .model_source import source_path
    from .models import ModelDirectoryError

    try:
        root = source_path(path)
    except ModelDirectoryError:  # not installed (any more)
        return ("missing",)
    try:
        return source_identity(sorted(root.glob("*.safetensors")) + build_inputs(root) if root.is_dir() else [root])
    except OSError:
        return ("missing",)


def runtime_form_root() -> Path:
    """The folder of the runtime forms: ``$MEMSPEC_RUNTIME_FORMS_DIR``, else ``runtime-drafts`` in the cache root
    (``$MEMSPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/memspec_ros``)."""
    from .model_source import cache_root

    override = os.environ.get("MEMSPEC_RUNTIME_FORMS_DIR")
    return Path(override).expanduser() if override else cache_root() / RUNTIME_FORM_DIR


# the modules that decide how a runtime form's tensors are built and packed (the kernels' C source is the library's
# name's, below): an edit elsewhere in the runtime leaves the forms as they are
PACKING_SOURCES = ("storage.py", "models.py", "forward_paths.py", "cpu_kernels.py", "draft_forward.py",
                   "draft_vocab.py")


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """The code that packed a form (PACKING_SOURCES): two checkouts sharing a cache (a node and a bench from a newer
    tree) wrote forms under one name, and RuntimeForm's check compares shapes and dtypes only, which two int4
    packings share. Taken when the first DraftStorage is made, so that a checkout changed later in this process's
    life (a pull while the node sits unconfigured) does not name forms that this process's code packs. A form of
    older code is pruned once unused (UNUSED_FORM_SECONDS)."""
    import hashlib

    folder = Path(__file__).parent
    h = hashlib.sha256()
    for name in PACKING_SOURCES:
        path = folder / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b""))
    return h.hexdigest()[:16]


def runtime_form_file(spec: ModelSpec, source: tuple) -> Path:
    """Where a draft's runtime form goes: ``<draft>-<version>.safetensors``, ``<draft>`` naming the draft's folder,
    its forward path, the kernels this process compiled and the runtime's code, ``<version>`` its weights files
    (:func:`source_identity`), so that a new version's form replaces the old one's (:func:`prune_stale_forms`)."""
    import hashlib

    from . import cpu_kernels
    from .models import forward_path_for

    def digest(value: object) -> str:
        return hashlib.sha256(repr(value).encode()).hexdigest()[:16]

    # the library's name, not its folder: it is memspec_kernels-<key of its source, compiler, flags, CPU, torch>, in a
    # folder of its own per process where the kernel cache is shared (a form per process then, never pruned as old)
    draft = (str(Path(spec.path).resolve()), forward_path_for(spec), spec.dtype, cpu_kernels.status().isa,
             Path(cpu_kernels.status().library).name, torch.__version__, _code_digest())
    return runtime_form_root() / f"{digest(draft)}-{digest(source)}.safetensors"


def prune_stale_forms(file: Path) -> None:
    """Remove the runtime forms that no load can use any more: older versions of ``file``'s draft (same
    ``<draft>-`` prefix), forms whose weights files are gone (a draft deleted or moved, a test's temporary zoo), and
    forms no process wrote or read for UNUSED_FORM_SECONDS (every process writes the forms of the drafts it loads
    first and marks each later read: one untouched that long is of a torch version, kernel build or forward path no
    longer in use, which the prefix names but cannot be read back from), so that the cache holds about one form per
    draft on disk. Another process that
    still holds one of them finds it gone and builds that draft from its files again."""
    prefix = file.name.split("-", 1)[0] + "-"
    unused = time.time() - UNUSED_FORM_SECONDS
    for other in file.parent.glob("*.safetensors"):
        # only files named as runtime_form_file names them: the folder may be one the user pointed
        # MEMSPEC_RUNTIME_FORMS_DIR at, holding models of their own
        if other != file and FORM_NAME.fullmatch(other.name) and (
                other.name.startswith(prefix) or _older_than(other, unused) or not _source_exists(other)):
            try:
                other.unlink(missing_ok=True)
            except OSError:  # another user's form in a shared sticky folder: theirs to prune. Raised here, it
                pass  # failed the load that had just written its own form, which was then never used
    stale = time.time() - PARTIAL_STALE_SECONDS
    for partial in file.parent.glob("tmp*.partial"):  # a write a killed process left (RuntimeForm.write)
        try:
            if partial.stat().st_mtime < stale:
                partial.unlink(missing_ok=True)
        except OSError:
            pass


UNUSED_FORM_SECONDS = 30 * 86400.0


def _older_than(path: Path, when: float) -> bool:
    try:
        return path.stat().st_mtime < when
    except OSError:  # gone meanwhile
        return False


def _source_exists(form: Path) -> bool:
    """Whether every weights file a runtime form was built from is still there (its header's metadata says which;
    a file without it is not a form this code wrote: it is kept)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(form), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (OSError, SafetensorError):
        return True  # unreadable now (being written, or not ours): not ours to remove
    try:
        source = json.loads(metadata[SOURCE_METADATA])
        return all(Path(path).is_file() for path, *_ in source)
    except KeyError:
        return True
    except (ValueError, TypeError):
        return False


@dataclass
class LoadRecord:
    """One draft load through the storage tier."""

    name: str
    nbytes: int
    requests: int
    read_seconds: float  # the paced cold read
    build_seconds: float  # bytes -> model in fast memory
    cached_after_drop: float | None
    # a first load's writing of the runtime form later loads read (RuntimeForm): not the load's own work, but done on
    # the loader thread before the draft is handed over, so it delays this load by as much
    form_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.read_seconds + self.build_seconds


@dataclass
class DraftStorage:
    """Loads drafts through a medium and keeps a record of every load (safe from the loader thread).

    ``keep_records`` False: no record is kept. A storage made from a medium's name (:func:`draft_storage`: the node's
    draft cache) has no reader of its records, and kept one per load for as long as the node ran; the benches make
    their own DraftStorage and take its records (take_records, steady_loads)."""

    medium: StorageMedium
    records: list[LoadRecord] = field(default_factory=list)
    keep_records: bool = True

    def __post_init__(self) -> None:
        _code_digest()  # the code as it is now (its docstring)
        self._lock = threading.Lock()
        self._forms: dict[tuple, RuntimeForm] = {}
        # drafts (their key and source) whose form is not written again before this monotonic time: never (inf) for
        # one that cannot be made; FORM_RETRY_SECONDS on for one the cache folder refused (full, read-only), which
        # every load wrote whole again until the disk refused it, on the loader thread
        self._form_retry_at: dict[tuple, float] = {}

    def load(self, spec: ModelSpec, name: str = "") -> LoadedModel:
        """Read the draft cold through the medium and build it: its safetensors the first time (then its runtime
        form is written), its runtime form after that (RuntimeForm)."""
        from .model_source import is_model_source, resolve_model_path
        from .models import check_sizes_fit_weights, read_config, safetensors_files

        if is_model_source(spec.path):
            spec = replace(spec, path=str(resolve_model_path(spec.path)))
        config = read_config(spec.path)  # a folder missing, or a file: said so (load_model's order), not "no weights"
        files = safetensors_files(spec.path)  # checks the headers (and refuses pickles) before the timed read
        key = (str(Path(spec.path).resolve()), spec.dtype, spec.device, spec.quantization)
        # a draft whose files changed (weights, config.json, its vocabulary map) is built from them again
        source = source_identity(files + build_inputs(spec.path))
        with self._lock:
            form = self._forms.get(key)
        loaded = None
        reads: list = []  # a form read that then failed stays in: its paced read was paid, and the record said less
        if form is not None and form.source == source:
            from safetensors import SafetensorError

            try:
                reads.append(read_cold(form.file, self.medium))
                t0 = time.perf_counter()
                loaded = form.build(reads[0][0])
            # removed, damaged or changed since (ValueError: its layout differs): the source still is
            except (OSError, SafetensorError, KeyError, ValueError) as error:
                log.warning("%s's runtime form %s could not be read (%s): building it from its safetensors again",
                            name or spec.path, form.file, error)
                with self._lock:
                    self._forms.pop(key, None)
        from_files = loaded is None
        if from_files:
            # before the read (a runtime form was built from files that passed it: not again at every switch);
            # build_model builds no quantized draft and no remote code, whatever the spec says
            if not spec.trust_remote_code:
                check_sizes_fit_weights(spec, config, files)
            blobs = [read_cold(f, self.medium) for f in files]
            reads += blobs
            t0 = time.perf_counter()
            loaded = build_model(spec, [blob for blob, _ in blobs])
        build = time.perf_counter() - t0
        if not from_files:
            # read: in use (prune_stale_forms keeps forms written or read lately; a node up for more than
            # UNUSED_FORM_SECONDS reads forms it wrote long ago). After the timed build
            mark_used(form.file)
        form_seconds = 0.0
        # a draft prepared off the lean forward has per-module forwards bound to its own layers (row_exact), which a
        # runtime form's copies would share: it is built from its safetensors each time
        if from_files and loaded.prepared is None:
            t1 = time.perf_counter()
            self._keep_form(key, loaded, spec, source, name)
            form_seconds = time.perf_counter() - t1
        cached = [r.cached_after_drop for _, r in reads]
        record = LoadRecord(
            name=name or Path(spec.path).name, nbytes=sum(r.nbytes for _, r in reads),
            requests=sum(r.requests for _, r in reads), read_seconds=sum(r.seconds for _, r in reads),
            build_seconds=build, cached_after_drop=None if None in cached else max(cached, default=0.0),
            form_seconds=form_seconds)
        if self.keep_records:
            with self._lock:
                self.records.append(record)
        return loaded

    def _keep_form(self, key, loaded: LoadedModel, spec: ModelSpec, source: tuple, name: str | None) -> None:
        """Write ``loaded``'s runtime form for the loads after this one."""
        if time.monotonic() < self._form_retry_at.get((key, source), 0.0):
            return
        target = None
        try:  # the name too: a cache root that cannot be named (an unknown ~user in it, no home) loses the form only
            target = runtime_form_file(spec, source)
            form = RuntimeForm.write(loaded, target, source)
        except OSError as error:  # a full or read-only cache costs later loads their speed, not this load
            with self._lock:
                self._form_retry_at[(key, source)] = time.monotonic() + FORM_RETRY_SECONDS
            log.warning("could not keep %s's runtime form in %s (%s): its loads build it from its "
                        "safetensors (tried again in %.0f s); point MEMSPEC_RUNTIME_FORMS_DIR (or MEMSPEC_CACHE_DIR, "
                        "XDG_CACHE_HOME) at a writable folder to keep it", name or spec.path,
                        target.parent if target is not None else "the cache folder", error,
                        FORM_RETRY_SECONDS)
            return
        except Exception as error:  # not the medium's fault (a model the form cannot hold): this load still stands
            log.warning("could not keep %s's runtime form (%s: %s): its loads build it from its safetensors each"
                        " time", name or spec.path, type(error).__name__, error)
            with self._lock:  # the same files would fail the same way: not written again
                self._form_retry_at[(key, source)] = math.inf
            return
        with self._lock:
            self._forms[key] = form

    def steady_loads(self, specs: Mapping[str, ModelSpec], repeats: int = 1) -> list[LoadRecord]:
        """``repeats`` cold loads of each draft as a running node loads it after its first time: a first load in
        a process builds the draft from its safetensors and keeps its runtime form, every later one reads that
        form (eMMC, int4 drafts: 37-39 ms a read in the run at 76859ea, against 69-105 ms for the fp32 first builds
        the bench timed before, docs/results). So each is loaded once untimed, then timed; records taken before are
        dropped, as are the untimed loads'."""
        for name, spec in specs.items():
            self.load(spec, name)
        self.take_records()
        for _ in range(repeats):
            for name, spec in specs.items():
                self.load(spec, name)
        return self.take_records()

    def take_records(self) -> list[LoadRecord]:
        """The loads recorded so far, and forget them (a bench keeps only its timed runs' loads)."""
        with self._lock:
            records, self.records = self.records, []
        return records

    def summary(self, records: Sequence[LoadRecord], iteration_seconds: float) -> dict:
        """The medium, the measured load time per draft and its ratio to one speculative iteration."""
        by_draft: dict[str, list[LoadRecord]] = {}
        for r in records:
            by_draft.setdefault(r.name, []).append(r)

        def mean(xs: Sequence[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        drafts = {}
        for name, rs in sorted(by_draft.items()):
            seconds = mean([r.seconds for r in rs])
            cached = [r.cached_after_drop for r in rs if r.cached_after_drop is not None]
            drafts[name] = {
                "loads": len(rs), "bytes": rs[0].nbytes,
                "load_seconds": seconds, "read_seconds": mean([r.read_seconds for r in rs]),
                "build_seconds": mean([r.build_seconds for r in rs]),
                # the writing of the runtime form, on the loader thread after the build, over the draft's loads
                # (only a first load writes one: 0 where every load was a later one, as in a bench's timed loads);
                # not in load_seconds (the medium's read and the build), but it held the loader that long
                "form_seconds": mean([r.form_seconds for r in rs]),
                "min_read_seconds": self.medium.min_read_seconds(rs[0].nbytes),
                "load_to_iteration": seconds / iteration_seconds if iteration_seconds > 0 else None,
                "page_cache_after_drop": max(cached) if cached else None,
            }
        per_draft = mean_load_seconds(records)
        return {
            "medium": self.medium.name, "emulated": self.medium.emulated, **{
                k: v for k, v in self.medium.describe().items() if k not in ("name", "emulated")},
            "iteration_seconds": iteration_seconds,
            "load_seconds": mean(list(per_draft.values())),
            "load_to_iteration": load_to_iteration(per_draft, iteration_seconds),
            "drafts": drafts,
        }


def draft_storage(storage: str | StorageMedium | DraftStorage | None) -> DraftStorage | None:
    """A DraftStorage for a medium name or medium, keeping no load records: nobody holds it to read them, and a
    running node loads drafts for as long as it runs (None: none; a DraftStorage is used as given, records kept as
    its maker chose)."""
    if storage is None or isinstance(storage, DraftStorage):
        return storage
    return DraftStorage(storage_medium(storage), keep_records=False)


def mean_load_seconds(records: Sequence[LoadRecord]) -> Mapping[str, float]:
    """Mean measured load time per draft name."""
    sums: dict[str, list[float]] = {}
    for r in records:
        sums.setdefault(r.name, []).append(r.seconds)
    return {name: sum(v) / len(v) for name, v in sums.items()}


def load_to_iteration(load_seconds: Mapping[str, float], iteration_seconds: float) -> float | None:
    """A draft load in speculative iterations: the mean over drafts of each one's mean load time (each draft
    weighs the same, however often it was loaded) over one iteration's seconds; None without loads or an
    iteration time. The one definition of the ratio the benches and figures report per medium."""
    if not load_seconds or iteration_seconds <= 0:
        return None
    return sum(load_seconds.values()) / len(load_seconds) / iteration_seconds
