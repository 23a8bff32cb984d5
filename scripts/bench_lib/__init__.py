"""Pieces of scripts/bench.py: statistics (stats), Prometheus scraping (prom), the load client (client),
the servers the bench starts (servers) and the report: JSON, Markdown (report), plots (plots). docs/performance.md
documents the method and the JSON keys."""
