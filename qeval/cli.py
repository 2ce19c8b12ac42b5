"""Command line: ``qeval run | validate | report | gate | plan | compare | show``.

Exit codes (a contract release CI relies on; :mod:`qeval.errors` holds the constants):

* 0: done; for ``run`` and ``gate``, every gate candidate passed.
* 1: a gate candidate failed a rule, damage measured (or the gate judged no candidate); wins
  over 4 when both occur.
* 2: bad input: a recipe, suite, model config, run folder, flag or an output that cannot
  be written. One line on stderr naming file, line and field; no traceback.
* 3: internal error (a bug in qeval or a library): one line on stderr naming the log file
  that holds the traceback.
* 4: the gate could not judge some candidate (its tier or the reference tier has no result
  or did not finish: verdict ERROR with the reason) and none failed a rule; not a verdict on
  the model (``run`` and ``gate``; :data:`qeval.errors.EXIT_GATE_ERROR`).
* 5: reserved for the gate's INCONCLUSIVE verdict (gate statistics, issue 58; not built yet).
* 130: interrupted by Ctrl-C; 143: by SIGTERM (a CI cancel). Finished stages are kept.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import __version__
from .bounded import check_output_dir, check_output_file, expand_user, safe_join
from .analysis.compare import compare_markdown, compare_runs
from .analysis.floor import check_rules_against_floor, floor_from_run, previous_floor
from .errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, QevalInputError
from .executors import make_executor
from .paths import cache_root, staging_dir
from .pipeline import default_lanes
from .progress import RunProgress, planned_stages
from .recipe import MAX_COUNT, MAX_TOKENS, load_recipe, load_time_floor, speculative_depths, speculative_engine
from .report.outputs import OUTPUT_NAMES, build_outputs, plan_text
from .report.review import item_changes_markdown, tier_review
from .report.show import show as show_review
from .results import RUN_SCOPE, RunLayout, get_path, load_run, stage_done
from .run import Interrupted, Runner, StageFailed, new_run_dir, preflight
from .source import model_source_path
from .storage import RemoteStorage, is_url, localize_source, storage_for
from .tiers import get_method
from .validate import static_checks

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="qeval: which quantization tier to serve, and which fallbacks, measured.")
console = Console(stderr=True, soft_wrap=True)  # no hard wraps: CI logs keep paths and commands whole
out = Console(soft_wrap=True, markup=False)


def _print_version(value: bool) -> None:
    if value:
        out.print(f"qeval {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="print qeval's version and exit")) -> None:
    """qeval: which quantization tier to serve, and which fallbacks, measured."""


def _fail(e: QevalInputError) -> None:
    console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _parse_tiers(recipe, tiers: Optional[str]) -> list[str] | None:
    if tiers is None:
        return None
    names = [t.strip() for t in tiers.split(",") if t.strip()]
    known = [t.name for t in recipe.tiers]
    if not names:
        raise QevalInputError(f"no tier named (recipe tiers: {', '.join(known)})", field="--tiers")
    for n in names:
        if n not in known:
            raise QevalInputError(f"unknown tier {n!r} (recipe tiers: {', '.join(known)})", field="--tiers")
    return names


def describe_plan(recipe, only: list[str] | None = None) -> str:
    """Human-readable resolved plan of a recipe (what ``qeval validate`` prints); ``only``:
    the ``--tiers`` subset, the other tiers marked as not run."""
    m = recipe.model
    local = model_source_path(m.source, recipe.base_dir) if m.source else None
    lines = [f"recipe   {recipe.name}" + (f"  ({recipe.path})" if recipe.path else ""),
             f"model    {m.source or 'gguf_package:' + str(m.gguf_package)}"
             + (f" -> {local}" if local is not None and str(local) != m.source else "") + f"  dtype={m.dtype}"
             f"  revision={m.revision or '-'}  trust_remote_code={m.trust_remote_code}",
             f"device   {recipe.device}   threads {recipe.threads}   executor {recipe.executor}",
             f"speed    depths {recipe.speed.depths} (main {recipe.speed.main_depth})  decode_tokens "
             f"{recipe.speed.decode_tokens}  repeats {recipe.speed.repeats}  warmup {recipe.speed.warmup}",
             ]
    ld = recipe.load
    lines.append(f"load     concurrency {ld.concurrency}  depth {recipe.load_depth}  output_tokens {ld.output_tokens}"
                 f"  requests_per_stream {ld.requests_per_stream}  prefill_chunk {ld.prefill_chunk}  SLO TTFT p95 <= "
                 f"{ld.slo.ttft_p95_s:g} s, ITL p95 <= {ld.slo.itl_p95_s:g} s" if ld.enabled else "load     off")
    if ld.enabled and ld.arrivals is not None:
        ar = ld.arrivals
        what = f"rates {ar.rates} req/s" if ar.rates else f"sweep of {ar.sweep.points} rates"  # type: ignore[union-attr]
        per = f"{ar.requests} requests" if ar.requests else f"{ar.duration_s:g} s"
        lines.append(f"arrivals {what}  {ar.process} (seed {ar.seed})  {per} per rate  queue {ld.queue.max_waiting} "
                     f"waiting, timeout {ld.queue.timeout_s:g} s  max error rate {ld.slo.max_error_rate:g}")
    if ld.enabled and ld.shared_prefix_tokens:
        lines.append(f"prefix   {ld.shared_prefix_tokens} shared tokens of {recipe.load_depth}  KV reuse {ld.prefix_cache}")
    if ld.enabled and ld.interference is not None:
        it = ld.interference
        lines.append(f"stall    {it.prompt_tokens}-token prompt on {it.streams} decoding streams  unchunked and "
                     f"chunks {it.chunk_sizes}")
    if ld.enabled and ld.depths:
        lines.append(f"grid     depths {ld.depths} x concurrency {ld.concurrency}")
    lines.append("tiers" + (f"    {len(only)} of {len(recipe.tiers)} (--tiers)" if only is not None else ""))
    width = max([16] + [len(t.name) for t in recipe.tiers])
    for t in recipe.tiers:
        extra = {k: v for k, v in t.model_dump().items() if k not in ("name", "method") and v is not None}
        built = "" if get_method(t.method) else "   [not built yet]"
        skipped = "   [not run: not in --tiers]" if only is not None and t.name not in only else ""
        lines.append(f"  - {t.name:<{width}} {t.method:<5} {extra}{built}{skipped}")
    if recipe.suites:
        lines.append("suites")
        for s in recipe.suites:
            lines.append(f"  - {s.name:<16} {s.kind:<11} {s.path}  max_new_tokens={s.max_new_tokens}"
                         f"  limit={s.limit or 'all'}"
                         + (f"  fidelity_limit={s.fidelity_limit}" if s.fidelity_limit else "")
                         + (f"  depths={s.depths}  fidelity_tokens={s.fidelity_tokens}" if s.kind == "long_context"
                            else ""))
    lines.append("files    (relative paths start at the recipe's folder)")
    for loc, value, what in recipe.data_paths():
        resolved = recipe.resolve_path(value)
        lines.append(f"  - {what:<17} {value}" + ("" if str(resolved) == value else f"  -> {resolved}"))
    rd = recipe.quality.reference_dtype
    lines.append("quality  reference pass in " + (f"{rd}" if rd != "auto" else
                                                   f"float32 on CPU, {m.dtype} on CUDA (auto)")
                 + f"; noise floor: {recipe.gate.reference} as served ({m.dtype}) scored against it")
    g = recipe.gate
    rules = {k: v for k, v in g.rules.model_dump().items() if v is not None}
    lines.append(f"gate     reference {g.reference}; candidates {', '.join(recipe.gate_candidates) or '-'}; "
                 f"depth {recipe.gate_depth}; rules {rules or 'none'}")
    lines += power_lines(recipe)
    for pair in recipe.speculative:
        lines.append(f"draft    {pair.target} with {pair.draft} drafting on {speculative_engine(recipe.tier(pair.target))[0]}: "
                     f"k {', '.join(map(str, pair.draft_tokens))}; depths {speculative_depths(recipe, pair)}; "
                     f"{pair.prompts} prompts x {pair.new_tokens} new tokens (after every tier)")
    floor = load_time_floor(recipe)
    if floor:
        n = len(only) if only is not None else len(recipe.tiers)
        total = sum(t for _, t in floor)
        parts = "; ".join(f"{w}: {t:,.0f} s" for w, t in floor)
        lines.append(f"time     load stage: at least {total:,.0f} s per tier ({parts}), {total * n:,.0f} s over "
                     f"{n} tiers, before the closed loop and the workloads (measured, not bounded here); each "
                     f"stage stops at load.timeout_s {recipe.load.timeout_s:g} s")
    return "\n".join(lines)


def power_lines(recipe) -> list[str]:
    """What the suites can decide, before anything runs: for each paired behaviour rule
    set, the checks the suites give and the smallest drop they detect
    (:func:`qeval.analysis.evidence.detectable_drop` at the gate's confidence and power),
    beside the drop the rule guards against as a share of the reference's rate."""
    from .analysis.evidence import detectable_drop  # start-up time: scipy, only where the gate has such rules
    from .measure.long_context import load_long_context  # start-up time: suite files, same
    from .measure.suites import load_suite  # start-up time: suite files, same
    g, rules = recipe.gate, recipe.gate.rules
    wanted = [(n, t) for n, t in (("min_pass_rate_rel", rules.min_pass_rate_rel),
                                  ("min_recall_rel", rules.min_recall_rel)) if t is not None]
    if not wanted:
        return []
    checks = questions = 0
    for s in recipe.suites:
        path = recipe.resolve_path(s.path)
        if s.kind == "long_context":
            items = load_long_context(path, s.name)[: s.limit or None]
            questions += sum(len(i.questions) for i in items)
        else:
            items = load_suite(path, s.name, multi_turn=s.kind == "multi_turn")[: s.limit or None]
            checks += sum(len(t.checks) for i in items for t in i.turns)
    out = []
    for name, t in wanted:
        n = checks if name == "min_pass_rate_rel" else questions
        det = detectable_drop(n, 1 - g.confidence, g.power)
        sees = f"see a drop of {det:.3f}" if det is not None else "see no drop"
        out.append(f"power    {name} {t:g}: {n} paired {'checks' if name == 'min_pass_rate_rel' else 'questions'} "
                   f"{sees} ({g.confidence:.0%} confidence, {g.power:.0%} power); the rule guards against "
                   f"{1 - t:.2f} x the reference's rate, so it decides where that rate is at least "
                   + (f"{min(det / (1 - t), 1.0):.2f}" if det is not None and t < 1 else "- (never)")
                   + f"; otherwise not enough evidence ({g.insufficient_evidence})")
    return out


def floor_roots(recipe) -> list[Path]:
    """Where earlier runs of a recipe are looked for: ``results/`` (``qeval run``'s default
    output, relative to the current directory) and ``<storage>/results`` for a mounted
    storage path (relative to the recipe's folder, as ``qeval run`` takes it)."""
    roots = [Path("results")]
    if recipe.storage and not is_url(recipe.storage):
        roots.append(Path(recipe.resolve_path(recipe.storage)) / "results")
    return roots


@app.command()
def validate(recipe: Path = typer.Argument(..., help="recipe YAML"),
             tiers: Optional[str] = typer.Option(None, "--tiers", help="comma-separated subset, as `qeval run "
                                                 "--tiers` takes it: the plan marks the others as not run"),
             floor_from: Optional[Path] = typer.Option(
                 None, "--floor-from", help="a run folder whose measured noise floor the gate's KLD rule is "
                                            "checked against (default: the newest earlier run of this recipe "
                                            "under results/ measured with the same model, reference tier, "
                                            "reference dtype and device)")) -> None:
    """Validate a recipe and print the resolved plan.

    A gate ``max_kld_mean`` below the noise floor of an earlier run is refused (exit 2).
    """
    try:
        r = load_recipe(recipe)
        subset = _parse_tiers(r, tiers)
        static_checks(r)
        floor = floor_from_run(floor_from) if floor_from is not None else previous_floor(r, floor_roots(r))
        check_rules_against_floor(r, floor)
    except QevalInputError as e:
        _fail(e)
    out.print(describe_plan(r, subset), highlight=False)
    from .validate import _local_checkpoint, tier_capabilities  # start-up time: validate only
    for name, verdict, text in tier_capabilities(r, _local_checkpoint(r.model, r.base_dir)):
        out.print(f"runs     {name}: {verdict} ({text})", highlight=False)
    if floor is not None:
        out.print(f"floor    {floor.kld_mean:.3g} nats KLD ({floor.what}; from {floor.source})", highlight=False)


@app.command()
def run(recipe: Path = typer.Argument(..., help="recipe YAML"),
        tiers: Optional[str] = typer.Option(None, "--tiers", help="comma-separated subset, e.g. bf16,int8"),
        out_arg: Optional[str] = typer.Option(None, "--out", help="results folder (default: results/)"),
        resume_arg: Optional[str] = typer.Option(None, "--resume", help="an unfinished run folder (or its URL "
                                                 "under a storage URL) to complete"),
        executor: Optional[str] = typer.Option(None, "--executor", help="a registered executor: local or ray"),
        ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Ray cluster address"),
        junit: Optional[str] = typer.Option(None, "--junit", help="write gate results as JUnit XML"),
        fresh: bool = typer.Option(False, "--fresh", help="recompute the reference pass and quality results "
                                   "instead of reusing cached ones with the same content key (speed, memory "
                                   "and load are always measured anew)"),
        estimate: bool = typer.Option(False, "--estimate", help="print the plan and what it can be known to cost "
                                      "before it runs (the load stage's least time, the gate rules' power), "
                                      "then exit without running"),
        ) -> None:
    """Quantize, measure and judge every tier of RECIPE; exit code follows the gate."""
    resume = None
    out_dir: Optional[Path] = None
    try:
        if out_arg is not None and not out_arg.strip():
            raise QevalInputError("give a results folder (got an empty string)", field="--out")
        out_dir = expand_user(out_arg, field="--out") if out_arg is not None else None
        if resume_arg is not None and not resume_arg.strip():
            raise QevalInputError("give a run folder (got an empty string)", field="--resume")
        resume = expand_user(resume_arg, field="--resume") if resume_arg else None
        r = load_recipe(recipe)
        subset = _parse_tiers(r, tiers)  # before the static checks, which read the model (seconds)
        depths_checked = static_checks(r, gguf_tokenizer=False)
        if estimate:
            out.print(describe_plan(r, subset), highlight=False)
            raise typer.Exit(0)
        chosen = make_executor(executor, ray_address) if executor else \
            make_executor(r.executor, ray_address, recipe=r)
        junit_path = check_output_file(junit, field="--junit") if junit is not None else None
        remote = storage_for(r)
        if remote is not None:  # a URL: work in a local staging folder, copy through the store
            try:
                remote.probe()
            except QevalInputError as e:
                raise r.error(("storage",), e.message) from None
            if out_dir is None:
                out_dir = _staging_root()
            if resume is not None and is_url(str(resume_arg)):
                resume = _fetch_run(remote, str(resume_arg))
        elif r.storage and out_dir is None and resume is None:
            mount = r.resolve_path(r.storage)  # a relative mount path starts at the recipe's folder too
            out_dir = mount / "results"
            os.environ.setdefault("QEVAL_CACHE", str(mount / "cache"))
        if resume is not None and is_url(str(resume_arg)) and remote is None:
            raise QevalInputError("a run URL can be resumed only with the recipe's storage at that URL",
                                  field="--resume")
        if resume is not None:
            if not RunLayout(resume).is_run():
                raise QevalInputError("not a qeval run folder (no run.json)", file=resume, field="--resume")
            run_dir = resume
        else:
            check_output_dir(out_dir if out_dir is not None else Path("results"), field="--out")
            preflight(r)
            run_dir = None
        if junit_path is not None:
            if run_dir is not None and any(junit_path.resolve() == (run_dir / n).resolve() for n in OUTPUT_NAMES):
                raise QevalInputError("would overwrite one of the run's own outputs", file=junit_path,
                                      field="--junit")
        if run_dir is None:
            try:
                run_dir = new_run_dir(r, out_dir)
            except OSError as e:
                raise QevalInputError(f"cannot create the run folder: {e.strerror or e.__class__.__name__}",
                                      file=out_dir or "results", field="--out") from None
        runner = Runner(r, run_dir, subset, executor=chosen, fresh=fresh, depths_checked=depths_checked)
        if resume is not None:
            runner.check_resume()  # reads only: a refused resume changes nothing in the folder
            check_output_dir(resume, field="--resume", create=False)  # stages are written there
    except QevalInputError as e:
        _fail(e)
    console.print(f"[bold]qeval[/] run [cyan]{escape(r.name)}[/] -> {escape(str(run_dir))}", highlight=False)
    floor = load_time_floor(r)
    if floor:  # time said before it is spent (qeval run --estimate prints the whole plan)
        console.print(f"  load: at least {sum(t for _, t in floor):,.0f} s per tier of open-loop arrivals, then "
                      "what the closed loop and the workloads take", highlight=False)
    progress = RunProgress(console, r.name, planned_stages(r, runner.tiers, runner.layout),
                           lanes=default_lanes(r, None if r.device == "auto" else r.device))

    def on_event(tier: str, stage: str, msg: str) -> None:
        if stage in ("done", "failed", "storage"):
            colour = {"done": "green", "failed": "red"}.get(stage, "yellow")
            console.print(f"  [{colour}]{stage:>6}[/] {escape(tier)}" + (f": {escape(msg)}" if msg else ""),
                          highlight=False)
        else:
            progress.event(tier, stage, msg)

    runner.on_event = on_event
    runner.on_stage_end = progress.stage_end
    try:
        with progress:
            runner.run()
    except QevalInputError as e:
        _fail(e)
    except StageFailed as e:  # source or env: nothing can be measured; finished stages are kept
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERNAL)
    except (Interrupted, KeyboardInterrupt):
        where = runner.remote.url_of(runner.remote_rel) if runner.remote is not None else run_dir
        console.print(f"[yellow]interrupted[/]: finished stages are kept; resume with "
                      f"`qeval run {escape(str(recipe))} --resume {escape(str(where))}`", highlight=False)
        raise typer.Exit(_interrupted_exit())
    try:
        code = _decide(run_dir, junit_path)
    except QevalInputError as e:
        _fail(e)
    if runner.remote is not None:
        try:
            runner.publish_outputs()
            console.print(f"results: {escape(runner.remote.url_of(runner.remote_rel))} "
                          f"(local copy: {escape(str(run_dir))})", highlight=False)
        except Exception as e:  # the local copy is complete; say what did not reach the store
            console.print(f"[red]results are only in {escape(str(run_dir))}[/]: copying them to "
                          f"{escape(str(r.storage))} failed ({e.__class__.__name__}: "
                          f"{escape(' '.join(str(e).split())[:200])}); `qeval run {escape(str(recipe))} "
                          f"--resume {escape(str(run_dir))}` copies them once the store is reachable", highlight=False)
    else:
        console.print(f"results: {escape(str(run_dir))}", highlight=False)
    raise typer.Exit(code)


def _run_folder(arg: str, which: str = "run"):
    """A run folder argument: a local path, or the URL of a run in a store (copied into the
    staging folder first; fsspec reads credentials and endpoint from the environment, e.g.
    ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``). Returns ``(local folder, (store, rel) or None)``.

    Raises:
        QevalInputError: the URL is not a run folder (no run.json) or cannot be read.
    """
    if not arg.strip():
        raise QevalInputError("give a run folder (got an empty string)", field=which)
    if not is_url(arg):
        local = expand_user(arg, field=which)
        if not local.is_dir() or not (local / "run.json").exists():
            raise QevalInputError("not a qeval run folder (no run.json)", file=local, field=which)
        return local, None
    url = arg.rstrip("/")
    parts = url.split("/")
    if len(parts) < 5 or parts[-3] != "results":
        raise QevalInputError(f"{arg} is not a run URL (.../results/<name>/<timestamp>)", field=which)
    base = "/".join(parts[:-3])
    rel = "/".join(parts[-3:])
    try:
        store = RemoteStorage(base)
        if not store.exists(f"{rel}/{RunLayout.RUN_JSON}"):
            if not store.fs.exists(store.root.split("/")[0]):
                raise QevalInputError(f"cannot read {arg}: {base.split('://')[0]}://{store.root.split('/')[0]} does "
                                      f"not exist or these credentials cannot see it", field=which)
            raise QevalInputError(f"{arg} is not a qeval run folder (no run.json)", field=which)
        local = _staging_copy(store, rel)
    except QevalInputError:
        raise
    except Exception as e:  # credentials, network: the user's setup
        raise QevalInputError(f"cannot read {arg}: {e.__class__.__name__}: {' '.join(str(e).split())[:200]}",
                              field=which) from None
    return local, (store, rel)


def _staging_root() -> Path:
    """Local folder for runs whose storage is a URL: ``$QEVAL_CACHE/staging``."""
    return staging_dir()


def _staging_copy(store, rel: str) -> Path:
    """Download the run ``rel`` (``results/<name>/<ts>``) into ``staging/<name>/<ts>``."""
    local = safe_join(_staging_root(), Path(rel).parent.name, Path(rel).name, what="run name")  # no '..' out
    store.download_dir(rel, local)
    return local


def _fetch_run(remote, url: str) -> Path:
    """Copy a run folder from the store (``<storage>/results/<name>/<ts>``) into the staging
    folder, for ``--resume URL``. Returns the local folder.

    Raises:
        QevalInputError: the URL is not a run folder under the recipe's storage.
    """
    prefix = remote.url + "/"
    rel = url.rstrip("/")[len(prefix):] if url.startswith(prefix) else ""
    parts = rel.split("/")
    if len(parts) != 3 or parts[0] != "results" or not remote.exists(f"{rel}/{RunLayout.RUN_JSON}"):
        raise QevalInputError(f"{url} is not a run folder under {remote.url}/results/", field="--resume")
    local = _staging_copy(remote, rel)
    if stage_done(RunLayout(local), RUN_SCOPE, "source"):
        try:
            localize_source(remote, local)
        except RuntimeError as e:
            raise QevalInputError(str(e), field="--resume") from None
    return local


def _decide(run_dir: Path, junit: Optional[Path]) -> int:
    """Tables, gate, report from the stored JSON; returns the gate's exit code."""
    code, text = build_outputs(run_dir, junit=junit)
    out.print(text, highlight=False, soft_wrap=True)
    return code


def _writable_run(local: Path, junit: Optional[str] = None) -> Optional[Path]:
    """Before reading anything: the run folder can take its outputs and ``--junit`` names
    a file that can be written (not a folder, a device, nor one of the run's outputs).

    Raises:
        QevalInputError: naming the folder or the flag.
    """
    if local.is_dir() and (local / "run.json").exists():
        check_output_dir(local, field="run", create=False)
    if junit is None:
        return None
    return check_output_file(junit, field="--junit", not_in=tuple(local / n for n in OUTPUT_NAMES))


@app.command()
def report(run_dir: str = typer.Argument(..., help="a run folder, or its URL under a storage URL")) -> None:
    """Rebuild table.md/csv, gate.json and report.html from stored JSON (no model is loaded).
    A run at a URL is copied into the staging folder, rebuilt, and its outputs copied back."""
    try:
        local, remote = _run_folder(run_dir)
        _writable_run(local)
        _decide(local, None)
        if remote is not None:
            remote[0].upload_dir(local, remote[1], include=lambda rel: rel in RunLayout.OUTPUT_FILES)
    except QevalInputError as e:
        _fail(e)


@app.command()
def gate(run_dir: str = typer.Argument(..., help="a run folder, or its URL under a storage URL"),
         junit: Optional[str] = typer.Option(None, "--junit", help="write JUnit XML here")) -> None:
    """Judge a finished run against its recipe's gate: exit 0 pass, 1 fail (a rule measured
    damage), 4 error (a candidate's tier or the reference's did not finish: not judged),
    2 bad input."""
    try:
        if junit is not None and not junit.strip():
            raise QevalInputError("give a file name (got an empty string)", field="--junit")
        local = _run_folder(run_dir)[0]
        junit_path = _writable_run(local, junit)
        code = _decide(local, junit_path)
    except QevalInputError as e:
        _fail(e)
    raise typer.Exit(code)


@app.command()
def plan(run_dir: Optional[str] = typer.Argument(None, help="a run folder or its URL: measured figures replace "
                                                 "estimates row by row"),
         model: Optional[str] = typer.Option(None, "--model", help="config.json or local model folder (estimates)"),
         recipe: Optional[str] = typer.Option(None, "--recipe", help="plan the tiers of this recipe (default: the "
                                              "run's tiers, or every tier kind)"),
         gpu: Optional[str] = typer.Option(None, "--gpu", help="a known GPU (memory and bandwidth), e.g. rtx4090, "
                                           "h100-sxm; --gpu-mem and --bandwidth override it"),
         gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="device memory, e.g. 24GiB, 80GB "
                                               "(default: --gpu's, the run's GPU, else 24GiB)"),
         bandwidth: Optional[str] = typer.Option(None, "--bandwidth", help="memory bandwidth, e.g. 1008GB/s "
                                                 "(default: --gpu's, else the run's measured)"),
         usable: Optional[float] = typer.Option(None, "--usable", help="share of memory usable (default 0.95, "
                                                "or the GPU entry's)"),
         context: int = typer.Option(32768, "--context", help="tokens per sequence"),
         users: int = typer.Option(8, "--users", help="concurrent sequences"),
         overhead: str = typer.Option("1GiB", "--overhead", help="runtime overhead (activations, CUDA context)"),
         as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
         ) -> None:
    """Capacity and speed plan per tier: weights, KV cache, sequences that fit, decode bound
    and expected tokens/s on a GPU; estimates from a config, measured figures from a run."""
    try:
        if run_dir is None and model is None and recipe is None:
            raise QevalInputError("give RUN_DIR, --model or --recipe", field="plan")
        if context <= 0:
            raise QevalInputError(f"must be a positive number of tokens (got {context})", field="--context")
        if users <= 0:
            raise QevalInputError(f"must be a positive number of sequences (got {users})", field="--users")
        if context > MAX_TOKENS:  # a bound keeps every product below float overflow
            raise QevalInputError(f"must be at most {MAX_TOKENS:,} tokens (got {context})", field="--context")
        if users > MAX_COUNT:
            raise QevalInputError(f"must be at most {MAX_COUNT:,} sequences (got {users})", field="--users")
        local = _run_folder(run_dir)[0] if run_dir else None
        out.print(plan_text(local, model, gpu_mem, context, users, overhead, recipe=recipe, gpu=gpu,
                            bandwidth=bandwidth, usable=usable, as_json=as_json), highlight=False)
    except QevalInputError as e:
        _fail(e)


@app.command()
def compare(run_a: str = typer.Argument(..., help="baseline run folder (or its URL)"),
            run_b: str = typer.Argument(..., help="new run folder (or its URL)")) -> None:
    """Compare the same tiers of two runs side by side, with deltas."""
    try:
        a, b = _run_folder(run_a, "RUN_A")[0], _run_folder(run_b, "RUN_B")[0]
        rows = compare_runs(a, b)
        out.print(compare_markdown(rows, run_a, run_b), highlight=False)
        out.print(item_changes_markdown(a, b, [r.tier for r in rows]), highlight=False)
    except QevalInputError as e:
        _fail(e)


@app.command()
def show(run_dir: str = typer.Argument(..., help="a run folder, or its URL under a storage URL"),
         tier: str = typer.Argument(..., help="a tier of the run"),
         item: Optional[str] = typer.Option(None, "--item", help="only this item (suite/id, or the id alone)"),
         flips: bool = typer.Option(False, "--flips", help="only the items that flipped against the reference"),
         failing: bool = typer.Option(False, "--failing", help="only the items that fail on the tier"),
         ) -> None:
    """A tier's flipped and failing items beside the reference's answers, their checks and
    KLD, and the positions of highest KLD (the report's review section, in the terminal)."""
    try:
        local = _run_folder(run_dir)[0]
        run, tiers = load_run(local)
        if tier not in tiers:
            raise QevalInputError(f"no tier {tier!r} in this run (tiers: {', '.join(tiers) or 'none'})",
                                  file=local, field="TIER")
        ref = get_path(run.recipe, "gate", "reference") or "bf16"
        review = tier_review(local, tier, ref)
        if review is None:
            raise QevalInputError(f"tier {tier!r} has no stored answers (status {tiers[tier].status})",
                                  file=local, field="TIER")
        if item is not None and not review.find(item):
            raise QevalInputError(f"tier {tier!r} answered no item {item!r}", file=local, field="--item")
        show_review(Console(soft_wrap=False), review, item=item, flips=flips, failing=failing)
    except QevalInputError as e:
        _fail(e)


#: The signal that stopped the process (SIGINT unless SIGTERM arrived): exit 130 or 143 (_interrupted_exit).
_SIGNAL = {"n": int(signal.SIGINT)}


def _on_term(signum, _frame) -> None:  # CI cancels with SIGTERM: stop like Ctrl-C (stages kept, exit 143)
    _SIGNAL["n"] = int(signum)
    raise KeyboardInterrupt


def _interrupted_exit() -> int:
    """The exit code of an interrupted command: EXIT_TERMINATED (143) after SIGTERM, else
    EXIT_INTERRUPTED (130, Ctrl-C)."""
    return EXIT_TERMINATED if _SIGNAL["n"] == int(signal.SIGTERM) else EXIT_INTERRUPTED


def _crash_log(exc: BaseException) -> Path | None:
    """Write the traceback of an unexpected exception to ``$QEVAL_CACHE/logs/`` (else the
    temporary folder); returns the file, or None when nothing could be written."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"qeval {' '.join(sys.argv[1:])}\n{text}"
    name = f"qeval-crash-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"
    folders: list[Path] = []
    try:
        folders.append(cache_root() / "logs")
    except Exception:  # noqa: BLE001 - a bad $QEVAL_CACHE must not hide the crash
        pass
    folders.append(Path(tempfile.gettempdir()))
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            p = folder / name
            p.write_text(text, encoding="utf-8")
            return p
        except OSError:
            continue
    return None


def main() -> None:
    """Console entry point; applies the exit-code contract in the module docstring.

    Usage errors (unknown option or command, a flag value of the wrong type, a missing
    argument) are one line ``error: <command>: <message>``, exit 2, instead of click's
    boxed usage text. An unexpected exception is one line naming the log file that holds
    its traceback, exit 3."""
    try:
        from typer._click.exceptions import UsageError  # optional: typer >= 0.2x vendors click
    except ImportError:  # older typer: click itself
        from click.exceptions import UsageError  # optional: older typer has no vendored click
    try:
        signal.signal(signal.SIGTERM, _on_term)
    except ValueError:  # not the main thread (embedded use): leave signals alone
        pass
    try:
        rc = app(standalone_mode=False, prog_name="qeval")
    except UsageError as e:  # NoSuchOption, BadParameter, MissingParameter, ...
        where = e.ctx.command_path if e.ctx is not None else "qeval"
        msg = " ".join(e.format_message().split())
        if msg:  # empty: bare `qeval`, whose help click already printed
            console.print(f"[bold red]error:[/] {escape(where)}: {escape(msg)} (see `{escape(where)} --help`)",
                          highlight=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(_interrupted_exit())
    except QevalInputError as e:  # pragma: no cover - commands catch their own
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the contract: one line, traceback in a log, exit 3
        log = _crash_log(e)
        what = " ".join(f"{e.__class__.__name__}: {e}".split())[:300]
        console.print(f"[bold red]internal error:[/] {escape(what)} (traceback in "
                      f"{escape(str(log)) if log else 'no log: nothing could be written'}; please report it)",
                      highlight=False, soft_wrap=True)
        sys.exit(EXIT_INTERNAL)
    if rc == EXIT_INTERRUPTED:  # typer turns KeyboardInterrupt (also ours, from SIGTERM) into exit 130
        rc = _interrupted_exit()
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
