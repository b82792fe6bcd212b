"""The DFlash2 drafter: DFlash layers in dynamic causal convolutions, and a candidate selector whose scores
are pairwise (a token's score depends on the token before it). Config (``config``), layers and checkpoint
(``model``), binding to a target (``drafter``) and the per-generation context (``context``)."""
