"""The per-layer attention kinds (a Hugging Face config's ``layer_types``) of the families that mix them: Qwen3.5
(linear and full attention), Gemma 4 and gpt-oss (sliding and full)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["checked_layer_types"]


def checked_layer_types(layer_types: list[str], n_layers: int, allowed: tuple[str, ...],
                        default: Callable[[int], list[str]]) -> list[str]:
    """``layer_types``, or ``default(n_layers)`` when it is empty, once it names one of ``allowed`` for each of the
    ``n_layers`` layers; ValueError saying how many entries it has and which are unknown otherwise."""
    types = layer_types or default(n_layers)
    unknown = sorted(set(types) - set(allowed))
    if unknown or len(types) != n_layers:
        raise ValueError(f"layer_types must give one of {allowed} for each of the {n_layers} layers; got "
                         f"{len(types)} entries{f', unknown {unknown}' if unknown else ''}")
    return types
