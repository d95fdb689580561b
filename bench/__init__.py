"""Benchmark harness for specdec (`make bench`, `python -m bench.run --help`).

Measures, on the same machine and in the same run: the target model alone (in-process HF generate),
Hugging Face assisted generation with the same draft ("the peer", plus its prompt-lookup mode), and
specdec's three services on loopback, for a fixed prompt set (bench/prompts.py). Appends a section per
run to the month's log in docs/bench-logs/ and redraws docs/bench_*.png.

  common.py      what every bench shares: paths, log, machine info, CPU load, markdown tables, free ports,
                 appending a section to the month's log in docs/bench-logs/
  run.py         the main bench's command line; run_plan.py (its rows), run_rows.py (what it measures:
                 in-process baselines via inprocess.py, specdec rows via pipeline.py), run_section.py (its
                 markdown), report.py (aggregates, bounds, tables), plots.py
  concurrency.py, replicas.py, overhead.py, self_draft.py, suffix_cost.py, step_cost.py, exactness.py:
                 one question each (see each module's docstring); concurrency_report.py writes the
                 concurrency sweep up
"""
