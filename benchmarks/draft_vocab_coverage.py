"""Coverage of pruned draft vocabularies: the share of training loss tokens inside a vocabulary of D tokens built
by dflash/drafter/vocab.py (the tokenizer's added tokens + the most frequent loss tokens), for several D.

Inputs: a tokenize stage's `token_counts.json` (`--counts`, the demo: artifacts/tokenize/token_counts.json), or,
without one, a stand-in: the assistant turns (reasoning + answer + <|im_end|>) of the tiny target's own
pre-training corpus (dflash.target.synthetic.pretrain_corpus, the text the demo's target learned to answer in),
rendered with the real Qwen3 chat template (thinking mode) and tokenized; the last assistant turn of each
conversation is the supervised part, as the tokenize stage supervises a turn. Output: a table on stdout
(D, coverage, distinct loss tokens), and a JSON line with the same numbers.

    python benchmarks/draft_vocab_coverage.py                                   # stand-in, 4000 conversations
    python benchmarks/draft_vocab_coverage.py --counts artifacts/tokenize/token_counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.drafter.vocab import TokenCounts, added_token_ids, coverage_table  # noqa: E402

SIZES = (32, 48, 64, 96, 128, 192, 256, 379, 512, 1024, 32768)
VOCAB = 151936  # Qwen3's embedding rows (the tiny target's vocabulary)


def stand_in(conversations: int, seed: int) -> TokenCounts:
    """Loss-token counts of the last assistant turn of `conversations` pre-training conversations (docstring)."""
    from dflash.core.chat import load_fast_chat
    from dflash.target.build import qwen3_tokenizer_dir
    from dflash.target.synthetic import pretrain_corpus

    folder = qwen3_tokenizer_dir()
    chat = load_fast_chat(str(folder))
    kwargs = {"enable_thinking": True}
    prompts, fulls = [], []
    for messages in pretrain_corpus(conversations, seed):
        prompts.append(chat.render(messages[:-1], True, kwargs))
        fulls.append(chat.render(messages, False, kwargs))
    counts: Counter = Counter()
    end = chat.encode_batch(["<|im_end|>"])[0][0]
    for p, f in zip(chat.encode_batch(prompts), chat.encode_batch(fulls), strict=True):
        supervised = f[len(p) :]
        cut = supervised.index(end) + 1 if end in supervised else len(supervised)  # the engine stops at <|im_end|>
        counts.update(supervised[:cut])
    return TokenCounts(dict(counts), tuple(added_token_ids(folder)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="", help="a tokenize stage's token_counts.json ('' = the stand-in)")
    ap.add_argument("--conversations", type=int, default=4000, help="stand-in: pre-training conversations")
    ap.add_argument("--seed", type=int, default=0, help="stand-in: corpus seed (the target stage uses base.seed)")
    args = ap.parse_args()
    tc = TokenCounts.read(args.counts) if args.counts else stand_in(args.conversations, args.seed)
    table = coverage_table(tc, [s for s in SIZES if s >= len(tc.always_in)], VOCAB)
    source = args.counts or f"stand-in: pretrain_corpus({args.conversations}, seed {args.seed}), last assistant turn"
    print(f"source: {source}")
    print(f"loss tokens {tc.total}, distinct {len(tc.counts)}, always-in (added tokens) {len(tc.always_in)}")
    print(f"{'D':>7}  coverage")
    for size, cov in table.items():
        print(f"{size:>7}  {cov:.6f}")
    print(json.dumps({"source": source, "loss_tokens": tc.total, "distinct": len(tc.counts), "coverage": table}))


if __name__ == "__main__":
    main()
