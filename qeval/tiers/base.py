"""What a tier method implements: prepare an artifact, load it on an engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..engines import engines_for_format, get_engine
from ..engines.base import EngineOptions
from ..weight_formats import Dense


@dataclass
class TierContext:
    """Everything a tier method needs besides its spec.

    Attributes:
        source_path: the BF16 source checkpoint folder.
        source_sha256: its hash (artifact cache key root).
        device: "cpu" or "cuda" (already resolved from ``auto``).
        dtype: the source dtype name ("bfloat16").
        threads: torch threads pinned for this process.
        calibration: callable returning calibration texts (list[str]) for the recipe's
            sample count; only GPTQ/AWQ call it.
        calibration_fields: what identifies the calibration set (path hash, samples, seq_len).
        log: a one-line logger.
        trust_remote_code: from the recipe (default False).
    """
    source_path: str
    source_sha256: str
    device: str
    dtype: str = "bfloat16"
    threads: int = 1
    calibration: Callable[[], list[str]] | None = None
    calibration_fields: dict = field(default_factory=dict)
    log: Callable[[str], None] = print
    trust_remote_code: bool = False


class TierMethod:
    """Base class of tier methods.

    ``needs_artifact`` False means the tier serves the source checkpoint as it is (bf16).
    ``artifact_format`` is the format of what :meth:`prepare` writes (``hf``: a
    transformers checkpoint folder; ``gguf``: a folder with one GGUF file; a method's own
    format such as ``gptqmodel`` when it loads the artifact itself, see :meth:`loaders`).
    ``default_engine`` serves the tier when the recipe names none (``engine:``); any
    engine whose ``formats`` include ``artifact_format`` can serve it too.
    """
    method: str = ""
    artifact_format: str = "hf"
    default_engine: str = "hf"
    needs_artifact: bool = True

    # -- engines --------------------------------------------------------------------------
    def loaders(self) -> dict[str, Callable[[Any, TierContext, Path | None], Any]]:
        """Engine name -> a loader of this method's own ``(spec, ctx, artifact) -> Engine``,
        for an artifact an engine cannot open by format alone (default: none)."""
        return {}

    def engines(self) -> tuple[str, ...]:
        """Engines that can serve this method's tiers, the default first."""
        names = list(self.loaders()) + list(engines_for_format(self.artifact_format))
        return tuple(dict.fromkeys([n for n in [self.default_engine] if n in names] + names))

    def engine_name(self, spec: Any) -> str:
        """The engine a tier runs on: the recipe's ``engine:`` or :attr:`default_engine`."""
        return getattr(spec, "engine", None) or self.default_engine

    def backend_label(self, spec: Any, ctx: TierContext) -> str | None:
        """A label for the kernel that runs the weights (None: the engine's own)."""
        return None

    def engine_options(self, spec: Any, ctx: TierContext) -> EngineOptions:
        """How :meth:`load` asks the engine to open the artifact."""
        return EngineOptions(device=ctx.device, dtype=ctx.dtype, threads=ctx.threads, kv_cache=spec.kv_cache,
                             flash_attn=getattr(spec, "flash_attn", None), trust_remote_code=ctx.trust_remote_code,
                             backend=self.backend_label(spec, ctx), decode=getattr(spec, "decode", "auto"))

    def load(self, spec: Any, ctx: TierContext, artifact: Path | None) -> Any:
        """Load the artifact (or the source when ``needs_artifact`` is False) on the tier's
        engine: a loader of the method's own (:meth:`loaders`), else the engine's ``open``
        with :attr:`artifact_format`.

        Raises:
            ValueError: a method that needs an artifact got none, or an engine that cannot
                open this method's artifacts.
        """
        name = self.engine_name(spec)
        own = self.loaders().get(name)
        if own is not None:
            return own(spec, ctx, artifact)
        if name not in engines_for_format(self.artifact_format):
            raise ValueError(f"engine {name!r} cannot serve {self.method} tiers (engines: {', '.join(self.engines())})")
        if self.needs_artifact and artifact is None:
            raise ValueError(f"{self.method} needs its artifact")
        path = Path(artifact) if self.needs_artifact else Path(ctx.source_path)
        return get_engine(name).open(self.artifact_format, path, self.engine_options(spec, ctx))

    def key_fields(self, spec: Any, ctx: TierContext) -> dict:
        """The inputs that identify this tier's artifact (hashed into the cache key)."""
        return {"method": self.method, "source_sha256": ctx.source_sha256}

    def check(self, spec: Any, ctx: TierContext) -> dict:
        """Validate the spec against the model before any work; returns resolved
        parameters (e.g. the group size ``auto`` picked). Raises QevalInputError."""
        return {}

    def prepare(self, spec: Any, ctx: TierContext, out_dir: Path) -> dict:
        """Build the artifact into ``out_dir``; return quantization info
        (``quant_seconds``, ``quant_peak_bytes``, ``group_size``, ``backend``...)."""
        raise NotImplementedError

    def prepare_runtime(self, spec: Any, ctx: TierContext, artifact: Path | None = None) -> dict:
        """Before the timed load in the measure stage: get the runtime ready (build kernels
        the library compiles at first use), so ``load_seconds`` is loading only. Returns
        what was done (``kernel_build_seconds``...).

        Raises:
            TierUnavailable: the runtime cannot work on this machine (one line: what to install).
        """
        return {}

    def load_dequantized(self, spec: Any, ctx: TierContext, artifact: Path | None) -> Any | None:
        """The tier's weights dequantized into a dense transformers model (for quality on
        slow kernels); None when the method has no such path."""
        return None

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:
        """Stored bytes and bits per weight of the loaded tier."""
        return {}

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> Any:
        """The :class:`qeval.weight_formats.WeightFormat` this tier's artifact stores, for
        estimates from a config (``qeval plan``) before anything is built. ``shape`` is the
        model's :class:`qeval.model_config.ModelShape`; ``dtype`` the source dtype.
        Default: the source checkpoint as it is (every tensor in ``dtype``).

        Raises:
            QevalInputError: the spec cannot be applied to this model (e.g. a group size).
        """
        return Dense(dtype)
