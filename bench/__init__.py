"""Benchmarks of logit-distill (not tests). ``python -m bench.run`` (``make bench``) measures every
figure of docs/BENCHMARKS.md as a ratio of two things timed side by side in one run, writes
``bench/results.json`` and regenerates docs/BENCHMARKS.md."""
