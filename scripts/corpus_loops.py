"""How much of a self-distilled corpus is looping answers (`data.loops`), per sampling and finish.

A looping answer's tail only repeats 8-grams it already produced (`dspark.training.loops`). Prints
per temperature and finish reason: answers, response tokens, looping answers and their tokens from
the loop's start on, and what `data.loops: truncate` would remove.

    python scripts/corpus_loops.py data/selfdistill/smollm2-135m
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from dspark.training.loops import LOOP_KEEP, loop_start
from dspark.training.shards import load_corpus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("corpus", type=Path)
    args = parser.parse_args()
    answers, tokens, looping, tails = Counter(), Counter(), Counter(), Counter()
    for shard in load_corpus(args.corpus, None):
        for s in shard.samples:
            key = ("greedy" if s.temperature == 0 else f"T = {s.temperature:g}", s.finish_reason)
            answers[key] += 1
            tokens[key] += len(s.response_ids)
            start = loop_start(s.response_ids)
            if start is not None:
                looping[key] += 1
                tails[key] += max(0, len(s.response_ids) - start - LOOP_KEEP)
    print("| sampling | finish | answers | response tokens | looping answers | tokens truncate removes |")
    print("|---|---|---|---|---|---|")
    for key in sorted(answers):
        print(
            f"| {key[0]} | {key[1]} | {answers[key]:,} | {tokens[key]:,} | {looping[key]:,} | {tails[key]:,} |"
        )
    total, cut = sum(tokens.values()), sum(tails.values())
    print(
        f"| all | | {sum(answers.values()):,} | {total:,} | {sum(looping.values()):,} | {cut:,} ({cut / total:.1%}) |"
    )


if __name__ == "__main__":
    main()
