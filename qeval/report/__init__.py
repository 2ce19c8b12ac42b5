"""Outputs a person or CI reads: tier tables (Markdown, CSV), ``gate.json``, the
self-contained ``report.html`` and JUnit XML. All are rebuilt from a run folder's stored
JSON (``qeval report RUN_DIR``): no model, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..analysis.gate import GateReport
from ..results import GateFile, RunLayout, json_text, write_all
from .html import (DEFAULT_BUDGET_BYTES, DEFAULT_USERS, _analyse, _tables_text, default_budget_bytes, render_report,
                   slow_path_flags, write_report, write_tables)
from .table import COLUMNS, SlowPath, TierTable, markdown_table, tier_table
from .junit import gate_offenders, junit_xml, write_junit
from .review import run_reviews

__all__ = ["COLUMNS", "DEFAULT_BUDGET_BYTES", "DEFAULT_USERS", "Outputs", "SlowPath", "TierTable",
           "default_budget_bytes", "junit_xml", "markdown_table", "rebuild_outputs", "render_report",
           "slow_path_flags", "tier_table", "write_junit", "write_report", "write_tables"]


@dataclass
class Outputs:
    """What :func:`rebuild_outputs` wrote, the gate verdict behind it and ``gate.json`` as written."""
    table_md: Path
    table_csv: Path
    gate_json: Path
    report_html: Path
    junit_xml: Path | None
    gate: GateReport
    gate_file: GateFile

    def exit_code(self) -> int:
        """The gate's exit code (:meth:`qeval.analysis.gate.GateReport.exit_code`): 0 when every
        judged candidate passes, 1 when one failed a rule (or none was judged), else 4 when
        some candidate could not be judged."""
        return self.gate.exit_code()


def rebuild_outputs(run_dir: str | Path, recipe_dict: dict | None = None,
                    junit: bool | str | Path = False) -> Outputs:
    """Rewrite every decision output of a run folder from its stored JSON.

    Writes ``table.md``, ``table.csv``, ``gate.json`` (gate verdict plus the Pareto front and
    fallback ladder), ``report.html`` and, when ``junit`` is true or a path, JUnit XML
    (``True``: ``<run_dir>/junit.xml``). Everything is computed before anything is written,
    and the files are written all or none (:func:`qeval.results.write_all`).

    Args:
        run_dir: run folder (``run.json`` + ``tiers/*.json``).
        recipe_dict: recipe to judge with instead of the one in ``run.json``
            (a ``Recipe.model_dump()``); None: the stored one.
        junit: False, True, or the XML file's path.

    Returns:
        :class:`Outputs`; ``outputs.exit_code()`` is the gate's exit code.

    Raises:
        QevalInputError: not a run folder, malformed JSON, a recipe section that does
            not validate, or an output that cannot be written.
    """
    layout = RunLayout(run_dir)
    run, a, spec = _analyse(layout.root, recipe_dict)
    slow = slow_path_flags(a.tiers, a.reference, max(a.depths), spec.slow_path_fraction)
    md, csv_text = _tables_text(a, slow, run.prompt_format)
    gate_file = GateFile.model_validate({**a.gate.to_dict(), "quality_metric": a.quality_metric,
                                         "pareto": a.pareto.to_dict(), "ladder": a.ladder.to_dict(),
                                         "slow_path": {n: s.text for n, s in slow.items()},
                                         "load_stopped": {n: t.load.stopped for n, t in a.tiers.items()
                                                          if t.load is not None and t.load.stopped}})
    reviews = run_reviews(layout.root, list(a.tiers), a.reference)
    files = {layout.table_md: md, layout.table_csv: csv_text, layout.gate_json: json_text(gate_file),
             layout.report_html: render_report(run, a, spec, reviews=reviews)}
    jpath = None
    if junit:
        jpath = layout.junit_xml if junit is True else Path(junit)
        files[jpath] = junit_xml(a.gate, offenders=gate_offenders(a.gate, reviews))
    write_all(files)  # all or none: a failure while rendering or writing leaves every old output as it was
    return Outputs(layout.table_md, layout.table_csv, layout.gate_json, layout.report_html, jpath, a.gate, gate_file)
