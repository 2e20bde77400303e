"""Check an exported draft GGUF against the engine's draft: greedy proposals from llama.cpp and from PyTorch.

    python scripts/check_draft_gguf.py --draft models/drafts/general --gguf artifacts/drafts-gguf/general.gguf \
        [--prompts 4] [--tokens 16] [--json out/draft-gguf-check.json]

For held-out chat prompts of every workload: the project's draft (``load_model``, target ids)
continues the prompt's token ids greedily for ``--tokens`` tokens (stopping at an end token);
``llama-completion -m GGUF --temp 0`` continues the same text. Agreement: the leading tokens
whose decoded text is a prefix of llama.cpp's output, and whole continuations equal as text.
Also how often a zero head row (ids outside the draft's subset) would win the argmax,
teacher-forced over every position of the prompts and the draft's continuations.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

from memspec_ros.bench.llamacpp_bench import LLAMACPP_BIN, llamacpp_program
from memspec_ros.runtime.chat import prompt_ids
from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
from memspec_ros.zoo.chat_build import DEFAULT_TARGET
from memspec_ros.zoo.draft_gguf import outside_wins

END_TEXT = ("<|im_end|>", "<|endoftext|>")


def llama_greedy(gguf: Path, text: str, tokens: int) -> str:
    cmd = [str(llamacpp_program(LLAMACPP_BIN, "llama-completion")), "-m", str(gguf), "-p", text, "-n", str(tokens),
           "--temp", "0", "-t", "1", "-tb", "1", "-no-cnv", "-c", "2048", "--seed", "0", "--no-display-prompt",
           "--simple-io", "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-800:])
    return done.stdout


@torch.inference_mode()
def draft_greedy(draft, ids: list[int], tokens: int, ends: set[int]) -> list[int]:
    out: list[int] = []
    for _ in range(tokens):
        nxt = int(draft(torch.tensor([ids + out])).logits[0, -1].argmax())
        if nxt in ends:
            break
        out.append(nxt)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="models/drafts/general")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--zoo", default="models")
    ap.add_argument("--domains", default="code,math,law,medical,general")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per workload")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    draft = load_model(ModelSpec(a.draft)).model
    ends = {tokenizer.convert_tokens_to_ids(t) for t in END_TEXT}
    rows = []
    for domain in a.domains.split(","):
        lines = (Path(a.zoo) / "workloads" / f"{domain}.jsonl").read_text().splitlines()
        rows += [(domain, json.loads(line)["prompt"]) for line in lines if line.strip()][: a.prompts]
    cases, agree, total, equal, all_ids = [], 0, 0, 0, []
    for domain, prompt in rows:
        ids = prompt_ids(tokenizer, prompt)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ours = draft_greedy(draft, ids, a.tokens, ends)
        all_ids.append(ids + ours)
        theirs = llama_greedy(Path(a.gguf), text, a.tokens)
        lead = 0
        while lead < len(ours) and theirs.startswith(tokenizer.decode(ours[: lead + 1])):
            lead += 1
        same = tokenizer.decode(ours) == theirs.removesuffix("\n\n")  # llama-completion ends with a blank line
        agree, total, equal = agree + lead, total + len(ours), equal + same
        cases.append({"domain": domain, "draft_tokens": len(ours), "leading_agree": lead, "equal_text": same,
                      "draft": tokenizer.decode(ours), "llamacpp": theirs})
        print(f"{domain:8s} {lead:2d}/{len(ours):2d} {'=' if same else '!'} {tokenizer.decode(ours)!r} | {theirs!r}")
    wins, positions, lowest = outside_wins(draft, all_ids)
    result = {"draft": a.draft, "gguf": a.gguf, "tokens": a.tokens, "prompts": len(cases),
              "leading_tokens_agree": agree, "draft_tokens": total, "continuations_equal": equal,
              "zero_row_wins": wins, "positions": positions,
              "smallest_top_subset_logit": lowest, "cases": cases}
    print(f"agreement: {agree}/{total} tokens, {equal}/{len(cases)} continuations identical;"
          f" a zero head row would win at {wins}/{positions} positions (prompt + continuation; smallest top"
          f" subset logit {lowest:.2f})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
