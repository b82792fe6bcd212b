"""How many draft nodes a round gets: the policies (``policy``) and, one concept a module, what ``"auto"`` is
made of: ``settings``, ``costs``, ``acceptance`` (with its shrinkage rule), ``backoff``, ``decide`` and ``learned``."""
