"""The cluster side: the disaggregated backend, the control plane's server, node registry and
membership, admission and placement policies, the operator's actions. Import from the modules."""
