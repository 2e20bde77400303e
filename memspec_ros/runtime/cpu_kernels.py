"""The engine's own CPU kernels (runtime/cpu_kernels.c), compiled on the machine that runs them.

At 1 thread the bundled target's forward is compute-bound: ATen's int4 kernel dequantizes each weight again
for every 4 rows (a 5-row verify costs ~2x a 1-token step), and its attention and oneDNN's int8 GEMM spend
tens of microseconds per call on set-up. The C file says what each kernel does and why its rows are exact.
Each kernel is written for AVX512-VNNI (and AMX tiles where the CPU has AMX), for AVX2, and in portable C for any
other CPU (untested on ARM);
which one a machine got is in :func:`status` (``isa``). ``MEMSPEC_CPU_KERNELS=portable`` builds the portable
C alone (tests, A/B runs).

The file is compiled once per machine with the system C compiler (``$CC``, else ``cc``) and ``-march=native``
into the cache folder (``$MEMSPEC_CACHE_DIR``, else ``~/.cache/memspec_ros``), keyed by the source, the
compiler and this CPU's flags, and loaded with ctypes: nothing is downloaded, and no Python package is
built. Where there is no compiler, the forward paths keep ATen's kernels and :func:`status` says why.
``MEMSPEC_CPU_KERNELS=0`` turns them off (for A/B runs).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from .atomic_write import held_lock, owned_by_me

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")
# threads through OpenMP, whose calls resolve to the libgomp torch loaded (runtime/cpu_kernels.c: parallel_for);
# a compiler without OpenMP builds the same kernels single-threaded
OPENMP = "-fopenmp"
# as memspec_kernel_features() reports them
FEATURE_W4, FEATURE_I8, FEATURE_DECODER, FEATURE_W4_BLOCKED, FEATURE_F32, FEATURE_STEP = 1, 2, 4, 16, 32, 64
W4_BLOCK = 16  # outputs per block of w4's blocked layout
ENV_SWITCH = "MEMSPEC_CPU_KERNELS"  # 0: ATen's kernels; portable: the portable C even where SIMD code exists
PORTABLE = "portable"
COMPILE_TIMEOUT_S = 120
FALLBACK_RETRY_S = 24 * 3600  # a fallback built after a timed-out fuller build is built again after this long
# the longest another process's build may hold the compile lock: its three attempts and their probes, and a margin
LOCK_WAIT_S = 3 * COMPILE_TIMEOUT_S + 120


@dataclass(frozen=True)
class KernelStatus:
    """Which kernels this machine runs, and why any are missing."""

    w4: bool = False  # 4-bit weights x fp32 rows
    i8: bool = False  # int8 weights x int8 rows
    decoder: bool = False  # a whole w4/i8 decoder in one call
    step: bool = False  # a whole forward, ids to logits, in one call (model_step)
    w4_blocked: bool = False  # w4 takes its weights in blocks of 16 outputs (AVX512-VNNI, AMX; see pack_w4)
    f32: bool = False  # fp32 weights x fp32 rows, each sum in one fixed order (rows exact)
    isa: str = ""  # the instruction set each kernel was compiled for
    library: str = ""
    reason: str = ""  # why they are missing, or why they were built degraded ('' when they run as built)

    def describe(self) -> str:
        names = [name for name, on in (("w4", self.w4), ("i8", self.i8), ("f32", self.f32), ("decoder", self.decoder))
                 if on]
        if not names:
            text = "none (ATen's kernels)"
        else:
            text = f"memspec {', '.join(names)} ({self.isa})"
        return f"{text}; {self.reason}" if self.reason else text


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (x86 ``flags``, Arm ``Features``), or None where there is none
    (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def _compiler() -> list[str]:
    """The C compiler's command: ``$CC`` split as a shell would (``ccache gcc``, ``gcc -m64``), else ``cc``."""
    try:
        return shlex.split(os.environ.get("CC") or "") or ["cc"]
    except ValueError as exc:  # an unbalanced quote: the kernels are not built (ATen runs), and the status says why
        raise RuntimeError(f"$CC={os.environ['CC']!r} is not a command line ({exc}): fix or unset CC") from exc


def _native_macros(compiler: list[str]) -> str:
    """What ``-march=native`` turns on here (__AVX512F__, __AMX_TILE__, ...): exactly what selects the code paths
    compiled in, so a cached library built on another CPU (a shared cache folder) is never loaded here (SIGILL)."""
    try:
        done = subprocess.run([*compiler, "-march=native", "-dM", "-E", "-x", "c", os.devnull],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return "\n".join(sorted(done.stdout.splitlines()))


def _build(out_dir: Path, portable: bool = False) -> Path:
    """The compiled library for this source, compiler and CPU; compiled once, reused after (only if it is this
    user's alone: :func:`_ours_alone`)."""
    compiler = _compiler()
    flags = (*FLAGS, "-DMEMSPEC_PORTABLE") if portable else FLAGS
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    # torch's own folder too: the OpenMP runtime the library links is resolved beside it (torch's libgomp), so two
    # environments sharing the cache, one of which could not load the other's library, deleted it and published
    # their fallback build under the one key
    key = hashlib.sha256("\0".join([_source_text(), " ".join(compiler), version, " ".join((*flags, OPENMP)),
                                    " ".join(sorted(cpu_flags() or {platform.processor()})), _native_macros(compiler),
                                    platform.machine(), str(Path(torch.__file__).parent), torch.__version__]).encode()
                         ).hexdigest()[:16]
    library = out_dir / f"memspec_kernels-{key}.so"
    if library.exists() and _ours_alone(library) and not _fallback_to_retry(library):
        return library
    if (library.exists() and not _ours_alone(library)) or (out_dir.exists() and not owned_by_me(out_dir)):
        # anyone who can write a library under this name runs code in the node when it loads (its key is computed
        # from public inputs): one that is not this user's alone is never loaded, and none is built where another
        # user could swap it before it loads; this process builds its own, in a private temporary folder, where no
        # other process builds
        out_dir = Path(tempfile.mkdtemp(prefix="memspec_kernels_"))
        atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
        library = out_dir / library.name
        _compile(out_dir, library, compiler, flags)
        return library
    # not writable by others whatever the umask (a CI runner's 0000 made it world-writable: the next process then
    # refused it as not its own and compiled the kernels again into a temporary folder, in every process)
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    # one process compiles a key at a time: processes started together each compiled, and one slowed by the others
    # past a timeout published its fallback over the full build another had just published (every later process
    # then ran the slower kernels), and their fallback notes could end up beside the wrong library
    # Bounded: a process stopped while it holds the lock must not hold every other's configure for good (past the
    # bound the caller runs ATen's kernels and says why)
    lock = out_dir / f".{library.stem}.lock"
    with held_lock(lock, lambda: log.warning("another process is compiling the CPU kernels (it holds %s): waiting"
                                             " for it, at most %g s", lock, LOCK_WAIT_S), timeout=LOCK_WAIT_S):
        if library.exists() and _ours_alone(library):  # built by the process that held the lock
            if _fallback_to_retry(library):
                # a fallback kept because a fuller build timed out (a machine busy for a moment) is built again once
                # a day: kept for good, one busy moment left every later process on the slower kernels; retried at
                # every start, a machine too slow for the full build would pay its timeouts at each one. The build
                # replaces it only if one succeeds; if none does, it stays, tried again a day later
                try:
                    _compile(out_dir, library, compiler, flags, keep_fallback=True)
                except (OSError, RuntimeError, subprocess.SubprocessError):
                    _fallback_note(library).touch()
            return library
        _compile_unless_timed_out_lately(out_dir, library, compiler, flags)
    return library


def _compile_unless_timed_out_lately(out_dir: Path, library: Path, compiler: list[str], flags: tuple[str, ...]
                                     ) -> None:
    """_compile, unless every attempt timed out less than FALLBACK_RETRY_S ago (three compiler timeouts cost up to
    6 minutes: not paid again at every process start, but once a day, as a timed-out full build's fallback is).
    Timeouts only: a fast failure (a header missing, an OpenMP runtime not found) costs nothing to try again, and
    the fix a user makes for it changes nothing in the key."""
    failed = library.with_suffix(".failed.txt")
    if _recent(failed):
        raise RuntimeError(f"an earlier build of this library failed ({failed.read_text()[:300]}); it is tried"
                           f" again a day later: delete {failed} to try now")
    try:
        _compile(out_dir, library, compiler, flags)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        if "timed out" in str(exc):
            with contextlib.suppress(OSError):  # a cache that cannot take the note: the compiler's error is reported
                failed.write_text(str(exc))
        raise
    failed.unlink(missing_ok=True)


def _recent(note: Path) -> bool:
    """Whether ``note`` was written less than FALLBACK_RETRY_S ago (False where there is none)."""
    try:
        return time.time() - note.stat().st_mtime < FALLBACK_RETRY_S
    except OSError:
        return False


def _ours_alone(path: Path) -> bool:
    """Whether ``path`` is this user's, writable by nobody else and no symlink, in a folder of this user's that not
    every user can write to (group write allowed: a group per user, umask 002): a shared or misconfigured cache
    folder must not hand the node a library someone else wrote."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
            and owned_by_me(path.parent))


def _run_compiler(command: list[str], timeout: float = COMPILE_TIMEOUT_S) -> subprocess.CompletedProcess | None:
    """``command`` run to its end, or None past ``timeout``: then its whole process group is killed (the driver
    alone left cc1 and ld running, and a late ld could still write the output the next attempt links)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended meanwhile, with all it started
            pass
        process.communicate()
        return None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@cache
def _source_text() -> str:
    """The kernels' C source as this process first read it: the key hashes these bytes and the compiler builds
    them (from a copy). Compiled from SOURCE's path, a checkout changed while this process waited for another's
    lock (up to LOCK_WAIT_S) published a library of other source, and other struct layouts, under this key."""
    return SOURCE.read_text()


def _compile(out_dir: Path, library: Path, compiler: list[str], flags: tuple[str, ...],
             keep_fallback: bool = False) -> None:
    """Compile the kernels into ``library`` (a temporary name in ``out_dir``, renamed when whole). ``keep_fallback``:
    a fallback's retry, which replaces it only with the full build (RuntimeError where it got only a fallback
    again)."""
    from .atomic_write import sync_dir

    # compile to a temporary name and rename: a concurrent process never loads a half-written file
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    source = partial.with_suffix(".c")  # the bytes the key hashed (_source_text), in this private temporary name
    # without OpenMP, then the portable C alone (no -march=native: an assembler too old for this CPU's
    # instructions still gets a library); every attempt's error is kept for the one message
    portable_flags = tuple(f for f in flags if f != "-march=native") + ("-DMEMSPEC_PORTABLE",) * (
        "-DMEMSPEC_PORTABLE" not in flags)
    errors = []
    try:
        # a #line: the compiler's messages name cpu_kernels.c and its lines, not this copy (gone after the build)
        source.write_text(f"#line 1 {json.dumps(str(SOURCE))}\n" + _source_text())
        for tried in ((*flags, OPENMP), flags, portable_flags):
            done = _run_compiler([*compiler, *tried, "-o", str(partial), str(source), "-lm"])
            if done is None:  # the next, simpler attempt still has its chance
                errors.append(f"[{' '.join(tried)}] timed out after {COMPILE_TIMEOUT_S} s")
                continue
            if done.returncode == 0:
                # loaded here, where it is to run: one that builds but cannot load (an OpenMP runtime the loader
                # cannot find) is not kept. Closed again at once: the caller loads it under its final name, and a
                # library left mapped from this temporary name would be one more copy (and one that a later
                # rewrite of the file in place, a damaged cache's repair, would turn into a SIGBUS)
                # not writable by the group whatever the linker and umask made it (gold, lld and mold keep umask
                # 002's 0775): _ours_alone and _open refuse such a file (the probe refused every build then), and
                # every process would compile its own
                os.chmod(partial, 0o755)
                try:
                    probe = _open(partial)
                except (OSError, AttributeError) as exc:  # AttributeError: a symbol _bind needs is missing
                    errors.append(f"[{' '.join(tried)}] built but does not load: {str(exc)[-300:]}")
                    continue
                _close(probe)
                break
            errors.append(f"[{' '.join(tried)}] {done.stderr.strip()[-300:]}")
        else:
            raise RuntimeError(f"{' '.join(compiler)} failed: " + " | ".join(errors))
        if errors and keep_fallback:
            raise RuntimeError("the full build failed again: " + " | ".join(errors))
        # on disk before the rename publishes it: a power cut must not leave a truncated library under the name
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        fallback = _fallback_note(library)
        if errors:  # a fallback build is kept, and says so on every load (status().reason)
            fallback.write_text(" | ".join(errors))
        else:
            fallback.unlink(missing_ok=True)
        os.replace(partial, library)
        sync_dir(out_dir)
    finally:
        partial.unlink(missing_ok=True)
        source.unlink(missing_ok=True)


def _fallback_to_retry(library: Path) -> bool:
    """Whether ``library`` is a fallback kept after a fuller build timed out, at least FALLBACK_RETRY_S ago."""
    note = _fallback_note(library)
    try:
        return "timed out" in note.read_text() and not _recent(note)
    except OSError:  # no note: a full build (or it went meanwhile)
        return False


def _fallback_note(library: Path) -> Path:
    """Beside a library built without OpenMP or -march=native: why the full build failed."""
    return library.with_suffix(".fallback.txt")


def _close(library: ctypes.CDLL) -> None:
    """dlclose a library loaded only to be tested (where the platform has it; elsewhere it stays loaded), then the
    descriptor it was loaded through (:func:`_open`)."""
    import _ctypes

    close = getattr(_ctypes, "dlclose", None)
    if close is not None:
        try:
            close(library._handle)
        finally:  # the descriptor goes whatever dlclose says
            fd = getattr(library, "_memspec_fd", None)
            if fd is not None:
                os.close(fd)


def _open(path: Path) -> ctypes.CDLL:
    """dlopen the very file :func:`_ours_alone` vouched for: opened without following a link, checked again on the
    open file, and loaded through its descriptor (/proc/self/fd), so that another user who can rename entries in a
    folder on the way cannot swap the library between the check and the load (a path loaded by name was looked up
    again by dlopen). OSError where the file is a link or not this user's alone.

    The descriptor stays open while the library is loaded (closed by :func:`_close`): dlopen finds a library by the
    name it was loaded under first, so a later library opened on the same descriptor number, which a closed one
    frees, was handed the first one (the build's probe of a new library, in a process that had loaded the kernels)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    library = None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise OSError(f"{path} is not this user's alone (owner {st.st_uid}, mode {stat.filemode(st.st_mode)})")
        by_descriptor = f"/proc/self/fd/{fd}"
        library = ctypes.CDLL(by_descriptor if os.path.exists(by_descriptor) else str(path))
        library._memspec_fd = fd
        _bind(library)
        return library
    except BaseException:
        if library is not None:
            _close(library)  # the descriptor with it
        else:
            os.close(fd)
        raise


def _bind(library: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    library.memspec_kernel_features.restype = i
    library.memspec_kernel_isa.restype = ctypes.c_char_p
    library.w4_matmul.argtypes = [p] * 4 + [i] * 4
    library.w4_matmul.restype = i
    library.i8_matmul.argtypes = [p] * 7 + [i] * 4
    library.i8_matmul.restype = i
    library.f32_matmul.argtypes = [p] * 3 + [i] * 4
    library.f32_matmul.restype = i
    library.decoder_forward.argtypes = [p, i, p, i, i, p, p, i, i, i, i, i, f, i]
    library.decoder_forward.restype = i
    library.model_step.argtypes = [p, p, i, i, p, p, i, p, p, p, i]
    library.model_step.restype = i
    library.exp_shifted_sum.argtypes = [p, i, f]  # the decoder's e^x, bound for its tests
    library.exp_shifted_sum.restype = f
    library.silu_mul.argtypes = [p, p, p, i]
    library.silu_mul.restype = None
    library.rank_head.argtypes = [p, p, p, i, i, p, p, f, p, p, i, p, p, i, p, p, p]
    library.rank_head.restype = None


_LOAD = threading.Lock()


def _load() -> tuple[ctypes.CDLL | None, KernelStatus]:
    """The library and its status, built and loaded by the first caller (the loader thread and the decode thread
    may both ask first: one compiles, the other waits for it)."""
    with _LOAD:
        return _load_once()


@cache
def _load_once() -> tuple[ctypes.CDLL | None, KernelStatus]:
    switch = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return None, KernelStatus(reason=f"turned off by {ENV_SWITCH}=0")
    if switch not in ("1", "true", "yes", "on", "", PORTABLE):  # a typo meant for an A/B run built the SIMD kernels
        return None, KernelStatus(reason=f"{ENV_SWITCH}={switch!r} is none of 0, {PORTABLE}, 1: kernels off until"
                                         " it is")
    from .model_source import cache_root  # the one cache folder the runtime writes to

    folder, portable = cache_root() / "kernels", switch == PORTABLE
    try:
        path = _build(folder, portable=portable)
        try:
            library = _open(path)
        except (OSError, AttributeError):  # a damaged cached library (truncated, from another toolchain, a symbol
            # missing): built again, once
            path.unlink(missing_ok=True)
            path = _build(folder, portable=portable)
            library = _open(path)
    # AttributeError: a cached library that lacks a symbol _bind needs (uncaught, @cache kept no result and every
    # status() raised it again)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        return None, KernelStatus(reason=f"not compiled ({type(exc).__name__}: {exc}); ATen's kernels run")
    note = _fallback_note(path)
    why = note.read_text() if note.is_file() else ""
    reason = (f"built without OpenMP or -march=native, as the full build failed ({why[:300]}); delete {path} to try"
              " again" + (" (a timed-out build is tried again a day later by itself)" if "timed out" in why else "")
              if note.is_file() else "")
    features = library.memspec_kernel_features()
    return library, KernelStatus(w4=bool(features & FEATURE_W4), i8=bool(features & FEATURE_I8),
                                 decoder=bool(features & FEATURE_DECODER), step=bool(features & FEATURE_STEP),
                                 w4_blocked=bool(features & FEATURE_W4_BLOCKED), f32=bool(features & FEATURE_F32),
                                 isa=library.memspec_kernel_isa().decode(), library=str(path), reason=reason)


def status() -> KernelStatus:
    return _load()[1]


def _library() -> ctypes.CDLL:
    library = _load()[0]
    if library is None:
        raise RuntimeError(f"the memspec CPU kernels are not loaded: {status().reason}")
    return library


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


# ctypes lets go of the GIL during a call: one kernel call at a time keeps the thread counts as set
_CALL = threading.Lock()


def _threads() -> int:
    """Threads a kernel call splits its work among: torch's intra-op count, so one setting governs both."""
    return torch.get_num_threads()


def _check_operand(t: torch.Tensor, name: str, dims: int, dtype: torch.dtype = torch.float32,
                   shape: tuple[int, ...] | None = None) -> None:
    """The C kernels read raw pointers: a tensor of another shape, type or layout would be read out of bounds."""
    if t.dim() != dims or t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu" or (
            shape is not None and tuple(t.shape) != shape):
        raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor"
                         f" {'of shape ' + str(shape) if shape else f'of {dims} dimensions'}, got {t.dtype}"
                         f" {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


def _point_at_buffers(table: ctypes.Array, buffers: list[tuple[torch.Tensor, torch.Tensor]], kv_heads: int,
                      head_dim: int, start: int, n: int) -> None:
    """Point each layer's slot at its KV buffers ([1, kv_heads, capacity, head_dim] fp32), which the C writes at
    rows start..start+n-1 and attends over 0..start+n-1; called under ``_CALL``, the table being shared. On the
    decode loop's path, so every layer's buffers are checked by the attributes the C's addressing rests on (a
    later layer of fp16, of fewer heads or a view (expand) was written past its end, where only the first layer was
    checked whole) and the first layer's device (a forward's buffers come from one cache, kv_cache.claim_rows)."""
    if len(buffers) != len(table):
        raise ValueError(f"{len(buffers)} layers of KV buffers for a decoder of {len(table)}")
    if any(t.device.type != "cpu" for t in buffers[0]):
        raise ValueError(f"a KV buffer on {buffers[0][0].device}: the C kernels read CPU memory")
    if start < 0:
        raise ValueError(f"a forward cannot start at position {start}")
    f32 = torch.float32
    for layer, (slot, (keys, values)) in enumerate(zip(table, buffers, strict=True)):
        shape = keys.shape
        if (keys.dtype is not f32 or values.dtype is not f32 or values.shape != shape or len(shape) != 4
                or shape[0] != 1 or shape[1] != kv_heads or shape[3] != head_dim
                or not keys.is_contiguous() or not values.is_contiguous()):
            raise ValueError(f"layer {layer}'s KV buffers: expected contiguous float32 tensors of shape"
                             f" (1, {kv_heads}, capacity, {head_dim}), got {keys.dtype} {tuple(shape)} and"
                             f" {values.dtype} {tuple(values.shape)}")
        capacity = shape[2]
        if start + n > capacity:
            raise ValueError(f"KV buffers of {capacity} rows cannot take positions {start}..{start + n - 1}")
        slot.keys, slot.values, slot.capacity = _ptr(keys), _ptr(values), capacity


def w4_matmul(rows: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, *, check: bool = True
              ) -> torch.Tensor:
    """rows [M, K] times 4-bit weights (``packed`` [O, K/32, 16] uint8, ``scale_min`` [O, K/32] int32 of bf16
    pairs; see :func:`pack_w4`): float32 [M, O]. The rows are quantized to int8 per block of 32 and each block's
    dot product with the levels is an exact integer (runtime/cpu_kernels.c). ``check``: validate the operands,
    which the C reads by pointer; a layer that built its own (forward_paths) skips it, since its linears run on
    every forward transformers makes, the assisted-generation baseline's too (~1 us of ~30)."""
    x = rows.float().contiguous()
    if check:
        o, k = packed.shape[0], x.shape[-1]
        _check_operand(x, "rows", 2)
        _check_operand(packed, "packed", 3, torch.uint8, (o, k // 32, 16))
        _check_operand(scale_min, "scale_min", 2, torch.int32, (o, k // 32))
        if k % 32 or (status().w4_blocked and o % 16):
            raise ValueError(f"w4_matmul: rows of {k} inputs in groups of 32 for {o} outputs")
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    with _CALL:
        failed = _library().w4_matmul(_ptr(packed), _ptr(scale_min), _ptr(x), _ptr(out), x.shape[0], x.shape[1],
                                      packed.shape[0], _threads())
    if failed:  # the message built only then: these run on every linear of a forward
        _raise_for("w4", failed, f"{x.shape[1]} inputs (groups of 32) for {packed.shape[0]} outputs")
    return out


BAD_SHAPE = -2  # cpu_kernels.c's KERNEL_BAD_SHAPE: refused before anything was read or written


def _raise_for(kernel: str, failed: int, shapes: str) -> None:
    """A kernel's non-zero return code as the exception it means; nothing was written to the output then."""
    if failed == BAD_SHAPE:
        raise ValueError(f"the {kernel} kernel refuses {shapes}: see its docstring for the shapes it takes")
    raise MemoryError(f"the {kernel} kernel could not allocate its scratch memory")


def pack_w4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit levels ``q`` [O, G, 32] (0..15) with a scale and minimum per group [O, G], in w4_matmul's layout:
    ``packed`` [O, G, 16] uint8 and ``scale_min`` [O, G] int32, each group's bf16 scale and minimum sharing one
    int32 (scale in the low half). Byte j of a group holds weight j (low nibble) and j + 16 (high). Where w4 runs
    on vpdpbusd or AMX tiles (``status().w4_blocked``) the same bytes are ordered per 16 outputs and group as
    those want them (runtime/cpu_kernels.c: w4 on vpdpbusd), and the scales per 16 outputs and group; O % 16 == 0
    there. The shapes are the same either way, so layers concatenate along outputs as before (in blocks of 16)."""
    q = q.to(torch.uint8)
    scale_min = torch.stack([scale, low], -1).to(torch.bfloat16).contiguous().view(torch.int32)[..., 0]
    out_features, groups = scale_min.shape
    if not status().w4_blocked:
        return (q[..., :16] | (q[..., 16:] << 4)).contiguous(), scale_min.contiguous()
    if out_features % W4_BLOCK:
        raise ValueError(f"w4's blocked layout takes outputs in blocks of {W4_BLOCK}, got {out_features}")
    blocks = out_features // W4_BLOCK
    # [block, output n, group, tile line r, byte j] -> [block, group, r, n, j]: line r holds levels 4r..4r+3 per output
    tile = q.view(blocks, W4_BLOCK, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 512)
    packed = (tile[..., :256] | (tile[..., 256:] << 4)).reshape(out_features, groups, 16)
    scale_min = scale_min.view(blocks, W4_BLOCK, groups).permute(0, 2, 1).reshape(out_features, groups)
    return packed.contiguous(), scale_min.contiguous()


def unpack_w4(packed: torch.Tensor, scale_min: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_w4` undone: levels [O, G, 32] and scale_min [O, G] in output order, whichever layout."""
    if not status().w4_blocked:
        return torch.cat([packed & 15, packed >> 4], -1), scale_min
    out_features, groups = scale_min.shape
    blocks = out_features // W4_BLOCK
    half = packed.reshape(blocks, groups, 256)
    tile = torch.cat([half & 15, half >> 4], -1).view(blocks, groups, 8, W4_BLOCK, 4)
    q = tile.permute(0, 3, 1, 2, 4).reshape(out_features, groups, 32)
    return q, scale_min.view(blocks, groups, W4_BLOCK).permute(0, 2, 1).reshape(out_features, groups)


def i8_matmul(rows: torch.Tensor, weight: torch.Tensor, bias128: torch.Tensor, scale: torch.Tensor, *,
              check: bool = True) -> torch.Tensor:
    """Int8Linear's arithmetic: rows [M, K] quantized per row, times int8 ``weight`` [O, K], scaled: float32 [M, O].
    ``bias128`` is 128 * weight.sum(1) as int32. ``check``: as :func:`w4_matmul`'s."""
    x = rows.float().contiguous()
    if check:
        _check_operand(x, "rows", 2)
        o = weight.shape[0]
        _check_operand(weight, "weight", 2, torch.int8, (o, x.shape[1]))
        _check_operand(bias128, "bias128", 1, torch.int32, (o,))
        _check_operand(scale, "scale", 1, torch.float32, (o,))
        if x.shape[1] % 64 or not x.shape[1]:  # the kernels step 64 bytes along a row (VNNI); AMX divides by K/64
            raise ValueError(f"i8_matmul: {x.shape[1]} inputs is not a positive multiple of 64")
    m, k = x.shape
    o = weight.shape[0]
    out = torch.empty(m, o, dtype=torch.float32)
    scratch_x = torch.empty(m * k, dtype=torch.uint8)
    row_scale = torch.empty(m, dtype=torch.float32)
    with _CALL:
        failed = _library().i8_matmul(_ptr(x), _ptr(weight), _ptr(bias128), _ptr(scale), _ptr(out), _ptr(scratch_x),
                                      _ptr(row_scale), m, k, o, _threads())
    if failed:  # nothing was written: an uninitialised ``out`` would pass for activations
        _raise_for("i8", failed, f"{k} inputs")
    return out


def f32_matmul(rows: torch.Tensor, weight: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """rows [M, K] times fp32 ``weight`` [O, K] (K % 16 == 0): float32 [M, O], each row's sums in the order a
    row alone gets (runtime/cpu_kernels.c: f32), so a verify's rows equal one-token steps bit for bit.
    ``check``: as :func:`w4_matmul`'s."""
    x = rows.float().contiguous()
    if check:
        _check_operand(x, "rows", 2)
        _check_operand(weight, "weight", 2, torch.float32, (weight.shape[0], x.shape[1]))
        if x.shape[1] % 16:
            raise ValueError(f"f32_matmul: {x.shape[1]} inputs is not a multiple of 16")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    with _CALL:
        failed = _library().f32_matmul(_ptr(x), _ptr(weight), _ptr(out), x.shape[0], x.shape[1], weight.shape[0],
                                       _threads())
    if failed:  # the message built only then: these run on every linear of a forward
        _raise_for("f32", failed, f"{x.shape[1]} inputs (a multiple of 16)")
    return out


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("in_features", ctypes.c_int), ("out_features", ctypes.c_int),
                ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("capacity", ctypes.c_int)]


def _kernel_kind(module: torch.nn.Module) -> tuple[int, tuple[str, ...]] | None:
    """(the C's kind, the tensors it reads, by attribute) of a forward-path linear the kernels run, else None."""
    from .forward_paths import Float32Linear, Int4Linear, Int8Linear  # forward_paths imports this module

    if isinstance(module, Int4Linear) and module.own_kernel:
        return 4, ("packed", "scale_min")
    if isinstance(module, Float32Linear):
        return 32, ("weight",)
    if isinstance(module, Int8Linear) and module.own_kernel:
        return 8, ("qweight", "bias128", "scale")
    return None


def _kernel_linear(module: torch.nn.Module) -> _Linear | str:
    """The C description of a forward-path linear that runs on this file's kernels, or why it cannot."""
    if getattr(module, "bias", None) is not None:
        return f"{type(module).__name__} has a bias"
    if not getattr(module, "rows_at_once", True):  # the C call takes a verify's rows together: they would differ
        return f"{type(module).__name__} computes rows differently together (forward_paths.check_rows)"
    kind = _kernel_kind(module)
    if kind is None:
        return f"{type(module).__name__} does not run on the memspec kernels"
    pointers = [_ptr(t) for t in _kernel_tensors(module)]
    return _Linear(kind[0], module.in_features, module.out_features, *pointers, *[None] * (3 - len(pointers)))


def _kernel_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors :func:`_kernel_linear` takes pointers into, kept by the decoder and step themselves: kept through
    the module alone, a later ``module.to()`` or ``load_state_dict(assign=True)`` freed them under the C's
    pointers."""
    kind = _kernel_kind(module)
    return [getattr(module, name) for name in kind[1]] if kind is not None else []


class Decoder:
    """Every layer of a lean Llama forward (runtime/draft_forward.py) in one C call, for models whose linears
    all run on this file's kernels. Build with :meth:`build`, which says why a model does not qualify."""

    def __init__(self, layers: ctypes.Array, keep: list[object], dims: tuple[int, int, int, int, int],
                 eps: float) -> None:
        # keep: what the C structs point into (norm tensors, the linears and their weight tensors), alive as long as
        # this decoder is (a module whose tensors are replaced after the build keeps running its old weights here:
        # build the lean forward again after changing a model's weights)
        self._layers, self._keep = layers, keep
        self.dim, self.heads, self.kv_heads, self.head_dim, self.intermediate = dims
        self.eps = eps

    @classmethod
    def build(cls, layers: list, dims: tuple[int, int, int, int, int], eps: float) -> Decoder | str:
        if not status().decoder:
            return "the decoder kernel is not compiled here: " + status().reason
        dim, heads, kv_heads, head_dim, intermediate = dims
        if kv_heads <= 0 or dim % 64 or head_dim % 64 or intermediate % 64 or heads % kv_heads:
            return f"shapes the kernel does not take (hidden {dim}, head_dim {head_dim}, intermediate {intermediate})"
        table = (_Layer * len(layers))()
        keep: list[object] = []
        for slot, layer in zip(table, layers, strict=True):
            for norm in (layer.attn_norm, layer.mlp_norm):
                if norm.dtype != torch.float32 or not norm.is_contiguous():
                    return "RMSNorm weights are not contiguous fp32"
                # the C code reads dim floats of host memory from each: a shorter one read past its end
                if norm.numel() != dim or norm.device.type != "cpu":
                    return f"an RMSNorm weight of {norm.numel()} values on {norm.device}, not {dim} on the CPU"
                # an alias of its memory, not the Parameter: a cast or move of the model (model.half()) gives the
                # same Parameter new memory and frees the old, which the pointers below still named
                keep.append(norm.detach())
            slot.attn_norm, slot.mlp_norm = _ptr(layer.attn_norm), _ptr(layer.mlp_norm)
            q_width, kv_width = heads * head_dim, kv_heads * head_dim
            widths = {"qkv": (dim, q_width + 2 * kv_width), "o": (q_width, dim), "gate_up": (dim, 2 * intermediate),
                      "down": (intermediate, dim)}
            for name in ("qkv", "o", "gate_up", "down"):
                described = _kernel_linear(getattr(layer, name))
                if isinstance(described, str):
                    return f"{name}: {described}"
                if (described.in_features, described.out_features) != widths[name]:  # the C sizes its buffers so
                    return (f"{name} maps {described.in_features} -> {described.out_features}, not the"
                            f" {widths[name][0]} -> {widths[name][1]} these dimensions give")
                setattr(slot, name, described)
                # its weights outlive a caller that drops the lean forward, and a module moved after this build
                keep += [getattr(layer, name), *_kernel_tensors(getattr(layer, name))]
        return cls(table, keep, dims, eps)

    def __call__(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                 buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run every layer on ``x`` [n, dim] (fp32, contiguous, in place) at positions start..start+n-1; each
        layer's keys and values go into ``buffers`` ([1, kv_heads, capacity, head_dim] fp32, as
        kv_cache.claim_rows returns them, already extended by n rows)."""
        _check_operand(x, "x", 2, torch.float32, (x.shape[0], self.dim))
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        for t in (cos, sin):
            if t.dim() != 2 or t.shape[0] < x.shape[0] or t.shape[1] != self.head_dim:
                raise ValueError(f"the rotary tables must be [{x.shape[0]}+, {self.head_dim}], got {tuple(t.shape)}")
        with _CALL:
            _point_at_buffers(self._layers, buffers, self.kv_heads, self.head_dim, start, x.shape[0])
            failed = _library().decoder_forward(self._layers, len(buffers), _ptr(x), x.shape[0], start, _ptr(cos),
                                                _ptr(sin), self.dim, self.heads, self.kv_heads, self.head_dim,
                                                self.intermediate, self.eps, _threads())
        if failed:
            _raise_for("decoder", failed, "a layer's shapes")


class _StepModel(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_void_p), ("n_layers", ctypes.c_int), ("dim", ctypes.c_int),
                ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("intermediate", ctypes.c_int), ("eps", ctypes.c_float), ("embed_kind", ctypes.c_int),
                ("embed_rows", ctypes.c_int), ("embed", ctypes.c_void_p), ("embed_scales", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("head", _Linear), ("scatter", ctypes.c_void_p),
                ("scatter_n", ctypes.c_int), ("width", ctypes.c_int)]


class Step:
    """A whole lean forward in one C call (model_step): embedding rows, every layer, the final RMSNorm, the head
    and a reduced vocabulary's scatter into target-width rows. Why: in the engine's loop each draft forward runs
    right after a target verify has streamed the target's weights through the caches, and every small tensor
    operation then costs ~15-20 us of cold dispatch; this leaves two allocations per forward. The arithmetic is
    the decoder's and the linears' own kernels, so rows stay exact (a verify's rows equal one-token steps).
    Build with :meth:`build`, which says why a model does not qualify."""

    def __init__(self, decoder: Decoder, model: _StepModel, keep: list[object], width: int) -> None:
        self.decoder, self._model, self._keep, self.width = decoder, model, keep, width
        self.rows = model.embed_rows

    @classmethod
    def build(cls, decoder: Decoder, embed: torch.nn.Module, final_norm: torch.Tensor, head: torch.nn.Module,
              scatter: torch.Tensor | None, width: int) -> Step | str:
        from .forward_paths import F16Embedding, Q8Embedding  # forward_paths imports this module

        if not status().step:
            return "the step kernel is not compiled here"
        model = _StepModel(ctypes.cast(decoder._layers, ctypes.c_void_p), len(decoder._layers), decoder.dim,
                           decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.intermediate, decoder.eps)
        # what model's pointers name, alive as long as the step is (the tensors' memory: see Decoder.build)
        keep: list[object] = [final_norm.detach()]
        if type(embed) is torch.nn.Embedding and embed.weight.dtype == torch.float32 and embed.weight.is_contiguous():
            model.embed_kind, model.embed = 32, _ptr(embed.weight)
            keep.append(embed.weight.detach())
        elif isinstance(embed, F16Embedding) and embed.table.is_contiguous():
            model.embed_kind, model.embed = 16, _ptr(embed.table)
            keep.append(embed.table)
        elif isinstance(embed, Q8Embedding) and embed.values.is_contiguous() and embed.scales.is_contiguous():
            model.embed_kind, model.embed, model.embed_scales = 8, _ptr(embed.values), _ptr(embed.scales)
            keep += [embed.values, embed.scales]
        else:
            return f"embedding {type(embed).__name__} is not an fp32 or fp16 table or Q8_0 rows"
        if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in keep):  # read as host memory
            return "the embedding or the final RMSNorm weight is not on the CPU"
        if embed.embedding_dim != decoder.dim:
            return f"embedding width {embed.embedding_dim} is not the hidden size {decoder.dim}"
        model.embed_rows = embed.num_embeddings
        if final_norm.dtype != torch.float32 or not final_norm.is_contiguous():
            return "the final RMSNorm weight is not contiguous fp32"
        if final_norm.numel() != decoder.dim:  # (its device: with the embedding's, above)
            return f"the final RMSNorm weight has {final_norm.numel()} values, not {decoder.dim}"
        model.final_norm = _ptr(final_norm)
        described = _kernel_linear(head)
        if isinstance(described, str):
            return f"lm_head: {described}"
        if described.in_features != decoder.dim:
            return f"lm_head takes {described.in_features} inputs, not the hidden size {decoder.dim}"
        model.head = described
        if scatter is not None:
            scatter = scatter.to(torch.int64).contiguous()
            if scatter.numel() > described.out_features or (
                    scatter.numel() and (int(scatter.min()) < 0 or int(scatter.max()) >= width)):
                return "the reduced vocabulary's map does not fit its head or the target's width"
            model.scatter, model.scatter_n = _ptr(scatter), scatter.numel()
            keep.append(scatter)
        elif width != described.out_features:
            return f"lm_head has {described.out_features} outputs, not {width}"
        model.width = width
        keep += [final_norm, head, *_kernel_tensors(head)]  # the tensors its _Linear points into
        return cls(decoder, model, keep, width)

    def __call__(self, rows: list[int], start: int, rope: tuple[torch.Tensor, torch.Tensor], keep: int,
                 buffers: list[tuple[torch.Tensor, torch.Tensor]], normed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [keep, width] of the last ``keep`` of the embedding ``rows`` fed at positions start...;
        ``rope``: the rotary table's cos and sin ([positions, head_dim] fp32, contiguous, covering every fed
        position); ``buffers``: each layer's KV buffers, as :meth:`Decoder.__call__` takes them; ``normed``: an
        [n, dim] tensor to receive every fed row's final-normed hidden state, or None."""
        n = len(rows)
        if n < 1 or not 1 <= keep <= n:
            raise ValueError(f"a forward of {n} rows cannot keep the last {keep}")
        if min(rows) < 0 or max(rows) >= self.rows:
            raise IndexError(f"token row out of range: the embedding has {self.rows} rows")
        if rope[0].shape[0] < start + n or rope[1].shape[0] < start + n:
            raise ValueError(f"the rotary table covers {rope[0].shape[0]} positions, not {start + n}")
        for t in rope:  # read from row ``start`` by pointer arithmetic below
            if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != self.decoder.head_dim or not t.is_contiguous():
                raise ValueError(f"a rotary table must be contiguous fp32 [positions, {self.decoder.head_dim}]")
        if normed is not None:
            _check_operand(normed, "normed", 2, torch.float32, (n, self.decoder.dim))
        # fp32 on the CPU whatever torch's process-wide defaults are at this moment (transformers' from_pretrained
        # sets a 16-bit default while another thread loads a model): the C code writes fp32 through these pointers
        x = torch.empty(n, self.decoder.dim, dtype=torch.float32, device="cpu")
        logits = torch.empty(keep, self.width, dtype=torch.float32, device="cpu")
        offset = start * self.decoder.head_dim * 4  # bytes: row ``start`` of the fp32 tables
        with _CALL:
            _point_at_buffers(self.decoder._layers, buffers, self.decoder.kv_heads, self.decoder.head_dim, start, n)
            failed = _library().model_step(ctypes.byref(self._model), (ctypes.c_int32 * n)(*rows), n, start,
                                           _ptr(rope[0]) + offset, _ptr(rope[1]) + offset, keep, _ptr(x),
                                           _ptr(normed) if normed is not None else None, _ptr(logits), _threads())
        if failed:
            _raise_for("step", failed, "a layer's or the head's shapes")
        return logits


class RankHead:
    """The predictor's ranking head in one C call (rank_head): P(d | [prompt ; mean of the recent rows]) over
    LayerNorm, linear, GELU, linear and softmax, with the parameters of a :class:`~.predictor.RankingHead` in eval
    mode. Why: a scheduling point comes right after a verify, when each small tensor operation costs tens of
    microseconds of cold dispatch (see :class:`Step`); the dozen a ranking took cost ~0.5 ms, every N iterations.
    Build with :meth:`build`, which says why a head does not qualify."""

    def __init__(self, tensors: list[torch.Tensor], eps: float, dim: int, hidden: int, classes: int) -> None:
        self._keep = tensors  # the pointers below point into these
        self._weights = [_ptr(t) for t in tensors]
        self.eps, self.dim, self.hidden, self.classes = eps, dim, hidden, classes

    @classmethod
    def build(cls, norm: torch.nn.LayerNorm, first: torch.nn.Linear, last: torch.nn.Linear) -> RankHead | str:
        if _load()[0] is None:
            return f"the memspec CPU kernels are not loaded: {status().reason}"
        tensors = [norm.weight, norm.bias, first.weight, first.bias, last.weight, last.bias]
        if any(t is None or t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            return "the head's parameters are not CPU fp32 tensors with biases"
        n = norm.normalized_shape[0]
        if len(norm.normalized_shape) != 1 or n % 2 or first.in_features != n or last.in_features != first.out_features:
            return "the head's layers do not chain as LayerNorm(2d) -> Linear -> Linear"
        return cls([t.detach().contiguous() for t in tensors], float(norm.eps), n // 2, first.out_features,
                   last.out_features)

    def __call__(self, prompt: torch.Tensor, recent_rows: list[torch.Tensor]) -> list[float]:
        """P(d | x) for x = [prompt ; mean over every row of ``recent_rows``] (none: the recent half is zero)."""
        parts = [r for r in recent_rows if r.shape[0]]
        for t in (prompt, *parts):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.shape[-1] != self.dim:
                raise ValueError(f"rank_head takes contiguous CPU fp32 rows of width {self.dim}")
        if prompt.numel() != self.dim or any(r.dim() != 2 for r in parts):  # the C reads shape[0] rows of each
            raise ValueError(f"rank_head takes one prompt row and [rows, {self.dim}] recent parts")
        probs = (ctypes.c_float * self.classes)()
        # scratch per call (ctypes arrays, no tensor operation): a head may serve a live and a replayed engine
        scratch = ((ctypes.c_float * (2 * self.dim))(), (ctypes.c_float * self.hidden)())
        w = self._weights
        _library().rank_head(_ptr(prompt), (ctypes.c_void_p * max(1, len(parts)))(*[_ptr(r) for r in parts]),
                             (ctypes.c_int * max(1, len(parts)))(*[r.shape[0] for r in parts]), len(parts), self.dim,
                             w[0], w[1], self.eps, w[2], w[3], self.hidden, w[4], w[5], self.classes,
                             *scratch, probs)
        return list(probs)
