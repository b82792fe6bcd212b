"""The decoding loop: ``DecodeState`` (one generation), ``speculative_round`` (one round), HF-style inputs, and
``SpeculativeGenerator`` (``generate`` / ``stream`` over rounds)."""
