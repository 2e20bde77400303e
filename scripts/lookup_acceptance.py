"""How often copies from the context would stand, replayed over recorded greedy answers (no model runs).

For each held-out answer the target gave (the chat zoo's teacher shards: prompt ids and greedy answer
ids), decoding is replayed as the engine does it with context lookup alone: at each step the
``NgramIndex`` over prompt + answer so far proposes up to gamma tokens, the longest prefix equal to the
answer stands, plus one token. It reports, per length of the matched suffix, how many iterations had a
copy, the mean number accepted, and the chance that the first j copied tokens stand.

With ``--verify-ms`` (the target's measured 1..gamma+1-token forward times, as adaptive gamma measures
them) it also replays adaptive gamma's choice (runtime/gamma_choice.py) over the same answers, with one
acceptance estimate for all copies (what the engine does) and with one per match length, and reports
the speed each would reach against the target alone under those costs: a comparison free of timing
noise, since only the costs are measured.

With ``--remember`` the adaptive replay runs once more over the held-out answers in a shuffled order,
each searching the answers before it first (a node with ``memspec.remember_answers``).

With ``--corpus train`` the lookup also searches the target's own answers to the training requests (a
``Datastore``, runtime/datastore.py, as the engine does with the zoo's ``datastore.safetensors``; the
held-out requests are not among them): how much more a lookup that also searched past answers copies.
``--datastore FILE`` searches a zoo's datastore file instead (the bundled ``models/datastore.safetensors``: the
same kind of answers, with those to training requests that ask what a held-out request asks withheld).

    python scripts/lookup_acceptance.py artifacts/chat-zoo-build/teacher --gamma 4 \
        --json docs/results/lookup-acceptance.json
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from memspec_ros.argtypes import controller_limit, float_in, output_file, positive_int
from memspec_ros.runtime.datastore import Datastore, read_answers
from memspec_ros.runtime.gamma_choice import ForwardCosts, GammaChooser
from memspec_ros.runtime.lookup import LookupConfig, NgramIndex


def answers(folder: Path, split: str) -> Iterator[tuple[str, list[int], list[int]]]:
    """(domain, prompt ids, answer ids) from ``<split>-*.safetensors`` teacher shards."""
    shards = sorted(folder.glob(f"{split}-*.safetensors"))
    if not shards:
        raise SystemExit(f"no {split}-*.safetensors teacher shards in {folder} (memspec-zoo build writes them to"
                         " <work_dir>/teacher)")
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            domains = json.loads(f.metadata()["meta"])["domains"]
            answer, answer_at = f.get_tensor("answer_ids").tolist(), f.get_tensor("answer_offsets").tolist()
            prompt, prompt_at = f.get_tensor("prompt_ids").tolist(), f.get_tensor("prompt_offsets").tolist()
        for i, domain in enumerate(domains):
            yield domain, prompt[prompt_at[i] : prompt_at[i + 1]], answer[answer_at[i] : answer_at[i + 1]]


def replay(prompt: list[int], answer: list[int], gamma: int, config: LookupConfig,
           datastore: Datastore | None = None) -> Iterator[tuple[int, int, int]]:
    """(matched suffix length, tokens proposed, tokens accepted) for every iteration; 0, 0, 0 without a copy."""
    index = NgramIndex(config, [datastore] if datastore is not None else [])
    # the prefill commits the answer's first token (speculative.py), and no proposal runs past the answer's last
    # token, after which the engine commits nothing more (it proposes at most the tokens left less one)
    index.extend(prompt + answer[:1])
    at = 1
    while at < len(answer):
        proposal, matched = index.propose(min(gamma, len(answer) - at - 1))
        accepted = 0
        while accepted < len(proposal) and at + accepted < len(answer) and proposal[accepted] == answer[at + accepted]:
            accepted += 1
        yield matched, len(proposal), accepted
        index.extend(answer[at : at + accepted + 1])
        at += accepted + 1


def replay_adaptive(pairs: list[tuple[list[int], list[int]]], costs: ForwardCosts, gamma: int,
                    config: LookupConfig, per_length: bool, datastore: Datastore | None = None,
                    remember: bool = False) -> float:
    """Tokens per second of copies chosen by adaptive gamma over ``pairs`` (prompt ids, answer ids) under
    ``costs``: one acceptance estimate for all copies, or (``per_length``) one per matched length. With
    ``remember``, the answers before each one in ``pairs`` are searched first, as a controller with
    ``remember_answers`` does (runtime/controller.py), then ``datastore``."""
    tokens, ms = 0, 0.0
    for i, (prompt, answer) in enumerate(pairs):
        stores = [Datastore(a for _, a in pairs[:i])] if remember and i else []
        stores += [datastore] if datastore is not None else []
        chooser, index, at = GammaChooser(gamma), NgramIndex(config, stores), 1
        index.extend(prompt + answer[:1])  # as replay(): the prefill's token first, no proposal past the answer
        while at < len(answer):
            proposal, matched = index.propose(min(gamma, len(answer) - at - 1))
            name = f"lookup:{matched}" if per_length else "lookup"
            chosen = chooser.choose(costs, name, len(proposal)) if proposal else 0
            accepted = 0
            while accepted < chosen and at + accepted < len(answer) and proposal[accepted] == answer[at + accepted]:
                accepted += 1
            if chosen:
                chooser.observe(name, chosen, accepted)
            tokens, ms = tokens + accepted + 1, ms + costs.verify_ms[chosen]
            index.extend(answer[at : at + accepted + 1])
            at += accepted + 1
    return 1000.0 * tokens / ms


def _verify_ms(parser: argparse.ArgumentParser, text: str, gamma: int) -> list[float]:
    """--verify-ms: gamma + 1 positive, finite times (a 0 divided by zero, a nan went into the JSON)."""
    try:
        values = [float_in(1e-9, 1e9)(v) for v in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"--verify-ms {text!r}: {exc}")
    if len(values) != gamma + 1:
        parser.error(f"--verify-ms needs {gamma + 1} times (1..gamma+1 tokens), got {len(values)}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher", type=Path, help="folder of teacher shards (memspec-zoo build's"
                        " <work_dir>/teacher, by default artifacts/chat-zoo-build/teacher)")
    parser.add_argument("--split", default="heldout", help="shard prefix (default heldout)")
    parser.add_argument("--gamma", type=controller_limit("gamma"), default=4)
    parser.add_argument("--min-ngram", type=positive_int, default=LookupConfig().min_ngram)
    parser.add_argument("--max-ngram", type=positive_int, default=LookupConfig().max_ngram)
    parser.add_argument("--verify-ms", help="comma-separated ms of a 1..gamma+1-token target forward: also replay"
                        " adaptive gamma's choice under these costs")
    parser.add_argument("--corpus", help="also search this split's answers (e.g. train) before each prompt")
    parser.add_argument("--datastore", type=Path, help="also search this datastore file's answers (e.g. the bundled"
                        " models/datastore.safetensors) before each prompt; instead of --corpus")
    parser.add_argument("--corpus-shares", help="with --corpus (or --datastore) and --verify-ms: comma-separated shares"
                        " of the corpus"
                        " (its first answers) to replay adaptive gamma with too, e.g. 0.125,0.25,0.5,1")
    parser.add_argument("--remember", action="store_true",
                        help="with --verify-ms: also replay the held-out answers in a shuffled order, each searching"
                             " the earlier ones first (memspec.remember_answers)")
    parser.add_argument("--json", type=output_file, help="write the figures here")
    args = parser.parse_args()
    config = LookupConfig(args.min_ngram, args.max_ngram)
    if args.corpus and args.datastore:
        raise SystemExit("--corpus and --datastore both name the answers to search: pass one")
    # checked before the replay, which found them only at its end
    verify_ms = _verify_ms(parser, args.verify_ms, args.gamma) if args.verify_ms else None
    if (args.remember or args.corpus_shares) and not verify_ms:  # both were ignored without a word
        parser.error("--remember and --corpus-shares replay adaptive gamma: they need --verify-ms")
    if args.corpus_shares and not (args.corpus or args.datastore):
        parser.error("--corpus-shares needs --corpus or --datastore")
    try:
        # (the text as given, the share): the JSON's keys are the user's text, as before
        shares = [(v, float_in(0.0, 1.0)(v)) for v in args.corpus_shares.split(",")] if args.corpus_shares else []
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"--corpus-shares {args.corpus_shares!r}: {exc}")
    if args.datastore:
        every = [a for a in read_answers(args.datastore)[0] if len(a)]  # empty rows: withheld answers
    else:
        every = [a for _, _, a in answers(args.teacher, args.corpus)] if args.corpus else []
    corpus = Datastore(every) if every else None
    by_length: dict[int, list[int]] = defaultdict(list)  # matched length -> accepted per copied iteration
    iterations = answered = 0
    per_domain: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # iterations, copied, accepted
    for domain, prompt, answer in answers(args.teacher, args.split):
        answered += 1
        for matched, proposed, accepted in replay(prompt, answer, args.gamma, config, corpus):
            iterations += 1
            row = per_domain[domain]
            row[0] += 1
            if proposed:
                by_length[matched].append(accepted)
                row[1] += 1
                row[2] += accepted
    result = {
        "teacher": str(args.teacher), "split": args.split, "gamma": args.gamma,
        "min_ngram": config.min_ngram, "max_ngram": config.max_ngram, "answers": answered, "iterations": iterations,
        "corpus": {"split": args.corpus, "datastore": str(args.datastore) if args.datastore else None,
                   "answers": corpus.answers, "tokens": corpus.token_count,
                   "min_ngram": corpus.config.min_ngram, "max_ngram": corpus.config.max_ngram} if corpus else None,
        "copied_share": sum(len(v) for v in by_length.values()) / iterations if iterations else 0.0,
        "by_match_length": {
            str(n): {"iterations": len(v), "mean_accepted": sum(v) / len(v),
                     "first_j_stand": [sum(1 for a in v if a >= j) / len(v) for j in range(1, args.gamma + 1)]}
            for n, v in sorted(by_length.items())
        },
        "by_domain": {d: {"copied_share": c / i, "accepted_per_copy": a / c if c else 0.0}
                      for d, (i, c, a) in sorted(per_domain.items())},
    }
    if verify_ms:
        costs = ForwardCosts(verify_ms=verify_ms, draft_ms=0.0)
        pairs = [(p, a) for _, p, a in answers(args.teacher, args.split)]
        alone = 1000.0 / verify_ms[0]
        result["adaptive_replay"] = {
            "verify_ms": verify_ms, "target_alone_tps": alone,
            **{f"{label}_vs_target_alone": replay_adaptive(pairs, costs, args.gamma, config, per_length, corpus) / alone
               for label, per_length in (("one_estimate", False), ("per_match_length", True))},
        }
        if corpus is not None and shares:  # how the gain grows with the datastore's size
            result["adaptive_replay"]["by_corpus_share"] = {
                text: replay_adaptive(pairs, costs, args.gamma, config, False,
                                      Datastore(every[: round(len(every) * share)])) / alone
                for text, share in shares}
        if args.remember:  # served one after another in a shuffled order, each remembering those before it
            random.Random(0).shuffle(pairs)
            result["adaptive_replay"]["remembering_earlier_answers_vs_target_alone"] = replay_adaptive(
                pairs, costs, args.gamma, config, False, corpus, remember=True) / alone
    text = json.dumps(result, indent=1)
    print(text)  # before the write: a failed write loses no figure
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
