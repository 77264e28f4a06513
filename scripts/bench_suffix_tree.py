"""The suffix trie's cost on this CPU: the Python one (`SuffixTree`) against the C++ one (`NativeSuffixTree`).

    python scripts/bench_suffix_tree.py [--seed 0]

Per appended token (a prompt built from repeated phrases, fed 4 tokens at a time as accepted drafts arrive, and
random tokens) and per `SuffixProposer.propose` call over a growing request with a global cache of finished outputs.
"""

from __future__ import annotations

import argparse
import random
import time

from tandem.spec_decode import DraftRequest
from tandem.spec_decode.native import native_suffix_tree
from tandem.spec_decode.suffix import NativeSuffixTree, SuffixProposer, SuffixTree


def append_us(cls: type, seqs: list[list[int]]) -> float:
    """Microseconds per token appended, each sequence in its own tree, 4 tokens a call."""
    t0, n = time.perf_counter(), 0
    for seq in seqs:
        tree = cls(64)
        for i in range(0, len(seq), 4):
            tree.extend(0, seq[i : i + 4])
        n += len(seq)
    return 1e6 * (time.perf_counter() - t0) / n


def propose_us(native: bool, seqs: list[list[int]]) -> float:
    """Microseconds per `propose` of one request (K = 4), every 3 tokens of each sequence after its first 100."""
    p = SuffixProposer(native=native)
    t0, calls = time.perf_counter(), 0
    for i, seq in enumerate(seqs):
        for end in range(100, len(seq), 3):
            p.propose([DraftRequest(f"r{i}", seq[:end], 100, 4)])
            calls += 1
        p.release(f"r{i}")
        p.tidy(None)
    return 1e6 * (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if native_suffix_tree() is None:
        raise SystemExit("the native suffix tree does not build here")
    rng = random.Random(args.seed)
    phrases = [[rng.randrange(5000) for _ in range(rng.randint(3, 12))] for _ in range(50)]
    repeated = [[t for _ in range(60) for t in rng.choice(phrases)] for _ in range(32)]
    fresh = [[rng.randrange(50_000) for _ in range(500)] for _ in range(32)]
    print("| | Python | C++ | ratio |\n|---|---|---|---|")
    for name, seqs in (("append, repeated phrases (us / token)", repeated), ("append, random tokens (us / token)", fresh)):
        a, b = append_us(SuffixTree, seqs), append_us(NativeSuffixTree, seqs)
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.1f}x |")
    a, b = propose_us(False, repeated), propose_us(True, repeated)
    print(f"| propose, K = 4 (us / call) | {a:.1f} | {b:.1f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
