"""`tokenmill doctor`: what limits a serving deployment (KV pool, --max-num-seqs, prefix caching, the
prefill chunk, memory bandwidth, compute, CPU threads, queueing) and what to change, from a window of its
/metrics and, with --probe, a short bounded probe of its own."""
