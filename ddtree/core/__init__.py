"""The pure-tensor core: the draft tree and its builders, the tree attention mask and positions, the decoding
rule, and the verify walk. Knows nothing of models."""
