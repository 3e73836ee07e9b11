"""The residual-connection plugin contract and the registry that names strategies."""

import copy
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from mhar_lightning.config import ModelConfig

Stream = tuple[Tensor, ...]
"""Per-forward residual state: the tensors that cross each transformer block."""


class Residual(nn.Module, ABC):
    """A residual strategy: how sublayer inputs are formed from the embedding and earlier outputs.

    An instance built from YAML or by name is a *template* holding only hyperparameters. The decoder
    calls `spawn` once per transformer block (sites `2i, 2i+1`) and once for the final read (site
    `L = 2 * n_layers`), so routing parameters live, shard and checkpoint with their block. Per forward:

        stream = final.start(embedding)
        for each transformer block (sublayers l = 2i, 2i + 1):
            stream = router.enter(stream, l)
            for l in (2i, 2i + 1):  y = f_l(router.read_normed(stream, l, norm_l));  stream = router.write(stream, l, y)
        h = final.finish(stream)

    The stream is a tuple of tensors, so it can cross activation-checkpointed and FSDP-wrapped blocks.
    Subclasses implement `build` (create parameters), `read`, `write` and, where needed, `start`, `enter`,
    `finish` and `reset_parameters`.
    """

    sites: range
    n_sublayers: int

    def spawn(self, config: ModelConfig, sites: range) -> "Residual":
        """A fresh router for routing sites `sites` (sublayer indices; `config.n_sublayers` is the final read)."""
        router = copy.deepcopy(self)
        router.sites = sites
        router.n_sublayers = config.n_sublayers
        router.build(config)
        router.reset_parameters()
        return router

    def build(self, config: ModelConfig) -> None:
        """Create this router's parameters for `self.sites` (none by default)."""

    def reset_parameters(self) -> None:
        """(Re)initialise parameters; called after `build` and after materialising from the meta device."""

    def start(self, embedding: Tensor) -> Stream:
        """The stream before sublayer 0 (called on the final router)."""
        return (embedding,)

    def enter(self, stream: Stream, l: int) -> Stream:
        """The stream that transformer block sublayers `l` and `l + 1` read and write (unchanged by default).

        A strategy whose two reads do not depend on the first sublayer's output can compute both here at once.
        """
        return stream

    @abstractmethod
    def read(self, stream: Stream, l: int) -> Tensor:
        """The input of sublayer `l` (before its pre-norm)."""

    def read_normed(self, stream: Stream, l: int, norm: nn.Module) -> Tensor:
        """The pre-normed input of sublayer `l`, `norm(read(stream, l))`; a strategy may fuse the two."""
        return norm(self.read(stream, l))

    @abstractmethod
    def write(self, stream: Stream, l: int, y: Tensor) -> Stream:
        """The stream after sublayer `l` produced `y`."""

    def finish(self, stream: Stream) -> Tensor:
        """The final hidden state, before the final norm (called on the final router)."""
        return self.read(stream, self.n_sublayers)

    def site(self, l: int) -> int:
        """Row of this router's per-site parameters that belongs to sublayer `l`."""
        return l - self.sites.start

    def spec(self) -> dict[str, Any]:
        """`{"class_path", "init_args"}` that rebuilds this template (as in a jsonargparse config).

        Constructor arguments are read back from attributes of the same name, a convention subclasses keep.
        """
        params = inspect.signature(type(self).__init__).parameters.values()
        args = {p.name: getattr(self, p.name) for p in params if p.name != "self" and p.kind == p.POSITIONAL_OR_KEYWORD}
        return {"class_path": f"{type(self).__module__}.{type(self).__qualname__}", "init_args": args}

    def extra_repr(self) -> str:
        sites = getattr(self, "sites", None)
        return "" if sites is None else f"sites={sites.start}..{sites.stop - 1}"


RESIDUALS: dict[str, type[Residual]] = {}


def register_residual(name: str):
    """Class decorator: make a strategy available by `name` in configs (`residual: name`)."""

    def add(cls: type[Residual]) -> type[Residual]:
        if name in RESIDUALS and RESIDUALS[name] is not cls:
            raise ValueError(f"residual strategy {name!r} is already registered by {RESIDUALS[name].__qualname__}")
        RESIDUALS[name] = cls
        return cls

    return add


def make_residual(spec: "str | Residual | Mapping[str, Any]", **kwargs) -> Residual:
    """A strategy template from a registered name (plus its arguments), a `spec()` mapping or an instance."""
    if isinstance(spec, Residual):
        if kwargs:
            raise ValueError("pass arguments either to the Residual instance or with a name, not both")
        return spec
    if isinstance(spec, Mapping):
        if "class_path" not in spec:  # e.g. `--model.residual mhar --model.residual.init_args.heads 4` lost the name
            raise ValueError(
                f"residual {dict(spec)} names no strategy; give arguments with its class, e.g. "
                "residual: {class_path: mhar_lightning.residual.MHAR, init_args: {heads: 4}}"
            )
        module, _, name = spec["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, Residual)):
            raise TypeError(f"{spec['class_path']} is not a subclass of mhar_lightning.residual.Residual")
        return cls(**{**spec.get("init_args", {}), **kwargs})
    if spec not in RESIDUALS:
        raise ValueError(f"unknown residual strategy {spec!r}; known: {', '.join(sorted(RESIDUALS))}")
    return RESIDUALS[spec](**kwargs)
