"""Benchmarks behind `seqtrain bench NAME`: each module has `main(argv) -> int` and writes JSON."""
