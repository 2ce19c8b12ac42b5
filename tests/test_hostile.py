"""Hostile and broken input (issue 15): a corpus of malformed recipes, suite rows, model
configs, run folders and flags, each driven through the real CLI in its own process
(``tests/hostile_driver.py``: 1 GiB address-space cap, 10 s limit), each answered with the
documented exit code and, for bad input, exactly one line on stderr and no traceback.

Each case says which class of the issue it covers:
1 memory/stack/time, 2 regex, 3 model configs, 4 names, 5 run folders, 6 outputs,
7 resume, 8 loose values, 9 messages.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURE_RUN = REPO / "tests" / "fixtures" / "run_synthetic"
TIME_LIMIT_S = 120.0  # a hang guard (tests/hostile_driver.py kills the case), not a timing check
MEMORY_LIMIT_BYTES = 1 << 30


@dataclass
class Case:
    id: str
    cls: int                      # the class (1-9)
    argv: list[str]
    rc: int
    want: tuple[str, ...] = ()    # substrings of the one stderr line (placeholders {D}, {R})
    files: dict[str, Any] = field(default_factory=dict)
    setup: Callable[[Path, Path], None] | None = None
    check: Callable[[Path, dict], None] | None = None


CASES: list[Case] = []


def add(*cases: Case) -> None:
    CASES.extend(cases)


# ---- building blocks ----------------------------------------------------------------------

HEAD = "name: h\nmodel: {source: {R}/m}\n"
TIERS = "tiers:\n  - {name: bf16, method: bf16}\n  - {name: i8, method: int8}\n"
GOOD = HEAD + TIERS
ROW = {"id": "a", "category": "c", "turns": [{"user": "hi", "checks": [{"kind": "min_words", "value": 1}]}]}


def row_with(check: dict) -> str:
    r = json.loads(json.dumps(ROW))
    r["turns"][0]["checks"] = [check]
    return json.dumps(r)


def recipe(id: str, cls: int, text: str | bytes, rc: int = 2, *want: str) -> Case:
    return Case(id, cls, ["validate", "{D}/r.yaml"], rc, want or ("{D}/r.yaml",), files={"r.yaml": text})


def suite(id: str, cls: int, rows: str | bytes, *want: str, rc: int = 2) -> Case:
    return Case(id, cls, ["validate", "{D}/r.yaml"], rc, want or ("{D}/s.jsonl",),
                files={"s.jsonl": rows, "r.yaml": GOOD + "suites: [{name: s, path: {D}/s.jsonl, kind: long_output}]\n"})


def config(id: str, cls: int, cfg: str | bytes, *want: str, tiers: str = TIERS) -> Case:
    return Case(id, cls, ["validate", "{D}/r.yaml"], 2, want or ("{D}/mm/config.json",),
                files={"mm/config.json": cfg, "r.yaml": "name: h\nmodel: {source: {D}/mm}\n" + tiers})


def plan_model(id: str, cls: int, cfg: str | bytes, *want: str, extra: tuple[str, ...] = (), rc: int = 2) -> Case:
    return Case(id, cls, ["plan", "--model", "{D}/config.json", *extra], rc, want, files={"config.json": cfg})


def _copy_run(d: Path) -> Path:
    run = d / "run"
    shutil.copytree(FIXTURE_RUN, run)
    return run


def _edit_json(p: Path, fn: Callable[[Any], Any]) -> None:
    p.write_text(json.dumps(fn(json.loads(p.read_text()))))


def run_folder(id: str, cls: int, mutate: Callable[[Path], None], *want: str, argv: tuple[str, ...] = ("gate",),
               rc: int = 2, check: Callable[[Path, dict], None] | None = None) -> Case:
    def setup(d: Path, root: Path) -> None:
        mutate(_copy_run(d))
    return Case(id, cls, [*argv, "{D}/run"], rc, want, setup=setup, check=check)


def no_outputs_written(d: Path, res: dict) -> None:
    for name in ("table.md", "table.csv", "gate.json", "report.html"):
        assert not (d / "run" / name).exists(), f"{name} written although the command failed"


def lol(levels: int = 9, width: int = 9) -> str:
    """A "billion laughs": each anchor is a list of `width` aliases of the one before."""
    out = "lol0: &a0 [" + ",".join(["lol"] * width) + "]\n"
    for i in range(1, levels):
        out += f"lol{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]\n"
    return out


# ---- 1. memory, stack, time ---------------------------------------------------------------

add(
    recipe("yaml-billion-laughs", 1, GOOD + lol(), 2, "{D}/r.yaml:", "aliases expanded"),
    recipe("yaml-billion-laughs-in-tiers", 1, HEAD + lol() + "tiers: *a8\n", 2, "{D}/r.yaml:", "aliases expanded"),
    recipe("yaml-deep-flow-list", 1, HEAD + "tiers: " + "[" * 3000 + "]" * 3000 + "\n", 2, "{D}/r.yaml:3"),
    recipe("yaml-deep-flow-map", 1, HEAD + TIERS + "x: " + "{a: " * 500 + "1" + "}" * 500 + "\n", 2,
           "{D}/r.yaml:", "nested more than 64"),
    recipe("yaml-deep-block", 1, HEAD + TIERS + "".join("  " * i + "k:\n" for i in range(200)), 2,
           "{D}/r.yaml:", "nested more than 64"),
    recipe("yaml-recursive-alias", 1, HEAD + "tiers: &t [*t]\n", 2, "{D}/r.yaml:3", "recursive"),
    Case("validate-dev-zero", 1, ["validate", "/dev/zero"], 2, ("/dev/zero", "not a regular file")),
    Case("validate-directory", 1, ["validate", "{D}"], 2, ("{D}", "folder")),
    Case("validate-fifo", 1, ["validate", "{D}/fifo.yaml"], 2, ("fifo.yaml", "not a regular file"),
         setup=lambda d, r: os.mkfifo(d / "fifo.yaml")),
    recipe("yaml-too-large", 1, GOOD + ("# padding padding padding padding padding\n" * 30000), 2,
           "{D}/r.yaml", "more than the 1,048,576"),
    Case("yaml-sparse-10gib", 1, ["validate", "{D}/r.yaml"], 2, ("{D}/r.yaml", "bytes"),
         setup=lambda d, r: os.truncate(_touch(d / "r.yaml"), 10 << 30)),
    recipe("yaml-int-5000-digits", 1, GOOD + "threads: 1" + "0" * 5000 + "\n", 2, "{D}/r.yaml", "cannot be read"),
    recipe("yaml-int-400-digits", 8, GOOD + "threads: 1" + "0" * 400 + "\n", 2, "{D}/r.yaml:6", "threads",
           "less than or equal to 1024"),
    recipe("yaml-bad-timestamp", 1, GOOD + "x: 2024-13-45\n", 2, "{D}/r.yaml", "cannot be read"),
    recipe("yaml-python-tag", 1, "name: !!python/object/apply:os.system [echo pwned]\n" + GOOD[8:], 2,
           "{D}/r.yaml:1", "not valid YAML"),
    recipe("yaml-binary-tag", 8, "name: !!binary aGVsbG8=\nmodel: {source: {R}/m}\n" + TIERS, 2,
           "{D}/r.yaml:1", "name"),
    recipe("yaml-set-tag", 8, HEAD + "tiers: !!set {a, b}\n", 2, "{D}/r.yaml:3", "tiers"),
    recipe("yaml-sequence-key", 1, GOOD + "? [a, b]\n: 1\n", 2, "{D}/r.yaml"),
    recipe("yaml-two-documents", 1, GOOD + "---\nname: other\n", 2, "{D}/r.yaml", "not valid YAML"),
    recipe("yaml-empty", 1, "", 2, "{D}/r.yaml", "mapping"),
    recipe("yaml-scalar", 1, "just text\n", 2, "{D}/r.yaml:1", "mapping"),
    recipe("yaml-list", 1, "[1, 2, 3]\n", 2, "{D}/r.yaml:1", "mapping"),
    recipe("yaml-not-utf8", 1, b"name: h\xff\xfe\n", 2, "{D}/r.yaml:1", "UTF-8"),
    recipe("yaml-nul-bytes", 1, b"name: h\x00\x00\n", 2, "{D}/r.yaml"),
    recipe("yaml-huge-string", 9, GOOD + "device: '" + "x" * 900_000 + "'\n", 2, "{D}/r.yaml:6", "device"),
    recipe("quality-bf16-matmul-unknown", 8, GOOD + "quality: {bf16_matmul: fast}\n", 2, "{D}/r.yaml:6",
           "bf16_matmul"),
    recipe("yaml-huge-method", 9, HEAD + "tiers: [{name: a, method: '" + "m" * 50_000 + "'}]\n", 2,
           "{D}/r.yaml:3", "unknown method"),
)


def _touch(p: Path) -> Path:
    p.write_bytes(b"")
    return p


# ---- 2. regex checks ----------------------------------------------------------------------

add(
    suite("regex-repeat-2**32", 2, row_with({"kind": "regex", "pattern": "a{4294967296}"}),
          "{D}/s.jsonl:1", "pattern", "above 1000"),
    suite("regex-repeat-1e8", 2, row_with({"kind": "regex", "pattern": "a{100000000}"}),
          "{D}/s.jsonl:1", "pattern", "above 1000"),
    suite("regex-nested-counted-repeats", 2, row_with({"kind": "regex", "pattern": "((a{100}){100}){100}"}),
          "{D}/s.jsonl:1", "pattern", "expand"),
    suite("regex-5000-nested-groups", 2, row_with({"kind": "regex", "pattern": "(" * 5000 + "a" + ")" * 5000}),
          "{D}/s.jsonl:1", "turns[0].checks[0].pattern"),
    suite("regex-1000-nested-groups", 2, row_with({"kind": "regex", "pattern": "(" * 400 + "a" + ")" * 400}),
          "{D}/s.jsonl:1", "nested more than 32"),
    suite("regex-very-long", 2, row_with({"kind": "regex", "pattern": "ab" * 3000}), "{D}/s.jsonl:1", "characters"),
    suite("regex-invalid", 2, row_with({"kind": "regex", "pattern": "(unclosed"}), "{D}/s.jsonl:1",
          "invalid regular expression"),
    suite("regex-bad-escape", 2, row_with({"kind": "regex", "pattern": "\\"}), "{D}/s.jsonl:1",
          "invalid regular expression"),
    suite("regex-flags-bad", 2, row_with({"kind": "regex", "pattern": "a", "flags": "ix"}), "{D}/s.jsonl:1", "flags"),
    suite("regex-pattern-number", 2, row_with({"kind": "regex", "pattern": 5}), "{D}/s.jsonl:1", "pattern"),
    suite("regex-catastrophic-accepted", 2, row_with({"kind": "regex", "pattern": "(a+)+$"}), rc=0),
)

# ---- suite rows: bounded JSONL ------------------------------------------------------------

add(
    suite("row-deep-5000", 1, '{"id": "a", "x": ' + "[" * 5000 + "]" * 5000 + "}", "{D}/s.jsonl:1", "nested"),
    suite("row-deep-100", 1, json.dumps(dict(ROW, category=None)).replace('null', "[" * 100 + "]" * 100),
          "{D}/s.jsonl:1", "nested more than 64"),
    suite("row-int-5000-digits", 1, '{"id": "a", "max_new_tokens": 1' + "0" * 5000 + "}", "{D}/s.jsonl:1"),
    suite("row-nan", 8, json.dumps(ROW)[:-1] + ', "max_new_tokens": NaN}', "{D}/s.jsonl:1", "NaN"),
    suite("row-duplicate-key", 1, '{"id": "a", "id": "b"}', "{D}/s.jsonl:1", "duplicate key"),
    suite("row-not-utf8", 1, b'{"id": "\xff"}\n', "{D}/s.jsonl:1", "UTF-8"),
    suite("row-is-list", 1, "[1, 2]", "{D}/s.jsonl:1", "JSON object"),
    suite("row-empty-file", 1, "\n\n", "{D}/s.jsonl", "no items"),
    suite("row-max-new-tokens-string", 8, json.dumps(dict(ROW, max_new_tokens="5")), "{D}/s.jsonl:1",
          "max_new_tokens"),
    suite("row-min-words-true", 8, row_with({"kind": "min_words", "value": True}), "{D}/s.jsonl:1", "value"),
    Case("suite-is-directory", 1, ["validate", "{D}/r.yaml"], 2, ("{D}/sdir",),
         files={"sdir/x": "", "r.yaml": GOOD + "suites: [{name: s, path: {D}/sdir, kind: long_output}]\n"}),
    Case("suite-dev-zero", 1, ["validate", "{D}/r.yaml"], 2, ("/dev/zero", "is not a file"),
         files={"r.yaml": GOOD + "suites: [{name: s, path: /dev/zero, kind: long_output}]\n"}),
    Case("suite-sparse-100gib", 1, ["validate", "{D}/r.yaml"], 2, ("{D}/s.jsonl", "bytes"),
         files={"r.yaml": GOOD + "suites: [{name: s, path: {D}/s.jsonl, kind: long_output}]\n"},
         setup=lambda d, r: os.truncate(_touch(d / "s.jsonl"), 100 << 30)),
)

# ---- 3. model configs ---------------------------------------------------------------------

GPTQ = TIERS + "  - {name: g, method: gptq}\n"
add(
    config("config-array", 3, "[1, 2, 3]", "{D}/mm/config.json:1", "JSON object"),
    config("config-array-gptq", 3, "[1, 2, 3]", "{D}/mm/config.json:1", "JSON object", tiers=GPTQ),
    config("config-string-layers", 3, '{"num_hidden_layers": "2", "max_position_embeddings": 4096}',
           "{D}/mm/config.json", "num_hidden_layers"),
    config("config-string-context", 3, '{"max_position_embeddings": "4096"}', "{D}/mm/config.json",
           "max_position_embeddings"),
    config("config-bool-heads-gptq", 3, '{"num_attention_heads": true}', "{D}/mm/config.json",
           "num_attention_heads", tiers=GPTQ),
    config("config-not-json", 3, "this is not json", "{D}/mm/config.json:1", "invalid JSON"),
    config("config-not-json-gptq", 3, "{oops", "{D}/mm/config.json:1", "invalid JSON", tiers=GPTQ),
    config("config-huge-int", 3, '{"num_hidden_layers": 1' + "0" * 400 + "}", "{D}/mm/config.json",
           "num_hidden_layers"),
    config("config-5000-digits", 3, '{"num_hidden_layers": 1' + "0" * 5000 + "}", "{D}/mm/config.json"),
    config("config-deep", 3, '{"a": ' + "[" * 3000 + "]" * 3000 + "}", "{D}/mm/config.json", "nested"),
    config("config-not-utf8", 3, b'{"a": "\xff"}', "{D}/mm/config.json:1", "UTF-8"),
    config("config-text-config-list", 3, '{"text_config": []}', "{D}/mm/config.json", "text_config"),
    recipe("source-nosuchuser", 3, "name: h\nmodel: {source: ~nosuchuser1234/m}\n" + TIERS, 2,
           "{D}/r.yaml:2", "model.source", "no such user"),
    Case("config-is-directory", 3, ["validate", "{D}/r.yaml"], 2, ("{D}/r.yaml:2", "no config.json"),
         files={"mm/config.json/x": "", "r.yaml": "name: h\nmodel: {source: {D}/mm}\n" + TIERS}),
    plan_model("plan-config-array", 3, "[]", "{D}/config.json:1", "JSON object"),
    plan_model("plan-config-string-field", 3, '{"num_hidden_layers": "24"}', "{D}/config.json", "num_hidden_layers"),
    plan_model("plan-config-not-json", 3, "nope", "{D}/config.json:1", "invalid JSON"),
    plan_model("plan-config-10**400-layers", 1, json.dumps({"num_hidden_layers": 10 ** 400, "hidden_size": 64}),
               "{D}/config.json", "num_hidden_layers"),
    plan_model("plan-config-missing-field", 3, '{"num_hidden_layers": 2}', "hidden_size"),
    Case("plan-model-nosuchuser", 3, ["plan", "--model", "~nosuchuser1234/config.json"], 2,
         ("--model", "no such user")),
    Case("plan-model-dev-zero", 1, ["plan", "--model", "/dev/zero"], 2, ("/dev/zero", "not a regular file")),
)

LLAMA = json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
                    "max_position_embeddings": 8192})
add(
    plan_model("plan-control", 3, LLAMA, rc=0),
    plan_model("plan-gpu-mem-400-zeros", 1, LLAMA, "--gpu-mem", "too large", extra=("--gpu-mem", "1" + "0" * 400 + "GiB")),
    plan_model("plan-gpu-mem-long-fraction", 1, LLAMA, rc=0, extra=("--gpu-mem", "0." + "5" * 400 + "GiB")),
    plan_model("plan-gpu-mem-word", 9, LLAMA, "--gpu-mem", "not a memory size", extra=("--gpu-mem", "lots")),
    plan_model("plan-users-negative", 9, LLAMA, "--users", extra=("--users", "-1")),
    plan_model("plan-context-zero", 9, LLAMA, "--context", extra=("--context", "0")),
    plan_model("plan-context-huge", 1, LLAMA, "--context", extra=("--context", "1" + "0" * 30)),
    plan_model("plan-overhead-negative", 9, LLAMA, "--overhead", extra=("--overhead", "-1GiB")),
)

# ---- 4. names -----------------------------------------------------------------------------

add(
    recipe("name-trailing-newline", 4, 'name: "h\\n"\nmodel: {source: {R}/m}\n' + TIERS, 2, "{D}/r.yaml:1", "name"),
    recipe("name-300-chars", 4, f"name: {'n' * 300}\nmodel: {{source: {{R}}/m}}\n" + TIERS, 2,
           "{D}/r.yaml:1", "at most 64"),
    recipe("name-dotdot", 4, "name: a..b\nmodel: {source: {R}/m}\n" + TIERS, 2, "{D}/r.yaml:1", "name"),
    recipe("tier-name-traversal", 4, HEAD + "tiers: [{name: ../../x, method: bf16}]\n", 2,
           "{D}/r.yaml:3", "tiers[0].name"),
    recipe("tier-name-trailing-newline", 4, HEAD + 'tiers: [{name: "bf16\\n", method: bf16}]\n', 2,
           "{D}/r.yaml:3", "tiers[0].name"),
    recipe("tier-name-300-chars", 4, HEAD + f"tiers: [{{name: {'t' * 300}, method: bf16}}]\n", 2,
           "{D}/r.yaml:3", "at most 64"),
    recipe("tier-name-number", 4, HEAD + "tiers: [{name: 5, method: bf16}]\n", 2, "{D}/r.yaml:3", "tiers[0].name"),
    recipe("suite-name-slash", 4, GOOD + "suites: [{name: a/b, path: x.jsonl, kind: long_output}]\n", 2,
           "{D}/r.yaml:6", "suites[0].name"),
    recipe("suite-name-300-chars", 4, GOOD + f"suites: [{{name: {'s' * 300}, path: x.jsonl, kind: long_output}}]\n",
           2, "{D}/r.yaml:6", "suites[0].name"),
)

# ---- 8. loose values ----------------------------------------------------------------------

add(
    recipe("trust-remote-code-yes", 8, 'name: h\nmodel: {source: {R}/m, trust_remote_code: "yes"}\n' + TIERS, 2,
           "{D}/r.yaml:2", "model.trust_remote_code", "valid boolean"),
    recipe("trust-remote-code-1", 8, "name: h\nmodel: {source: {R}/m, trust_remote_code: 1}\n" + TIERS, 2,
           "{D}/r.yaml:2", "model.trust_remote_code"),
    recipe("threads-string", 8, GOOD + 'threads: "4"\n', 2, "{D}/r.yaml:6", "threads", "valid integer"),
    recipe("threads-huge", 8, GOOD + "threads: 100000\n", 2, "{D}/r.yaml:6", "threads"),
    recipe("threads-float", 8, GOOD + "threads: 2.5\n", 2, "{D}/r.yaml:6", "threads"),
    recipe("work-threads-zero", 8, GOOD + "work_threads: 0\n", 2, "{D}/r.yaml:6", "work_threads"),
    recipe("group-size-true", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: g, method: gptq, group_size: true}]\n",
           2, "{D}/r.yaml:3", "tiers[1].group_size"),
    recipe("group-size-string", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: g, method: gptq, group_size: '128'}]\n",
           2, "{D}/r.yaml:3", "tiers[1].group_size"),
    # each tier method owns its schema (qeval/tiers/<method>.py): strict there too
    recipe("awq-group-size-huge", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: a, method: awq, group_size: 10000000}]\n",
           2, "{D}/r.yaml:3", "tiers[1].group_size"),
    recipe("awq-sym-string", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: a, method: awq, sym: 'no'}]\n",
           2, "{D}/r.yaml:3", "tiers[1].sym"),
    recipe("gguf-flash-attn-1", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: q, method: gguf, flash_attn: 1}]\n",
           2, "{D}/r.yaml:3", "tiers[1].flash_attn"),
    recipe("gguf-type-huge", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: q, method: gguf, type: " + "Q" * 5000 + "}]\n",
           2, "{D}/r.yaml:3", "tiers[1].type"),
    recipe("fp8-kv-cache-number", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: f, method: fp8, kv_cache: 8}]\n",
           2, "{D}/r.yaml:3", "tiers[1].kv_cache"),
    recipe("int8-decode-true", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: i, method: int8, decode: true}]\n",
           2, "{D}/r.yaml:3", "tiers[1].decode"),
    recipe("tier-name-newline", 4, HEAD + 'tiers: [{name: bf16, method: bf16}, {name: "fp8\\n", method: fp8}]\n',
           2, "{D}/r.yaml:3", "tiers[1].name"),
    recipe("bits-true", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: g, method: gptq, bits: true}]\n",
           2, "{D}/r.yaml:3", "tiers[1].bits"),
    recipe("sym-string", 8, HEAD + "tiers: [{name: bf16, method: bf16}, {name: g, method: gptq, sym: 'no'}]\n",
           2, "{D}/r.yaml:3", "tiers[1].sym"),
    recipe("timeout-nan", 8, GOOD + "speed: {timeout_s: .nan}\n", 2, "{D}/r.yaml:6", "speed.timeout_s", "finite"),
    recipe("timeout-negative", 8, GOOD + "speed: {timeout_s: -5}\n", 2, "{D}/r.yaml:6", "speed.timeout_s"),
    recipe("timeout-inf", 8, GOOD + "speed: {timeout_s: .inf}\n", 2, "{D}/r.yaml:6", "speed.timeout_s"),
    recipe("stage-timeout-nan", 8, GOOD + "stage_timeout_s: .nan\n", 2, "{D}/r.yaml:6", "stage_timeout_s"),
    recipe("depth-huge", 1, GOOD + "speed: {depths: [1" + "0" * 30 + "]}\n", 2, "{D}/r.yaml:6", "speed.depths[0]"),
    recipe("gate-candidates-empty", 8, GOOD + "gate: {candidates: []}\n", 2, "{D}/r.yaml:6", "gate.candidates"),
    recipe("gate-depth-huge", 1, GOOD + "gate: {depth: 1" + "0" * 400 + "}\n", 2, "{D}/r.yaml:6", "gate.depth"),
    recipe("storage-no-protocol", 8, GOOD + 'storage: "://x"\n', 2, "{D}/r.yaml:6", "storage"),
    recipe("storage-empty", 8, GOOD + 'storage: ""\n', 2, "{D}/r.yaml:6", "storage"),
    recipe("bootstrap-huge", 1, GOOD + "quality: {bootstrap: 1000000000000}\n", 2, "{D}/r.yaml:6", "quality.bootstrap"),
    recipe("depths-many", 1, GOOD + "speed: {depths: [" + ",".join(str(i) for i in range(1, 200)) + "]}\n", 2,
           "{D}/r.yaml:6", "speed.depths"),
    Case("lm-eval-not-yaml", 8, ["validate", "{D}/r.yaml"], 2, ("{D}/r.yaml:6", "quality.lm_eval_tasks[0]", ".yaml"),
         files={"t.jsonl": "{}", "r.yaml": GOOD + "quality: {lm_eval_tasks: [{D}/t.jsonl]}\n"}),
    Case("lm-eval-missing", 8, ["validate", "{D}/r.yaml"], 2, ("{D}/r.yaml:6", "not found"),
         files={"r.yaml": GOOD + "quality: {lm_eval_tasks: [{D}/nope.yaml]}\n"}),
    Case("lm-eval-no-task", 8, ["validate", "{D}/r.yaml"], 2, ("{D}/t.yaml", "task"),
         files={"t.yaml": "dataset_path: json\n", "r.yaml": GOOD + "quality: {lm_eval_tasks: [{D}/t.yaml]}\n"}),
    Case("lm-eval-task-name-traversal", 5, ["validate", "{D}/r.yaml"], 2, ("{D}/t.yaml", "task", "plain name"),
         files={"t.yaml": "task: ../../../etc/evil\n", "r.yaml": GOOD + "quality: {lm_eval_tasks: [{D}/t.yaml]}\n"}),
    Case("lm-eval-billion-laughs", 1, ["validate", "{D}/r.yaml"], 2, ("{D}/t.yaml", "aliases"),
         files={"t.yaml": "task: t\n" + lol(), "r.yaml": GOOD + "quality: {lm_eval_tasks: [{D}/t.yaml]}\n"}),
    Case("suite-path-nosuchuser", 8, ["validate", "{D}/r.yaml"], 2, ("{D}/r.yaml:6", "suites[0].path", "no such user"),
         files={"r.yaml": GOOD + "suites: [{name: s, path: ~nosuchuser1234/s.jsonl, kind: long_output}]\n"}),
    recipe("control-good", 8, GOOD, 0),
    recipe("control-float-1e-3", 8, GOOD + "gate: {rules: {min_decode_rel: 1e-3}}\n", 0),
    Case("key-900k-characters", 8, ["validate", "{D}/r.yaml"], 2,
         ("{D}/r.yaml:", "...(900000 characters): unknown field"),
         files={"r.yaml": GOOD + "? " + "k" * 900_000 + "\n: 1\n"},
         check=lambda d, res: _short_line(res)),
    recipe("rule-never-computed", 8, GOOD + "gate: {rules: {max_kld_mean: 0.5}}\n", 2,
           "{D}/r.yaml", "gate.rules.max_kld_mean", "needs a long_output or multi_turn suite"),
)

# ---- 9. messages --------------------------------------------------------------------------


def _short_line(res: dict) -> None:
    """The one-line error stays one short line whatever the size of what it names."""
    assert len(res["stderr"]) < 400 and res["stderr"].count("\n") <= 1, res["stderr"][:400]


def _no_value_error(d: Path, res: dict) -> None:
    assert "Value error" not in res["stderr"]


add(
    Case("message-no-value-error-prefix", 9, ["validate", "{D}/r.yaml"], 2,
         ("{D}/r.yaml:6", "speed.depths", "at least one depth"), files={"r.yaml": GOOD + "speed: {depths: []}\n"},
         check=_no_value_error),
    Case("message-no-value-error-prefix-name", 9, ["validate", "{D}/r.yaml"], 2, ("{D}/r.yaml:1",),
         files={"r.yaml": "name: a/b\nmodel: {source: {R}/m}\n" + TIERS}, check=_no_value_error),
    Case("validate-missing-file", 9, ["validate", "{D}/nope.yaml"], 2, ("{D}/nope.yaml", "not found")),
)

# ---- 5. run folders -----------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[Path], None]:
    """Mutation: set a dotted key of a file in the run folder (``run.json:recipe.gate.depth``)."""
    fname, dotted = path.split(":", 1)

    def mutate(run: Path) -> None:
        def fn(obj: Any) -> Any:
            cur = obj
            keys = dotted.split(".")
            for k in keys[:-1]:
                cur = cur[int(k)] if isinstance(cur, list) else cur[k]
            last = keys[-1]
            if isinstance(cur, list):
                cur[int(last)] = value
            else:
                cur[last] = value
            return obj
        _edit_json(run / fname, fn)
    return mutate


def _write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    def mutate(run: Path) -> None:
        p = run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    return mutate


def _tier_dir(run: Path) -> None:
    (run / "tiers" / "int8.json").unlink()
    (run / "tiers" / "int8.json").mkdir()


def _traversal(run: Path) -> None:
    (run.parent / "x.json").write_text('{"tier": "secret", "status": "ok", "error": "SECRET-CONTENT"}')
    _set("run.json:recipe.tiers.1.name", "../x")(run)


def _symlink_out(run: Path) -> None:
    (run.parent / "outside.json").write_text('{"status": "ok", "error": "SECRET-CONTENT"}')
    (run / "tiers" / "int8.json").unlink()
    (run / "tiers" / "int8.json").symlink_to(run.parent / "outside.json")


def _long_error(run: Path) -> None:
    def fn(t: dict) -> dict:
        t.update(status="failed", error="\n".join(f"line {i} of a very long log" for i in range(200_000)))
        return t
    _edit_json(run / "tiers" / "int8.json", fn)


def _short_stdout(d: Path, res: dict) -> None:
    assert len(res["stdout"]) < 100_000, len(res["stdout"])
    assert "more lines" in res["stdout"]


def _only_reference(run: Path) -> None:
    def fn(r: dict) -> dict:
        r["recipe"]["tiers"] = r["recipe"]["tiers"][:1]
        return r
    _edit_json(run / "run.json", fn)
    for p in (run / "tiers").glob("*.json"):
        if p.stem != "bf16":
            p.unlink()


def _assert(ok: bool, why: str) -> None:
    assert ok, why


def _no_secret(d: Path, res: dict) -> None:
    assert "SECRET" not in res["stdout"] + res["stderr"]
    no_outputs_written(d, res)


add(
    run_folder("tier-json-list", 5, _write("tiers/int8.json", "[1, 2]"), "{D}/run/tiers/int8.json:1", "object",
               check=no_outputs_written),
    run_folder("tier-json-not-utf8", 5, _write("tiers/int8.json", b'{"status": "\xff"}'),
               "{D}/run/tiers/int8.json:1", "UTF-8"),
    run_folder("tier-json-directory", 5, _tier_dir, "{D}/run/tiers/int8.json", "folder"),
    run_folder("tier-json-invalid", 5, _write("tiers/int8.json", "{"), "{D}/run/tiers/int8.json:1", "invalid JSON"),
    run_folder("tier-json-deep", 1, _write("tiers/int8.json", '{"quant": ' + "[" * 3000 + "]" * 3000 + "}"),
               "{D}/run/tiers/int8.json", "nested"),
    run_folder("tier-memory-list", 5, _set("tiers/int8.json:memory", [1]), "{D}/run/tiers/int8.json", "memory"),
    run_folder("tier-speed-depth-list", 5, _set("tiers/int8.json:speed.1024", [1]), "{D}/run/tiers/int8.json",
               "speed.1024"),
    run_folder("tier-tensor-types-list", 5, _set("tiers/int8.json:quant.tensor_types", ["Q4_K"]),
               "{D}/run/tiers/int8.json", "quant.tensor_types"),
    run_folder("tier-load-list", 5, _set("tiers/int8.json:load", [1]), "{D}/run/tiers/int8.json", "load"),
    run_folder("tier-load-points-strings", 5, _set("tiers/int8.json:load", {"points": ["a"]}),
               "{D}/run/tiers/int8.json", "load.points[0]"),
    run_folder("tier-load-point-no-concurrency", 5, _set("tiers/int8.json:load", {"points": [{"admitted": True}]}),
               "{D}/run/tiers/int8.json", "load.points[0].concurrency"),
    run_folder("tier-load-concurrency-string", 8, _set("tiers/int8.json:load", {"points": [{"concurrency": "4"}]}),
               "{D}/run/tiers/int8.json", "load.points[0].concurrency"),
    run_folder("tier-load-depth-string", 8, _set("tiers/int8.json:load", {"depth": "4096", "points": []}),
               "{D}/run/tiers/int8.json", "load.depth"),
    run_folder("tier-load-scheduling-numbers", 5, _set("tiers/int8.json:load", {"scheduling": [1], "points": []}),
               "{D}/run/tiers/int8.json", "load.scheduling[0]"),
    run_folder("tier-status-number", 5, _set("tiers/int8.json:status", 5), "{D}/run/tiers/int8.json", "status"),
    run_folder("run-json-list", 5, _write("run.json", "[]"), "{D}/run/run.json:1", "object"),
    run_folder("run-json-deep", 1, _write("run.json", '{"x": ' + "[" * 5000 + "]" * 5000 + "}"),
               "{D}/run/run.json", "nested"),
    run_folder("run-json-directory", 5, lambda r: ((r / "run.json").unlink(), (r / "run.json").mkdir()),
               "{D}/run/run.json", "folder"),
    run_folder("run-json-not-json", 5, _write("run.json", "nope"), "{D}/run/run.json:1", "invalid JSON"),
    run_folder("run-json-missing", 5, lambda r: (r / "run.json").unlink(), "{D}/run", "not a qeval run folder"),
    run_folder("recipe-string", 5, _set("run.json:recipe", "a recipe"), "{D}/run/run.json", "recipe"),
    run_folder("recipe-tiers-dict", 5, _set("run.json:recipe.tiers", {"a": 1}), "{D}/run/run.json", "recipe.tiers"),
    run_folder("recipe-tier-without-name", 5, _set("run.json:recipe.tiers.1", {"method": "int8"}),
               "{D}/run/run.json", "recipe.tiers[1].name"),
    run_folder("recipe-tier-name-traversal", 5, _traversal, "{D}/run/run.json", "recipe.tiers[1].name",
               check=_no_secret),
    run_folder("tier-symlink-outside", 5, _symlink_out, "{D}/run/tiers", "outside", check=_no_secret),
    run_folder("gate-depth-10**400", 1, _set("run.json:recipe.gate.depth", 10 ** 400), "{D}/run/run.json",
               "recipe.gate.depth", check=no_outputs_written),
    run_folder("gate-depth-huge-report", 5, _set("run.json:recipe.gate.depth", 10 ** 12), "{D}/run/run.json",
               "recipe.gate.depth", argv=("report",), check=no_outputs_written),
    run_folder("speed-depths-absurd", 1, _set("run.json:recipe.speed.depths", [256, 10 ** 300]), "{D}/run/run.json",
               "recipe.speed.depths[1]", check=no_outputs_written),
    run_folder("run-gate-candidates-empty", 8, _set("run.json:recipe.gate.candidates", []), "{D}/run/run.json",
               "recipe.gate.candidates"),
    run_folder("gate-metric-unknown", 9, _set("run.json:recipe.gate.quality_metric", "vibes"), "{D}/run/run.json",
               "recipe.gate.quality_metric"),
    run_folder("gate-judges-nothing", 8, _only_reference, rc=1),
    Case("gate-judges-nothing-junit", 8, ["gate", "{D}/run", "--junit", "{D}/j.xml"], 1,
         setup=lambda d, r: _only_reference(_copy_run(d)),
         check=lambda d, res: _assert('failures="1"' in (d / "j.xml").read_text() and "no_candidates"
                                      in (d / "j.xml").read_text(), "JUnit must fail a gate that judged nothing")),
    run_folder("failed-tier-200000-line-error", 9, _long_error, rc=1, check=_short_stdout),
    run_folder("report-tier-json-list", 5, _write("tiers/int8.json", "[]"), "{D}/run/tiers/int8.json:1",
               argv=("report",), check=no_outputs_written),
    run_folder("plan-weights-10**400", 1, _set("tiers/int8.json:memory.weight_bytes", 10 ** 400), rc=0,
               argv=("plan",)),
    run_folder("plan-figures-extreme", 1, lambda r: (_set("tiers/int8.json:memory.weight_bytes", -10 ** 300)(r),
                                                      _set("tiers/int8.json:memory.kv_bytes_per_token", 1e-300)(r)),
               rc=0, argv=("plan",)),
    run_folder("plan-weights-float-1e308", 8, _set("tiers/int8.json:memory.weight_bytes", -1e308),
               "{D}/run/tiers/int8.json", "memory.weight_bytes", "integer out of range", argv=("plan",)),
    run_folder("report-gpu-memory-2**70", 1, _set("run.json:gpu_memory_bytes", 2 ** 70), rc=0, argv=("report",)),
    run_folder("report-gpu-memory-1e308", 8, _set("run.json:gpu_memory_bytes", 1e308), "{D}/run/run.json",
               "gpu_memory_bytes", argv=("report",)),
    run_folder("plan-tier-json-list", 5, _write("tiers/int8.json", "[]"), "{D}/run/tiers/int8.json:1",
               argv=("plan",)),
    run_folder("plan-run-json-list", 5, _write("run.json", "[]"), "{D}/run/run.json:1", argv=("plan",)),
    Case("compare-bad-b", 9, ["compare", "{D}/good", "{D}/run"], 2, ("run B", "{D}/run/tiers/int8.json:1"),
         setup=lambda d, r: (shutil.copytree(FIXTURE_RUN, d / "good"), _write("tiers/int8.json", "[]")(_copy_run(d)))),
    Case("compare-bad-a", 9, ["compare", "{D}/run", "{D}/good"], 2, ("run A", "{D}/run/run.json"),
         setup=lambda d, r: (shutil.copytree(FIXTURE_RUN, d / "good"), _write("run.json", "[]")(_copy_run(d)))),
    Case("compare-missing-b", 9, ["compare", "{D}/good", "{D}/nope"], 2, ("RUN_B", "not a qeval run folder"),
         setup=lambda d, r: shutil.copytree(FIXTURE_RUN, d / "good")),
    Case("show-tier-path", 5, ["show", "{D}/run", "../../x"], 2, ("TIER", "no tier"),
         setup=lambda d, r: _copy_run(d)),
    run_folder("report-answers-not-list", 5, _write("answers/int8.json", '{"a": 1}'), "{D}/run/answers/int8.json",
               "array", argv=("report",)),
    run_folder("report-answers-check-list", 8, _write("answers/int8.json", '[{"item": "s/a", "checks": [[1]]}]'),
               "{D}/run/answers/int8.json", "checks", argv=("report",)),
    run_folder("control-gate", 5, lambda r: None, rc=1),
)

# ---- 6. outputs that cannot be written -----------------------------------------------------


def _read_only(d: Path, root: Path) -> None:
    run = _copy_run(d)
    _make_read_only(run)


_READ_ONLY: list[Path] = []  # undone after the corpus ran (pytest must be able to clean up)


def _make_read_only(p: Path) -> None:
    _READ_ONLY.append(p)
    if os.geteuid() == 0:  # root ignores permission bits: the immutable flag binds root too
        subprocess.run(["chattr", "+i", str(p)], check=True)
    else:
        p.chmod(0o555)


def _undo_read_only(p: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(p)], check=False)
    else:
        p.chmod(0o755)


def _run_setup(d: Path, root: Path) -> None:
    shutil.copytree(FIXTURE_RUN, d / "run")


RUN_RECIPE = {"r.yaml": GOOD}
add(
    Case("report-read-only-run", 6, ["report", "{D}/run"], 2, ("{D}/run", "cannot write"), setup=_read_only),
    Case("gate-read-only-run", 6, ["gate", "{D}/run", "--junit", "{D}/j.xml"], 2, ("{D}/run", "cannot write"),
         setup=_read_only),
    Case("gate-junit-directory", 6, ["gate", "{D}/run", "--junit", "{D}"], 2, ("--junit", "folder"),
         setup=_run_setup, check=no_outputs_written),
    Case("gate-junit-empty", 6, ["gate", "{D}/run", "--junit", ""], 2, ("--junit", "empty"),
         setup=_run_setup, check=no_outputs_written),
    Case("gate-junit-proc", 6, ["gate", "{D}/run", "--junit", "/proc/qeval-x/j.xml"], 2, ("--junit",),
         setup=_run_setup, check=no_outputs_written),
    Case("gate-junit-dev-null", 6, ["gate", "{D}/run", "--junit", "/dev/null"], 2, ("--junit", "regular file"),
         setup=_run_setup, check=no_outputs_written),
    Case("gate-junit-is-an-output", 6, ["gate", "{D}/run", "--junit", "{D}/run/gate.json"], 2,
         ("--junit", "own outputs"), setup=_run_setup),
    Case("run-out-dev-null", 6, ["run", "{D}/r.yaml", "--out", "/dev/null"], 2, ("--out", "not a folder"),
         files=RUN_RECIPE),
    Case("run-out-proc", 6, ["run", "{D}/r.yaml", "--out", "/proc/qeval-x"], 2, ("--out",), files=RUN_RECIPE),
    Case("run-out-empty", 6, ["run", "{D}/r.yaml", "--out", ""], 2, ("--out", "empty"), files=RUN_RECIPE),
    Case("run-out-read-only", 6, ["run", "{D}/r.yaml", "--out", "{D}/ro"], 2, ("--out", "cannot write"),
         files={"r.yaml": GOOD, "ro/.keep": ""}, setup=lambda d, r: _make_read_only(d / "ro")),
    Case("run-junit-directory", 6, ["run", "{D}/r.yaml", "--junit", "{D}", "--out", "{D}/res"], 2,
         ("--junit", "folder"), files=RUN_RECIPE),
    Case("run-junit-empty", 6, ["run", "{D}/r.yaml", "--junit", "", "--out", "{D}/res"], 2, ("--junit", "empty"),
         files=RUN_RECIPE),
    Case("run-junit-proc", 6, ["run", "{D}/r.yaml", "--junit", "/proc/qeval-x/j.xml", "--out", "{D}/res"], 2,
         ("--junit",), files=RUN_RECIPE),
)

# ---- 7. resume ----------------------------------------------------------------------------


def _resume_setup(change: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def setup(d: Path, root: Path) -> None:
        sys.path.insert(0, str(REPO))
        from qeval.recipe import parse_recipe
        text = GOOD.replace("{R}", str(root))
        rd = parse_recipe(text, d / "r.yaml").model_dump(mode="json")
        change(rd)
        (d / "prev").mkdir()
        (d / "prev" / "run.json").write_text(json.dumps({"recipe": rd, "started_at": "then"}))
    return setup


def _unchanged(d: Path, res: dict) -> None:
    run = json.loads((d / "prev" / "run.json").read_text())
    assert run == {"recipe": run["recipe"], "started_at": "then"}, "run.json was rewritten"
    assert sorted(p.name for p in (d / "prev").iterdir()) == ["run.json"]


add(
    Case("resume-other-recipe-name", 7, ["run", "{D}/r.yaml", "--resume", "{D}/prev"], 2,
         ("{D}/prev/run.json", "made by recipe 'other'"), files=RUN_RECIPE,
         setup=_resume_setup(lambda rd: rd.update(name="other")), check=_unchanged),
    Case("resume-other-recipe-content", 7, ["run", "{D}/r.yaml", "--resume", "{D}/prev"], 2,
         ("cannot resume", "speed"), files=RUN_RECIPE,
         setup=_resume_setup(lambda rd: rd["speed"].update(depths=[64], main_depth=64)), check=_unchanged),
    Case("resume-other-model", 7, ["run", "{D}/r.yaml", "--resume", "{D}/prev"], 2, ("cannot resume", "model"),
         files=RUN_RECIPE, setup=_resume_setup(lambda rd: rd["model"].update(source="/elsewhere")),
         check=_unchanged),
    Case("resume-run-json-list", 7, ["run", "{D}/r.yaml", "--resume", "{D}/prev"], 2, ("{D}/prev/run.json:1",),
         files={"r.yaml": GOOD, "prev/run.json": "[]"}),
    Case("resume-recipe-string", 7, ["run", "{D}/r.yaml", "--resume", "{D}/prev"], 2,
         ("{D}/prev/run.json", "recipe"), files={"r.yaml": GOOD, "prev/run.json": '{"recipe": "x"}'}),
    Case("resume-no-recipe", 7, ["run", "{D}/r.yaml", "--resume", "{D}/prev"], 2,
         ("{D}/prev/run.json", "recipe", "required field is missing"), files={"r.yaml": GOOD, "prev/run.json": '{}'}),
    Case("resume-not-a-run", 7, ["run", "{D}/r.yaml", "--resume", "{D}"], 2, ("--resume", "not a qeval run folder"),
         files=RUN_RECIPE),
    Case("resume-empty", 7, ["run", "{D}/r.yaml", "--resume", ""], 2, ("--resume", "empty"), files=RUN_RECIPE),
)

# ---- flags --------------------------------------------------------------------------------

add(
    Case("run-tiers-commas", 9, ["run", "{D}/r.yaml", "--tiers", ",,", "--out", "{D}/res"], 2, ("--tiers",),
         files=RUN_RECIPE),
    Case("run-tiers-unknown", 9, ["run", "{D}/r.yaml", "--tiers", "bf16,../x", "--out", "{D}/res"], 2,
         ("--tiers", "'../x'"), files=RUN_RECIPE),
    Case("run-executor-bogus", 9, ["run", "{D}/r.yaml", "--executor", "mars", "--out", "{D}/res"], 2,
         ("--executor",), files=RUN_RECIPE),
    Case("plan-neither", 9, ["plan"], 2, ("give RUN_DIR",)),
    Case("gate-empty-arg", 9, ["gate", ""], 2, ("empty",)),
    Case("gate-nosuchuser", 9, ["gate", "~nosuchuser1234/run"], 2, ("no such user",)),
    Case("usage-unknown-option", 9, ["validate", "--bogus", "x"], 2, ("No such option",)),
)


# ---- the run ------------------------------------------------------------------------------

def _subst(s: str, d: Path, root: Path) -> str:
    return s.replace("{D}", str(d)).replace("{R}", str(root))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    (root / "m").mkdir()
    (root / "m" / "config.json").write_text(LLAMA)
    cases = []
    for c in CASES:
        d = root / c.id
        d.mkdir()
        for rel, content in c.files.items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                p.write_bytes(content)
            else:
                p.write_text(_subst(content, d, root))
        if c.setup is not None:
            c.setup(d, root)
        cases.append({"id": c.id, "argv": [_subst(a, d, root) for a in c.argv], "cwd": str(d),
                      "env": {"QEVAL_CACHE": str(root / "cache"), "COLUMNS": "200"}})
    (root / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    try:
        p = subprocess.run([sys.executable, str(REPO / "tests" / "hostile_driver.py"), str(root / "cases.json"),
                            str(root / "results.json")], env=env, capture_output=True, text=True,
                           timeout=60 + 15 * len(cases))
        assert p.returncode == 0, p.stderr[-3000:]
        results = {r["id"]: r for r in json.loads((root / "results.json").read_text())}
    finally:
        for p in _READ_ONLY:
            _undo_read_only(p)
    return root, results


def test_corpus_is_large_and_covers_every_class():
    assert len(CASES) >= 100, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.cls for c in CASES} == set(range(1, 10))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(corpus, case):
    root, results = corpus
    res = results[case.id]
    d = root / case.id
    out = res["stdout"] + res["stderr"]
    assert not res["timed_out"], f"hung: still running after {TIME_LIMIT_S} s"
    assert res["maxrss_bytes"] < MEMORY_LIMIT_BYTES, res["maxrss_bytes"]
    assert "Traceback" not in out, out[-3000:]
    assert res["rc"] == case.rc, f"exit {res['rc']}, want {case.rc}: {out[-2000:]}"
    lines = res["stderr"].strip().splitlines()
    if case.rc == 2:
        assert len(lines) == 1, res["stderr"][-3000:]
        assert lines[0].startswith("error: "), lines[0]
        assert len(lines[0]) < 2000, len(lines[0])
        for w in case.want:
            assert _subst(w, d, root) in lines[0], (w, lines[0])
    if case.check is not None:
        case.check(d, res)


def test_config_transformers_cannot_read_is_one_line(tmp_path):
    """Class 3, outside the timed corpus (importing torch, transformers and gptqmodel alone
    can take longer than 10 s on a loaded machine): a config.json whose fields pass qeval's
    own checks but that transformers cannot build, with a GPTQ tier, is one line naming
    the config, exit 2."""
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (tmp_path / "r.yaml").write_text(f"name: h\nmodel: {{source: {tmp_path}/mm}}\n" + GPTQ)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "validate", str(tmp_path / "r.yaml")], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert f"{tmp_path}/mm/config.json: " in lines[0] and "transformers" in lines[0]


def test_catastrophic_regex_times_out_as_its_own_state():
    """Class 2: `(a+)+$` on a long reply finishes in bounded time and is reported as timed
    out (passed None), neither a pass nor a fail; the behaviour summary counts it apart."""
    from qeval.measure.behaviour import summarise_behaviour
    from qeval.measure.suites import Check, run_check
    res = run_check(Check("regex", {"pattern": "(a+)+$"}), "a" * 50_000 + "b")  # returns: the timeout fired
    assert res.passed is None and res.status == "timeout" and "timed out" in res.detail
    ok = run_check(Check("regex", {"pattern": "b$"}), "a" * 50_000 + "b")
    assert ok.passed is True and ok.status == "pass"
    segs = [{"item": "s/a", "turn": 0, "answer_ids": [1], "text": "x", "finished": True, "checks": [None, True]}]
    ref = {("s/a", 0): {"checks": [False, True], "answer_ids": [1], "text": "x"}}
    b = summarise_behaviour(segs, ref, n_boot=10)
    assert b["checks_timed_out"] == 1 and b["n_checks"] == 1 and b["pass_rate"] == 1.0
    assert b["flips_fail_to_pass"] == 0 and b["flips_pass_to_fail"] == 0


def test_internal_error_is_one_line_with_a_log_and_exit_3(tmp_path):
    """The exit-code contract: an unexpected exception is exit 3, one line naming a log
    that holds the traceback (not exit 1, which means a failed gate)."""
    code = ("import sys, qeval.recipe as r\n"
            "def boom(*a, **k): raise ZeroDivisionError('simulated bug')\n"
            "r.load_recipe = boom\n"
            "sys.argv = ['qeval', 'validate', 'x.yaml']\n"
            "from qeval.cli import main; main()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO), QEVAL_CACHE=str(tmp_path / "cache")), timeout=120)
    assert p.returncode == 3, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" in lines[0] and "ZeroDivisionError" in lines[0], p.stderr
    log = Path(lines[0].split("traceback in ", 1)[1].split(";")[0])
    assert log.is_file() and "Traceback" in log.read_text() and "simulated bug" in log.read_text()
    assert "Traceback" not in p.stderr


def test_sigterm_exit_code_is_143(tmp_path):
    """SIGTERM while a command reads its input exits 143 (a CI cancel), not a traceback."""
    import signal
    code = ("import sys, time, qeval.cli as cli\n"
            "def slow(*a, **k):\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(60)\n"
            "cli.load_recipe = slow\n"
            "sys.argv = ['qeval', 'validate', 'x.yaml']\n"
            "cli.main()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.stdout.readline().strip() == "ready"  # inside the command: main() set its handlers before
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert "Traceback" not in err


def test_safe_join_never_leaves_the_root(tmp_path):
    from qeval.bounded import safe_join
    from qeval.errors import QevalInputError
    (tmp_path / "ok.json").write_text("{}")
    assert safe_join(tmp_path, "ok.json") == tmp_path / "ok.json"
    for bad in ("..", ".", "", "../x.json", "a/b", "a\\b", "x\0y"):
        with pytest.raises(QevalInputError):
            safe_join(tmp_path, bad)
    (tmp_path / "link.json").symlink_to("/etc/hostname")
    with pytest.raises(QevalInputError, match="outside"):
        safe_join(tmp_path, "link.json")


def test_store_keys_never_write_outside(tmp_path):
    """Class 5 through a storage URL: a stored key holding '..' is refused, nothing is
    written outside the staging folder (fsspec's memory store keeps such keys)."""
    from qeval.errors import QevalInputError
    from qeval.storage import RemoteStorage
    s = RemoteStorage(f"memory://qeval-hostile-{os.getpid()}/q")
    s.fs.pipe_file(s._p("results/r/t/run.json"), b"{}")
    s.fs.pipe_file(s._p("results/r/t/../../../../evil.txt"), b"x")
    with pytest.raises(QevalInputError, match="not a plain file name"):
        s.download_dir("results/r/t", tmp_path / "local")
    assert not any(p.name == "evil.txt" for p in tmp_path.parent.rglob("evil.txt"))


def test_writes_are_all_or_none(tmp_path):
    """write_all leaves no file changed when one of them cannot be written."""
    from qeval.errors import QevalInputError
    from qeval.results import write_all
    (tmp_path / "a.txt").write_text("old")
    (tmp_path / "sub").write_text("a file where a folder should be")
    with pytest.raises(QevalInputError):
        write_all({tmp_path / "a.txt": "new", tmp_path / "sub" / "b.txt": "x"})
    assert (tmp_path / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "sub"]
