"""The target side of a round, behind one seam: what a target is (``description``: windows, sinks, decoder,
stateful layer kinds, read once per model), its forward (``forward``) and KV cache (``cache``), tree
attention (``backends`` with ``get_backend``; ``kernels`` and ``split_attention`` for the math;
``registration`` with transformers, done when a backend prepares a model), layers with per-row state
behind one interface (``layer_kinds``; GDN in ``linear_attention``), the supported families and the
few-row CPU linear kernel."""
