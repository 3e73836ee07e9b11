"""The residual-connection plugin contract and the registry that names strategies."""

import contextlib
import copy
import importlib
import importlib.metadata
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor, nn

from mhar_lightning.config import ModelConfig

Stream = tuple[Tensor, ...]
"""Per-forward residual state: the tensors that cross each transformer block."""

ENTRY_POINT_GROUP = "mhar_lightning.residuals"
"""Python entry-point group through which installed packages register strategies by name."""


def sublayer_label(l: int, n_sublayers: int) -> str:
    """`attn i` / `mlp i` for sublayer `l` of transformer block i; `final` for the final read (l = L)."""
    if l == n_sublayers:
        return "final"
    return f"{'attn' if l % 2 == 0 else 'mlp'} {l // 2}"


@dataclass
class SiteCapture:
    """What routing sites read during captured forwards, keyed by sublayer (`n_sublayers` is the final read).

    `weights[l]`: read weights per head over the site's sources, [heads, sources], averaged over tokens.
    `keys[l]`, `queries[l]`: for a query-based strategy, what it matched its queries against ([sources, d],
    averaged over tokens) and its query ([d]).
    `scalars[l]`: named extra values of the site (a gate, a write weight), averaged over tokens.
    """

    weights: dict[int, Tensor] = field(default_factory=dict)
    keys: dict[int, Tensor] = field(default_factory=dict)
    queries: dict[int, Tensor] = field(default_factory=dict)
    scalars: dict[int, dict[str, Tensor]] = field(default_factory=dict)


def token_mean(t: Tensor, dims: int) -> Tensor:
    """`t` averaged over every leading dimension but its last `dims`, as fp32 on the CPU."""
    return t.detach().float().reshape(-1, *t.shape[t.dim() - dims :]).mean(0).cpu()


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

    A strategy whose sites weigh sources describes them for the probe, its callbacks and `mhar inspect`:
    `source_labels` names the sources, `site_sources` says which of them each site reads, and while
    `self.capture` is set (by `capture_sites`) its reads call `record` with their weights and any scalars to log.
    `weights_are_distributions` says whether those weights are probabilities over the sources (a softmax), which
    their entropy needs; learned mixing weights of any sign are not.

    `no_grad_inductor_options` are Inductor options that the compiled no-grad graphs of its blocks (validation) add
    to the kit's, for a strategy whose evaluation meets a compiler fault; its training graphs keep the kit's options.
    """

    sites: range
    n_sublayers: int
    capture: SiteCapture | None = None
    weights_are_distributions: bool = True
    no_grad_inductor_options: Mapping[str, Any] = MappingProxyType({})

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

    def source_labels(self) -> tuple[str, ...]:
        """Names of all the sources that sites of this model read (one shared axis); empty: nothing to probe."""
        return ()

    def site_sources(self, l: int) -> tuple[int, ...]:
        """Indices into `source_labels()` of what sublayer `l` reads, in the order of its recorded weights."""
        return tuple(range(len(self.source_labels())))

    def record(
        self, l: int, weights: Tensor, keys: Tensor | None = None, query: Tensor | None = None, **scalars: Tensor
    ) -> None:
        """Hand the attached capture sublayer `l`'s read weights [..., heads, sources] and named scalars [...]
        (leading dimensions are tokens; they are averaged away); a query-based strategy adds its keys
        [..., sources, d] and query (see `query_weights`).

        Call it only while `self.capture is not None`, so that capturing costs nothing otherwise."""
        self.capture.weights[l] = token_mean(weights, 2)
        if keys is not None and query is not None:
            self.capture.keys[l] = token_mean(keys, 2)
            self.capture.queries[l] = token_mean(query, 1)
        if scalars:
            self.capture.scalars[l] = {name: token_mean(value, 0) for name, value in scalars.items()}

    def query_weights(self, query: Tensor, keys: Tensor) -> Tensor:
        """[heads, sources]: the weights `query` gives sources with `keys` [sources, d] (query-based strategies)."""
        raise NotImplementedError(f"{type(self).__qualname__} records no queries")

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


class Registry(Mapping[str, type[Residual]]):
    """Strategy names: the kit's and those registered with `@register_residual`, plus every name that an installed
    package declares in the `mhar_lightning.residuals` entry-point group (imported only when looked up)."""

    def __init__(self) -> None:
        self.classes: dict[str, type[Residual]] = {}

    def add(self, name: str, cls: type[Residual]) -> None:
        if name in self.classes and self.classes[name] is not cls:
            raise ValueError(f"residual strategy {name!r} is already registered by {self.classes[name].__qualname__}")
        self.classes[name] = cls

    @staticmethod
    def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}

    def __getitem__(self, name: str) -> type[Residual]:
        if name in self.classes:
            return self.classes[name]
        entry_point = self.entry_points().get(name)
        if entry_point is None:
            raise KeyError(name)
        package = entry_point.dist.name if entry_point.dist else "its package"
        try:
            cls = entry_point.load()
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"residual strategy {name!r} ({entry_point.value}, from {package}) cannot be imported: {error};"
                f" reinstall {package}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Residual)):
            raise ValueError(f"residual strategy {name!r} ({entry_point.value}) is not a Residual subclass")
        self.add(name, cls)
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.classes.keys() | self.entry_points().keys()))

    def __len__(self) -> int:
        return len(self.classes.keys() | self.entry_points().keys())


RESIDUALS = Registry()


def register_residual(name: str):
    """Class decorator: make a strategy available by `name` in configs (`residual: name`).

    An installed package registers its strategies through the `mhar_lightning.residuals` entry-point group
    instead, so that the name works before anything imports the package."""

    def add(cls: type[Residual]) -> type[Residual]:
        RESIDUALS.add(name, cls)
        return cls

    return add


def residual_name(template: Residual) -> str:
    """The name a user knows `template`'s strategy by: its registered name, else its class path."""
    names = [name for name, cls in RESIDUALS.classes.items() if cls is type(template)]
    return names[0] if names else template.spec()["class_path"]


def import_class(class_path: str) -> type[Residual]:
    """The `Residual` subclass named by a dotted `class_path`; one line naming the fix when it cannot be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"residual class_path {class_path!r} cannot be imported ({error}): install the package that provides it"
            " or add its directory to PYTHONPATH"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Residual)):
        raise ValueError(f"{class_path} is not a subclass of mhar_lightning.residual.Residual")
    return cls


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
        cls = import_class(spec["class_path"])
        return cls(**{**spec.get("init_args", {}), **kwargs})
    if spec not in RESIDUALS:
        raise ValueError(f"unknown residual strategy {spec!r}; known: {', '.join(RESIDUALS)}")
    return RESIDUALS[spec](**kwargs)


@contextlib.contextmanager
def capture_sites(model: nn.Module) -> Iterator[SiteCapture]:
    """Record what every routing site of `model` reads (see `Residual.record`) while the context is open."""
    captured = SiteCapture()
    routers = [m for m in model.modules() if isinstance(m, Residual)]
    for router in routers:
        router.capture = captured
    try:
        yield captured
    finally:
        for router in routers:
            router.capture = None
