"""A complaint executor in Python: the Python twin of the Rust executors of ``reach dev``
(``services/agents/src/executor.rs``). It serves one category's capability
(``complaint.<category>``, service ``executor.<category>``) and turns a classified complaint
into a handling suggestion: department, priority, next steps and the key fields (company,
state, dollar amounts) — the same reply, field for field, as the Rust executor's.

It takes what ``examples/flows/complaint-flow.yaml`` sends a category node —
``{"complaint": {complaint_id, narrative, company?, state?}, "classification": {...}}`` — or
the complaint's fields at the top level, as the coordinator sends them::

    reach dev                                    # the Python instance joins the Rust ones
    .venv/bin/python sdk/python/examples/complaint_executor.py --category servicing
    reach task start --flow complaint-flow --input '{"complaint_id": "1", "narrative": "my autopay was misapplied and I got a late fee"}'

With ``reach dev --no-agents`` it is the only servicing executor; call it directly with
``reach call complaint.servicing --json '{"complaint_id": "1", "narrative": "..."}'`` or from a
flow of your own. Stop it with Ctrl-C or SIGTERM: it drains (finishes what it has, leaves the
mesh) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
from typing import Any

import grpc

from reach_mesh import AgentConfig, AgentRuntime, HandlerContext, Message, Payload, ReachError, data_part

#: What each category's executor does: the department that owns it and its next steps
#: (``{company}`` is the servicer named in the complaint, or "the servicer").
CATEGORIES: dict[str, tuple[str, list[str]]] = {
    "servicing": (
        "Loan Servicing Operations",
        [
            "pull the payment history and account notes from {company}",
            "verify every payment was applied and credited on its due date",
            "correct misapplied payments, fees or interest, and send the borrower a written account statement",
        ],
    ),
    "repayment": (
        "Repayment and Forgiveness",
        [
            "check eligibility for income-driven repayment, forbearance, deferment and forgiveness programs",
            "request the qualifying-payment count and plan history from {company}",
            "send the borrower the options with deadlines, and pause collection while the review is open",
        ],
    ),
    "credit_report": (
        "Credit Reporting Disputes",
        [
            "open an FCRA dispute: the furnisher must investigate within 30 days",
            "compare {company}'s reported status, balance and dates with the servicing record",
            "send corrections to every consumer reporting agency that received the tradeline",
        ],
    ),
    "origination": (
        "Lending and Origination",
        [
            "collect the application, disclosures and signed agreement",
            "review the sales contact for misleading or high-pressure practices",
            "assess rescission, refund or borrower-defense options",
        ],
    ),
}

URGENT_TERMS = ("garnish", "default", "identity theft", "lawsuit", "offset", "collections agency", "treasury offset")
HIGH_TERMS = ("delinquen", "credit score", "late fee", "collection", "denied", "past due", "derogatory")
#: Sums above this many US dollars raise priority to urgent.
URGENT_AMOUNT_USD = 50_000.0
#: CFPB narratives write amounts as ``{$1234.56}`` after scrubbing; ``$1,234`` is recognised too.
AMOUNT = re.compile(r"\{?\$\s?([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(\.[0-9]{1,2})?\}?")
#: Servicers and lenders narratives name, for complaints whose record lacks a company.
KNOWN_COMPANIES = (
    ("mohela", "MOHELA"),
    ("nelnet", "Nelnet, Inc."),
    ("navient", "Navient"),
    ("sallie mae", "SLM CORPORATION"),
    ("edfinancial", "EdFinancial Services"),
    ("aidvantage", "Maximus Federal Services, Inc."),
    ("maximus", "Maximus Federal Services, Inc."),
    ("climb credit", "Climb Credit Inc."),
    ("mpower", "MPOWER Financing"),
)

COMPLAINT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "a complaint, alone or under `complaint` with the classifier's `classification` next to it",
    "properties": {
        "complaint_id": {"type": "string"},
        "narrative": {"type": "string"},
        "company": {"type": "string"},
        "state": {"type": "string"},
        "complaint": {
            "type": "object",
            "required": ["complaint_id", "narrative"],
            "properties": {
                "complaint_id": {"type": "string"},
                "narrative": {"type": "string"},
                "company": {"type": "string"},
                "state": {"type": "string"},
            },
        },
        "classification": {"type": "object"},
    },
}

SUGGESTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["complaint_id", "category", "department", "priority", "next_steps", "fields", "handled_by"],
    "properties": {
        "complaint_id": {"type": "string"},
        "category": {"enum": list(CATEGORIES)},
        "department": {"type": "string"},
        "priority": {"enum": ["normal", "high", "urgent"]},
        "next_steps": {"type": "array", "items": {"type": "string"}},
        "fields": {
            "type": "object",
            "properties": {
                "company": {"type": ["string", "null"]},
                "state": {"type": ["string", "null"]},
                "amounts_usd": {"type": "array", "items": {"type": "number"}},
                "max_amount_usd": {"type": ["number", "null"]},
            },
        },
        "handled_by": {"type": "string"},
    },
}


def _present(value: str) -> str | None:
    value = value.strip()
    return value if value and value != "None" else None


def extract(narrative: str, company: str, state: str) -> dict[str, Any]:
    """The key fields: the company (the record's, else one the text names), the two-letter
    state, and the dollar amounts mentioned, in order, with the largest."""
    amounts = []
    for match in AMOUNT.finditer(narrative):
        amounts.append(float(match.group(1).replace(",", "") + (match.group(2) or "")))
    found = _present(company)
    if found is None:
        lower = narrative.lower()
        found = next((name for needle, name in KNOWN_COMPANIES if needle in lower), None)
    code = _present(state)
    if code is not None and not (len(code) == 2 and code.isascii() and code.isupper()):
        code = None
    return {
        "company": found,
        "state": code,
        "amounts_usd": amounts,
        "max_amount_usd": max(amounts) if amounts else None,
    }


def read_complaint(message: Message) -> dict[str, str]:
    """The complaint of a request: its first data part, or the object under ``complaint``.

    Raises:
        ReachError: INVALID_ARGUMENT naming what is missing.
    """
    data = message.data
    if not isinstance(data, dict):
        raise ReachError(
            grpc.StatusCode.INVALID_ARGUMENT, "the payload needs a data part with complaint_id and narrative"
        )
    if isinstance(data.get("complaint"), dict):
        data = data["complaint"]
    missing = [key for key in ("complaint_id", "narrative") if not isinstance(data.get(key), str)]
    if missing:
        raise ReachError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the complaint data part is malformed: {' and '.join(missing)} must be strings; "
            'send {"complaint_id": "...", "narrative": "..."}',
        )
    return {key: data.get(key) if isinstance(data.get(key), str) else "" for key in ("complaint_id", "narrative", "company", "state")}


def suggest(category: str, complaint: dict[str, str], handled_by: str) -> dict[str, Any]:
    """The handling suggestion for a complaint of ``category``."""
    fields = extract(complaint["narrative"], complaint["company"], complaint["state"])
    text = complaint["narrative"].lower()
    if any(term in text for term in URGENT_TERMS) or (fields["max_amount_usd"] or 0) >= URGENT_AMOUNT_USD:
        priority = "urgent"
    elif any(term in text for term in HIGH_TERMS):
        priority = "high"
    else:
        priority = "normal"
    department, steps = CATEGORIES[category]
    company = fields["company"] or "the servicer"
    return {
        "complaint_id": complaint["complaint_id"],
        "category": category,
        "department": department,
        "priority": priority,
        "next_steps": [step.format(company=company) for step in steps],
        "fields": fields,
        "handled_by": handled_by,
    }


def build(category: str, registry: str, instance_id: str = "") -> AgentRuntime:
    """The executor agent of ``category``, registering with ``registry``."""
    runtime = AgentRuntime(
        AgentConfig(service=f"executor.{category}", registry_endpoint=registry, instance_id=instance_id)
    )

    @runtime.handler(
        f"complaint.{category}",
        "1.0.0",
        description=f"suggest a resolution for a {category.replace('_', ' ')} complaint (Python executor)",
        input_schema=COMPLAINT_SCHEMA,
        output_schema=SUGGESTION_SCHEMA,
    )
    async def handle(ctx: HandlerContext, message: Message) -> Payload:
        suggestion = suggest(category, read_complaint(message), ctx.instance_id)
        return Payload(type="complaint.suggestion", parts=(data_part(suggestion),))

    return runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--category", choices=sorted(CATEGORIES), default="servicing", help="the category served")
    parser.add_argument("--registry", default="http://127.0.0.1:7070", help="the registry (reach dev's port)")
    parser.add_argument("--instance-id", default="", help="this instance's id (default executor.<category>-<random>)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to serve on (port 0: any free one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = args.listen.rpartition(":")
    asyncio.run(build(args.category, args.registry, args.instance_id).run(host, int(port)))


if __name__ == "__main__":
    main()
