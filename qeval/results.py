"""Run-folder layout and the tier result format; atomic writes.

A run folder ``results/<recipe name>/<UTC timestamp>/`` holds::

    run.json                 resolved recipe, recipe_path and recipe_dir (where its relative
                             paths start), package versions, CPU/GPU, threads, git commit,
                             memory bandwidth (bytes/s), source checkpoint
    tiers/<tier>.json        one TierResult per tier (below), written atomically
    stages/<tier>.<stage>.json  per-stage outputs (prepare, measure, load, quality) used for resume;
                             ``.error.json`` for a failed one: error (the one-line reason), type
                             ("input" | "exception"), exception, message, where (file:line),
                             condition (an assertion's source), cause, traceback
    logs/<tier>.<stage>.log  each stage's stdout/stderr (the tail goes into a failure)
    reference/               BF16 reference answers (token ids) and their log-probabilities
    table.md, table.csv      the tier table
    gate.json, report.html   decisions (analysis stage)

Tier result (``tiers/<tier>.json``); every figure may be absent (None) when not measured::

    {
      "tier": "gptq", "method": "gptq", "status": "ok" | "failed" | "not_built",
      "error": str | None,       # why it failed, one line: "ValueError: msg (at file:line)"
      "log_tail": str | None,    # the failed stage's last log lines
      "spec": {...tier spec from the recipe...},
      "engine": "hf" | "llamacpp", "backend": "gptqmodel:torch_int4", "device": "cpu",
      "threads": 1, "kv_cache": "model" | "int8", "flash_attn": bool | None,
      "decode_mode": "eager" | "static" | None,   # transformers tiers: the timed decode loop
      "decode_note": str | None,          # why a decode is slow or fell back (eager int8, compile failed)
      "decode_tokens": int,               # tokens per timed decode (int8 KV: whole re-quantization periods)
      "sampling": {"decode": "argmax", "ignored_file_defaults": {...}},  # model defaults set aside
      "runtime": {"kernel_build_seconds": float, "selected_kernel": str},  # built before the timed load
      "artifact": {"key": str, "path": str, "reused": bool},
      "quant": {"stored_bytes": int,            # all weights as stored (packed ints as stored)
                "bits_per_weight": float,       # 8 * stored_bytes / parameter count, whole model
                "bits_per_weight_quantized": float,  # over the quantized layers only
                "group_size": int | None, "quant_seconds": float, "quant_peak_bytes": int,
                "fallback_tensors": int | None},
      "memory": {"weight_bytes": int, "kv_bytes_per_token": float,
                 "peak_bytes": {"<depth>": int},
                 "kind": "cpu_vmhwm" | "cuda_max_allocated" | "cuda_nvml_process" | "cuda_nvml_device",
                 "nvml_peak_bytes": {"<depth>": int}, "nvml_kind": str,   # CUDA transformers tiers:
                 "nvml": str},                    # NVML beside torch's counter, or why it is absent
      "speed": {"<depth>": {"ttft_s": float, "prefill_tokens_per_s": float,
                            "decode_tokens_per_s": float, "roofline_tokens_per_s": float,
                            "roofline_share": float, "ttft_s_all": [..], "decode_tokens_per_s_all": [..]}},
      "quality": {"engine": "real" | "dequantized" | "reference",
                  "fidelity": {"kld_mean", "kld_se", "kld_median", "kld_p99", "kld_max",
                               "same_top_rate", "ppl_ratio", "ppl_ratio_se", "delta_p_mean",
                               "delta_p_rms", "n_tokens", "kld_by_bucket": {"0-255": float, ...}},
                  "behaviour": {"pass_rate", "pass_ci_low", "pass_ci_high", "n_checks",
                                "flips_pass_to_fail", "flips_fail_to_pass", "flip_rate",
                                "budget_exhausted_rate", "thinking_exhausted_rate",
                                "rouge_l", "chrf", "first_divergence_mean", "n_items"},
                  "lm_eval": {"<task>": {"<metric>": float}}},
      "load": {"depth": int, "output_tokens": int, "requests_per_stream": int, "prefill_chunk": int,
               "slo": {"ttft_p95_s": float, "itl_p95_s": float}, "scheduling": ["continuous" | "static"],
               "users_at_slo": int, "batching_gain": {"<N>": float}, "max_decode_tokens_per_s": float,
               "max_decode_at_concurrency": int, "requests_not_admitted": int,
               "kv_bytes_per_token": float, "kv_budget_bytes": float, "kv_budget_source": str,
               "engine": str, "backend": str, "device": str, "threads": int, "held_bytes": int,
               "points": [{"concurrency": int, "admitted": bool, "reason": str | None,
                           "scheduling": str, "requests": int, "requests_not_admitted": int,
                           "output_tokens": int, "duration_s": float, "decode_tokens_per_s": float,
                           "requests_per_s": float, "ttft_s": {"p50", "p95", "p99"},
                           "itl_s": {"p50", "p95", "p99"}, "e2e_s": {"p50", "p95"},
                           "tpot_mean_s": float, "decode_step_tokens_per_s": float,
                           "goodput_tokens_per_s": float, "slo_attainment": float, "meets_slo": bool,
                           "peak_bytes": int, "kv_bytes_peak": int, "kv_pool_bytes": int | None,
                           "steps": int, "details": {...engine extras...}}]}
              | {"error": str, "points": []}   # the load stage failed (the tier's other results stand)
              | None,                          # no sweep (load.enabled false, or an engine that cannot batch)
      "timings": {"prepare_s": float, "measure_s": float, "load_s": float, "quality_s": float}
    }

Load figures: seconds, tokens/s, bytes; definitions in :mod:`qeval.measure.load`.

Depth keys are strings in JSON (``"1024"``).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import QevalInputError

STATUS_OK = "ok"
STATUS_FAILED = "failed"
STATUS_NOT_BUILT = "not_built"


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


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """:func:`atomic_write_text` of ``json.dumps(obj, indent=2)``."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_json(path: str | Path) -> Any:
    """Load a JSON file.

    Raises:
        QevalInputError: missing or malformed file (names the file and line).
    """
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QevalInputError("file not found", file=p) from None
    except json.JSONDecodeError as e:
        raise QevalInputError(f"not valid JSON: {e.msg}", file=p, line=e.lineno) from None


def load_run(run_dir: str | Path) -> tuple[dict, dict[str, dict]]:
    """Read a run folder: ``(run.json content, {tier name: tier result})``, tiers in
    recipe order.

    Raises:
        QevalInputError: not a run folder, or a malformed JSON file in it.
    """
    d = Path(run_dir)
    if not (d / "run.json").is_file():
        raise QevalInputError("not a qeval run folder (no run.json)", file=d)
    run = read_json(d / "run.json")
    order = [t["name"] for t in run.get("recipe", {}).get("tiers", [])]
    tiers: dict[str, dict] = {}
    for name in order:
        p = d / "tiers" / f"{name}.json"
        if p.is_file():
            tiers[name] = read_json(p)
    for p in sorted((d / "tiers").glob("*.json")) if (d / "tiers").is_dir() else []:
        if p.stem not in tiers:
            tiers[p.stem] = read_json(p)
    return run, tiers


def get_path(obj: dict | None, *keys: Any) -> Any:
    """``obj[k1][k2]...`` or None when any level is missing (depth keys may be int or str)."""
    cur: Any = obj
    for k in keys:
        if not isinstance(cur, dict):
            return None
        if k in cur:
            cur = cur[k]
        elif str(k) in cur:
            cur = cur[str(k)]
        else:
            return None
    return cur
