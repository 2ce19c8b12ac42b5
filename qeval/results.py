"""The run format: every file of a run folder, its typed model, and the only code that
writes or reads it.

A run folder ``results/<recipe name>/<UTC timestamp>/`` holds (:class:`RunLayout` names
each path)::

    run.json                    RunInfo: resolved recipe, recipe_path and recipe_dir (where its
                                relative paths start), package versions, CPU/GPU, threads, git
                                commit, memory bandwidth (bytes/s), source checkpoint,
                                noise_floor (NoiseFloorSummary, below),
                                recipe_fingerprint (name + run-wide sections: --resume refuses
                                another recipe)
    tiers/<tier>.json           TierResult per tier, written atomically
    stages/_run.<stage>.json    run-wide stages: SourceStage, EnvStage, ReferenceStage, FloorStage
    stages/<tier>.<stage>.json  per-tier stages: PrepareStage, MeasureStage, LoadStage, QualityStage
                                (used for resume; merged into the tier result)
    stages/<scope>.<stage>.error.json   StageError of a failed stage: error (the one-line
                                reason), type, exception, message, where (file:line), condition
                                (an assertion's source), cause, traceback
    logs/<scope>.<stage>.log    each stage's stdout/stderr (the tail goes into a failure)
    logs/<tier>.server.log      a served tier's server (engine openai, serve:): its output, per start
    reference/segments.json     Segment list: BF16 reference answers (token ids, texts, checks)
    reference/logprobs.npy      their log-probabilities, float16 ``[answer tokens, vocab]``
    reference/long_context.json  with a long_context suite: the reference's answers and checks per
                                item and depth (prompt digest, where the document ends, offset)
    reference/long_context_logprobs.npy  log-probabilities of the last fidelity_tokens document
                                tokens of each item and depth, float16 ``[rows, vocab]``
    answers/<tier>.json         AnswerRow list: a tier's free-running answers with check results
                                and the prompt they answer (long-context answers carry their
                                ``depth`` and no prompt)
    review/<tier>.json          ReviewFile: per-item KLD and the positions of highest KLD
                                with both sides' top tokens (qeval.measure.review)
    lm_eval_tasks/<tier>/       resolved lm-eval task YAMLs
    table.md, table.csv         the tier table
    gate.json                   GateFile: the gate's verdicts, Pareto front, overload ladder
    report.html                 the report (analysis stage); junit.xml on request

Tier result (``tiers/<tier>.json``, :class:`TierResult`); every figure may be None when
not measured::

    {
      "tier": "gptq", "method": "gptq", "status": "ok" | "failed" | "not_built",
      "error": str | None,       # why it failed, one line: "ValueError: msg (at file:line)"
      "log_tail": str | None,    # the failed stage's last log lines
      "spec": {...tier spec from the recipe...},
      "engine": "hf" | "llamacpp", "backend": "gptqmodel:torch_int4", "device": "cpu",
      "threads": 1, "kv_cache": "model" | "int8",
      "flash_attn": bool,                  # a flash-attention kernel ran (llama.cpp: the setting, never auto)
      "kv_cache_dtype": "bfloat16" | "f16" | "q8_0" | "int8 (HQQ, group 64) + bfloat16 residual of 128 tokens",
      "attention": {"engine": "transformers" | "llama.cpp", "implementation": "sdpa" | "eager" | "flash" | "standard",
                    "kernels": {"prefill": [aten op names], "decode": [...]},   # transformers: seen by torch.profiler
                    "flash_attn": bool, "kv_cache_dtype": str},
      "open_seconds": float,               # seconds to open the model (older runs: "load_seconds")
      "decode_mode": "eager" | "static" | None,   # transformers tiers: the timed decode loop
      "decode_note": str | None,          # why a decode is slow or fell back (eager int8, compile failed,
                                          # a static step that broke into eager parts)
      "decode_check": {...} | None,       # static decode: what torch.compile did (fullgraph, graph_breaks,
                                          # break_reasons, graphs, recompiles, recompile_limit_hit,
                                          # compiles_in_timed_decode, cudagraph_replays(_per_step),
                                          # cudagraph_skips; qeval.engines.hf.decode_check_summary)
      "decode_tokens": int,               # tokens per timed decode (int8 KV: whole re-quantization periods)
      "dtype_emulated": "bfloat16" | "float16" | None,  # the dtype torch computed the tier in without
                                          # native instructions on the run's CPU (no AVX512_BF16 /
                                          # AMX-BF16; qeval.engines.ggml_cpu.torch_bf16_note); the
                                          # backend then says "(emulated on this CPU: no AVX512_BF16)"
      "sampling": {"decode": "argmax", "ignored_file_defaults": {...}},  # model defaults set aside
      "runtime": {"libraries": [str], "kernel_build_seconds": float, "selected_kernel": str},  # readied before
                                          # the memory baseline and the timed load (prepare_runtime)
      "artifact": {"key": str, "path": str, "reused": bool},
      "resolved": {...parameters the method resolved, e.g. the group size...},
      "quant": {"stored_bytes": int,            # all weights as stored (packed ints as stored)
                "bits_per_weight": float,       # 8 * stored_bytes / parameter count, whole model
                "bits_per_weight_quantized": float,  # over the quantized layers only
                "parameters": int, "group_size": int | None, "quant_seconds": float,
                "quant_peak_bytes": int, "fallback_tensors": int | None,
                ...method-specific extras (tensor_types, fallbacks, library, ...)},
      "memory": {"weight_bytes": int, "kv_bytes_per_token": float,
                 "peak_bytes": {"<depth>": int},   # the model's peak: CPU VmHWM less the baseline (the
                                                   # RSS with the tier's runtime imported and warmed, no
                                                   # model); CUDA torch.cuda.max_memory_allocated
                 "peak_breakdown": {"<depth>": {"weights_bytes": int, "kv_cache_bytes": int, "other_bytes": int}},
                 "kv_bytes_at_depth": {"<depth>": int},            # KV held for the tokens in the cache
                 "kv_allocated_bytes_at_depth": {"<depth>": int},  # KV allocated (llama.cpp: whole context)
                 "runtime_bytes": int,          # the process's resident size at the baseline
                 "runtime_engine_bytes": int,   # the part the tier's engine libraries added to it
                 "runtime_libraries": [str], "after_load_bytes": int, "baseline_bytes": int | None,
                 "reserved_unallocated_bytes": {"<depth>": int} | None,   # CUDA: reserved - allocated peak
                 "kind": "cpu_vmhwm" | "cuda_max_allocated" | "cuda_nvml_process" | "cuda_nvml_device"
                         | "server_rss_sampled"        # a served tier: its server's process tree RSS,
                                                       # sampled from before the server started
                         | "remote_endpoint_not_measured",
                 "nvml_peak_bytes": {"<depth>": int}, "nvml_after_load_bytes": int,
                 "nvml_kind": str,                # CUDA transformers tiers: NVML beside torch's counter,
                 "nvml": str},                    # or why it is absent
      "speed": {"<depth>": {"ttft_s": float, "prefill_tokens_per_s": float,
                            "decode_tokens_per_s": float, "roofline_tokens_per_s": float,
                            "roofline_share": float, "ttft_s_all": [..], "decode_tokens_per_s_all": [..],
                            "kv_pool": {"phase": str, "cleared_by": str,   # a served tier (KvPoolPhase)
                                        "before": {...}, "after": {...}, "empty_at_start": true} | None}},
      "quality": {"engine": "real" | "dequantized", "backend": str,
                  "fidelity": {"kld_mean", "kld_se", "kld_median", "kld_p99", "kld_max",
                               "same_top_rate", "ppl_ratio", "ppl_ratio_se", "delta_p_mean",
                               "delta_p_rms", "n_tokens", "kld_by_bucket": {"0-255": float, ...},
                               "kld_estimate": None | "top-<k> (remaining mass in one bucket; ...)",
                               "kld_topk": int | None},   # a server's top-k: KLD is that estimate
                  "behaviour": {"pass_rate", "pass_ci_low", "pass_ci_high", "n_checks",
                                "flips_pass_to_fail", "flips_fail_to_pass", "flip_rate",
                                "budget_exhausted_rate", "thinking_exhausted_rate",
                                "rouge_l", "chrf", "first_divergence_mean", "identical_rate",
                                "n_items", "n_answers",
                                "checks_timed_out"},   # regex checks not decided in bounded time
                  "fidelity_seconds": float, "behaviour_seconds": float,
                  "lm_eval": {"<task>": {"<metric>": float}} | {"skipped": str} | None,
                  "long_context": {              # LongContext; only with a long_context suite
                      "depths": {"<depth>": {"recall", "recall_ci_low", "recall_ci_high", "n_questions",
                                             "n_items", "by_kind": {"lookup": float, ...},
                                             "flips_pass_to_fail", "flips_fail_to_pass", "flip_rate",
                                             "budget_exhausted_rate",
                                             "fidelity": {"kld_mean", "kld_se", "kld_median", "kld_p99",
                                                          "kld_max", "same_top_rate", "ppl_ratio",
                                                          "ppl_ratio_se", "delta_p_mean", "delta_p_rms",
                                                          "n_tokens"} | None}},   # None for the reference
                      "fidelity_tokens": {"<suite>": int}, "seconds": float} | None,
                  "output_length": {             # OutputLength: new tokens per answered turn vs the
                      "n_answers", "n_unpaired",  # reference's on the same turns (qeval.measure.output_length)
                      "mean_new_tokens", "p95_new_tokens", "ref_mean_new_tokens", "ref_p95_new_tokens",
                      "mean_ratio", "p95_ratio", "budget_hit_rate", "ref_budget_hit_rate",
                      "thinking": {"n_answers", "mean_tokens", "ref_mean_tokens", "mean_ratio"} | None,
                      "by_kind": {"long_output": {...the same figures...}, "multi_turn": {...}}} | None,
                  "reference_dtype": "float32",   # what the reference pass computed in
                  "noise_floor": bool},           # True on the reference tier when its fidelity is the floor
      "load": {...} | None,      # LoadSection (qeval/results_load.py, every field documented there):
                                 # the closed loop's points per concurrency (users at SLO, batching
                                 # gain), the open loop's "arrivals" (rate points, knee, where a sweep
                                 # stopped), or {"error": str, "points": []} when the load stage failed;
                                 # None: no sweep (load.enabled false, or an engine that cannot batch)
      "timings": {"prepare_s": float, "measure_s": float, "load_s": float, "quality_s": float}
    }

Load figures: seconds, tokens/s, bytes; definitions in :mod:`qeval.measure.load`.

``run.json`` ``noise_floor`` (:class:`NoiseFloorSummary`, from the floor stage
:class:`FloorStage`; read by :mod:`qeval.analysis.floor`)::

    {"tier": "bf16", "served_dtype": "bfloat16", "reference_dtype": "float32", "measured": bool,
     "backend": str, "kld_mean": float, "kld_se": float, "kld_median", "kld_p99", "kld_max",
     "same_top_rate", "ppl_ratio", "n_tokens", "why": str | None}   # why: when not measured

Depth keys are strings in JSON (``"1024"``). The models forbid unknown fields where qeval
owns every key (a typo in a writer, or a reader expecting a key nothing writes, fails in
the tests); ``quant`` and the reference stage keep extra keys, because they carry
method- or engine-specific figures and come from cached artifact manifests. A file that
does not fit its model is bad input: :class:`~qeval.errors.QevalInputError` naming the
file and field.

Reading a run folder never trusts it: every file is read with the bounded JSON loader
(:mod:`qeval.bounded`: a regular file, size and depth bounded, UTF-8), ``run.json``'s
recorded tiers must have plain names (:func:`qeval.bounded.name_problem`), the load section
of a tier result is typed (:mod:`qeval.results_load`), and every path
:class:`RunLayout` builds from a name goes through :func:`qeval.bounded.safe_join`, so
nothing outside the run folder is read or written. Errors are one line naming the file and
field.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from .bounded import MAX_JSON_BYTES, load_json, name_problem, pydantic_message, safe_join
from .errors import QevalInputError
from .results_speculative import SpecAlone, SpecDivergence, SpecPair, SpecRow  # noqa: F401 - the run format's speculative file
from .results_load import (ArrivalsSection, Knee, LoadPoint, LoadSection, LoadSlo,  # noqa: F401 - the run
                           Percentiles, RatePoint)  # format's load models, re-exported with the rest

STATUS_OK = "ok"
STATUS_FAILED = "failed"
STATUS_NOT_BUILT = "not_built"
Status = Literal["ok", "failed", "not_built"]

RUN_SCOPE = "_run"  # the "tier" name of run-wide stages (source, env, reference)
TIER_STAGES = ("prepare", "measure", "load", "quality")


# ---- the layout ------------------------------------------------------------------------

class RunLayout:
    """Every path inside one run folder (see the module docstring for the tree).

    Args:
        root: the run folder (need not exist yet).
    """

    RUN_JSON = "run.json"
    #: Files a person or CI reads, rebuilt by ``qeval report`` (relative paths).
    OUTPUT_FILES = (RUN_JSON, "table.md", "table.csv", "gate.json", "report.html", "junit.xml")

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    # run-wide files
    @property
    def run_json(self) -> Path:
        return self.root / self.RUN_JSON

    @property
    def tiers_dir(self) -> Path:
        return self.root / "tiers"

    @property
    def stages_dir(self) -> Path:
        return self.root / "stages"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def reference_dir(self) -> Path:
        return self.root / "reference"

    @property
    def reference_segments(self) -> Path:
        return self.reference_dir / "segments.json"

    @property
    def reference_logprobs(self) -> Path:
        return self.reference_dir / "logprobs.npy"

    @property
    def reference_long_context(self) -> Path:
        """``reference/long_context.json`` (only with a long_context suite)."""
        return self.reference_dir / "long_context.json"

    @property
    def reference_long_context_logprobs(self) -> Path:
        """``reference/long_context_logprobs.npy`` (only with a long_context suite)."""
        return self.reference_dir / "long_context_logprobs.npy"

    @property
    def floor_review(self) -> Path:
        """``reference/floor_review.json``: the floor stage's review of the reference tier as
        served (per-item KLD, worst positions), which that tier's quality stage reuses."""
        return self.reference_dir / "floor_review.json"

    @property
    def table_md(self) -> Path:
        return self.root / "table.md"

    @property
    def table_csv(self) -> Path:
        return self.root / "table.csv"

    @property
    def gate_json(self) -> Path:
        return self.root / "gate.json"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def junit_xml(self) -> Path:
        return self.root / "junit.xml"

    # per tier (``scope`` is a tier name or RUN_SCOPE)
    # Every path built from a name (a tier name read from run.json) goes through
    # qeval.bounded.safe_join: one plain component that stays inside the folder.
    def _join(self, folder: Path, name: str) -> Path:
        return safe_join(folder, name, what="tier or stage name", file=self.run_json)

    def tier_result(self, tier: str) -> Path:
        """``tiers/<tier>.json``.

        Raises:
            QevalInputError: a name that would leave the run folder (``../x``, a symlink out).
        """
        return self._join(self.tiers_dir, f"{tier}.json")

    def stage(self, scope: str, stage: str, error: bool = False) -> Path:
        """``stages/<scope>.<stage>.json`` (or ``.error.json``); raises as :meth:`tier_result`."""
        return self._join(self.stages_dir, f"{scope}.{stage}{'.error' if error else ''}.json")

    def stage_partial(self, scope: str, stage: str) -> Path:
        """``stages/<scope>.<stage>.partial.json``: what a stage measured so far, written as
        each point completes (the load stage), kept when the stage is stopped."""
        return self._join(self.stages_dir, f"{scope}.{stage}.partial.json")

    def log(self, scope: str, stage: str) -> Path:
        """``logs/<scope>.<stage>.log``; raises as :meth:`tier_result`."""
        return self._join(self.logs_dir, f"{scope}.{stage}.log")

    def answers(self, tier: str) -> Path:
        """``answers/<tier>.json``; raises as :meth:`tier_result`."""
        return self._join(self.root / "answers", f"{tier}.json")

    def review(self, tier: str) -> Path:
        """``review/<tier>.json``; raises as :meth:`tier_result`."""
        return self._join(self.root / "review", f"{tier}.json")

    def lm_eval_tasks(self, tier: str) -> Path:
        """``lm_eval_tasks/<tier>/``; raises as :meth:`tier_result`."""
        return self._join(self.root / "lm_eval_tasks", tier)

    def is_run(self) -> bool:
        """Whether the folder holds a ``run.json``."""
        return self.run_json.is_file()

    # relative-path filters (copying through a store, see qeval.storage)
    def rel(self, path: Path) -> str:
        """``path`` relative to the run folder, ``/``-separated."""
        return Path(path).relative_to(self.root).as_posix()

    @staticmethod
    def tier_files(tier: str) -> Callable[[str], bool]:
        """Filter over relative paths: one tier's files (its stages, logs, answers, result)."""
        def inc(rel: str) -> bool:
            name = rel.split("/", 1)[-1]
            return rel in (f"tiers/{tier}.json", f"answers/{tier}.json", f"review/{tier}.json") or (
                rel.startswith(("stages/", "logs/")) and name.startswith(f"{tier}."))
        return inc

    @staticmethod
    def run_wide_file(rel: str) -> bool:
        """Filter over relative paths: what every tier task needs (run.json, run stages, reference)."""
        return rel == RunLayout.RUN_JSON or rel.startswith((f"stages/{RUN_SCOPE}.", "reference/"))

    @staticmethod
    def run_log(rel: str) -> bool:
        """Filter over relative paths: the run-wide stages' logs."""
        return rel.startswith(f"logs/{RUN_SCOPE}.")


# ---- models ------------------------------------------------------------------------------

class _Closed(BaseModel):
    """Every key is declared: an unknown one is an error."""
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """Declared keys typed; method-specific extra keys kept as they are."""
    model_config = ConfigDict(extra="allow")


def _open_seconds() -> Any:
    """The ``open_seconds`` field: seconds to open the tier's model
    (:meth:`qeval.tiers.base.TierMethod.open_engine`), written ``open_seconds``; run folders
    from before issue 45 have ``load_seconds``, read as it."""
    return Field(None, validation_alias=AliasChoices("open_seconds", "load_seconds"))


class _StageBase(_Closed):
    """What the worker adds to every stage file: seconds it took, host, recipe fingerprint."""
    stage_seconds: float | None = None
    host: str | None = None
    fingerprint: str | None = None


class SourceStage(_StageBase):
    """``stages/_run.source.json``: the resolved BF16 source checkpoint.

    ``max_context`` in tokens (``max_position_embeddings``); ``storage_rel`` its place in a
    storage URL when the recipe has one; ``gguf`` the GGUF file a GGUF source was expanded
    from and ``locate_seconds`` how long ``gguf_package: package:function`` took to name it."""
    path: str
    sha256: str
    origin: str
    converted: bool = False
    max_context: int | None = None
    storage_rel: str | None = None
    gguf: str | None = None  # the GGUF file the checkpoint was expanded from (model.source .gguf, gguf_package)
    locate_seconds: float | None = None  # gguf_package package:function: the call's seconds


class EnvStage(_StageBase):
    """``stages/_run.env.json``: device, GPU name and memory (bytes), memory bandwidth (bytes/s)."""
    device: str
    bandwidth_bytes_per_s: float | None = None
    gpu: str | None = None
    gpu_memory_bytes: int | None = None
    bandwidth_probe_bytes: int | None = None
    torch: str | None = None
    torch_threads: int | None = None
    # llama.cpp's CPU variant chosen by running the candidates (qeval.worker._llama_cpu_choice):
    # {"variant", "passed_over": ["zen4: SIGILL (illegal instruction) in the probe"], "probes": [...], ...}
    llama_cpu: dict[str, Any] | None = None


class ReferenceStage(_StageBase):
    """``stages/_run.reference.json``: the reference pass's manifest info (answer counts,
    seconds, stop ids) plus where its cached artifact is. Extra keys of older manifests are kept."""
    model_config = ConfigDict(extra="allow")
    segments: int | None = None
    answer_tokens: int | None = None
    vocab: int | None = None
    generate_seconds: float | None = None
    reference_seconds: float | None = None
    stop_ids: list[int] = Field(default_factory=list)
    backend: str | None = None
    long_context_segments: int | None = None
    long_context_seconds: float | None = None
    reused: bool | None = None
    artifact: str | None = None


class QuantInfo(_Open):
    """Storage figures of a tier's weights (bytes, bits per weight) and how they were made;
    method-specific extras (``tensor_types``, ``fallbacks``, ``library`` ...) are kept."""
    stored_bytes: int | None = None
    parameters: int | None = None
    bits_per_weight: float | None = None
    bits_per_weight_quantized: float | None = None
    group_size: int | None = None
    quant_seconds: float | None = None
    quant_peak_bytes: int | None = None
    fallback_tensors: int | None = None
    backend: str | None = None
    tensor_types: dict[str, int] | None = None  # GGUF: {llama.cpp type name: tensor count}
    fallbacks: dict[str, int] | None = None     # GGUF: {"nominal->actual" type: tensor count}


class PrepareStage(_StageBase):
    """``stages/<tier>.prepare.json``: the artifact (None for a tier served from the source)."""
    artifact: str | None = None
    key: str | None = None
    reused: bool | None = None
    resolved: dict[str, Any] | None = None
    info: QuantInfo = Field(default_factory=QuantInfo)


class PeakBreakdown(_Closed):
    """A model peak (bytes) split: the stored weights, the KV cache allocated at that depth,
    and the rest (activations, logits, workspace, kernel repacks; negative when weights are
    memory-mapped and not all resident). :func:`qeval.measure.memory.peak_breakdown`."""
    weights_bytes: int
    kv_cache_bytes: int
    other_bytes: int


class Memory(_Closed):
    """Memory of a loaded tier: bytes; ``peak_bytes`` and ``kv_bytes_at_depth`` per depth.

    ``peak_bytes`` is the model's peak: on CPU VmHWM less ``baseline_bytes``, the RSS with
    the tier's runtime imported and warmed (``runtime_bytes``; ``runtime_engine_bytes`` the
    part its engine libraries added), no model; on CUDA ``torch.cuda.max_memory_allocated``
    (``reserved_unallocated_bytes`` beside it) or NVML. ``peak_breakdown`` splits it."""
    weight_bytes: int | None = None
    kv_bytes_per_token: float | None = None
    kv_bytes_at_depth: dict[str, int] = Field(default_factory=dict)
    kv_allocated_bytes_at_depth: dict[str, int] = Field(default_factory=dict)
    peak_bytes: dict[str, int | None] = Field(default_factory=dict)
    peak_breakdown: dict[str, PeakBreakdown | None] = Field(default_factory=dict)
    after_load_bytes: int | None = None
    baseline_bytes: int | None = None
    runtime_bytes: int | None = None
    runtime_engine_bytes: int | None = None
    runtime_libraries: list[str] | None = None
    reserved_unallocated_bytes: dict[str, int | None] | None = None
    kind: str | None = None
    nvml_peak_bytes: dict[str, int | None] | None = None
    nvml_after_load_bytes: int | None = None
    nvml_kind: str | None = None
    nvml: str | None = None


class KvPoolPhase(_Closed):
    """How a served tier's timed phase (a speed depth, a load point) started on an empty KV
    pool (:meth:`qeval.engines.openai.OpenAIEngine.kv_pool_phase`): what emptied it
    (``erase_slots``, ``reset_prefix_cache``, ``flush_cache``, ``restart``) and the server's
    own counters at the start and the end (names as the server gives them: llama-server
    ``/slots`` and ``/metrics``, vLLM and SGLang ``/metrics``). A phase whose pool was not
    empty at its start fails instead, so ``empty_at_start`` is always true in a stored row."""
    phase: str
    cleared_by: str
    before: dict[str, float] = Field(default_factory=dict)
    after: dict[str, float] | None = None
    empty_at_start: bool = True


class SpeedPoint(_Closed):
    """Speed at one depth: TTFT (s), prefill and decode tokens/s (medians), roofline bound
    (tokens/s) and achieved share, the raw repeats, and for a served tier how its KV pool
    was emptied first (``kv_pool``)."""
    ttft_s: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    ttft_s_all: list[float] = Field(default_factory=list)
    decode_tokens_per_s_all: list[float] = Field(default_factory=list)
    decode_from_cache: int | None = None  # repeats that decoded from the cache cut back to the depth (no prefill)
    roofline_tokens_per_s: float | None = None
    roofline_share: float | None = None
    kv_pool: KvPoolPhase | None = None


class MeasureStage(_StageBase):
    """``stages/<tier>.measure.json``: engine, backend, memory and speed of one tier."""
    engine: str | None = None
    backend: str | None = None
    device: str | None = None
    threads: int | None = None
    kv_cache: str | None = None
    flash_attn: bool | None = None
    kv_cache_dtype: str | None = None
    attention: dict[str, Any] | None = None
    open_seconds: float | None = _open_seconds()
    decode_mode: str | None = None
    decode_note: str | None = None
    decode_check: dict[str, Any] | None = Field(None, description="static decode: what torch.compile did "
                                                "(qeval.engines.hf: graph breaks, recompiles, CUDA-graph replays)")
    decode_tokens: int | None = None
    # the dtype torch computed the tier in without native instructions on this CPU ("bfloat16"
    # without AVX512_BF16 / AMX-BF16): speed and load are torch's emulated CPU path, not the
    # dtype as served natively (qeval.engines.hf.HFEngine.dtype_emulated); None: native, a GPU
    # or another engine
    dtype_emulated: str | None = None
    sampling: dict[str, Any] | None = None
    runtime: dict[str, Any] | None = None
    served: dict[str, Any] | None = Field(None, description="a served tier: prompt_mode, token_counts (server "
                                          "usage | source tokenizer on the text | server token ids), dialect, "
                                          "tokenizer_check, fidelity (why not measurable, or None)")
    quant: QuantInfo = Field(default_factory=QuantInfo)
    memory: Memory = Field(default_factory=Memory)
    speed: dict[str, SpeedPoint] = Field(default_factory=dict)


class Fidelity(_Closed):
    """Teacher-forced fidelity against the reference (definitions: qeval.measure.fidelity)."""
    n_tokens: int = 0
    kld_mean: float | None = None
    kld_se: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    same_top_rate: float | None = None
    ppl_ratio: float | None = None
    ppl_ratio_se: float | None = None
    delta_p_mean: float | None = None
    delta_p_rms: float | None = None
    kld_by_bucket: dict[str, float] = Field(default_factory=dict)
    kld_estimate: str | None = None  # None: full vocabulary; else e.g. "top-20 (...)": a server's top-k
    kld_topk: int | None = None      # k of that estimate
    not_measured: str | None = None  # why there is no figure (a chat-mode endpoint: no teacher-forced scoring)
    # same_top_spec[k - 1] = [accepted, steps] of the greedy speculative loop replayed along the
    # reference's answers with this tier as the draft of draft length k (k = 1..16;
    # qeval.measure.speculative.speculative_steps): accepted / steps is what it predicts per step
    same_top_spec: list[list[int]] | None = None


class Behaviour(_Closed):
    """Free-running behaviour against the reference (definitions: qeval.measure.behaviour)."""
    pass_rate: float | None = None
    pass_ci_low: float | None = None
    pass_ci_high: float | None = None
    n_checks: int | None = None
    flips_pass_to_fail: int | None = None
    flips_fail_to_pass: int | None = None
    flip_rate: float | None = None
    n_compared: int | None = None  # checks decided on both the tier and the reference (the paired test's n)
    budget_exhausted_rate: float | None = None
    thinking_exhausted_rate: float | None = None
    rouge_l: float | None = None
    chrf: float | None = None
    first_divergence_mean: float | None = None
    identical_rate: float | None = None
    n_items: int | None = None
    n_answers: int | None = None
    checks_timed_out: int | None = None  # regex checks not decided in bounded time (neither pass nor fail)


class OutputLengthFigures(_Closed):
    """New tokens per answered turn of a tier against the reference's answers to the same
    turns (:func:`qeval.measure.output_length.summarise_output_length`): means and 95th
    percentiles (tokens, the stop token included), their ratios tier / reference, and the
    shares that hit the token budget."""
    n_answers: int = 0
    mean_new_tokens: float | None = None
    p95_new_tokens: float | None = None
    ref_mean_new_tokens: float | None = None
    ref_p95_new_tokens: float | None = None
    mean_ratio: float | None = None
    p95_ratio: float | None = None
    budget_hit_rate: float | None = None
    ref_budget_hit_rate: float | None = None


class ThinkingLength(_Closed):
    """Tokens of the thinking part (``<think>...</think>``) of the paired answers that have
    one on either side: means (tokens) and tier / reference."""
    n_answers: int = 0
    mean_tokens: float | None = None
    ref_mean_tokens: float | None = None
    mean_ratio: float | None = None


class OutputLength(OutputLengthFigures):
    """A tier's output length (``quality.output_length``): the figures over every paired
    turn, ``n_unpaired`` turns without a reference answer, the thinking part, and the
    figures per suite kind (``long_output``, ``multi_turn``)."""
    n_unpaired: int = 0
    thinking: ThinkingLength | None = None
    by_kind: dict[str, OutputLengthFigures] = Field(default_factory=dict)


class LongContextDepth(_Closed):
    """Long-context figures of one tier at one document depth
    (:func:`qeval.measure.long_context.summarise_long_context`): recall (share of questions
    answered exactly) with its percentile-bootstrap 95 % interval, questions and items
    counted, recall by question kind, flips against the reference per question (None for the
    reference), budget exhaustion, and fidelity over the last document tokens (None for the
    reference: KLD 0, same-top 1 and PPL ratio 1 by definition)."""
    recall: float | None = None
    recall_ci_low: float | None = None
    recall_ci_high: float | None = None
    n_questions: int | None = None
    n_items: int | None = None
    by_kind: dict[str, float] = Field(default_factory=dict)
    flips_pass_to_fail: int | None = None
    flips_fail_to_pass: int | None = None
    flip_rate: float | None = None
    n_compared: int | None = None  # questions decided on both the tier and the reference
    budget_exhausted_rate: float | None = None
    fidelity: Fidelity | None = None


class LongContext(_Closed):
    """A tier's long-context section: ``depths`` keyed by depth in tokens (a string),
    ``fidelity_tokens`` per suite (how many document tokens were scored), seconds it took."""
    depths: dict[str, LongContextDepth] = Field(default_factory=dict)
    fidelity_tokens: dict[str, int] = Field(default_factory=dict)
    seconds: float | None = None


class Quality(_Closed):
    """Quality of one tier: which engine computed it, fidelity, behaviour, lm-eval scores,
    long-context recall and fidelity by depth."""
    engine: str | None = None
    backend: str | None = None
    fidelity: Fidelity | None = None
    behaviour: Behaviour | None = None
    fidelity_seconds: float | None = None
    behaviour_seconds: float | None = None
    lm_eval: dict[str, Any] | None = None
    long_context: LongContext | None = None
    output_length: OutputLength | None = None  # qeval.measure.output_length
    reference_dtype: str | None = None
    noise_floor: bool | None = None
    bf16_matmul: str | None = None   # "native" or "float32" as applied (qeval.engines.bf16_matmul)
    reused: bool | None = None       # the result of an earlier run with the same content key (issue 18)
    content_key: str | None = None   # that key (qeval.quality_stages.quality_fields); None: not keyable


class FloorStage(_StageBase):
    """``stages/_run.floor.json``: the noise floor (:func:`qeval.quality_stages.noise_floor_pass`):
    the reference tier served in ``served_dtype`` scored against the reference computed in
    ``reference_dtype``. ``measured`` False (with ``why``) when the two dtypes are the same."""
    tier: str
    served_dtype: str | None = None
    reference_dtype: str | None = None
    measured: bool = False
    fidelity: Fidelity | None = None
    backend: str | None = None
    bf16_matmul: str | None = None  # "native" or "float32" as applied (qeval.engines.bf16_matmul)
    seconds: float | None = None
    why: str | None = None
    reused: bool | None = None  # from an earlier run with the same content key (qeval.quality_stages.floor_fields)


class NoiseFloorSummary(_Closed):
    """``run.json`` ``noise_floor``: the floor stage's figures (KLD in nats), or why it was not
    measured (:func:`qeval.run.floor_summary`)."""
    tier: str | None = None
    served_dtype: str | None = None
    reference_dtype: str | None = None
    measured: bool = False
    backend: str | None = None
    bf16_matmul: str | None = None
    kld_mean: float | None = None
    kld_se: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    same_top_rate: float | None = None
    ppl_ratio: float | None = None
    n_tokens: int | None = None
    why: str | None = None


class QualityStage(_StageBase):
    """``stages/<tier>.quality.json``."""
    quality: Quality


class SpeculativeStage(_StageBase):
    """``stages/_run.speculative.json``: every recipe ``speculative`` pair as it ran
    (:mod:`qeval.results_speculative`; :func:`qeval.worker.stage_speculative`)."""
    pairs: list[SpecPair] = Field(default_factory=list)
    spec: list[dict[str, Any]] = Field(default_factory=list)  # the recipe's pairs it ran (resume redoes on a change)


class LoadStage(_StageBase):
    """``stages/<tier>.load.json``: the load sweep's section (:func:`qeval.measure.serving.load_sweep`;
    None with ``skipped`` when the engine cannot batch) and the recipe ``load`` section it ran with."""
    load: LoadSection | None = None
    skipped: str | None = None
    load_fingerprint: str | None = None


class _ExceptionFields(_Closed):
    """What :func:`qeval.failures.describe_exception` records of one exception: its type
    name, message (one line, at most 300 characters), ``where`` (``file:line`` of the raising
    frame) and ``condition`` (an assertion's failed statement)."""
    exception: str | None = None
    message: str | None = None
    where: str | None = None
    condition: str | None = None


class ExceptionInfo(_ExceptionFields):
    """The root exception a failed stage's exception was raised from, and ``reason``, the
    one line its fields make."""
    reason: str | None = None


class StageError(_ExceptionFields):
    """``stages/<scope>.<stage>.error.json``: why a stage failed (``type`` input: bad input;
    unavailable: the tier cannot run on this machine as asked; exception: anything else).

    ``error`` is the one-line reason (``ValueError: bad shape (at torch/nn/functional.py:99)``);
    for an exception also its type, message, raising frame, an assertion's condition and the
    root ``cause`` it was raised from (:func:`qeval.failures.describe_exception`)."""
    error: str
    type: Literal["input", "unavailable", "exception"]
    cause: ExceptionInfo | None = None
    traceback: str | None = None


class Artifact(_Closed):
    """Where a tier's prepared artifact is in the cache (key, folder) and whether it was reused."""
    key: str | None = None
    path: str | None = None
    reused: bool | None = None


class AnswerRow(_Open):
    """One answered turn in ``answers/<tier>.json`` (and, with token ids, in
    ``reference/segments.json``): ``item`` is ``<suite>/<id>``; ``checks`` the pass/fail of
    each check, ``check_details`` their one-line reasons; ``finished`` False when the answer
    hit its token budget; ``system``/``prompt`` the text it answers (None in runs before
    they were stored). A long-context answer has the document ``depth`` in tokens (and no
    prompt: the document is rendered from the suite file at that depth). Suite kinds may add keys."""
    item: str
    turn: int = 0
    depth: int | None = None
    text: str = ""
    finished: bool = True
    checks: list[bool | None] = Field(default_factory=list)  # None: not decided in bounded time (a regex timeout)
    check_details: list[str] = Field(default_factory=list)
    system: str | None = None
    prompt: str | None = None


class Segment(_Closed):
    """One answered turn of the reference pass in ``reference/segments.json``
    (:func:`qeval.measure.quality.answer_all`): ``item`` (``<suite>/<id>``), its suite and
    suite kind, ``turn``; the prompt's and the answer's token ids (the answer ends with the
    stop token when ``finished``); the answer's text and its check results (None: a check
    not decided in bounded time) with their one-line reasons; ``offset``, the row of
    ``reference/logprobs.npy`` holding the distribution of the answer's first token."""
    item: str
    suite: str | None = None
    kind: str | None = None
    turn: int = 0
    prompt_ids: list[int]
    answer_ids: list[int]
    finished: bool = True
    text: str = ""
    checks: list[bool | None] = Field(default_factory=list)
    check_details: list[str] = Field(default_factory=list)
    offset: int | None = None


class ItemKld(_Closed):
    """KL(P_ref || P_tier) in nats over one answered turn's positions: mean and max."""
    item: str
    turn: int
    kld_mean: float | None = None
    kld_max: float | None = None
    n_tokens: int = 0


class WorstPosition(_Closed):
    """One of the positions of highest KLD: the text before it, the reference token it
    predicts, and both sides' most likely tokens as ``[token text, probability]``."""
    item: str
    turn: int
    position: int
    kld: float
    context: str
    target: str
    ref_top: list[tuple[str, float]]
    tier_top: list[tuple[str, float]]


class ReviewFile(_Closed):
    """``review/<tier>.json`` (:mod:`qeval.measure.review`): per-item KLD, and the positions
    of highest KLD over all items, largest first."""
    tier: str
    items: list[ItemKld] = Field(default_factory=list)
    worst: list[WorstPosition] = Field(default_factory=list)


class GateRuleRow(_Closed):
    """One rule applied to one candidate (:class:`qeval.analysis.gate.RuleResult`): ``value``
    the candidate's figure as compared and ``threshold`` its bound (numbers in the rule's
    unit: GiB, tokens/s, shares, nats, streams; None when missing), ``message`` one line."""
    rule: str
    passed: bool
    value: Any = None
    threshold: Any = None
    message: str = ""
    # behaviour rules decided on evidence (qeval.analysis.evidence): "pass" | "fail" | "not enough
    # evidence", and {method, n, p_value, observed, tolerance, detectable, interval, alpha, power, why};
    # on a candidate the gate could not judge: "error" (its status check) and "not judged" (its rules)
    outcome: str | None = None
    evidence: dict[str, Any] | None = None


class GateCandidate(_Closed):
    """A candidate's verdict: its tier status, ``pass``/``fail`` (a rule measured damage) or
    ``error`` (not judged: its tier or the reference's has no result or did not finish;
    ``error`` says why), the rules it failed (names), the rules left not judged, every
    rule's result and notes (e.g. within the noise floor)."""
    tier: str
    status: str | None = None
    # "not run": left out by --tiers, neither pass nor fail; "error": qeval could not judge it
    verdict: Literal["pass", "fail", "error", "not run"]
    error: str | None = None  # for "error": which tier did not finish, its status, the short error
    failed_rules: list[str] = Field(default_factory=list)
    not_judged_rules: list[str] = Field(default_factory=list)  # set rules of an "error" candidate
    undecided_rules: list[str] = Field(default_factory=list)  # rules whose suites could not decide
    rules: list[GateRuleRow] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class GateNoiseFloor(_Closed):
    """The measured noise floor the gate's notes used (:class:`qeval.analysis.floor.NoiseFloor`):
    mean KLD and its standard error (nats), the tier and dtypes, where it came from, and
    ``threshold`` = ``factor`` x ``kld_mean`` (a KLD at most that is indistinguishable)."""
    kld_mean: float
    kld_se: float | None = None
    tier: str | None = None
    served_dtype: str | None = None
    reference_dtype: str | None = None
    source: str = "this run"
    threshold: float
    factor: float


class ParetoRow(_Closed):
    """One tier's place relative to the Pareto front (:class:`qeval.analysis.pareto.ParetoEntry`):
    peak bytes and decode tokens/s at the depth, the quality metric's value, users at SLO
    (streams), and for a dominated tier one front tier dominating it, for a tier not
    compared the reason."""
    tier: str
    status: Literal["front", "dominated", "not_compared"]
    memory_bytes: float | None = None
    decode_tokens_per_s: float | None = None
    quality: float | None = None
    dominated_by: str | None = None
    reason: str | None = None
    users_at_slo: float | None = None


class ParetoSection(_Closed):
    """``gate.json`` ``pareto``: the front at ``depth`` tokens on memory, the speed objective
    (``decode`` or ``users_at_slo``) and ``quality_metric``; ``front`` the names on it."""
    depth: int
    quality_metric: str
    speed: str = "decode"
    front: list[str] = Field(default_factory=list)
    entries: list[ParetoRow] = Field(default_factory=list)


class LadderRung(_Closed):
    """One rung of the overload ladder (:class:`qeval.analysis.ladder.LadderStep`): peak bytes
    at the gate depth, the quality metric's value, users at SLO (streams) and the best
    aggregate decode tokens/s of the load sweep; users gained, memory saved (bytes and %)
    and quality lost (positive = worse) versus the rung above and the first rung."""
    tier: str
    peak_bytes: float | None = None
    quality: float | None = None
    users_at_slo: float | None = None
    max_decode_tokens_per_s: float | None = None
    users_gained_vs_prev: float | None = None
    users_gained_vs_first: float | None = None
    saved_vs_prev_bytes: float | None = None
    saved_vs_prev_pct: float | None = None
    saved_vs_first_bytes: float | None = None
    saved_vs_first_pct: float | None = None
    quality_lost_vs_prev: float | None = None
    quality_lost_vs_first: float | None = None
    requests_per_s_at_slo: float | None = None  # at the tier's own output length (analysis.capacity)
    output_tokens_rel: float | None = None  # mean new tokens per answer / the reference's


class RateRungRow(_Closed):
    """One rung of the ladder in rates (:class:`qeval.analysis.ladder.RateRung`): the tier's
    knee (req/s), the rate above which the service steps down to it, the first measured rate
    above the knee, its quality (KLD nats, pass rate share, pass->fail flips) and what it
    gives up against the first rung (positive = worse)."""
    tier: str
    knee_rps: float
    from_rps: float | None = None
    above_rps: float | None = None
    kld_mean: float | None = None
    pass_rate: float | None = None
    flips_pass_to_fail: int | None = None
    kld_given_up: float | None = None
    pass_rate_given_up: float | None = None
    flips_given_up: int | None = None


class RateLadderSection(_Closed):
    """``gate.json`` ``ladder.rates``: the rungs in the order a service steps down them, the
    rate above which it refuses (req/s), members left out with why, and the sentence."""
    steps: list[RateRungRow] = Field(default_factory=list)
    refuse_above_rps: float | None = None
    unplaced: dict[str, str] = Field(default_factory=dict)
    text: str = ""


class LadderSection(_Closed):
    """``gate.json`` ``ladder`` (:mod:`qeval.analysis.ladder`): rungs ordered by ``basis``
    (``users_at_slo`` at ``load_depth``, else ``peak_memory`` at ``depth``), and the passing
    tiers that could not be placed with the reason."""
    depth: int
    quality_metric: str
    basis: str = "peak_memory"
    load_depth: int | None = None
    steps: list[LadderRung] = Field(default_factory=list)
    unplaced: dict[str, str] = Field(default_factory=dict)
    rates: RateLadderSection | None = None
    # {member: "bfloat16"}: the ladder's members that torch computed in a dtype the run's CPU
    # emulates (their rows' dtype_emulated); their users at SLO and knees are torch's CPU path
    emulated: dict[str, str] = Field(default_factory=dict)


class GateFile(_Closed):
    """``gate.json`` (:func:`qeval.report.rebuild_outputs`): the gate's verdict (``passed``,
    ``verdict`` ``pass``/``fail``/``error`` and its ``reason``, the ``exit_code``: 0 pass,
    1 fail, 4 error: some candidate could not be judged and none failed), the reference
    tier, the gate depth (tokens), the rules that were set ``{name: threshold}``, the noise floor used, warnings about the gate
    itself, one verdict per candidate; the quality metric, Pareto front, overload ladder and
    ``slow_path`` (``{tier: why its decode is slow}``) beside it."""
    passed: bool
    # "error": qeval could not judge some candidate (and none failed a rule); None: written
    # before the verdict was recorded (then read ``passed``)
    verdict: Literal["pass", "fail", "error"] | None = None
    reason: str | None = None  # why not "pass": the failing candidates and rules, or what was not judged
    exit_code: int
    reference: str
    depth: int
    rules: dict[str, float] = Field(default_factory=dict)
    confidence: float | None = None  # the behaviour rules' confidence and power (qeval.analysis.evidence)
    power: float | None = None
    insufficient_evidence: Literal["fail", "warn", "pass"] | None = None  # what "not enough evidence" does
    noise_floor: GateNoiseFloor | None = None
    warnings: list[str] = Field(default_factory=list)
    judged: int | None = None  # candidates the gate judged (those --tiers asked for)
    not_run: list[str] = Field(default_factory=list)  # candidates left out by --tiers
    candidates: list[GateCandidate] = Field(default_factory=list)
    quality_metric: str
    pareto: ParetoSection
    ladder: LadderSection
    slow_path: dict[str, str] = Field(default_factory=dict)
    # {tier: "load stopped after the closed loop at 2 streams: ..."}: the tiers whose load stage
    # stopped early; their knee and ladder rungs come from the points it finished (partial)
    load_stopped: dict[str, str] = Field(default_factory=dict)


class Timings(_Closed):
    """Seconds each tier stage took."""
    prepare_s: float | None = None
    measure_s: float | None = None
    load_s: float | None = None
    quality_s: float | None = None


class TierResult(_Closed):
    """``tiers/<tier>.json``: the merged stages of one tier (shape in the module docstring)."""
    tier: str
    method: str
    status: Status
    error: str | None = None
    log_tail: str | None = None
    spec: dict[str, Any] = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)
    artifact: Artifact | None = None
    resolved: dict[str, Any] | None = None
    quant: QuantInfo | None = None
    engine: str | None = None
    backend: str | None = None
    device: str | None = None
    threads: int | None = None
    kv_cache: str | None = None
    flash_attn: bool | None = None
    kv_cache_dtype: str | None = None
    attention: dict[str, Any] | None = None
    open_seconds: float | None = _open_seconds()
    decode_mode: str | None = None
    decode_note: str | None = None
    decode_check: dict[str, Any] | None = Field(None, description="static decode: what torch.compile did "
                                                "(qeval.engines.hf: graph breaks, recompiles, CUDA-graph replays)")
    decode_tokens: int | None = None
    # the dtype torch computed the tier in without native instructions on this CPU ("bfloat16"
    # without AVX512_BF16 / AMX-BF16): speed and load are torch's emulated CPU path, not the
    # dtype as served natively (qeval.engines.hf.HFEngine.dtype_emulated); None: native, a GPU
    # or another engine
    dtype_emulated: str | None = None
    sampling: dict[str, Any] | None = None
    runtime: dict[str, Any] | None = None
    served: dict[str, Any] | None = None  # a served tier's prompt mode and token-count source (MeasureStage.served)
    memory: Memory | None = None
    speed: dict[str, SpeedPoint] | None = None
    quality: Quality | None = None
    load: LoadSection | None = Field(None, description="the load stage's figures (closed-loop points, open-loop "
                                     "arrivals; qeval.results_load), error and no points when it failed")

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


class ScheduledStage(_Closed):
    """One stage as the local pipelined executor ran it (``run.json`` ``schedule``):
    ``tier`` (``_run`` for run-wide stages), ``stage``, ``start_s`` (seconds after the
    pipeline began), ``seconds`` (wall time in the parent, process start included),
    ``threads`` (OMP/torch threads it was given), ``timed`` (ran alone) and ``beside``
    (``tier.stage`` of every stage whose run overlapped it)."""
    tier: str
    stage: str
    start_s: float
    seconds: float
    threads: int
    timed: bool
    ok: bool
    beside: list[str] = Field(default_factory=list)


class RunInfo(_Closed):
    """``run.json``: what was run, where and with what (versions, CPU, GPU, bandwidth), and,
    with the pipelined local executor, which stages ran beside which (``lanes``, ``schedule``)."""
    recipe: dict[str, Any]
    recipe_path: str | None = None
    recipe_dir: str | None = None  # where the recipe's relative paths start (absolute)
    qeval_commit: str | None = None
    versions: dict[str, str | None] = Field(default_factory=dict)
    cpu: str | None = None
    cpu_count: int | None = None
    threads: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    source: SourceStage | None = None
    # how the suites' conversations became prompts (qeval.measure.prompt_format, recipe model.chat_template):
    # "tokenizer" (its own chat template), "file:<name>" (a Jinja file), "plain" (lm-eval's plain text)
    prompt_format: str | None = None
    env: EnvStage | None = None
    bandwidth_bytes_per_s: float | None = None
    device: str | None = None
    gpu: str | None = None
    gpu_memory_bytes: int | None = None
    noise_floor: NoiseFloorSummary | None = None
    recipe_fingerprint: str | None = None  # qeval.stages.recipe_fingerprint: --resume refuses another recipe
    lanes: int | None = None  # untimed stages run side by side, at most this many (qeval.pipeline)
    schedule: list[ScheduledStage] | None = None
    # llama.cpp's CPU backend as the GGUF tiers ran it, one entry per distinct variant:
    # {"cpu_variant": "zen4" | "built-in", "instruction_sets": [...], "devices": [...],
    #  "amx_granted": bool | None, "tiers": [...]} (qeval.engines.ggml_cpu.describe)
    llama_cpp: list[dict[str, Any]] | None = None
    tiers_run: list[str] | None = None  # `qeval run --tiers`: the tiers asked to run (None: all); the gate judges these

    @field_validator("recipe")
    @classmethod
    def _recorded_tiers(cls, v: dict) -> dict:
        return check_recorded_tiers(v)


STAGE_MODELS: dict[str, type[_StageBase]] = {
    "source": SourceStage, "env": EnvStage, "reference": ReferenceStage, "floor": FloorStage,
    "prepare": PrepareStage, "measure": MeasureStage, "load": LoadStage, "quality": QualityStage,
    "speculative": SpeculativeStage}

M = TypeVar("M", bound=BaseModel)


# ---- atomic writes -----------------------------------------------------------------------

def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder,
    fsync, then ``os.replace``. A reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_all(files: dict[Path, str]) -> None:
    """Write several text files all or none: each goes to a temporary file beside it first,
    and only when every one is written are they renamed into place (a failure before the
    renames leaves every old file as it was).

    Raises:
        QevalInputError: a file cannot be written (read-only folder, full disk), naming it.
    """
    tmps: list[tuple[str, Path]] = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            tmps.append((tmp, path))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
        for tmp, path in tmps:
            os.replace(tmp, path)
        tmps = []
    except OSError as e:
        where = tmps[-1][1] if tmps else next(iter(files), None)
        raise QevalInputError(f"cannot write: {e.strerror or e.__class__.__name__}", file=where) from None
    finally:
        for tmp, _ in tmps:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def json_text(obj: Any) -> str:
    """``json.dumps(obj, indent=2)`` plus a newline, as every JSON file of a run folder is
    written (a pydantic model is dumped first; numpy values and paths converted)."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump()
    return json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n"


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """:func:`atomic_write_text` of :func:`json_text` of ``obj``."""
    atomic_write_text(path, json_text(obj))


def _json_default(o: Any) -> Any:
    try:
        import numpy as np  # start-up time: numpy only for numpy values
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path: str | Path, *, expect: type | None = None) -> Any:
    """Load a JSON file with the bounded loader (:func:`qeval.bounded.load_json`).

    Args:
        expect: the top level's type (``dict``), or None for any.

    Raises:
        QevalInputError: missing, not a regular file, too large, not UTF-8, malformed,
            too deep, or not ``expect`` (names the file and line).
    """
    return load_json(path, limit=MAX_JSON_BYTES, expect=expect)


def short_error(text: Any, limit: int = 300) -> str:
    """A stored error message as one short line: its first line, cut to ``limit``
    characters, saying how much was left out (a failed tier's error may hold a whole log)."""
    s = str(text)
    lines = s.splitlines() or [""]
    first = " ".join(lines[0].split())
    more = len(lines) - 1
    if len(first) > limit:
        first = first[: limit - 1] + "…"
    return first + (f" (+{more:,} more lines)" if more > 0 else "")


class FieldProblem(ValueError):
    """A validator's error about a field below the one it validates (``load.points[0]``):
    :func:`parse_model` names ``field`` instead of the validated field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_recorded_tiers(recipe: Any) -> Any:
    """Check ``run.json``'s recorded recipe: its ``tiers`` (when present) a list of objects
    each with a plain name (:func:`qeval.bounded.name_problem`), since readers build paths
    from them. Returns it.

    Raises:
        FieldProblem: naming the tier's field (:func:`parse_model` turns it into the file's one line).
    """
    tiers = recipe.get("tiers") if isinstance(recipe, dict) else None
    if tiers is None:
        return recipe
    if not isinstance(tiers, list):
        raise FieldProblem("recipe.tiers", "must be a list of tier objects")
    for i, t in enumerate(tiers):
        if not isinstance(t, dict):
            raise FieldProblem(f"recipe.tiers[{i}]", "must be an object")
        if "name" not in t:
            raise FieldProblem(f"recipe.tiers[{i}].name", "a tier needs a name")
        problem = name_problem(t["name"], "tier name")
        if problem:
            raise FieldProblem(f"recipe.tiers[{i}].name", problem)
    return recipe


def read_model(path: str | Path, model: type[M]) -> M:
    """Read a JSON file (bounded: :func:`read_json`) into ``model``.

    Raises:
        QevalInputError: missing, not a regular file, too large, malformed, too deep, not
            an object, or content that does not fit the model (names the file and the
            first bad field).
    """
    return parse_model(read_json(path, expect=dict), model, path)


def parse_model(data: Any, model: type[M], where: str | Path | None = None) -> M:
    """Validate ``data`` (a dict) as ``model``.

    Raises:
        QevalInputError: the first field that does not fit, named as ``a.b[0].c``, its
            message one short line (:func:`qeval.bounded.pydantic_message`).
    """
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        msg = pydantic_message(err)
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, FieldProblem):  # a section's own check names the field inside it
            loc, msg = inner.field, inner.message
        raise QevalInputError(f"{msg} (expected a {model.__name__} of this qeval version)",
                              file=where, field=loc or None) from None


# ---- the run folder's readers and writers ---------------------------------------------------

def write_run_info(layout: RunLayout, info: RunInfo) -> None:
    """Write ``run.json`` atomically."""
    atomic_write_json(layout.run_json, info)


def read_run_info(layout: RunLayout) -> RunInfo:
    """``run.json`` of the run folder (bounded read; recorded tier names checked).

    Raises:
        QevalInputError: not a run folder, or a ``run.json`` that is not a bounded JSON
            object fitting :class:`RunInfo` (a directory, a list, a recipe that is a string,
            a tier without a name or with a name like ``../x``).
    """
    if not layout.root.is_dir() or not (layout.run_json.exists() or layout.run_json.is_symlink()):
        raise QevalInputError("not a qeval run folder (no run.json)", file=layout.root)
    return read_model(layout.run_json, RunInfo)


def write_stage(layout: RunLayout, scope: str, stage: str, data: dict | BaseModel) -> BaseModel:
    """Validate a stage's output against its model (:data:`STAGE_MODELS`) and write it
    atomically. Returns the model.

    Raises:
        pydantic.ValidationError: the stage produced a key or value its model does not
            declare (a bug in the stage, reported as the stage's failure).
    """
    model = data if isinstance(data, BaseModel) else STAGE_MODELS[stage].model_validate(data)
    atomic_write_json(layout.stage(scope, stage), model)
    return model


def read_stage(layout: RunLayout, scope: str, stage: str) -> Any:
    """A finished stage's file as its model (:data:`STAGE_MODELS`).

    Raises:
        QevalInputError: missing, malformed, or not fitting the model.
    """
    return read_model(layout.stage(scope, stage), STAGE_MODELS[stage])


def stage_done(layout: RunLayout, scope: str, stage: str) -> bool:
    """Whether the stage finished (its file exists)."""
    return layout.stage(scope, stage).exists()


def read_speculative(layout: RunLayout) -> SpeculativeStage | None:
    """The run's speculative pairs (``stages/_run.speculative.json``), None when it has none.

    Raises:
        QevalInputError: the file does not fit :class:`SpeculativeStage` (one line naming it).
    """
    return read_stage(layout, RUN_SCOPE, "speculative") if stage_done(layout, RUN_SCOPE, "speculative") else None


def write_stage_error(layout: RunLayout, scope: str, stage: str, error: StageError) -> None:
    """Write ``stages/<scope>.<stage>.error.json`` atomically."""
    atomic_write_json(layout.stage(scope, stage, error=True), error)


def read_partial_load(layout: RunLayout, tier: str) -> dict | None:
    """The load stage's partial section (``stages/<tier>.load.partial.json``: the points
    measured before the stage stopped; :func:`qeval.worker.stage_load` writes it after each
    point), or None when there is none or it cannot be read."""
    p = layout.stage_partial(tier, "load")
    if not p.exists():
        return None
    try:
        d = read_json(p, expect=dict)
    except (QevalInputError, ValueError):
        return None
    return d.get("load") if isinstance(d.get("load"), dict) else None


def read_stage_error(layout: RunLayout, scope: str, stage: str) -> StageError | None:
    """The stage's error record (bounded read), or None when there is none or it cannot be read."""
    p = layout.stage(scope, stage, error=True)
    if not p.exists():
        return None
    try:
        return StageError.model_validate(read_json(p, expect=dict))
    except (QevalInputError, ValueError):
        return None


def write_tier_result(layout: RunLayout, result: TierResult) -> None:
    """Write ``tiers/<tier>.json`` atomically."""
    atomic_write_json(layout.tier_result(result.tier), result)


def read_tier_result(layout: RunLayout, tier: str) -> TierResult:
    """``tiers/<tier>.json``.

    Raises:
        QevalInputError: missing, malformed, or not fitting :class:`TierResult`.
    """
    return read_model(layout.tier_result(tier), TierResult)


def load_run(run_dir: str | Path) -> tuple[RunInfo, dict[str, TierResult]]:
    """Read a run folder: ``(run.json, {tier name: tier result})``, tiers in recipe
    order, then any other ``tiers/<name>.json`` whose stem is a plain name.

    Raises:
        QevalInputError: not a run folder, a file that is not bounded JSON fitting its
            model, or a name that would leave the folder; one line naming the file.
    """
    layout = RunLayout(run_dir)
    run = read_run_info(layout)
    order = [t["name"] for t in run.recipe.get("tiers") or []]
    tiers: dict[str, TierResult] = {}
    tdir = layout.tiers_dir
    if not tdir.is_dir():
        return run, tiers
    for name in order:
        p = layout.tier_result(name)
        if p.exists() or p.is_symlink():
            tiers[name] = read_tier_result(layout, name)
    for p in sorted(tdir.iterdir()):
        if p.suffix != ".json" or p.stem in tiers or name_problem(p.stem):
            continue  # not a tier file (temporary files of atomic writes start with '.')
        tiers[p.stem] = read_tier_result(layout, p.stem)
    return run, tiers


def get_path(obj: Any, *keys: Any) -> Any:
    """``obj[k1][k2]...`` (attributes of a model, keys of a dict) or None when any level
    is missing (depth keys may be int or str)."""
    cur: Any = obj
    for k in keys:
        if isinstance(cur, BaseModel):
            extra = cur.model_extra or {}
            if isinstance(k, str) and k in type(cur).model_fields:
                cur = getattr(cur, k)
            elif str(k) in extra:
                cur = extra[str(k)]
            else:
                return None
        elif isinstance(cur, dict):
            if k in cur:
                cur = cur[k]
            elif str(k) in cur:
                cur = cur[str(k)]
            else:
                return None
        else:
            return None
    return cur


def _list_of(path: Path, model: type[M]) -> list[M]:
    data = read_json(path, expect=list)  # bounded (qeval.bounded)
    return [parse_model(row, model, f"{path}[{i}]") for i, row in enumerate(data)]


def read_answers(layout: RunLayout, tier: str) -> list[AnswerRow] | None:
    """``answers/<tier>.json`` (None when the tier has none).

    Raises:
        QevalInputError: malformed, or a row not fitting :class:`AnswerRow`.
    """
    p = layout.answers(tier)
    return _list_of(p, AnswerRow) if p.is_file() else None


def write_answers(layout: RunLayout, tier: str, rows: list[AnswerRow]) -> None:
    """Write ``answers/<tier>.json`` atomically: each row with the fields it was given
    (a long-context answer has a ``depth`` and no turn or prompt)."""
    atomic_write_text(layout.answers(tier), json_text([r.model_dump(exclude_unset=True) for r in rows]))


def write_segments(path: str | Path, segments: list[Segment]) -> None:
    """Write a reference pass's ``segments.json`` atomically (built in the artifact cache,
    linked into the run folder as ``reference/segments.json``)."""
    atomic_write_text(path, json_text([s.model_dump() for s in segments]))


def read_segments(layout: RunLayout) -> list[Segment]:
    """``reference/segments.json``: the reference pass's answered turns with token ids.

    Raises:
        QevalInputError: missing, malformed, or a row not fitting :class:`Segment`.
    """
    return _list_of(layout.reference_segments, Segment)


def read_gate(layout: RunLayout) -> GateFile | None:
    """``gate.json`` (None when the run has none yet).

    Raises:
        QevalInputError: malformed, or not fitting :class:`GateFile`.
    """
    p = layout.gate_json
    return read_model(p, GateFile) if p.is_file() else None


def read_floor_review(layout: RunLayout) -> ReviewFile | None:
    """``reference/floor_review.json`` (None when the floor stage kept none).

    Raises:
        QevalInputError: malformed, or not fitting :class:`ReviewFile`.
    """
    p = layout.floor_review
    return read_model(p, ReviewFile) if p.is_file() else None


def read_reference_answers(layout: RunLayout) -> list[AnswerRow] | None:
    """The reference's answered turns from ``reference/segments.json`` (None when absent).

    Raises:
        QevalInputError: malformed, or a row not fitting :class:`AnswerRow`.
    """
    p = layout.reference_segments
    return _list_of(p, AnswerRow) if p.is_file() else None


def read_reference_long_context(layout: RunLayout) -> list[AnswerRow] | None:
    """The reference's long-context answers, one per item and depth, from
    ``reference/long_context.json`` (None when the run has no long_context suite).

    Raises:
        QevalInputError: malformed, or a row not fitting :class:`AnswerRow`.
    """
    p = layout.reference_long_context
    return _list_of(p, AnswerRow) if p.is_file() else None


def read_review(layout: RunLayout, tier: str) -> ReviewFile | None:
    """``review/<tier>.json`` (None when the tier has none).

    Raises:
        QevalInputError: malformed, or not fitting :class:`ReviewFile`.
    """
    p = layout.review(tier)
    return read_model(p, ReviewFile) if p.is_file() else None
