"""Finding and loading checkpoints: directories and hub ids (``hub``), a drafter by its ``architectures``
(``drafter``), a target with its drafter (``pair``) and the shipped default pair (``pretrained``)."""
