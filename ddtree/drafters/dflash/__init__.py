"""The DFlash block-diffusion drafter: config (``config``), layers (``model``, ``attention``), checkpoint files
(``checkpoint``), binding to a target (``drafter``) and the per-generation context (``context``)."""
