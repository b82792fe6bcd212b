"""Process-level plumbing under every layer: ranks that must decide alike, CPU threads, stage timing, the
cache folder."""
