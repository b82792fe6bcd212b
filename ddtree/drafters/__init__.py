"""Proposers: the ``Drafter`` / ``DraftContext`` protocols, ``Proposal`` and the one way a proposal becomes a tree
(``base``), the target features drafters read, the DFlash and DFlash2 drafters (``dflash/``, ``dflash2/``), the
registry from a checkpoint's ``architectures`` to a drafter class (``registry``) and model-free prompt lookup."""
