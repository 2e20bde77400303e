"""Interleaved A/B of the draft's confidence stop (runtime/gamma_choice.py: row_pays, draft_pays), in one process on
the same prompts: adaptive gamma with the stop against adaptive gamma without it (each iteration proposes the gamma
chosen from the running acceptance, as before the stop), beside the target alone. Each held-out prompt (round-robin
over the zoo's workloads, its domain's draft) runs all three, the order rotating per prompt; decode tokens/s summed
over prompts. ``lookup`` also copies from the context and the zoo's datastore (the node's defaults) in both arms.

    .venv/bin/python scripts/ab_confidence_stop.py int4 12            # path (int4 | int8 | none), prompts
    .venv/bin/python scripts/ab_confidence_stop.py int4 12 lookup
"""

from __future__ import annotations

import sys
from pathlib import Path

from ab_common import zoo

from memspec_ros.runtime.datastore import Datastore
from memspec_ros.runtime.loader import find_datastore
from memspec_ros.runtime.lookup import LookupConfig
from memspec_ros.runtime.speculative import generate


def main(path: str, count: int, lookup: bool) -> None:
    z = zoo(path, count)
    target, prompts, eos = z.target, z.prompts, z.eos
    extra = dict(lookup=LookupConfig(), datastores=(Datastore.load(find_datastore(Path("models"))),)) if lookup else {}
    arms = ("alone", "adaptive", "adaptive+stop")
    totals = {arm: [0.0, 0, 0, 0, 0] for arm in arms}  # seconds, tokens, drafted iterations, proposed, dropped
    identical = True
    # warm-up, and the one-off forward timings adaptive gamma uses, for every draft a prompt will use: warmed for
    # `general` alone, each other draft's timing and first-forward setup fell into whichever adaptive arm ran it
    # first, which the rotation made the stop-less arm for three of the four domain drafts
    for draft in dict.fromkeys(map(z.draft_for, range(len(prompts)))):
        generate(target, prompts[0], draft, gamma=4, max_new_tokens=8, eos_token_ids=eos, adaptive_gamma=True)
    for i, ids in enumerate(prompts):
        draft = z.draft_for(i)
        outputs = set()
        for arm in arms[i % 3:] + arms[: i % 3]:
            session = generate(target, ids, None if arm == "alone" else draft, gamma=4, max_new_tokens=128,
                               eos_token_ids=eos, adaptive_gamma=arm != "alone", confidence_stop=arm == "adaptive+stop",
                               **({} if arm == "alone" else extra))
            its = session.stats.iterations
            t = totals[arm]
            t[0] += session.stats.decode_seconds
            t[1] += session.stats.decode_tokens
            t[2] += sum(1 for it in its if it.proposed + it.dropped > 0)
            t[3] += sum(it.proposed for it in its)
            t[4] += sum(it.dropped for it in its)
            outputs.add(tuple(session.generated_ids))
        identical &= len(outputs) == 1
    alone = totals["alone"][1] / totals["alone"][0]
    for arm in arms:
        s, n, drafted, proposed, dropped = totals[arm]
        print(f"{path}{' lookup' if lookup else ''} {arm}: {n / s:.1f} tok/s ({n / s / alone:.3f}x alone);"
              f" proposed {proposed}, dropped {dropped} in {drafted} drafted iterations")
    new, old = (totals[a][1] / totals[a][0] for a in ("adaptive+stop", "adaptive"))
    print(f"stop / no stop: {new / old:.3f}x; outputs identical: {identical} ({len(prompts)} prompts)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "int4", int(sys.argv[2]) if len(sys.argv) > 2 else 12,
         len(sys.argv) > 3 and sys.argv[3] == "lookup")
