"""Interleaved A/B of the two per-forward overhead cuts, in one process on the same prompts
(docs/results/measured-here.md: "Why the loop was slower than its forwards"): ``step`` toggles the one-call
forward (cpu_kernels.Step) on the target and the drafts; ``views`` makes the KV cache slice its keys/values
views at every claim and crop again, as it did before;
``choice`` takes a greedy draft token through the checked row's torch max and a detached argmax again.
Each held-out prompt (round-robin over the zoo's workloads, its domain's draft) runs the target alone and the engine
(gamma 4) both ways, the order alternating per prompt; decode tokens/s summed over prompts.

    .venv/bin/python scripts/ab_forward_overheads.py int4 12 step     # path (int4 | int8 | none), prompts, what
"""

from __future__ import annotations

import sys

import torch
from ab_common import zoo

from memspec_ros.runtime import kv_cache, speculative
from memspec_ros.runtime.draft_forward import lean_forward_for
from memspec_ros.runtime.speculative import generate

_CLAIM, _CROP = kv_cache.PreallocatedLayer.claim, kv_cache.PreallocatedLayer.crop
_GREEDY = speculative._greedy_draft_token


def _torch_choice(name: str, *forward_args, confidence: bool = False) -> tuple[int, float]:
    row = speculative._checked_draft_row(name, *forward_args)
    token = row.detach().numpy().argmax(-1).tolist()  # argmax_rows as it was: a detach dispatch first
    return token, float(torch.softmax(row, -1)[token]) if confidence else 1.0


def _eager_claim(self, like):
    buffers = _CLAIM(self, like)
    self._key_buffer[..., : self._length, :], self._value_buffer[..., : self._length, :]  # the old views
    return buffers


def _eager_crop(self, tokens: int) -> None:
    _CROP(self, tokens)
    if self._key_buffer is not None:
        self._key_buffer[..., : self._length, :], self._value_buffer[..., : self._length, :]


def main(path: str, count: int, what: str) -> None:
    z = zoo(path, count)
    target, drafts, prompts, eos = z.target, z.drafts, z.prompts, z.eos
    steps = {model: lean_forward_for(model).step for model in (target, *drafts.values())}

    def switch(on: bool) -> None:
        if what == "views":
            kv_cache.PreallocatedLayer.claim = _CLAIM if on else _eager_claim
            kv_cache.PreallocatedLayer.crop = _CROP if on else _eager_crop
        elif what == "choice":
            speculative._greedy_draft_token = _GREEDY if on else _torch_choice
        else:
            for model, step in steps.items():
                lean_forward_for(model).step = step if on else None

    totals = {(kind, on): [0.0, 0] for kind in ("alone", "engine") for on in (True, False)}
    identical = True
    generate(target, prompts[0], drafts["general"], gamma=4, max_new_tokens=8, eos_token_ids=eos)  # warm-up
    for i, ids in enumerate(prompts):
        draft = z.draft_for(i)
        outputs = set()
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            switch(on)
            for kind in ("alone", "engine"):
                session = generate(target, ids, draft if kind == "engine" else None, gamma=4, max_new_tokens=128,
                                   eos_token_ids=eos)
                totals[(kind, on)][0] += session.stats.decode_seconds
                totals[(kind, on)][1] += session.stats.decode_tokens
                outputs.add(tuple(session.generated_ids))
        identical &= len(outputs) == 1
    switch(True)
    for kind in ("alone", "engine"):
        on, off = (totals[(kind, x)][1] / totals[(kind, x)][0] for x in (True, False))
        print(f"{path} {kind}: with {on:.1f} tok/s, without {off:.1f} -> {on / off:.3f}x")
    print(f"outputs identical: {identical} ({len(prompts)} prompts)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "int4", int(sys.argv[2]) if len(sys.argv) > 2 else 12,
         sys.argv[3] if len(sys.argv) > 3 else "step")
