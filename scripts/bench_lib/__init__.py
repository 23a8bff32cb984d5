"""Pieces of scripts/bench.py: statistics (stats), Prometheus scraping (prom), the load client (client),
the servers the bench starts (servers) and the report: JSON, Markdown (report), plots (plots). docs/performance.md
documents the method and the JSON keys. Shared by the other tools too: the Hopper compile target (hopper) and
tiny_model_corpus.txt (the text the tiny test model's tokenizer is trained on, and the word list of soak.py /
burst.py prompts)."""
