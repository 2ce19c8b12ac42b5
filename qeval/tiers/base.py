"""What a tier method implements: its recipe schema (a :class:`TierSpec` subclass), the
disk its artifact takes, preparing the artifact, opening it on an engine."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..bounded import checked_name
from ..engines import engines_for_format, get_engine
from ..engines.base import EngineOptions
from ..engines.servers import EndpointSpec, ServeSpec
from ..model_config import STRUCTURES
from ..results import RunLayout
from ..weight_formats import Dense


class TierSpec(BaseModel):
    """The recipe fields every tier has; a method's spec adds ``method: Literal[...]`` and
    its own parameters (the recipe's ``Tier`` union is built from them).

    Attributes:
        name: the tier's name (a file name in the run folder: letters, digits, ``-_.+``, at
            most :data:`qeval.bounded.MAX_NAME_LEN` characters, the whole string matched).
        kv_cache: ``model`` (the engine's default KV cache dtype) or ``int8``.
        quality_engine: per-tier override of ``quality.engine``.
        engine: the engine that serves the tier (default: the method's).
        endpoint: with ``engine: openai``, a server that already runs
            (:class:`~qeval.engines.servers.EndpointSpec`: ``url``, ``api_key_env``).
        serve: with ``engine: openai``, the server qeval starts on the tier's artifact
            (:data:`~qeval.engines.servers.ServeSpec`: a registered managed server's
            options, ``kind: llama-server | vllm | sglang``).
        prompt_mode: with ``engine: openai``, how prompts go to the server
            (:data:`~qeval.engines.openai.PROMPT_MODES`): ``tokens`` (token ids to
            ``/v1/completions``; llama-server, vLLM, SGLang), ``text`` (the prompt as text
            to ``/v1/completions``: Ollama, LM Studio, hosted completions) or ``chat``
            (the suite's messages to ``/v1/chat/completions``; the server's template);
            None: ``tokens``.
    """
    # strict, as the recipe's sections (qeval.recipe._Strict): "4" is not an int, 1 is not a
    # boolean, no NaN or infinity
    model_config = ConfigDict(extra="forbid", frozen=False, strict=True, allow_inf_nan=False)
    #: Fields that are engine settings, not part of the artifact: two tiers differing only in
    #: them share one artifact (a GGUF file with and without the int8 KV cache).
    engine_fields: ClassVar[tuple[str, ...]] = ("name", "kv_cache", "quality_engine", "engine", "endpoint", "serve",
                                                "prompt_mode")
    name: str
    kv_cache: Literal["model", "int8"] = Field(
        "model", description="'model': the engine's default KV cache dtype; 'int8': 8-bit KV cache")
    quality_engine: Literal["auto", "real", "dequantized"] | None = None
    engine: str | None = Field(None, description="the engine that serves the tier (hf: transformers, "
                               "llamacpp: llama.cpp, openai: an OpenAI-compatible server); default: the method's own")
    endpoint: EndpointSpec | None = Field(None, description="engine openai: a running server {url, api_key_env}")
    serve: ServeSpec | None = Field(None, description="engine openai: the server qeval starts on the artifact "
                                    "({kind: llama-server | vllm | sglang, ...}, or the kind alone)")
    prompt_mode: Literal["tokens", "text", "chat"] | None = Field(
        None, description="engine openai: tokens (token ids to /v1/completions), text (the prompt as text to "
        "/v1/completions: Ollama, LM Studio, hosted APIs) or chat (messages to /v1/chat/completions, the server's "
        "template; no fidelity); default tokens")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return checked_name(v, "tier name")

    @model_validator(mode="after")
    def _server_settings(self) -> "TierSpec":
        if self.endpoint is not None and self.serve is not None:
            raise ValueError("set one of endpoint: (a running server) and serve: (qeval starts one), not both")
        if (self.endpoint is not None or self.serve is not None) and self.engine != "openai":
            raise ValueError("endpoint: and serve: need engine: openai")
        if self.prompt_mode is not None and self.engine != "openai":
            raise ValueError("prompt_mode needs engine: openai (it says how prompts go to the server)")
        if self.engine == "openai" and self.endpoint is None and self.serve is None:
            raise ValueError("engine openai needs endpoint: {url: ..., api_key_env: ...} or serve: "
                             "llama-server | vllm | sglang")
        return self


class HfTierSpec(TierSpec):
    """A tier the transformers engine serves by default: ``decode`` picks its timed decode
    loop (:mod:`qeval.engines.hf`): ``eager`` (dynamic cache), ``static`` (StaticCache +
    torch.compile, CUDA graphs on CUDA) or ``auto`` (static on CUDA with the model's KV
    cache, else eager). ``kv_residual_tokens`` sets the int8 KV cache's full-precision
    residual (transformers ``QuantizedCache(residual_length=...)``, default 128): the newest
    tokens kept unquantized, and the period at which the cache re-quantizes."""
    engine_fields: ClassVar[tuple[str, ...]] = TierSpec.engine_fields + ("decode", "kv_residual_tokens")
    decode: Literal["auto", "eager", "static"] = Field(
        "auto", description="timed decode loop: eager | static (StaticCache + torch.compile) | auto")
    kv_residual_tokens: int | None = Field(
        None, gt=0, le=65536, description="kv_cache int8 on transformers: newest tokens kept in full precision, "
        "and the re-quantization period (QuantizedCache residual_length; default 128)")

    @model_validator(mode="after")
    def _static_needs_model_cache(self) -> "HfTierSpec":
        if self.decode == "static" and self.kv_cache != "model":
            raise ValueError("decode: static needs kv_cache: model (the int8 QuantizedCache cannot be compiled); "
                             "use decode: eager or auto")
        if self.kv_residual_tokens is not None and self.kv_cache != "int8":
            raise ValueError("kv_residual_tokens sets the int8 KV cache's residual: it needs kv_cache: int8")
        return self


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
        run_dir: the run folder (served tiers log their server in its ``logs/``).
        depth_text: the recipe's depth text file and ``depths`` its speed depths (a served
            tier checks the server's token counts on them).
        served_tokens: what a served tier's server must hold (tokens): ``sequence`` (the
            longest speed or quality sequence), ``load_sequence`` (one load request) and
            ``model`` (the model's context).
        prefix_caching: a served tier's server keeps a prefix cache across requests (the load
            stage of a recipe with a shared prefix reused: vLLM ``--enable-prefix-caching``).
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
    run_dir: str | None = None
    depth_text: str | None = None
    depths: tuple[int, ...] = ()
    served_tokens: dict = field(default_factory=dict)
    prefix_caching: bool = False


class TierMethod:
    """Base class of tier methods (one module each, registered by :mod:`qeval.tiers`).

    A method declares ``spec`` (its :class:`TierSpec` subclass: the recipe schema of its
    tiers), the disk its artifact takes for the pre-flight disk check
    (``bytes_per_parameter`` per source parameter, 0 for a tier served from the source, or
    :meth:`artifact_bytes_per_parameter` when it depends on the spec) and
    ``transient_dtype_copies`` (source-sized copies written while building, then deleted:
    gptqmodel's offload folder, GGUF's 16-bit intermediate). ``needs_calibration``:
    it reads the recipe's calibration text. ``has_dequantized``: :meth:`load_dequantized`
    gives a dense model for quality on slow kernels. ``prepare_alone``: its :meth:`prepare`
    scales with threads and slows far more beside other work than pairing gains, so the
    pipelined executor (:mod:`qeval.pipeline`) runs it alone with every core.

    ``needs_artifact`` False means the tier serves the source checkpoint as it is (bf16).
    ``artifact_format`` is the format of what :meth:`prepare` writes (``hf``: a
    transformers checkpoint folder; ``gguf``: a folder with one GGUF file; a method's own
    format such as ``gptqmodel`` when it loads the artifact itself, see :meth:`loaders`).
    ``default_engine`` serves the tier when the recipe names none (``engine:``); any
    engine whose ``formats`` include ``artifact_format`` can serve it too.
    """
    method: str = ""
    spec: ClassVar[type[TierSpec]]
    bytes_per_parameter: ClassVar[float | None] = None
    transient_dtype_copies: ClassVar[float] = 0.0
    artifact_format: str = "hf"
    default_engine: str = "hf"
    needs_artifact: bool = True
    needs_calibration: bool = False
    has_dequantized: bool = False
    prepare_alone: bool = False
    #: What the method does on each attention structure (:data:`qeval.model_config.STRUCTURES`,
    #: read from the model's config, never its name): ``runs`` (a test runs it on a tiny random
    #: model of that structure: tests/test_sliding_window.py, tests/test_tiers_quant.py),
    #: ``untested`` (attempted; a failure is that tier's own error, the gate's ERROR), or the
    #: reason it cannot run (refused at validate). README "Your own model" is generated from
    #: these (:func:`capability_table`).
    structures: ClassVar[dict[str, str]] = {"full": "runs", "sliding": "runs", "hybrid": "runs",
                                            "experts": "untested", "recurrent": "untested"}

    def capability(self, spec: Any, structure: Any) -> tuple[str, str]:
        """Whether tier ``spec`` runs on a model of ``structure``
        (:class:`qeval.model_config.Structure`): ``(verdict, text)`` with verdict ``runs``,
        ``untested`` or ``refused`` and the text validate prints. Beside :attr:`structures`,
        the transformers engine's int8 KV cache quantizes full-attention layers only
        (transformers' quantized cache layers do not slide; sliding layers keep the model's
        dtype within their window, :func:`qeval.model_config.int8_kv_layers`): a model with
        none is refused, a hybrid one says how many layers it quantizes."""
        worst, notes = "runs", []
        for kind in structure.kinds:
            say = self.structures.get(kind, "untested")
            if say not in ("runs", "untested"):
                return "refused", f"{self.method} on {kind} models: {say}"
            if say == "untested":
                worst = "untested"
                notes.append(f"{kind}: not yet run by qeval's tests")
        engine = getattr(spec, "engine", None) or self.default_engine
        if getattr(spec, "kv_cache", None) == "int8" and engine == "hf":
            if structure.full_layers == 0:
                return "refused", (f"kv_cache int8 on transformers quantizes full-attention layers only, and none "
                                   f"of this model's {structure.layers} layers is one ({structure.describe()}): "
                                   f"use the model's KV cache, or a gguf tier's q8_0 KV")
            if structure.sliding_layers:
                notes.append(f"int8 KV on {structure.full_layers} of {structure.layers} layers "
                             f"({structure.sliding_layers} sliding kept in the model's dtype, window {structure.window})")
        return worst, "; ".join(notes)

    # -- engines --------------------------------------------------------------------------
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The shim for tier-method plugins written before :meth:`open_engine` was renamed
        from ``load``: a subclass that defines ``load`` but no ``open_engine`` gets an
        ``open_engine`` that calls its ``load`` with a DeprecationWarning (its
        ``super().load(...)`` reaches :meth:`load` below, the parent's opening)."""
        super().__init_subclass__(**kwargs)
        legacy = cls.__dict__.get("load")
        if legacy is None or "open_engine" in cls.__dict__:
            return

        def open_engine(self: "TierMethod", spec: Any, ctx: TierContext, artifact: Path | None) -> Any:
            warnings.warn(f"tier method {cls.__module__}.{cls.__qualname__} defines load(spec, ctx, artifact): "
                          "define open_engine (renamed from load)", DeprecationWarning, stacklevel=2)
            return legacy(self, spec, ctx, artifact)

        open_engine._legacy_load = True  # type: ignore[attr-defined]
        cls.open_engine = open_engine  # type: ignore[method-assign]

    def load(self, spec: Any, ctx: TierContext, artifact: Path | None) -> Any:
        """Deprecated name of :meth:`open_engine`: an old caller's ``method.load(...)`` opens
        as :meth:`open_engine` does, with a DeprecationWarning; from an old plugin's ``load``
        (``super().load(...)``, already warned of), the ``open_engine`` of the classes above it."""
        mro = type(self).__mro__
        shimmed = [i for i, c in enumerate(mro) if getattr(c.__dict__.get("open_engine"), "_legacy_load", False)]
        if not shimmed:
            warnings.warn("TierMethod.load is renamed open_engine (\"load\" names the load test)",
                          DeprecationWarning, stacklevel=2)
        start = shimmed[-1] + 1 if shimmed else 0
        opener = next(c.__dict__["open_engine"] for c in mro[start:] if "open_engine" in c.__dict__)
        return opener(self, spec, ctx, artifact)

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
        """How :meth:`open_engine` asks the engine to open the artifact."""
        return EngineOptions(device=ctx.device, dtype=ctx.dtype, threads=ctx.threads, kv_cache=spec.kv_cache,
                             flash_attn=getattr(spec, "flash_attn", None), trust_remote_code=ctx.trust_remote_code,
                             backend=self.backend_label(spec, ctx), decode=getattr(spec, "decode", "auto"),
                             kv_residual=getattr(spec, "kv_residual_tokens", None),
                             server=server_options(spec, ctx))

    def open_engine(self, spec: Any, ctx: TierContext, artifact: Path | None) -> Any:
        """Open the artifact (or the source when ``needs_artifact`` is False) on the tier's
        engine: a loader of the method's own (:meth:`loaders`), else the engine's ``open``
        with :attr:`artifact_format`. (Named ``load`` before issue 45: "load" now names only
        the load test; a plugin that still defines ``load`` keeps working, see
        :meth:`__init_subclass__`.)

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

    #: qeval modules beside the method's own classes whose code builds its artifact (a
    #: converter, a quantize helper): their sources join :meth:`code_sha256`.
    builder_modules: ClassVar[tuple[str, ...]] = ()

    def code_sha256(self) -> str:
        """SHA-256 (16 hex digits) over the source files of the code that builds this
        method's artifact: every qeval module defining a class of the method's MRO (its own
        module, the base) and :attr:`builder_modules`. It joins the artifact's cache key
        (:meth:`artifact_fields`), so an upgrade that changes a quantizer rebuilds its
        artifacts instead of serving what the old code wrote; a change elsewhere in qeval
        does not."""
        import hashlib  # start-up time: only the prepare stage keys artifacts
        import importlib  # start-up time: as hashlib above
        import sys  # start-up time: as hashlib above
        names = [c.__module__ for c in type(self).__mro__ if c.__module__.startswith("qeval.")]
        names += list(self.builder_modules)
        h = hashlib.sha256()
        for name in sorted(set(names)):
            mod = sys.modules.get(name) or importlib.import_module(name)
            path = Path(getattr(mod, "__file__", "") or "")
            h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
        return h.hexdigest()[:16]

    def artifact_fields(self, spec: Any, ctx: TierContext) -> dict:
        """:meth:`key_fields` and ``code``: :meth:`code_sha256` (what the prepare stage keys
        the artifact by)."""
        return {**self.key_fields(spec, ctx), "code": self.code_sha256()}

    def check(self, spec: Any, ctx: TierContext) -> dict:
        """Validate the spec against the model before any work; returns resolved
        parameters (e.g. the group size ``auto`` picked). Raises QevalInputError."""
        return {}

    def artifact_bytes_per_parameter(self, spec: Any) -> float:
        """Bytes per source parameter this tier's artifact keeps in the cache (default
        :attr:`bytes_per_parameter`).

        Raises:
            NotImplementedError: the method declares neither (no silent default).
        """
        if self.bytes_per_parameter is None:
            raise NotImplementedError(f"tier method {self.method!r} declares no bytes_per_parameter")
        return float(self.bytes_per_parameter)

    def check_at_validate(self, checkpoint: Path | None) -> bool:
        """Whether ``qeval validate`` can run :meth:`check` now, before any model load
        (``checkpoint``: the source's config folder when it is on this machine)."""
        return False

    def prepare(self, spec: Any, ctx: TierContext, out_dir: Path) -> dict:
        """Build the artifact into ``out_dir``; return quantization info
        (``quant_seconds``, ``quant_peak_bytes``, ``group_size``, ``backend``...)."""
        raise NotImplementedError

    def prepare_runtime(self, spec: Any, ctx: TierContext, artifact: Path | None = None) -> dict:
        """Get the tier's runtime ready without loading the model: import and warm the
        libraries its engine runs on, and build kernels a library compiles at first use.
        The measure stage calls it before its CPU memory baseline and its timed open, so the
        tier's peaks count the model, its KV cache and its working buffers, not the import
        of its runtime (reported on its own as ``memory.runtime_bytes``), and
        ``open_seconds`` is opening the model only.

        The default warms the tier's engine (its ``warm_runtime``:
        :meth:`qeval.engines.hf.HFEngine.warm_runtime`,
        :meth:`qeval.engines.llamacpp.LlamaCppEngine.warm_runtime`); methods whose weights
        need a library of their own (gptqmodel, torchao) add it. Returns what was done
        (``{"libraries": [...]}``, ``kernel_build_seconds``...).

        Raises:
            TierUnavailable: the runtime cannot work on this machine (one line: what to install).
        """
        return get_engine(self.engine_name(spec)).warm_runtime(ctx.source_path, self.engine_options(spec, ctx))

    def load_dequantized(self, spec: Any, ctx: TierContext, artifact: Path | None) -> Any | None:
        """The tier's weights dequantized into a dense transformers model (for quality on
        slow kernels); None when the method has no such path."""
        return None

    def quant_info(self, spec: Any, ctx: TierContext, artifact: Path | None, engine: Any) -> dict:
        """Stored bytes and bits per weight of the loaded tier."""
        return {}

    def stored_info(self, spec: Any, ctx: TierContext, artifact: Path | None) -> dict:
        """Stored bytes and bits per weight from the files alone, for a tier whose model
        lives in another process (a served tier): the tensor bytes of the artifact's
        safetensors as stored (packed integers as stored), over the source checkpoint's
        parameter count (:func:`safetensors_sizes`). GGUF reads its file instead."""
        folder = Path(artifact) if (self.needs_artifact and artifact) else Path(ctx.source_path)
        stored, _ = safetensors_sizes(folder)
        _, params = safetensors_sizes(Path(ctx.source_path))
        return {"stored_bytes": stored, "parameters": params, "bits_per_weight": 8 * stored / params if params else None,
                "bits_per_weight_quantized": None, "group_size": getattr(spec, "group_size", None),
                "stored_from": "files"}

    def weight_format(self, spec: Any, shape: Any, dtype: str = "bfloat16") -> Any:
        """The :class:`qeval.weight_formats.WeightFormat` this tier's artifact stores, for
        estimates from a config (``qeval plan``) before anything is built. ``shape`` is the
        model's :class:`qeval.model_config.ModelShape`; ``dtype`` the source dtype.
        Default: the source checkpoint as it is (every tensor in ``dtype``).

        Raises:
            QevalInputError: the spec cannot be applied to this model (e.g. a group size).
        """
        return Dense(dtype)


def server_options(spec: Any, ctx: TierContext) -> dict | None:
    """:attr:`EngineOptions.server` of a tier with ``endpoint:`` or ``serve:`` (None
    otherwise): its settings, the server log ``logs/<tier>.server.log`` of the run folder,
    the source tokenizer, the depth text and depths (the engine checks the server's token
    counts on those prompts with its own tokenizer), the sequence lengths its server must
    hold (:attr:`TierContext.served_tokens`) and the tier's ``prompt_mode``."""
    if getattr(spec, "endpoint", None) is None and getattr(spec, "serve", None) is None:
        return None
    log = str(RunLayout(ctx.run_dir).log(spec.name, "server")) if ctx.run_dir else None
    return {"endpoint": spec.endpoint.model_dump() if spec.endpoint else None,
            "serve": spec.serve.model_dump() if spec.serve else None, "tier": spec.name,
            "log": log, "tokenizer": ctx.source_path, "depth_text": ctx.depth_text, "depths": list(ctx.depths),
            "tokens": dict(ctx.served_tokens), "prefix_caching": bool(ctx.prefix_caching),
            "prompt_mode": getattr(spec, "prompt_mode", None)}


#: Bytes per element of the safetensors dtypes (the format's own names).
_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_sizes(folder: Path) -> tuple[int, int]:
    """``(tensor bytes, tensor elements)`` over every ``*.safetensors`` file of ``folder``,
    from the files' headers (the safetensors library's ``safe_open``; nothing loaded)."""
    from safetensors import safe_open  # start-up time: reads headers only when a served tier needs them
    nbytes = nelem = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= int(d)
                nelem += n
                nbytes += n * _ST_BYTES.get(sl.get_dtype(), 4)
    return nbytes, nelem


def capability_table(methods: dict[str, "TierMethod"], kinds: tuple[str, ...] | None = None) -> str:
    """The Markdown table of tier method x attention structure from the methods'
    :attr:`TierMethod.structures` (README "Your own model"; a test checks the README holds
    exactly this table), with the transformers int8 KV cache's own row."""
    kinds = kinds or STRUCTURES
    rows = ["| tier method | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name in sorted(methods):
        m = methods[name]
        rows.append(f"| {name} | " + " | ".join(m.structures.get(k, "untested") for k in kinds) + " |")
    kv = {"full": "runs", "sliding": "refused (no full-attention layer)",
          "hybrid": "runs on the full-attention layers", "experts": "untested", "recurrent": "untested"}
    rows.append("| `kv_cache: int8` (transformers) | " + " | ".join(kv.get(k, "untested") for k in kinds) + " |")
    return "\n".join(rows)
