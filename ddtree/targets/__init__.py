"""The target side of a round: its forward, its KV cache (commit, rows), tree attention backends, split
prefix/tree attention, hybrid GDN layers, the supported families and the few-row CPU linear kernel."""
