"""Which drafter class serves a checkpoint: ``config.json``'s ``architectures`` mapped to a class, in one place.

A registered class binds its raw model to a target (``cls(model, target)``), loads a directory
(``cls.from_pretrained(path, target, *, dtype, device, **options)``), checks a config against the target's
before any weight is read (``cls.check_config(config_file, target_config)``) and names its raw model class
(``cls.model_class``). :func:`register_drafter` adds a class for another architecture; the loading layer
(:mod:`ddtree.loading.drafter`) resolves directories and hub ids through it.
"""

from __future__ import annotations

from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.dflash2.drafter import DFlash2Drafter

_DRAFTERS: dict[str, type] = {"DFlashDraftModel": DFlashDrafter, "DFlash2DraftModel": DFlash2Drafter}
_CLASS_PARTS = ("from_pretrained", "check_config", "model_class")


def register_drafter(architecture: str, drafter_class: type) -> None:
    """Serve checkpoints whose ``architectures`` name ``architecture`` with ``drafter_class``."""
    if not isinstance(architecture, str) or not architecture:
        raise TypeError(f"architecture must be a non-empty str (as config.json spells it), got {architecture!r}")
    missing = [name for name in _CLASS_PARTS if not hasattr(drafter_class, name)]
    if missing:
        raise TypeError(f"{getattr(drafter_class, '__name__', drafter_class)!s} cannot serve checkpoints: it lacks "
                        f"{', '.join(missing)} (see ddtree.drafters.registry)")
    _DRAFTERS[architecture] = drafter_class


def registered_architectures() -> list[str]:
    """The architectures a checkpoint may name, sorted."""
    return sorted(_DRAFTERS)


def drafter_class(config: dict, where: str = "the drafter config") -> type:
    """The class for a parsed ``config.json``: the first of its ``architectures`` that is registered.

    A config that names no architecture but has a ``dflash_config`` is a DFlash one (older exports write
    none). A config with neither is not a drafter config at all (a target's, most often).
    """
    if not isinstance(config, dict):
        raise ValueError(f"{where} is a JSON object (a dict), got {type(config).__name__}")
    names = config.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in _DRAFTERS:
            return _DRAFTERS[name]
    if names:
        raise ValueError(f"{where} names the architecture(s) {', '.join(map(str, names))}, which no ddtree drafter "
                         f"serves; registered: {', '.join(registered_architectures())}. Pass a drafter checkpoint, or "
                         "register a class with ddtree.drafters.registry.register_drafter")
    if "dflash_config" not in config:
        raise ValueError(f"{where}: this is not a DFlash drafter config (it has no dflash_config and names no "
                         f"architecture; registered: {', '.join(registered_architectures())}). Pass the drafter's "
                         "directory, not the target's")
    return DFlashDrafter


def drafter_class_for_model(model: object) -> type | None:
    """The registered class whose raw model ``model`` is (a ``DFlashDraftModel`` -> ``DFlashDrafter``), else None."""
    # register_drafter checked each class for model_class (duck-typed classes, so the dict holds plain types)
    return next((cls for cls in _DRAFTERS.values()
                 if isinstance(model, cls.model_class)), None)  # type: ignore[attr-defined]
