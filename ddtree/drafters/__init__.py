"""Proposers: the ``Drafter`` / ``DraftContext`` protocols and ``Proposal`` (``base``), the target features
drafters read, the DFlash drafter (``dflash/``) and model-free prompt lookup."""
