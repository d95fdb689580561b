"""Benchmark harness for specdec (`make bench`, `python -m bench.run --help`).

Measures, on the same machine and in the same run: the target model alone (in-process HF generate),
Hugging Face assisted generation with the same draft ("the peer", plus its prompt-lookup mode), and
specdec's three services on loopback, for a fixed prompt set (bench/prompts.py). Appends a section per
run to docs/BENCHMARKS.md and redraws docs/bench_*.png.
"""
