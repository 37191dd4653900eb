"""`tokenmill eval`: score local task files (JSONL) against the engine in-process or any
OpenAI-compatible server: log-likelihood of continuations, multiple choice accuracy, perplexity."""
