#!/usr/bin/env python3
"""Sum a SEQTRAIN_TEST_PROFILE file (tests/conftest.py): seconds by test file, by call site, and by test.

    SEQTRAIN_TEST_PROFILE=/tmp/profile.tsv make test; scripts/test-profile.py /tmp/profile.tsv.* [--top 40]   (make test runs two halves: one file each)
"""

from __future__ import annotations

import argparse
import collections
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", nargs="+", help="FILE, or the halves' FILE.control-plane FILE.rest")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    by_file: collections.Counter[str] = collections.Counter()
    by_site: collections.Counter[str] = collections.Counter()
    by_test: collections.Counter[str] = collections.Counter()
    total = 0.0
    for path in args.profile:
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 4:
                    continue
                seconds, test, site, leaf = float(parts[0]), parts[1], parts[2], parts[3]
                total += seconds
                by_file[test.split("::")[0]] += seconds
                by_site[f"{site}  <- in {leaf}"] += seconds
                by_test[test] += seconds
    print(f"{total / 60:.1f} min sampled")
    for title, counter in (("by test file", by_file), ("by call site (the innermost lines of test code, then the function it was in)",
                                                       by_site), ("by test", by_test)):
        print(f"\n## {title}")
        for key, seconds in counter.most_common(args.top):
            print(f"{seconds:8.1f} s  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
