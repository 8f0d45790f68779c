"""What every node process shares, whatever its role: its config and CLI (config.py), its KV
identity and heartbeat figures (identity.py), its link to the router (router_link.py), the
lifecycle a node kind builds on (service.py), the loop that serves it (runtime.py), and the
block shipper a prefill node and a decode node moving a request both send with (shipper.py).

    start ─▶ engine + KV transport ─▶ session with the router ─▶ NodeHello ─▶ serving
      ─▶ SIGTERM / "leave" / a broken engine ─▶ NodeGoodbye ─▶ transport and link closed
"""
