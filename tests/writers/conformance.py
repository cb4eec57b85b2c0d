"""Writes each case of the shared table with the Python writer.

    python conformance.py MONGODB_URI DATABASE < cases.json
    python conformance.py --templates < templates.json

First the writer's key hash is checked against the table's keyHashes;
any difference fails the script. Then each valid case is added in a
transaction of its own; a refused one is reported with its rule. One JSON
line a case: {"name", "id"} or {"name", "refused", "message"}; a last line
reports a call outside any transaction.

With --templates, each case of the subject-template table is checked as
a message is before it is written, without a database: one JSON line a
case, {"name", "subject"} or {"name", "refused"}; then {"value",
"token"} for each token, and {"template", "error"} for each template
that must be refused.
"""

import base64
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..",
                                "examples", "writers", "python"))

from bson import Binary, Code  # noqa: E402
from pymongo import MongoClient  # noqa: E402

import outbox  # noqa: E402


def native_cases():
    """Python values JSON cannot carry, which pymongo would store as
    something the relay refuses: each with the rule it breaks."""
    fine = {"message_type": "t", "payload": {}}
    return [
        ("native: Code as type", "type", {**fine, "message_type": Code("t")}),
        ("native: Code as payload", "payload", {**fine, "payload": Code("x")}),
        ("native: Code as key", "field_type", {**fine, "key": Code("k")}),
        ("native: Code as source", "field_type",
         {**fine, "source": Code("urn:x")}),
        ("native: Code as an extension's value", "field_type",
         {**fine, "extensions": {"tenant": Code("v")}}),
        ("native: Code as a header value", "field_type",
         {**fine, "headers": {"X-A": Code("v")}}),
        ("native: binData of subtype 4", "payload",
         {**fine, "payload": Binary(b"0123456789abcdef", 4)}),
        ("native: a list as payload", "payload", {**fine, "payload": [1]}),
        ("native: bool as key", "field_type", {**fine, "key": True}),
        ("native: bad prefix", "subject", {**fine, "subject_prefix": ""}),
    ]


def check_key_hashes(vectors):
    wrong = []
    for vector in vectors:
        computed = outbox.key_hash(vector["key"])
        if computed != vector["hash"]:
            wrong.append(f"{vector['key']!r}: {computed}, not {vector['hash']}")
    if wrong:
        sys.exit("the Python writer's key hash differs from the table: "
                 + "; ".join(wrong))


def payload_of(case):
    payload = case.get("payload")
    if payload is None:
        return None
    (kind, value), = payload.items()
    return base64.b64decode(value) if kind == "bytes" else value


def write(collection, session, case):
    return outbox.add_message(
        collection, session, case.get("type"), payload_of(case),
        key=case.get("key"), correlation_id=case.get("correlationId"),
        headers=case.get("headers"), subject=case.get("subject"),
        source=case.get("source"), extensions=case.get("extensions"))


def templates(table):
    prefix = table["prefix"]
    for case in table["cases"]:
        line = {"name": case["name"]}
        fields = dict(key=case.get("key"), headers=case.get("headers"),
                      subject_prefix=prefix)
        try:
            outbox.new_document(case["type"], {}, subject=case.get("ownSubject"),
                                subject_template=case["template"], **fields)
            line["subject"] = case.get("ownSubject") or outbox.render_subject(
                case["template"], case["type"], **fields)
        except outbox.OutboxViolation as violation:
            line.update(refused=violation.rule, message=str(violation))
        print(json.dumps(line), flush=True)
    for vector in table["tokens"]:
        print(json.dumps({"value": vector["value"],
                          "token": outbox.subject_token(vector["value"])}))
    for template in table["badTemplates"]:
        line = {"template": template, "error": None}
        try:
            outbox.render_subject(template, "t", key="k")
        except ValueError as error:
            line["error"] = str(error)
        print(json.dumps(line), flush=True)


def main():
    if sys.argv[1] == "--templates":
        templates(json.load(sys.stdin))
        return
    uri, database = sys.argv[1], sys.argv[2]
    table = json.load(sys.stdin)
    check_key_hashes(table["keyHashes"])
    cases = table["cases"]
    with MongoClient(uri) as client:
        collection = client[database][outbox.DEFAULT_COLLECTION]
        with client.start_session() as session:
            for case in cases:
                line = {"name": case["name"]}
                try:
                    added = session.with_transaction(
                        lambda s, case=case: write(collection, s, case))
                    line["id"] = str(added)
                except outbox.OutboxViolation as violation:
                    line.update(refused=violation.rule, message=str(violation))
                print(json.dumps(line), flush=True)
            for name, expected, kwargs in native_cases():
                line = {"name": name, "expected": expected}
                try:
                    outbox.new_document(**kwargs)
                except outbox.OutboxViolation as violation:
                    line.update(refused=violation.rule, message=str(violation))
                print(json.dumps(line), flush=True)
            line = {"name": "outside a transaction"}
            try:
                write(collection, session, cases[0])
            except outbox.NoTransaction as refusal:
                line.update(refused="no_transaction", message=str(refusal))
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
