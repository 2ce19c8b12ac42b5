"""qeval's llama.cpp speculative decoding figures against llama.cpp's own ``llama-speculative``,
on the same GGUF files and the same prompts (issue 51, the llama.cpp part).

For a target and a draft GGUF file (or two GGUF tiers of a finished run folder, ``--run-dir``),
on ``--prompts`` prompts of about ``--depth`` tokens cut from qeval's depth text:

* qeval: :func:`qeval.engines.llamacpp_spec.speculative_server` (llama-server with ``-md``,
  ``--spec-type draft-simple``, exactly k drafted per step, greedy): the target alone and,
  per k, drafted, accepted, acceptance rate = accepted / drafted (pooled over the prompts),
  tokens/s, and whether each answer is the target's own greedy answer token for token;
* the peer: llama.cpp's ``examples/speculative`` binary (``llama-speculative``, built with
  the other tools by :mod:`qeval.engines.llama_tools`) on the same files, one process per
  prompt and k: ``-p TEXT -n N --temp 0 --ignore-eos -np 1 --spec-draft-n-max k
  --spec-draft-n-min k --draft-p-min 0``, the same threads, context and flash-attention
  setting; its closing ``n_drafted``, ``n_accept`` and ``accept`` lines are parsed
  (acceptance pooled the same way), and its ``decoded N tokens in S seconds`` line.

Same prompts: each prompt's text is cut from the depth text by the target's tokenizer
(llama-cpp-python, ``vocab_only``), detokenized, and that text goes to ``llama-speculative``
(``-p``, ``--no-escape``); qeval sends the ids of that same text tokenized as
``llama-speculative`` tokenizes it (``common_tokenize(ctx, prompt, add_special=true,
parse_special=true)``: BOS where the vocabulary adds one), so both start from the same ids.

What differs between the two (both draft greedily from the draft's top token and verify
greedily, so the acceptance rates should agree closely, not exactly):

* ``llama-speculative`` can draft a tree (``-np`` > 1 branches split at ``--draft-p-split``)
  and verifies stochastically at temperature > 0; ``-np 1 --temp 0`` makes it draft one
  sequence of k tokens and verify greedily, as llama-server's ``draft-simple`` does;
* it ignores ``--spec-draft-n-min`` and ``--draft-p-min`` (always k drafted) and keeps
  drafting k up to the end, stopping once it has *more* than ``-n`` tokens (given
  ``new_tokens - 1``: at least ``new_tokens``, up to k more, and one more step); llama-server
  drafts at most the tokens still to generate - 1 and drops a draft shorter than n_min, so its
  last steps draft nothing. Over 64 new tokens that moves the rate by a few percent at most;
* a near-tie of the target (top two logits within a rounding error) may be resolved one way
  by llama-server's verification and the other by llama-speculative's (or the target alone):
  the answers then part and the rates are of two different continuations. The ``path``
  column says whether llama-speculative's answer (its printed text) starts with qeval's
  speculative answer's text for every prompt (``same``), else whether with the target
  alone's (``alone``), else ``other``; a rate difference with a path other than ``same``
  is the continuation's, not the counting's (seen at 48 new tokens, SmolLM2 Q4_1 against its
  Q2_K: a tie of 0.060 nats at new token 32, rates 52.2 % against 44.2 %);
* its timing covers the decode loop only (prompt excluded); qeval's tokens/s is the whole
  request (prompt included) over new tokens.

    python benchmarks/speculative_llama.py TARGET.gguf DRAFT.gguf [--draft-tokens 2,4]
        [--new-tokens 64] [--depth 256] [--prompts 2] [--threads 2] [--json OUT]
    python benchmarks/speculative_llama.py TARGET_TIER DRAFT_TIER --run-dir RUN_DIR [...]

Prints one row per k: qeval's and llama-speculative's acceptance rates and their ratio,
qeval's tokens/s (whole request) and decode tokens/s (after the TTFT proxy) with the draft and
their speed-up over the target alone, llama-speculative's decode tokens/s, and lossless: "yes"
when every answer is the target's own greedy answer token for token, else "tie" when each
first difference is a near-tie of the target (its top two logits, recomputed in one batch,
a tie the target's own one-batch and one-token passes break differently (``paths_disagree``)
and the two tokens those two: rounding, see
:mod:`qeval.engines.llamacpp_spec`), else "NO"; the differences are listed under the table.
Exit 0 when every k's rates agree within 10 %, 1 when one differs by more, 2 on bad input
(one line). Lossless is reported, not gated.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

AGREE = 0.10  # acceptance rates agree when their ratio is within 10 % of 1


def refuse(msg: str) -> None:
    """Bad input: one line, exit 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def tier_gguf(run_dir: Path, tier: str) -> Path:
    """The GGUF file of a finished tier of ``run_dir`` (``tiers/<tier>.json`` ``artifact.path``).

    Raises:
        ValueError: no such tier, no artifact, or not exactly one GGUF file in it (one line).
    """
    from qeval.engines.llamacpp import gguf_file
    f = run_dir / "tiers" / f"{tier}.json"
    if not f.is_file():
        raise ValueError(f"tier {tier}: no {f}")
    path = ((json.loads(f.read_text()).get("artifact") or {}).get("path"))
    if not path:
        raise ValueError(f"tier {tier}: no artifact path in {f}")
    try:
        return gguf_file(path)
    except RuntimeError as e:
        raise ValueError(f"tier {tier}: {e}") from None


def prompt_texts(target: Path, depth: int, n: int) -> tuple[list[str], list[list[int]]]:
    """``n`` prompt texts of about ``depth`` tokens cut from qeval's depth text (each starts
    ``depth // 2`` tokens after the last), and each text's ids as ``llama-speculative``
    tokenizes it (BOS where the vocabulary adds one; special tokens parsed), by the target's
    tokenizer through llama-cpp-python."""
    from llama_cpp import Llama  # the gguf extra (the benchmark needs it)
    from qeval import data as builtin_data
    from qeval.engines.llamacpp import cpu_backend
    cpu_backend()  # ggml's backends loaded as qeval loads them (a variant build has none linked in)
    text = builtin_data.builtin_path("builtin:depth_text").read_text()
    vocab = Llama(model_path=str(target), vocab_only=True, verbose=False)
    ids = vocab.tokenize(text.encode(), add_bos=False, special=False)
    if len(ids) < (n + 1) * depth // 2 + depth:
        raise ValueError(f"the depth text has {len(ids)} tokens: too few for {n} prompts of {depth}")
    texts, out = [], []
    for i in range(n):
        piece = vocab.detokenize(ids[i * depth // 2:i * depth // 2 + depth]).decode("utf-8", "replace").strip()
        texts.append(piece)
        out.append(vocab.tokenize(piece.encode(), add_bos=True, special=True))
    return texts, out


_NUM = {"n_drafted": r"n_drafted\s*=\s*(\d+)", "n_accept": r"n_accept\s*=\s*(\d+)",
        "accept_pct": r"\baccept\s*=\s*([0-9.]+)%", "n_predict": r"n_predict\s*=\s*(\d+)"}
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([0-9.]+)\s+seconds")


def parse_speculative(out: str) -> dict:
    """``llama-speculative``'s closing figures from its output: ``n_drafted``, ``n_accept``,
    ``accept_pct`` (its own percentage), ``n_predict``, ``decoded`` tokens and ``decode_s``.

    Raises:
        ValueError: a figure is missing (one line).
    """
    got: dict = {}
    for key, pat in _NUM.items():
        m = re.findall(pat, out)
        if not m:
            raise ValueError(f"llama-speculative printed no {key} line")
        got[key] = float(m[-1]) if key == "accept_pct" else int(m[-1])
    m = _DECODED.findall(out)
    if m:
        got["decoded"], got["decode_s"] = int(m[-1][0]), float(m[-1][1])
    return got


def llama_speculative(binary: Path, target: Path, draft: Path, text: str, k: int, *, new_tokens: int,
                      threads: int, ctx_size: int, flash_attn: bool) -> dict:
    """One ``llama-speculative`` run (module notes): its parsed figures plus ``wall_s`` and
    ``text``, what it printed after the prompt's echo (its answer, the new tokens' pieces;
    None where the echo is not found). ``-n new_tokens - 1``: it stops once it has more than
    ``-n``, so it makes at least ``new_tokens`` (up to k more).

    Raises:
        RuntimeError: it failed (its last output lines).
    """
    cmd = [str(binary), "-m", str(target), "-md", str(draft), "-p", text, "--no-escape", "-n", str(new_tokens - 1),
           "--temp", "0", "--ignore-eos", "-np", "1", "--spec-draft-n-max", str(k), "--spec-draft-n-min", str(k),
           "--draft-p-min", "0", "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
           "-c", str(ctx_size), "-fa", "on" if flash_attn else "off", "-ngl", "0", "-ngld", "0", "--seed", "0"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    out = p.stdout + "\n" + p.stderr
    if p.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-6:])
        raise RuntimeError(f"llama-speculative failed (exit {p.returncode}): {tail}")
    try:
        got = parse_speculative(out)
    except ValueError as e:
        raise RuntimeError(f"{e}: {' | '.join(out.strip().splitlines()[-6:])}") from None
    got["wall_s"] = wall
    at = p.stdout.find(text)
    got["text"] = p.stdout[at + len(text):] if at >= 0 else None
    return got


def ratio_verdict(ours: float | None, peer: float | None) -> tuple[float | None, bool]:
    """``(ours / peer, they agree within AGREE)``; rates of 0 on both sides agree."""
    if ours is None or peer is None:
        return None, False
    if peer == 0:
        return (None, ours == 0)
    r = ours / peer
    return r, abs(r - 1.0) <= AGREE


def main(argv: list[str] | None = None) -> int:
    """Measure both and compare (module docstring); exit code 0, 1 or 2."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", help="target GGUF file (or tier name with --run-dir)")
    ap.add_argument("draft", help="draft GGUF file (or tier name with --run-dir)")
    ap.add_argument("--run-dir", type=Path, help="a finished run folder: target and draft are its GGUF tiers")
    ap.add_argument("--draft-tokens", default="2,4")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        ks = sorted({int(k) for k in a.draft_tokens.split(",")})
    except ValueError:
        refuse(f"--draft-tokens {a.draft_tokens!r}: comma-separated whole numbers")
    if not ks or ks[0] < 1 or a.new_tokens < 2 or a.depth < 8 or a.prompts < 1 or a.threads < 1:
        refuse("--draft-tokens >= 1, --new-tokens >= 2, --depth >= 8, --prompts >= 1 and --threads >= 1")
    if a.run_dir is not None:
        try:
            target, draft = tier_gguf(a.run_dir, a.target), tier_gguf(a.run_dir, a.draft)
        except ValueError as e:
            refuse(str(e))
    else:
        target, draft = Path(a.target), Path(a.draft)
    for what, p in (("target", target), ("draft", draft)):
        if not p.is_file():
            refuse(f"{what} GGUF {p}: no such file")

    from qeval.engines.llama_tools import tool_path
    from qeval.engines.llamacpp import default_flash_attn
    from qeval.engines.llamacpp_spec import first_divergence, speculative_server
    try:
        texts, prompts = prompt_texts(target, a.depth, a.prompts)
    except ValueError as e:
        refuse(str(e))
    try:
        peer_bin = tool_path("llama-speculative", log=lambda m: print(m, file=sys.stderr))
    except FileNotFoundError as e:
        refuse(str(e))
    ctx = -(-(max(map(len, prompts)) + a.new_tokens + max(ks) + 16) // 256) * 256
    fa = default_flash_attn("cpu", "model")
    t0 = time.perf_counter()
    pair = speculative_server(target, draft, prompts, ks, a.new_tokens, threads=a.threads, ctx_size=ctx)
    qeval_wall = time.perf_counter() - t0
    peer: dict[int, list[dict]] = {}
    t0 = time.perf_counter()
    for k in ks:
        peer[k] = [llama_speculative(peer_bin, target, draft, t, k, new_tokens=a.new_tokens, threads=a.threads,
                                     ctx_size=ctx, flash_attn=fa) for t in texts]
    peer_wall = time.perf_counter() - t0

    alone_tps = statistics.median(r.tokens_per_s for r in pair.alone)
    alone_dec = _median([r.decode_tokens_per_s for r in pair.alone])
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
    print(f"target {target.name}, draft {draft.name}; {a.prompts} prompts of {[len(p) for p in prompts]} tokens, "
          f"{a.new_tokens} new tokens, {a.threads} threads, ctx {ctx}")
    print(f"qeval: {pair.how}")
    print(f"target alone (llama-server): {alone_tps:.1f} tok/s per request (prompt included), decode "
          f"{_fmt(alone_dec)} tok/s (medians over prompts); peak RSS with the draft {mib(pair.peak_bytes)}, "
          f"alone {mib(pair.details.get('target_alone_peak_bytes'))}")
    hdr = (f"{'k':>3} {'drafted':>8} {'accepted':>9} {'qeval acc':>10} {'llama acc':>10} {'ratio':>6} "
           f"{'acc/step':>9} {'tok/s':>7} {'x alone':>8} {'decode':>7} {'x alone':>8} {'llama dec':>10} "
           f"{'lossless':>9} {'path':>6}")
    print(hdr)
    rows, bad, notes = [], False, []
    for k in ks:
        runs = pair.runs[k]
        drafted, accepted = sum(r.drafted or 0 for r in runs), sum(r.accepted or 0 for r in runs)
        ours = accepted / drafted if drafted else None
        pd, pa = sum(x["n_drafted"] for x in peer[k]), sum(x["n_accept"] for x in peer[k])
        theirs = pa / pd if pd else None
        r, ok = ratio_verdict(ours, theirs)
        bad |= not ok
        tps = statistics.median(x.tokens_per_s for x in runs)
        dec = _median([x.decode_tokens_per_s for x in runs])
        ptps = _median([x["decoded"] / x["decode_s"] for x in peer[k] if x.get("decode_s")])
        divs = [None if x.lossless else first_divergence(target, p, ref.token_ids, x.token_ids, threads=a.threads)
                for x, p, ref in zip(runs, prompts, pair.alone)]
        ties = [d is None or (d["paths_disagree"] and {d["answer_token"], d["reference_token"]} == set(d["top2"]))
                for d in divs]
        lossless = "yes" if all(d is None for d in divs) else "tie" if all(ties) else "NO"
        path = _path(pair, k, peer[k], texts, target)
        for i, d in enumerate(divs):
            if d is not None:
                notes.append(f"k {k}, prompt {i}: first difference at new token {d['position']} (alone "
                             f"{d['reference_token']}, speculative {d['answer_token']}; the target's top two "
                             f"{d['top2']} {d['margin']:.4f} nats apart; the target's own passes {'dis' if d['paths_disagree'] else ''}agree: "
                             f"gap {d['gap_batch']:+.3f} in one batch, {d['gap_single']:+.3f} token by token)")
        row = {"k": k, "drafted": drafted, "accepted": accepted, "qeval_acceptance": ours,
               "llama_speculative_acceptance": theirs, "ratio": r, "agree": ok, "llama_drafted": pd,
               "llama_accepted": pa, "tokens_per_s": tps, "speedup": tps / alone_tps, "decode_tokens_per_s": dec,
               "decode_speedup": dec / alone_dec if dec and alone_dec else None,
               "llama_decode_tokens_per_s": ptps, "lossless": lossless, "divergences": divs, "path": path,
               "mean_accepted_per_step": accepted / sum(x.target_steps for x in runs),
               "seconds": [x.seconds for x in runs], "llama_runs": peer[k]}
        rows.append(row)
        print(f"{k:>3} {drafted:>8} {accepted:>9} {_pct(ours):>10} {_pct(theirs):>10} "
              f"{_fmt(r, 3):>6} {row['mean_accepted_per_step']:>9.2f} {tps:>7.1f} {tps / alone_tps:>8.2f} "
              f"{_fmt(dec):>7} {_fmt(row['decode_speedup'], 2):>8} {_fmt(ptps):>10} {lossless:>9} {path:>6}")
    for n in notes:
        print(f"  {n}")
    print(f"wall: qeval {qeval_wall:.1f} s (a server per k and one alone, {len(ks) + 1} starts), "
          f"llama-speculative {peer_wall:.1f} s ({len(ks) * len(texts)} runs); acceptance "
          f"{'agrees' if not bad else 'DIFFERS'} within {AGREE:.0%}")
    if a.json is not None:
        a.json.write_text(json.dumps({"target": str(target), "draft": str(draft),
                                      "prompt_tokens": [len(p) for p in prompts],
                                      "new_tokens": a.new_tokens, "threads": a.threads, "how": pair.how,
                                      "alone_tokens_per_s": alone_tps, "alone_decode_tokens_per_s": alone_dec,
                                      "alone_seconds": [x.seconds for x in pair.alone],
                                      "alone_peak_bytes": pair.details.get("target_alone_peak_bytes"),
                                      "peak_bytes": pair.peak_bytes,
                                      "memory_counter": pair.memory_counter, "rows": rows,
                                      "wall_s": {"qeval": qeval_wall, "llama_speculative": peer_wall}}, indent=1))
    return 1 if bad else 0


def _path(pair, k: int, peer: list[dict], texts: list[str], target: Path) -> str:
    """``same`` when llama-speculative's answer starts with the text of qeval's speculative
    answer for every prompt, else ``alone`` when with the target alone's, else ``other``
    (module notes); ``n/a`` when its answer was not found in its output."""
    from llama_cpp import Llama  # the gguf extra (the benchmark needs it)
    vocab = Llama(model_path=str(target), vocab_only=True, verbose=False)
    text = lambda ids: vocab.detokenize(ids).decode("utf-8", "replace")  # noqa: E731
    if any(x.get("text") is None for x in peer):
        return "n/a"
    if all(x["text"].startswith(text(r.token_ids)) for x, r in zip(peer, pair.runs[k])):
        return "same"
    if all(x["text"].startswith(text(r.token_ids)) for x, r in zip(peer, pair.alone)):
        return "alone"
    return "other"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


if __name__ == "__main__":
    raise SystemExit(main())
