"""kvtransport: ships paged KV blocks from prefill nodes into decode nodes' reserved blocks."""
