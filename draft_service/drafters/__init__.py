"""Drafters: every module here registers its drafter on import."""
import importlib
import pkgutil

from draft_service.drafters.base import REGISTRY, Drafter, register

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTRY", "Drafter", "register"]
