"""Model operators (matmul, MoE, attention, SDDMM, the training linear, RGCN, GraphSAGE, the
sparse-channel convolution), each declared as an :class:`pitgen.opspec.OpSpec`."""
from __future__ import annotations

from typing import Any, Callable, Mapping


def lazy_torch_classes(module: str, names: tuple[str, ...],
                       build: Callable[[], Mapping[str, type]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving the torch classes ``names``, which ``build()`` makes on
    first access: the module itself imports without torch."""
    built: dict[str, type] = {}

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if not built:
            built.update(build())
        return built[name]
    return __getattr__
