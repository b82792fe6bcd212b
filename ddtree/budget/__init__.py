"""How many draft nodes a round gets: the policies (``policy``) and, one concept a module, what ``"auto"`` is
made of: ``settings``, ``costs``, ``acceptance``, ``shrink``, ``backoff``, ``decide`` and ``learned``."""
