#!/usr/bin/env python3
"""Generate the long-context suite: ``datasets/long_context.jsonl`` (item specs) and
``datasets/long_context_filler.jsonl`` (the filler text the documents are padded with).

Everything is written for this project: fictional companies, people, contracts, ledgers,
incident logs and meeting transcripts, composed from the hand-written templates below.
Deterministic: a fixed seed, ``random.Random`` with per-item string seeds, so the same
command always writes the same bytes (``tests/test_long_context.py`` checks the committed
files against it).

An item is model-independent: a title, a preamble, *facts* (document lines with the
relative position, 0..1, where each goes) and *questions* with exact answers. The
renderer (``qeval/measure/long_context.py``) builds a document of an exact token depth
with the model's own tokenizer: filler lines of the item's genre, starting at the item's
``filler_start``, with the facts placed at their positions, then the questions. The
filler never contains any question's ``key`` or text answer (checked here and again when
the suite is loaded), so every answer comes from the placed facts alone.

Question kinds: ``lookup`` (one fact), ``multi`` (three facts in one answer), ``update``
(a value stated, then corrected later: the later value is right), ``count`` and ``sum``
(entries spread through the document), ``absent`` (the document does not say: the model
should say so).

Name banks come from ``make_calibration.py`` (one set of fictional names for the project);
the first part of each bank feeds the filler, the rest is reserved for facts, so a fact's
name never occurs in filler text.

Usage:
    python datasets/tools/make_long_context.py [--out-dir datasets] [--seed 20250301]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from typing import Callable

SEED = 20250301
ITEMS_PER_GENRE = 3
FILLER_PER_GENRE = 1000        # about 36K tokens of filler per genre before it repeats
FILLER_STRIDE = 300            # item k of a genre starts its filler at k * stride
GENRES = ("ledger", "contract", "incident_log", "meeting")
ITEMS_FILE = "long_context.jsonl"
FILLER_FILE = "long_context_filler.jsonl"
#: Where a value is first stated and where it is corrected (relative positions), by item.
UPDATE_AT = ((0.2, 0.8), (0.3, 0.7), (0.4, 0.8))

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_calibration", _HERE / "make_calibration.py")
_cal = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_cal)  # type: ignore[union-attr]

# ---- banks: filler part / reserved part ---------------------------------------------------
F_COMPANIES, R_COMPANIES = _cal.COMPANIES[:28], _cal.COMPANIES[28:]
F_FIRST, R_FIRST = _cal.FIRST[:32], _cal.FIRST[32:]
F_LAST, R_LAST = _cal.LAST[:26], _cal.LAST[26:]
F_SITES, R_SITES = _cal.SITES[:10], _cal.SITES[10:]
F_PROJECTS = _cal.PROJECTS[:10]
R_PROJECTS = ["Project Saffron", "Project Kingfisher", "Project Basalt", "Project Lantern", "Project Heron",
              "Project Copperleaf", "Project Marigold", "Project Solstice", "Project Driftwood", "Project Larch"]
DEPTS = _cal.DEPTS
SYSTEMS = _cal.SYSTEMS
MONTHS = _cal.MONTHS
WEEKDAYS = _cal.WEEKDAYS
CURRENCIES = ["£", "$", "€"]

F_SERVICES = ["billing-api", "order-router", "auth-service", "warehouse-sync", "reporting-db", "email-relay",
              "mobile-gateway", "label-printing", "vpn-edge", "customer-portal", "stock-feed", "payroll-batch",
              "search-api", "invoice-renderer", "file-transfer", "scheduler"]
R_SERVICES = ["ledger-sync", "payments-gateway", "route-optimiser", "tax-engine", "sensor-hub", "returns-portal",
              "price-feed", "dispatch-queue", "loyalty-points", "fleet-telemetry"]


def _fill(template: str, rng: random.Random, slots: dict[str, Callable[[], str]]) -> str:
    """``[a|b]`` picks one alternative; ``{slot}`` is drawn fresh from ``slots``."""
    text = re.sub(r"\[([^\[\]]*\|[^\[\]]*)\]", lambda m: rng.choice(m.group(1).split("|")), template)
    return re.sub(r"\{(\w+)\}", lambda m: slots[m.group(1)](), text)


def money(cur: str, amount: int) -> str:
    """``£4,250`` style."""
    return f"{cur}{amount:,}"


def _person(rng: random.Random, first: list[str], last: list[str]) -> str:
    return f"{rng.choice(first)} {rng.choice(last)}"


def _common_slots(rng: random.Random, cur: str) -> dict[str, Callable[[], str]]:
    return {
        "site": lambda: rng.choice(F_SITES),
        "dept": lambda: rng.choice(DEPTS),
        "system": lambda: rng.choice(SYSTEMS),
        "month": lambda: rng.choice(MONTHS),
        "weekday": lambda: rng.choice(WEEKDAYS),
        "person": lambda: _person(rng, F_FIRST, F_LAST),
        "company": lambda: rng.choice(F_COMPANIES),
        "project": lambda: rng.choice(F_PROJECTS),
        "service": lambda: rng.choice(F_SERVICES),
        "n": lambda: str(rng.randint(2, 24)),
        "days": lambda: str(rng.choice([5, 7, 10, 14, 20, 28, 30, 60, 90])),
        "hours": lambda: str(rng.choice([1, 2, 4, 8, 12, 24, 48])),
        "pct": lambda: f"{rng.randint(2, 40)}%",
        "mins": lambda: str(rng.randint(3, 95)),
        "amount": lambda: money(cur, rng.randint(12, 980) * 10),
        "big": lambda: money(cur, rng.randint(15, 400) * 1000),
    }


# ==========================================================================================
# ledger
# ==========================================================================================
LEDGER_DESC = [
    "monthly cleaning of the {site} warehouse", "replacement pallets for the {site} dock",
    "quarterly maintenance of the {system}", "{n} days of agency staff for {dept}", "courier charges for {month}",
    "stationery and printer supplies for {dept}", "annual calibration of the weighing scales at {site}",
    "travel for the {dept} team visit to {site}", "electricity for the {site} site, {month}",
    "support renewal for the {system}", "safety boots and gloves for the {site} shift teams",
    "catering for the {dept} planning day", "repairs to the loading bay door at {site}",
    "water treatment chemicals, {month} delivery", "external audit fee, second instalment",
    "recruitment advertising for {dept} roles", "training course for {n} {dept} staff",
    "insurance premium instalment for the van fleet", "forklift lease at {site}, {month}",
    "telephone and data lines, {month}", "office furniture for the {site} reception",
    "waste collection at {site}, {month}", "security patrols at {site} over the holiday weekend",
    "consultancy on {system} reporting", "packaging film and tape, {month} order",
    "fuel cards for the {site} delivery drivers", "HVAC service visit at {site}",
    "laptop replacements for {dept}", "translation of the {dept} handbook", "pest control visit at {site}",
]
LEDGER_TEMPLATES = [
    "{entry} | {company} | {cc} | {amount} | " + d for d in LEDGER_DESC
] + [
    "{entry} | {company} | {cc} | {amount} | [late payment fee|carriage charge|restocking fee] on the {month} order",
    "Correction to entry {entry}: cost centre changed to {cc} after the [quarterly|month-end] review.",
    "Correction to entry {entry}: description changed to \"" + LEDGER_DESC[3] + "\".",
    "Credit note {entry} | {company} | {cc} | -{amount} | [damaged goods returned|duplicate invoice reversed]",
    "Subtotal for {cc}, {month}: {big}",
    "Note: entries from {entry} onward were approved by {person} ({dept}).",
]


def _ledger_slots(rng: random.Random, cur: str) -> dict[str, Callable[[], str]]:
    s = _common_slots(rng, cur)
    s["entry"] = lambda: f"AP-{rng.randint(10000, 69999)}"
    s["cc"] = lambda: f"CC-{rng.randint(100, 699)} {rng.choice(DEPTS)}"
    return s


def ledger_filler(rng: random.Random) -> list[str]:
    cur = "£"
    slots = _ledger_slots(rng, cur)
    return [_fill(rng.choice(LEDGER_TEMPLATES), rng, slots) for _ in range(FILLER_PER_GENRE)]


def ledger_item(rng: random.Random, k: int) -> dict:
    cur = "£"  # the filler is in pounds too
    slots = _ledger_slots(rng, cur)
    sup = rng.sample(R_COMPANIES, 8)
    entries = iter(rng.sample(range(70000, 99999), 16))
    ccs = iter(rng.sample(range(700, 999), 16))

    def entry() -> str:
        return f"AP-{next(entries)}"

    def cc() -> tuple[str, str]:
        code = f"CC-{next(ccs)}"
        return code, f"{code} {rng.choice(DEPTS)}"

    def desc() -> str:
        return _fill(rng.choice(LEDGER_DESC), rng, slots)

    facts, questions = [], []
    pos3 = (0.1, 0.5, 0.9)
    # lookup
    e1 = entry()
    facts.append(_fact("f1", pos3[k % 3], f"{e1} | {sup[0]} | {cc()[1]} | {money(cur, rng.randint(20, 90) * 50)} | {desc()}"))
    questions.append({"id": "q1", "kind": "lookup", "key": sup[0], "ask": f"What is the entry number of the payment to {sup[0]}?",
                      "answer": e1, "facts": ["f1"]})
    # multi: amount, cost centre, entry number of three suppliers
    amt2 = rng.randint(20, 90) * 50
    code3, cc3 = cc()
    e4 = entry()
    order = [pos3[(k + i) % 3] for i in range(3)]
    facts.append(_fact("f2", order[0], f"{entry()} | {sup[1]} | {cc()[1]} | {money(cur, amt2)} | {desc()}"))
    facts.append(_fact("f3", order[1], f"{entry()} | {sup[2]} | {cc3} | {money(cur, rng.randint(20, 90) * 50)} | {desc()}"))
    facts.append(_fact("f4", order[2], f"{e4} | {sup[3]} | {cc()[1]} | {money(cur, rng.randint(20, 90) * 50)} | {desc()}"))
    questions.append({"id": "q2", "kind": "multi", "key": sup[1],
                      "ask": f"Give the amount paid to {sup[1]}, the cost centre code charged for {sup[2]}, "
                             f"and the entry number of the payment to {sup[3]}.",
                      "answer": [amt2, code3, e4], "facts": ["f2", "f3", "f4"]})
    # update
    old, new = rng.sample(range(40, 190), 2)
    old, new = old * 50, new * 50
    e5 = entry()
    early, late = UPDATE_AT[k % 3]
    facts.append(_fact("f5", early, f"{e5} | {sup[4]} | {cc()[1]} | {money(cur, old)} | {desc()}"))
    facts.append(_fact("f6", late, f"Correction to entry {e5}: the amount payable to {sup[4]} is amended to "
                                    f"{money(cur, new)} after the credit note was withdrawn."))
    questions.append({"id": "q3", "kind": "update", "key": sup[4],
                      "ask": f"After any corrections, what amount is payable to {sup[4]}?",
                      "answer": new, "stale": old, "facts": ["f5", "f6"]})
    # count and sum over the same supplier's entries
    n = 3 + (k % 3)
    amounts = [rng.randint(8, 160) * 25 for _ in range(n)]
    ids = []
    for i, a in enumerate(amounts):
        fid = f"f{7 + i}"
        ids.append(fid)
        facts.append(_fact(fid, _spread(i, n), f"{entry()} | {sup[5]} | {cc()[1]} | {money(cur, a)} | {desc()}",
                           value=a))
    questions.append({"id": "q4", "kind": "count", "key": sup[5],
                      "ask": f"How many entries for {sup[5]} does the ledger list?", "answer": n, "facts": ids})
    questions.append({"id": "q5", "kind": "sum", "key": sup[5],
                      "ask": f"What is the total amount of all entries for {sup[5]}?", "answer": sum(amounts),
                      "facts": ids})
    questions.append({"id": "q6", "kind": "absent", "key": sup[6],
                      "ask": f"What is the entry number of the payment to {sup[6]}?", "facts": []})
    owner = rng.choice(F_COMPANIES)
    year = 2022 + k
    return {"title": f"Accounts payable ledger extract, {owner}, financial year {year}",
            "preamble": "One line per entry: entry number | supplier | cost centre | amount | description. "
                        "Corrections and credit notes refer to earlier entries.",
            "facts": facts, "questions": questions}


# ==========================================================================================
# contract
# ==========================================================================================
CONTRACT_TEMPLATES = [
    "Service hours. The Supplier shall provide the Services between 07:00 and 19:00 on every working day, and "
    "outside those hours on [request|the Customer's written request] at the rates agreed for out-of-hours work.",
    "Response times. The Supplier shall respond to a Priority {n} ticket within {hours} hours and give the "
    "Customer a written update at least every {hours} hours until the ticket is closed.",
    "Reporting. By the {n}th working day of each month the Supplier shall send the Customer a report on ticket "
    "volumes, response times and open actions for the previous month.",
    "Reviews. The parties shall meet every [month|quarter] at {site} to review performance, risks and planned "
    "changes, and the Supplier shall write up the agreed actions within {days} days.",
    "Personnel. The Supplier shall give the Customer {days} days' notice before replacing any key member of "
    "the delivery team, and the replacement shall have comparable experience.",
    "Subcontracting. The Supplier shall not subcontract any part of the Services without the Customer's prior "
    "written consent, which shall not be unreasonably withheld.",
    "Invoicing. The Supplier shall invoice monthly in arrears, and the Customer shall pay each undisputed "
    "invoice within {days} days of receiving it.",
    "Disputed invoices. The Customer shall tell the Supplier of any disputed amount within {days} days, and the "
    "parties shall try in good faith to settle it within a further {days} days.",
    "Price changes. The Supplier may change its prices once a year on {days} days' written notice, by no more "
    "than the change in the published consumer price index over the previous twelve months.",
    "Change control. Either party may propose a change to the Services in writing; no change takes effect until "
    "both parties have signed a change note describing its effect on price and timetable.",
    "Access. The Customer shall give the Supplier's staff reasonable access to the {site} premises during "
    "working hours, subject to the site's safety and visitor rules.",
    "Equipment. Equipment supplied by the Customer remains its property, and the Supplier shall return it in "
    "good condition, fair wear and tear excepted, when it is no longer needed.",
    "Training. The Supplier shall train up to {n} of the Customer's staff in the use of the {system} at no extra "
    "charge during the first year.",
    "Documentation. The Supplier shall keep the operating manuals for the {system} up to date and shall deliver "
    "a revised copy within {days} days of any significant change.",
    "Backups. The Supplier shall back up the Customer's files every [night|four hours] and test a full restore at "
    "least once every {n} months, reporting the result to the Customer.",
    "Business continuity. The Supplier shall maintain a continuity plan for the Services, test it every year and "
    "share a summary of the test results with the Customer.",
    "Confidentiality. Each party shall keep the other's confidential information secret and use it only for the "
    "purposes of this Agreement, during its term and for {n} years afterwards.",
    "Publicity. Neither party shall issue a press release or public statement about this Agreement without the "
    "other party's written approval.",
    "Insurance. The Supplier shall keep public and employer's insurance with reputable insurers and shall provide "
    "certificates of cover on request.",
    "Audit. The Customer may, on {days} days' notice and not more than once a year, inspect the Supplier's "
    "records relating to the Services.",
    "Compliance. Each party shall comply with all laws that apply to it in performing this Agreement, including "
    "laws on bribery, modern slavery and export controls.",
    "Health and safety. The Supplier's staff shall follow the Customer's site rules at {site}, including sign-in, "
    "protective equipment and permit-to-work procedures.",
    "Environmental. The Supplier shall report each year the energy used and waste produced in delivering the "
    "Services, and agree reduction targets with the Customer.",
    "Force majeure. Neither party is in breach for a delay caused by events beyond its reasonable control, "
    "provided it notifies the other promptly and takes reasonable steps to reduce the delay.",
    "Escalation. A dispute not settled by the account leads within {days} days shall be referred to the "
    "[operations directors|chief executives] of both parties, who shall meet within a further {days} days.",
    "Mediation. If the directors cannot settle a dispute, the parties shall try mediation before starting any "
    "court proceedings, sharing the mediator's fees equally.",
    "Notices. Notices under this Agreement shall be in writing and sent by recorded delivery or by email to the "
    "addresses in Schedule {n}, and take effect on receipt.",
    "Assignment. Neither party may assign this Agreement without the other's consent, except to a company in "
    "the same group that takes over the relevant business.",
    "Entire agreement. This Agreement and its schedules are the whole agreement between the parties about the "
    "Services and replace earlier discussions on the same subject.",
    "Variation. No variation of this Agreement is valid unless it is in writing and signed by an authorised "
    "representative of each party.",
    "Severance. If any provision of this Agreement is found invalid, the rest of the Agreement continues in "
    "force and the parties shall agree a valid replacement.",
    "Waiver. A failure or delay in exercising a right does not waive that right or any other right under this "
    "Agreement.",
    "Exit. On expiry the Supplier shall give reasonable help for up to {days} days to move the Services to the "
    "Customer or a new provider, at the rates then in force.",
    "Handover. Within {days} days of expiry the Supplier shall return all Customer files and delete its copies, "
    "confirming the deletion in writing.",
    "Service review. The parties shall review the scope of the Services every {n} months and record any agreed "
    "adjustments in a change note.",
    "Sustainability. The Supplier shall use recycled packaging for deliveries to {site} wherever it is available "
    "at comparable cost.",
    "Rate card entry: [on-site engineer visit|remote support hour|emergency call-out|spare parts handling|"
    "operator training day] at the {site} site, {amount} per [visit|hour|call-out|order|day].",
    "Holidays. The Supplier shall keep enough staff available during public holidays to meet the response "
    "times in this Agreement.",
    "Key performance indicators. The Supplier shall meet at least {pct} of response-time targets in each month, "
    "measured from the Customer's ticketing platform.",
    "Security. The Supplier shall keep its systems patched, use multi-factor sign-in for administrative access "
    "and review access rights every {n} months.",
]

CONTRACT_CONCEPTS = [
    # key, fact text (value slot {v}), question, value kind
    ("contract manager", "Contract manager. The Customer appoints {v} as its contract manager; only that person may "
     "approve changes to the Services.", "Who is the Customer's contract manager?", "person"),
    ("escrow agent", "Escrow. A copy of the source code is held by {v}, acting as escrow agent, and is updated "
     "after every major release.", "Which company acts as the escrow agent?", "company"),
    ("purchase order", "Purchase order. Every invoice must quote purchase order {v}; invoices without it are "
     "returned unpaid.", "Which purchase order number must every invoice quote?", "po"),
    ("liability", "Limit of liability. The Supplier's total liability in any contract year is capped at {v}.",
     "What is the cap on the Supplier's total liability in a contract year?", "money"),
    ("data centre", "Hosting. The Customer's data is hosted only in the {v} data centre, with backups kept in the "
     "same country.", "In which data centre is the Customer's data hosted?", "site"),
    ("security lead", "Security contact. The Supplier's named security lead is {v}, who must be told of any "
     "suspected breach within one hour.", "Who is the Supplier's named security lead?", "person"),
]
CONTRACT_UPDATES = [
    ("for convenience", "Ending for convenience. Either party may end this Agreement for convenience on {v} days' "
     "written notice.", "Amendment No. {a}. The notice period for ending this Agreement for convenience is changed "
     "to {v} days' written notice.", "After all amendments, how many days' written notice are needed to end the "
     "Agreement for convenience?", (30, 45, 60, 75, 90, 120)),
    ("service credit", "Service credit. If monthly availability falls below the target, the Customer receives a "
     "service credit of {v} percent of the monthly fee.", "Amendment No. {a}. The service credit for missed "
     "availability is changed to {v} percent of the monthly fee.", "After all amendments, what service credit, "
     "in percent of the monthly fee, applies when availability is missed?", (5, 10, 15, 20, 25)),
]


def contract_filler(rng: random.Random) -> list[str]:
    slots = _common_slots(rng, "£")
    return [_fill(rng.choice(CONTRACT_TEMPLATES), rng, slots) for _ in range(FILLER_PER_GENRE)]


def contract_item(rng: random.Random, k: int) -> dict:
    cur = "£"
    people = iter(rng.sample([f"{f} {l}" for f in R_FIRST for l in R_LAST], 4))
    companies = iter(rng.sample(R_COMPANIES, 4))
    sites = iter(rng.sample(R_SITES, 4))
    pos = iter(rng.sample(range(70000, 99999), 4))

    def value(kind: str) -> tuple[str, str | int]:
        if kind == "person":
            v = next(people)
            return v, v
        if kind == "company":
            v = next(companies)
            return v, v
        if kind == "site":
            v = next(sites)
            return v, v
        if kind == "po":
            v = f"PO-{next(pos)}"
            return v, v
        n = rng.randint(20, 400) * 25000
        return money(cur, n), n

    concepts = rng.sample(CONTRACT_CONCEPTS, len(CONTRACT_CONCEPTS))
    facts, questions = [], []
    pos3 = (0.1, 0.5, 0.9)
    key, text, ask, kind = concepts[0]
    shown, ans = value(kind)
    facts.append(_fact("f1", pos3[k % 3], text.format(v=shown)))
    questions.append({"id": "q1", "kind": "lookup", "key": key, "ask": ask, "answer": ans, "facts": ["f1"]})
    answers, asks = [], []
    order = [pos3[(k + 1 + i) % 3] for i in range(3)]
    for i, (key_i, text_i, ask_i, kind_i) in enumerate(concepts[1:4]):
        shown, ans = value(kind_i)
        facts.append(_fact(f"f{2 + i}", order[i], text_i.format(v=shown)))
        answers.append(ans)
        asks.append(ask_i[0].lower() + ask_i[1:-1])
    questions.append({"id": "q2", "kind": "multi", "key": concepts[1][0],
                      "ask": "Answer all three: " + "; ".join(asks) + "?", "answer": answers,
                      "facts": ["f2", "f3", "f4"]})
    ukey, first, later, uask, choices = CONTRACT_UPDATES[k % 2]
    old, new = rng.sample(choices, 2)
    early, late = UPDATE_AT[k % 3]
    facts.append(_fact("f5", early, first.format(v=old)))
    facts.append(_fact("f6", late, later.format(v=new, a=rng.randint(2, 4))))
    questions.append({"id": "q3", "kind": "update", "key": ukey, "ask": uask, "answer": new, "stale": old,
                      "facts": ["f5", "f6"]})
    site = next(sites)
    n = 3 + ((k + 1) % 3)
    amounts = [rng.randint(6, 90) * 10 for _ in range(n)]
    services = ["on-site engineer visit", "remote support hour", "emergency call-out", "spare parts handling",
                "operator training day"]
    units = {"on-site engineer visit": "visit", "remote support hour": "hour", "emergency call-out": "call-out",
             "spare parts handling": "order", "operator training day": "day"}
    chosen = rng.sample(services, n)
    ids = []
    for i, (svc, a) in enumerate(zip(chosen, amounts)):
        fid = f"f{7 + i}"
        ids.append(fid)
        facts.append(_fact(fid, _spread(i, n), f"Rate card entry: {svc} at the {site} site, {money(cur, a)} per "
                                               f"{units[svc]}.", value=a))
    questions.append({"id": "q4", "kind": "count", "key": site,
                      "ask": f"How many rate card entries are listed for the {site} site?", "answer": n, "facts": ids})
    questions.append({"id": "q5", "kind": "sum", "key": site,
                      "ask": f"What is the total of the rate card amounts listed for the {site} site?",
                      "answer": sum(amounts), "facts": ids})
    akey, _t, aask, _k = concepts[4]
    questions.append({"id": "q6", "kind": "absent", "key": akey, "ask": aask, "facts": []})
    customer, supplier = rng.sample(F_COMPANIES, 2)
    return {"title": f"Master services agreement between {customer} (the Customer) and {supplier} (the Supplier)",
            "preamble": f"Signed copy, version {k + 2}. Each paragraph is one clause of the Agreement or an entry "
                        "of its schedules; amendments at the end of a schedule replace earlier wording.",
            "facts": facts, "questions": questions}


# ==========================================================================================
# incident log
# ==========================================================================================
INCIDENT_EVENTS = [
    "error rate above threshold after the [morning|overnight] deploy; rolled back", "disk latency alert on the "
    "primary node; replica promoted", "certificate expired on the public endpoint; renewed and redeployed",
    "queue backlog grew to {n} thousand messages; extra workers added", "slow responses traced to a missing index; "
    "index rebuilt", "memory leak in the worker pool; service restarted and fix scheduled", "upstream supplier "
    "API returned timeouts; retries increased", "nightly job overran by {mins} minutes; schedule moved",
    "configuration change applied to the wrong region; reverted", "connection pool exhausted during the "
    "{weekday} peak; pool size raised", "DNS record pointed at a retired host; record corrected",
    "login failures for {pct} of users; identity provider cache cleared", "storage volume {pct} full; old "
    "exports archived", "alert storm from a flapping health check; check threshold changed",
    "failed database failover test; runbook updated", "batch import rejected malformed rows; supplier asked to "
    "resend the file", "network packet loss between sites; carrier ticket raised",
]
INCIDENT_TEMPLATES = [
    "{inc} | {sev} | {service} | owner: {person} | " + e + "; customer-facing downtime {mins} minutes"
    for e in INCIDENT_EVENTS
] + [
    "{inc} | {sev} | {service} | owner: {person} | " + e + "; no customer impact" for e in INCIDENT_EVENTS[:8]
] + [
    "Update to {inc}: owner changed to {person} at the {weekday} hand-over.",
    "Update to {inc}: severity lowered to sev4 after the workaround held for {hours} hours.",
    "Postmortem for {inc} booked for {weekday} with {person} and the {dept} team.",
    "Shift hand-over: {person} to {person}; {n} tickets open, none urgent.",
    "Maintenance window announced for {service} on {weekday}, {hours} hours, approved by {person}.",
]


def _incident_slots(rng: random.Random) -> dict[str, Callable[[], str]]:
    s = _common_slots(rng, "£")
    s["inc"] = lambda: f"INC-{rng.randint(10000, 69999)}"
    s["sev"] = lambda: rng.choice(["sev1", "sev2", "sev3", "sev3", "sev4", "sev4"])
    return s


def incident_filler(rng: random.Random) -> list[str]:
    slots = _incident_slots(rng)
    return [_fill(rng.choice(INCIDENT_TEMPLATES), rng, slots) for _ in range(FILLER_PER_GENRE)]


def incident_item(rng: random.Random, k: int) -> dict:
    slots = _incident_slots(rng)
    svc = rng.sample(R_SERVICES, 7)
    people = iter(rng.sample([f"{f} {l}" for f in R_FIRST for l in R_LAST], 8))
    incs = iter(rng.sample(range(70000, 99999), 16))

    def inc() -> str:
        return f"INC-{next(incs)}"

    def event() -> str:
        return _fill(rng.choice(INCIDENT_EVENTS), rng, slots)

    def line(i: str, s: str, owner: str, mins: int | None = None) -> str:
        tail = f"customer-facing downtime {mins} minutes" if mins is not None else "no customer impact"
        return f"{i} | {rng.choice(['sev2', 'sev3'])} | {s} | owner: {owner} | {event()}; {tail}"

    facts, questions = [], []
    pos3 = (0.1, 0.5, 0.9)
    p1 = next(people)
    facts.append(_fact("f1", pos3[k % 3], line(inc(), svc[0], p1, rng.randint(5, 80))))
    questions.append({"id": "q1", "kind": "lookup", "key": svc[0], "ask": f"Who owned the {svc[0]} incident?",
                      "answer": p1, "facts": ["f1"]})
    i2, p3, i4 = inc(), next(people), inc()
    order = [pos3[(k + 2 + i) % 3] for i in range(3)]
    facts.append(_fact("f2", order[0], line(i2, svc[1], next(people))))
    facts.append(_fact("f3", order[1], line(inc(), svc[2], p3, rng.randint(5, 80))))
    facts.append(_fact("f4", order[2], line(i4, svc[3], next(people), rng.randint(5, 80))))
    questions.append({"id": "q2", "kind": "multi", "key": svc[1],
                      "ask": f"Give the incident number of the {svc[1]} incident, the owner of the {svc[2]} "
                             f"incident, and the incident number of the {svc[3]} incident.",
                      "answer": [i2, p3, i4], "facts": ["f2", "f3", "f4"]})
    i5, old, new = inc(), next(people), next(people)
    early, late = UPDATE_AT[k % 3]
    facts.append(_fact("f5", early, line(i5, svc[4], old, rng.randint(5, 80))))
    facts.append(_fact("f6", late, f"Update to {i5}: owner changed to {new} after the incident was escalated."))
    questions.append({"id": "q3", "kind": "update", "key": i5, "ask": f"Who owns {i5} after all updates?",
                      "answer": new, "stale": old, "facts": ["f5", "f6"]})
    n = 3 + ((k + 2) % 3)
    mins = [rng.randint(4, 75) for _ in range(n)]
    ids = []
    for i, m in enumerate(mins):
        fid = f"f{7 + i}"
        ids.append(fid)
        facts.append(_fact(fid, _spread(i, n), line(inc(), svc[5], _person(rng, F_FIRST, F_LAST), m), value=m))
    questions.append({"id": "q4", "kind": "count", "key": svc[5],
                      "ask": f"How many incidents were logged for {svc[5]}?", "answer": n, "facts": ids})
    questions.append({"id": "q5", "kind": "sum", "key": svc[5],
                      "ask": f"What is the total customer-facing downtime, in minutes, of the {svc[5]} incidents?",
                      "answer": sum(mins), "facts": ids})
    questions.append({"id": "q6", "kind": "absent", "key": svc[6], "ask": f"Who owned the {svc[6]} incident?",
                      "facts": []})
    company = rng.choice(F_COMPANIES)
    quarter = ("Q1", "Q2", "Q3", "Q4")[k % 4]
    return {"title": f"Operations incident log, {company} platform, {quarter}",
            "preamble": "One line per incident: incident number | severity | service | owner | what happened; "
                        "impact. Updates, hand-overs and maintenance notices refer to earlier lines.",
            "facts": facts, "questions": questions}


# ==========================================================================================
# meeting transcript
# ==========================================================================================
MEETING_LINES = [
    "I've looked at the {dept} figures again and {site} is still about {pct} behind plan.",
    "Can we take the {project} update first? I have to leave at half past.",
    "The supplier has confirmed delivery for {weekday}, but only {n} of the pallets.",
    "We ran the new rota at {site} for {n} weeks and overtime came down, though not by much.",
    "I'd rather not commit to a date until the {system} upgrade is tested.",
    "My team can cover the extra shifts in {month} if we get the agency staff approved.",
    "The customer survey came back with {pct} of replies asking for faster responses.",
    "Let's park that and come back to it when {person} has the numbers.",
    "The audit found nothing serious, just {n} minor points on record keeping.",
    "I spoke to {company} yesterday; they want a decision by {weekday}.",
    "We should check the contract before we promise anything on price.",
    "The pilot at {site} went well, and the staff there want to keep the new layout.",
    "Energy costs were {pct} higher than last year, mostly in the winter months.",
    "I'll circulate the draft after the meeting so people can comment by {weekday}.",
    "Training completion is at {pct}; the night shift is the group we keep missing.",
    "The {system} has been stable since the fix, no repeat of last month's outage.",
    "Can someone own the question of parking at {site}? It keeps coming up.",
    "We are waiting on {company} for the revised quote; they promised it this week.",
    "The backlog is down to {n} items, which is the lowest it has been this year.",
    "I agree with {person}; we should not split the team across two sites yet.",
    "The {project} steering group meets again on {weekday}, so we can raise it there.",
    "Sickness absence rose a little in {month}, mainly short-term colds.",
    "If we move the stock count to {weekday} we avoid the delivery peak.",
    "We still don't know whether the grant covers the {site} refurbishment.",
    "That's fair. Let's note the risk and review it next month.",
    "The new starters at {site} have all finished their induction.",
    "I'd like the dashboard to show weekly figures, not just monthly ones.",
    "Customer complaints are down {pct} since the returns process changed.",
]
MEETING_TEMPLATES = ["{person}: " + s for s in MEETING_LINES] + [
    "ACTION: {person} to [send the revised rota|check the supplier terms|update the risk log|book the site visit|"
    "draft the customer letter|confirm the training dates] by {weekday}.",
    "[Agreed|Decision]: the {dept} review moves to {month}.",
    "{person}: For {project}, I can approve {amount} from the contingency for [signage|temporary staff|extra "
    "testing|travel].",
]


def meeting_filler(rng: random.Random) -> list[str]:
    slots = _common_slots(rng, "€")
    return [_fill(rng.choice(MEETING_TEMPLATES), rng, slots) for _ in range(FILLER_PER_GENRE)]


def meeting_item(rng: random.Random, k: int) -> dict:
    cur = "€"
    proj = rng.sample(R_PROJECTS, 7)
    people = iter(rng.sample([f"{f} {l}" for f in R_FIRST for l in R_LAST], 6))
    sites = iter(rng.sample(R_SITES, 3))

    def speaker() -> str:
        return _person(rng, F_FIRST, F_LAST)

    facts, questions = [], []
    pos3 = (0.1, 0.5, 0.9)
    budget = rng.randint(12, 95) * 10000
    facts.append(_fact("f1", pos3[k % 3], f"{speaker()}: For the minutes, the budget we agreed for {proj[0]} is "
                                           f"{money(cur, budget)}."))
    questions.append({"id": "q1", "kind": "lookup", "key": proj[0], "ask": f"What budget was agreed for {proj[0]}?",
                      "answer": budget, "facts": ["f1"]})
    lead, site, b3 = next(people), next(sites), rng.randint(12, 95) * 10000
    order = [pos3[(k + i) % 3] for i in range(3)]
    facts.append(_fact("f2", order[0], f"{speaker()}: We have agreed that {lead} will lead the {proj[1]} pilot."))
    facts.append(_fact("f3", order[1], f"{speaker()}: {proj[2]} will be hosted at the {site} site from next month."))
    facts.append(_fact("f4", order[2], f"{speaker()}: The budget for {proj[3]} is set at {money(cur, b3)}."))
    questions.append({"id": "q2", "kind": "multi", "key": proj[1],
                      "ask": f"Who will lead the {proj[1]} pilot, at which site will {proj[2]} be hosted, and what "
                             f"is the budget for {proj[3]}?", "answer": [lead, site, b3],
                      "facts": ["f2", "f3", "f4"]})
    old, new = rng.sample(range(8, 48), 2)
    early, late = UPDATE_AT[k % 3]
    facts.append(_fact("f5", early, f"{speaker()}: The go-live for {proj[4]} is planned for week {old}."))
    facts.append(_fact("f6", late, f"{speaker()}: A correction to what was said earlier: the go-live for {proj[4]} "
                                    f"moves to week {new}."))
    questions.append({"id": "q3", "kind": "update", "key": proj[4],
                      "ask": f"In which week is the go-live for {proj[4]} now planned?", "answer": new, "stale": old,
                      "facts": ["f5", "f6"]})
    owner = next(people)
    n = 3 + (k % 3)
    tasks = rng.sample(["send the revised rota", "check the supplier terms", "update the risk log",
                        "book the site visit", "draft the customer letter", "confirm the training dates"], n)
    ids = []
    for i, t in enumerate(tasks):
        fid = f"f{7 + i}"
        ids.append(fid)
        facts.append(_fact(fid, _spread(i, n), f"ACTION: {owner} to {t} by {rng.choice(WEEKDAYS)}."))
    questions.append({"id": "q4", "kind": "count", "key": owner, "ask": f"How many actions were assigned to {owner}?",
                      "answer": n, "facts": ids})
    m = 3
    amounts = [rng.randint(3, 60) * 500 for _ in range(m)]
    sids = []
    for i, a in enumerate(amounts):
        fid = f"f{7 + n + i}"
        sids.append(fid)
        facts.append(_fact(fid, (0.25, 0.4, 0.65)[i], f"{speaker()}: For {proj[5]}, I can approve "
                                                         f"{money(cur, a)} from the contingency for "
                                                         f"{('signage', 'temporary staff', 'extra testing')[i]}.",
                           value=a))
    questions.append({"id": "q5", "kind": "sum", "key": proj[5],
                      "ask": f"What is the total approved from the contingency for {proj[5]}?", "answer": sum(amounts),
                      "facts": sids})
    questions.append({"id": "q6", "kind": "absent", "key": proj[6], "ask": f"What budget was agreed for {proj[6]}?",
                      "facts": []})
    company = rng.choice(F_COMPANIES)
    return {"title": f"Transcript: {company} operations steering meeting, {MONTHS[(3 * k + 1) % 12]}",
            "preamble": "Automatic transcript, lightly edited. Each line is one speaker turn; lines starting "
                        "ACTION, Agreed or Decision were added by the minute taker.",
            "facts": facts, "questions": questions}


# ==========================================================================================
# assembly
# ==========================================================================================
def _fact(fid: str, at: float, text: str, value: int | None = None) -> dict:
    f = {"id": fid, "at": at, "text": text}
    if value is not None:
        f["value"] = value
    return f


def _spread(i: int, n: int) -> float:
    """Positions of n entries from 15 % to 80 % of the document, evenly spaced."""
    return round(0.15 + 0.65 * i / (n - 1), 2) if n > 1 else 0.5


FILLERS = {"ledger": ledger_filler, "contract": contract_filler, "incident_log": incident_filler,
           "meeting": meeting_filler}
ITEMS = {"ledger": ledger_item, "contract": contract_item, "incident_log": incident_item, "meeting": meeting_item}


def generate(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """``(items, filler rows)``; deterministic for a given seed.

    Items alternate genres (lc-001 ledger, lc-002 contract, ...), so the first N items of
    the file mix every genre. Raises AssertionError when a question's key or text answer
    occurs in its genre's filler (the generator's own guarantee, re-checked on load).
    """
    filler: list[dict] = []
    pools: dict[str, list[str]] = {}
    for g in GENRES:
        pools[g] = FILLERS[g](random.Random(f"{seed}-filler-{g}"))
        filler += [{"genre": g, "text": t} for t in pools[g]]
    items: list[dict] = []
    for k in range(ITEMS_PER_GENRE):
        for g in GENRES:
            body = ITEMS[g](random.Random(f"{seed}-{g}-{k}"), k)
            row = {"id": f"lc-{len(items) + 1:03d}", "genre": g, "filler": FILLER_FILE,
                   "filler_start": k * FILLER_STRIDE, **body}
            _check(row, pools[g])
            items.append(row)
    return items, filler


def _check(row: dict, pool: list[str]) -> None:
    text = "\n".join(pool).casefold()
    for q in row["questions"]:
        strings = [q["key"]] + [a for a in _answers(q) if isinstance(a, str)]
        for s in strings:
            assert s.casefold() not in text, f"{row['id']} {q['id']}: {s!r} occurs in the {row['genre']} filler"


def _answers(q: dict) -> list:
    a = q.get("answer")
    return (a if isinstance(a, list) else [a]) + ([q["stale"]] if "stale" in q else []) if a is not None else []


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(_HERE.parent))
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    items, filler = generate(args.seed)
    out = Path(args.out_dir)
    _write(out / ITEMS_FILE, items)
    _write(out / FILLER_FILE, filler)
    print(f"wrote {len(items)} items to {out / ITEMS_FILE} and {len(filler)} filler lines to {out / FILLER_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
