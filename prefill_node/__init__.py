"""The prefill node: computes prompts' KV blocks and ships them to decode nodes (service.py)."""
