"""Empty the answers in a zoo's datastore whose training requests ask what a held-out request asks.

The committed zoo's workloads were split by source, so 109 of the 10,240 training requests it answered ask about
the same paragraph, clause or problem as a held-out request (chat_workloads.request_material); context lookup then
copied their answers into held-out answers. The build now drops such requests, and its datastore stage withholds
their answers; this applies the same to an existing datastore without the teacher's shards (answer i answers row i
of the zoo's workloads/train_requests.jsonl, and stays in place, empty).

    python scripts/withhold_datastore.py --zoo models
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memspec_ros.runtime.datastore import Datastore, read_answers
from memspec_ros.runtime.loader import DATASTORE_FILE
from memspec_ros.zoo.chat_workloads import withhold_heldout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", default="models", help="the zoo folder: datastore.safetensors and workloads/")
    args = parser.parse_args(argv)
    zoo = Path(args.zoo)
    path, folder = zoo / DATASTORE_FILE, zoo / "workloads"
    if not path.is_file() or not (folder / "train_requests.jsonl").is_file():
        parser.error(f"{zoo} has no {DATASTORE_FILE} or workloads/train_requests.jsonl")
    answers, meta = read_answers(path)
    kept, withheld = withhold_heldout([a.tolist() for a in answers], folder / "train_requests.jsonl", folder)
    store = Datastore(kept, fingerprint=meta.get("tokenizer_fingerprint", ""))
    extra = {k: v for k, v in meta.items() if k not in ("format", "tokenizer_fingerprint", "answers", "withheld")}
    previously = int(meta.get("withheld", 0))
    store.save(path, **extra, withheld=withheld)
    print(f"{path}: {store.answers} answers, {withheld} withheld ({previously} before), {store.token_count} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
