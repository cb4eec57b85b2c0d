"""Reads the relay's messages with the CloudEvents Python SDK.

    python read.py MESSAGES.json

MESSAGES.json holds {"messages": [...]}, each message as NATS delivered
it ({"name", "headers", "body_base64"}) and the event it must be
("expected": id, source, type, time, subject, datacontenttype,
data_base64, extensions). The SDK's HTTP binding reads the NATS message,
since the NATS binding's headers are the HTTP binding's: `ce-` names,
the same percent-encoding, and a `Content-Type` of
`application/cloudevents+json` for structured mode. Each structured
body is validated against the event format's JSON Schema
(cloudevents.json, beside this script) with its formats checked.

Prints one JSON line with the counts; exits 1 listing every difference.
"""

import base64
import json
import os
import sys

import jsonschema
from cloudevents.core.bindings.http import HTTPMessage, from_http
from cloudevents.core.formats.json import JSONFormat
from dateutil.parser import isoparse

CORE = {"specversion", "id", "source", "type", "time", "subject",
        "datacontenttype", "dataschema"}


def schema_validator():
    with open(os.path.join(os.path.dirname(__file__), "cloudevents.json")) as f:
        schema = json.load(f)
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    # The formats are what the schema checks of a source and a time: a
    # checker without the packages that read them passes anything.
    for bad in ({"source": "has space"}, {"time": "yesterday"}):
        event = {"specversion": "1.0", "id": "1", "type": "t", "source": "/s", **bad}
        if validator.is_valid(event):
            sys.exit(f"the schema's formats are not checked ({bad}): install "
                     "rfc3986-validator and rfc3339-validator")
    return validator


def data_matches(data, expected, content_type):
    if isinstance(data, (bytes, bytearray)):
        return bytes(data) == expected
    if isinstance(data, str):
        return data.encode("utf-8") == expected
    if data is None:
        return expected == b""
    return data == json.loads(expected)


def check(message, validator):
    expected = message["expected"]
    headers = message["headers"]
    body = base64.b64decode(message["body_base64"])
    wrong = []
    content_type = next((v for k, v in headers.items()
                         if k.lower() == "content-type"), "")
    structured = content_type.lower().startswith("application/cloudevents")
    if structured != (message["mode"] == "structured"):
        wrong.append(f"sent in the wrong mode (Content-Type {content_type!r})")
    if structured:
        errors = [e.message for e in validator.iter_errors(json.loads(body))]
        wrong.extend(f"schema: {e}" for e in errors)
    event = from_http(HTTPMessage(headers=headers, body=body), JSONFormat())
    got = {
        "specversion": event.get_specversion(),
        "id": event.get_id(),
        "source": event.get_source(),
        "type": event.get_type(),
        "subject": event.get_subject(),
        "datacontenttype": event.get_datacontenttype(),
    }
    want = {"specversion": "1.0", **{k: expected[k] for k in got if k in expected}}
    for name, value in want.items():
        if got[name] != value:
            wrong.append(f"{name}: {got[name]!r}, not {value!r}")
    time = event.get_time()
    if expected["time"] is None:
        # The SDK gives an event that has no time the time it reads it,
        # so an absent time is checked on the message itself.
        sent = (json.loads(body).get("time") if structured else
                next((v for k, v in headers.items() if k.lower() == "ce-time"), None))
        if sent is not None:
            wrong.append(f"time: {sent!r} sent, not none")
    elif time != isoparse(expected["time"]) or time.microsecond % 1000:
        wrong.append(f"time: {time!r}, not {expected['time']}")
    data = base64.b64decode(expected["data_base64"])
    if not data_matches(event.get_data(), data, expected["datacontenttype"]):
        wrong.append(f"data: {event.get_data()!r}, not {data!r}")
    extensions = {k: v for k, v in event.get_attributes().items()
                  if k not in CORE and v is not None}
    if extensions != expected["extensions"]:
        wrong.append(f"extensions: {extensions!r}, not {expected['extensions']!r}")
    return wrong


def main():
    with open(sys.argv[1]) as f:
        messages = json.load(f)["messages"]
    validator = schema_validator()
    failures = []
    modes = {}
    for message in messages:
        try:
            wrong = check(message, validator)
        except Exception as error:  # the SDK refusing is a failure to report
            wrong = [f"the SDK cannot read it: {type(error).__name__}: {error}"]
        if wrong:
            failures.append(f"{message['name']}: " + "; ".join(wrong))
        modes[message["mode"]] = modes.get(message["mode"], 0) + 1
    print(json.dumps({"read": len(messages), "modes": modes, "failed": len(failures)}))
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
