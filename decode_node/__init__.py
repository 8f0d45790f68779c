"""The decode node: adopts shipped KV blocks and decodes with paged attention (service.py)."""
