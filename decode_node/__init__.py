"""The decode node: adopts shipped KV blocks and decodes with paged attention (service.py); moves a
running request to another decode node with its blocks when the router takes it out (mover.py)."""
