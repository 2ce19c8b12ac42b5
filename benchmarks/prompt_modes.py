"""The three prompt modes of a served tier side by side on one llama-server: decode rates.

One llama-server (built from the vendored llama.cpp of the installed llama-cpp-python,
:func:`qeval.engines.llama_tools.tool_path`) serves one GGUF file; three ``openai`` engines
connect to it as endpoints, one per prompt mode (:data:`qeval.engines.openai.PROMPT_MODES`):
``tokens`` (token ids to ``/v1/completions``), ``text`` (the prompt decoded to text, same
route) and ``chat`` (that text as one user message to ``/v1/chat/completions``, the
server's template around it). Each round sends, in every mode, one greedy request of
``--depth`` prompt tokens and ``--decode-tokens`` new tokens (``ignore_eos``): a fresh
prompt per request (:func:`qeval.measure.load.distinct_prompts`), the modes' order rotated
from round to round so a drift of a shared machine falls on each mode alike.

Printed: per mode the median over rounds (and min-max) of TTFT and decode tokens/s
(:attr:`qeval.engines.base.Generation.decode_tokens_per_s`: ``(n - 1) / (t_last -
t_first)``; in text and chat modes the times are the arrivals of the chunks that carry
text), the median of the per-round ratios text / tokens and chat / tokens of decode
tokens/s against the target (within 10 %: issue 50), each mode's token-count source, and
the prompt tokens each mode's server counted on the depth prompts against the source
tokenizer (the tokenizer check: chat mode's difference is the server's template).

Never part of ``make test``; the figures of one run on shared cores are a sample, not a
rate to quote (docs/measurements.md has a dated run).

    python benchmarks/prompt_modes.py --gguf FILE --tokenizer DIR [--rounds 5] [--depth 128]
        [--decode-tokens 32] [--threads 2]

``--gguf`` defaults to the newest Q4_K_M artifact in ``$QEVAL_CACHE/artifacts`` and
``--tokenizer`` to the newest expanded source in ``$QEVAL_CACHE/sources`` (what ``make
demo`` leaves); where either is missing the script says which flag to give and exits 2.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = 0.10
MODES = ("tokens", "text", "chat")


def newest(pattern: str, root: Path) -> Path | None:
    """The most recently modified path under ``root`` matching ``pattern`` (None: none)."""
    found = sorted(root.glob(pattern), key=lambda p: p.stat().st_mtime) if root.exists() else []
    return found[-1] if found else None


def ratio_note(r: float | None) -> str:
    """``r`` (a rate ratio) against the target: within 10 % or not."""
    if r is None:
        return "-"
    return f"{r:.3f} ({'within' if abs(r - 1) <= TARGET else 'outside'} {TARGET:.0%})"


def spread(xs: list[float]) -> str:
    """``median [min, max]`` of ``xs`` (3 significant figures), ``-`` when empty."""
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}, {max(xs):.3g}]"


def main() -> int:
    """Run the comparison; returns the exit code (0, or 2 for a missing input)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf")
    ap.add_argument("--tokenizer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from qeval.engines.base import EngineOptions
    from qeval.engines.llama_tools import tool_path
    from qeval.engines.openai import OpenAIEngine
    from qeval.engines.servers import ManagedServer, free_port
    from qeval.engines.servers.llama_server import llama_server_command
    from qeval.measure.load import distinct_prompts
    from qeval.measure.speed import depth_prompt_ids
    from qeval.paths import cache_root

    gguf = Path(args.gguf) if args.gguf else newest("gguf-*/model-Q4_K_M.gguf", cache_root() / "artifacts")
    tok_dir = Path(args.tokenizer) if args.tokenizer else newest("*/tokenizer.json", cache_root() / "sources")
    tok_dir = tok_dir.parent if tok_dir is not None and tok_dir.is_file() else tok_dir
    if gguf is None or not gguf.exists():
        print("error: no GGUF file: give --gguf FILE (or run make demo first)", file=sys.stderr)
        return 2
    if tok_dir is None or not tok_dir.exists():
        print("error: no tokenizer folder: give --tokenizer DIR (the source checkpoint of the GGUF file)",
              file=sys.stderr)
        return 2
    depth_text = Path(__file__).resolve().parent.parent / "qeval" / "data" / "depth_text.txt"
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    prompt_for = distinct_prompts(depth_prompt_ids(tok, depth_text, max(4 * args.depth, 2048)), args.depth)

    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="qeval-modes-bench-")) / "server.log"
    cmd = llama_server_command(tool_path("llama-server"), gguf, port=port, threads=args.threads, parallel=1,
                               ctx_size=max(2048, 2 * (args.depth + args.decode_tokens + 64)))
    server = ManagedServer(cmd, port=port, log_path=log, name="llama-server").start(300)
    print(f"gguf {gguf}\ntokenizer {tok_dir}\nllama-server: {' '.join(cmd)}\n  log {log}", flush=True)
    print(f"rounds {args.rounds}  depth {args.depth}  decode tokens {args.decode_tokens}  "
          f"threads {args.threads}", flush=True)
    engines = {}
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for m in MODES:
            engines[m] = OpenAIEngine.open("gguf", gguf, EngineOptions(device="cpu", threads=args.threads, server={
                "endpoint": {"url": server.url}, "tier": m, "tokenizer": str(tok_dir), "prompt_mode": m,
                "depth_text": str(depth_text), "depths": [args.depth]}))
        for r in range(args.rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            for m in order:
                g = engines[m].generate(prompt_for(r, MODES.index(m)), args.decode_tokens, ignore_stop=True)
                rows[m].append({"ttft_s": g.prefill_s, "decode_tok_s": g.decode_tokens_per_s,
                                "tokens": len(g.token_times_s)})
            print(f"round {r + 1} ({', '.join(order)}): " + "  ".join(
                f"{m} {rows[m][-1]['decode_tok_s']:.1f} tok/s" for m in MODES), flush=True)
        info = {m: engines[m].served_info() for m in MODES}
    finally:
        for e in engines.values():
            e.close()
        server.stop()

    print("\n| mode | TTFT s, median [min, max] | decode tok/s, median [min, max] | decode / tokens mode, "
          "median of rounds | token counts | prompt tokens: server vs source tokenizer |")
    print("|---|---|---|---|---|---|")
    for m in MODES:
        dec = [x["decode_tok_s"] for x in rows[m] if x["decode_tok_s"]]
        ratios = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(rows[m], rows["tokens"])
                  if a["decode_tok_s"] and b["decode_tok_s"]]
        check = info[m]["tokenizer_check"]
        counted = ", ".join(f"{c['server_tokens']} vs {c['text_tokens']}"
                            + (f" ({c['difference']:+d}: the server's template)" if c.get("difference") else "")
                            for c in check) or "-"
        print(f"| {m} | {spread([x['ttft_s'] for x in rows[m]])} | {spread(dec)} | "
              f"{ratio_note(statistics.median(ratios)) if ratios and m != 'tokens' else '1'} | "
              f"{info[m]['token_counts']} | {counted} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
