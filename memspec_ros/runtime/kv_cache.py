"""KV cache layers for the engine: preallocated buffers written in place.

transformers' ``DynamicLayer`` appends with ``torch.cat`` on every forward, so
each layer reallocates and copies its whole cache every iteration; with the
engine's crop-and-append pattern (propose, verify, roll back) that is a fresh
allocation of a slightly different size per layer per forward. This layer keeps
one buffer per layer that grows by doubling, writes new keys and values into it
and hands attention a view of the valid prefix, so cropping is free and,
once a buffer is large enough, the cache allocates no new memory.

The views are made when read, not at every write or crop: the lean forward's kernels write into the
buffers and never read them as views, and each slicing is a tensor dispatch (two per layer, per
forward and per rollback: 60 of each for the bundled target's 30 layers), which in the engine's loop,
right after a verify has streamed the target's weights through the caches, costs several microseconds
apiece (measured: int4, 1 thread, ~0.56 ms per iteration for claims and crops together).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_CAPACITY = 256


def _prefix_view(buffer: str, assigned: str) -> property:
    """A layer attribute that reads as the valid prefix of its buffer once there is one (what was assigned
    before that), sliced when read."""

    def read(layer) -> torch.Tensor | None:
        whole = getattr(layer, buffer)
        return layer.__dict__.get(assigned) if whole is None else whole[..., : layer._length, :]

    def assign(layer, value: torch.Tensor | None) -> None:
        layer.__dict__[assigned] = value

    return property(read, assign)


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` backed by a doubling buffer; ``keys``/``values`` are views of its valid prefix."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None
    _length = 0
    _row_limit = 0  # the most rows the generation using it can write (0: unknown): growth stops there

    # transformers' base classes assign keys/values (None, an empty tensor); once a buffer exists, reads see it
    keys = _prefix_view("_key_buffer", "_keys")
    values = _prefix_view("_value_buffer", "_values")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self._length = 0

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
        self._length = 0

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = 0 if self._key_buffer is None else self._key_buffer.shape[-2]
        if needed <= capacity:
            return
        capacity = max(_MIN_CAPACITY, 2 * capacity, needed)
        if self._row_limit:  # doubling, but never past the generation's last row
            capacity = max(needed, min(capacity, self._row_limit))
        keys = key_states.new_empty(key_states.shape[:-2] + (capacity, key_states.shape[-1]))
        values = value_states.new_empty(value_states.shape[:-2] + (capacity, value_states.shape[-1]))
        if self._length:
            keys[..., : self._length, :] = self._key_buffer[..., : self._length, :]
            values[..., : self._length, :] = self._value_buffer[..., : self._length, :]
        self._key_buffer, self._value_buffer = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        self._reserve(key_states, value_states, end)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self._length = end
        return self.keys, self.values

    def claim(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend the cached prefix by ``like.shape[-2]`` rows that a kernel will write in place; returns the
        whole key and value buffers ([..., capacity, head_dim]) to write them into."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        end = self._length + like.shape[-2]
        self._reserve(like, like, end)
        self._length = end
        return self._key_buffer, self._value_buffer

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized or not self._length:
            return
        self._length = max(0, self._length + tokens_to_remove)


def limit_rows(cache: Cache, rows: int) -> None:
    """The most rows the generation using ``cache`` can write (its prompt and answer), on every layer there is: their
    buffers grow by doubling up to it, not past it. Doubling at the first verify after a long prompt's prefill took up
    to twice what a generation could ever use (a 1,024-token prompt and 128 new tokens: 2,048 rows for 1,152); a
    reservation of all of it up front took a generous max_new_tokens' rows for a short answer."""
    for layer in cache.layers:
        if type(layer) is PreallocatedLayer:
            layer._row_limit = rows


def crop_layers(cache: Cache, length: int) -> None:
    """Every layer of ``cache`` to at most ``length`` tokens, one absolute length for all: a forward that raised
    part-way (transformers' path, the lean Python one) has written some layers and not others, and a count relative
    to each layer's own length kept that difference for good (rows later forwards attend over, copy and keep)."""
    for layer in cache.layers:
        excess = layer.get_seq_length() - length
        if excess > 0:
            layer.crop(-excess)


def claim_rows(cache: Cache, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`PreallocatedLayer.claim` on layer ``layer_idx`` of a :func:`preallocated_cache`, creating the
    layer as ``Cache.update`` would."""
    while len(cache.layers) <= layer_idx:
        cache.layers.append(PreallocatedLayer())
    return cache.layers[layer_idx].claim(like)


@contextmanager
def claimed_rows(cache: Cache, layers: int, like: torch.Tensor, start: int
                 ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`claim_rows` on the first ``layers`` layers for the block, whose kernel writes rows from position
    ``start``; if the block raises (a forward refused after the claim, its scratch memory not allocated) every
    layer's length goes back, so the cache does not hold rows no forward wrote ahead of what its owner
    (speculative.KVState) counts. Every layer must hold exactly ``start`` rows: the C kernels write at ``start``
    and attend over rows 0..start+n-1, while a claim extends a layer from its own length, so a caller whose count
    differed would have the kernel attend over rows nobody wrote, or the cache count rows the kernel put elsewhere."""
    while len(cache.layers) < layers:
        cache.layers.append(PreallocatedLayer())
    lengths = [cache.layers[index]._length for index in range(layers)]
    if any(length != start for length in lengths):
        raise ValueError(f"a forward from position {start} on a cache whose layers hold {sorted(set(lengths))}"
                         " rows: the caller's count of cached tokens and the cache's disagree")
    try:
        yield [cache.layers[index].claim(like) for index in range(layers)]
    except BaseException:
        for index, length in enumerate(lengths):
            cache.layers[index]._length = length
        raise


def is_preallocated(cache: Cache) -> bool:
    return getattr(cache, "layer_class_to_replicate", None) is PreallocatedLayer and all(
        type(layer) is PreallocatedLayer for layer in cache.layers)


def preallocated_cache() -> Cache:
    """A cache whose layers (created lazily, one per model layer) are :class:`PreallocatedLayer`."""
    return Cache(layer_class_to_replicate=PreallocatedLayer)


def buffer_bytes(cache: Cache) -> int:
    """The memory a :func:`preallocated_cache` holds: its layers' key and value buffers (capacity, not length)."""
    return sum(buffer.nbytes for layer in cache.layers for buffer in (layer._key_buffer, layer._value_buffer)
               if buffer is not None)


def copy_prefix(cache: Cache, length: int) -> Cache:
    """A new :func:`preallocated_cache` holding copies of ``cache``'s first ``length`` positions: the two then
    grow apart (runtime/prompt_cache.py hands a goal that diverges from a kept conversation a copy of what they
    share, and keeps the conversation)."""
    out = preallocated_cache()
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        if keys is None or keys.dim() != 4 or keys.shape[-2] < length:
            held = None if keys is None else tuple(keys.shape)
            raise ValueError(f"layer {i} holds keys of shape {held}: fewer than the {length} positions to copy")
        copy = PreallocatedLayer()
        copy.update(keys[..., :length, :], values[..., :length, :])  # written into the copy's own buffers
        out.layers.append(copy)
    return out


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim from the process's own symbols (as storage.py reaches libc), or None (another C
    library). Not ctypes.util.find_library: it would start ldconfig or a compiler in a subprocess, inside a goal."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the operating system (glibc's malloc_trim); False where there is none.

    Why: KV buffers of a few hundred KB per layer come from the heap once glibc has raised its mmap threshold, and
    when the prompt cache drops a goal's caches their pages stay with the process. Measured with the bundled zoo
    (scripts/prompt_cache_memory.py: fp32, 240 goals, every sixth up to 600 tokens, the default 128 MiB budget; the
    cache held 121-134 MB throughout): resident memory 1,562-1,642 MB without this, 1,385-1,414 MB with it; a call
    took 3.0 ms (median of 189, 18.9 at most)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

