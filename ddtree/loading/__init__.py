"""Finding and loading checkpoints: the shipped default pair (SmolLM2-135M and its DFlash drafter)."""
