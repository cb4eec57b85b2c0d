"""Adding outbox messages from Python (pymongo), inside the caller's transaction.

An outbox message means something only if it commits or aborts with the
business write it announces, so add_message refuses a session with no
transaction in progress. Each message is checked as the relay checks it
(the rules of docs/contract.md, as every relay holds them), so a bad one
fails here, in the application, and not later as a dead letter; the
reason's rule name is the one the Rust writer and the relay report.

For a relay that sends each message as a CloudEvent, a message may name
its own `source` (a URI-reference) and carry `extensions`: headers whose
names are CloudEvents attribute names, sent as attributes of the event.
"""

import random
import re
import unicodedata
from collections.abc import Mapping
from datetime import datetime, timezone

from bson import Binary, Code, ObjectId
from bson.int64 import Int64

DEFAULT_COLLECTION = "outbox"
DEFAULT_SUBJECT_PREFIX = "outbox"
DEFAULT_SUBJECT_TEMPLATE = "{prefix}.{type}"
MAX_SUBJECT_CHARS = 512
RESERVED_HEADER_PREFIXES = ("nats-", "outbox-")
# The prefix of every header a CloudEvents receiver reads as an attribute.
CLOUDEVENTS_HEADER_PREFIX = "ce-"
# The attributes CloudEvents defines itself, and `data`: no header may take
# one of these names, or a receiver would read it as the attribute the
# relay derives from the document.
CORE_ATTRIBUTES = ("specversion", "id", "source", "type", "subject", "time",
                   "datacontenttype", "dataschema", "data")
MAX_ATTRIBUTE_NAME = 20
# A URI-reference (RFC 3986), ASCII only, matched whole: the relay's own
# pattern (src/contract/cloudevents.rs), character for character, so that a
# source is refused here exactly when the relay would refuse it.
URI_REFERENCE = r"^(?:[A-Za-z][A-Za-z0-9+.\-]*:(?://(?:(?:[!$&-.0-;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*@)?(?:\[[!$&-.0-;=A-Z_a-z~]+\]|(?:[!$&-.0-9;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|/(?:(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?://(?:(?:[!$&-.0-;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*@)?(?:\[[!$&-.0-;=A-Z_a-z~]+\]|(?:[!$&-.0-9;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|/(?:(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?:[!$&-.0-9;=@-Z_a-z~]|%[0-9A-Fa-f]{2})+(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?)?)(?:\?(?:[!$&-;=?-Z_a-z~]|%[0-9A-Fa-f]{2})*)?(?:#(?:[!$&-;=?-Z_a-z~]|%[0-9A-Fa-f]{2})*)?$"  # noqa: E501
_URI_REFERENCE = re.compile(URI_REFERENCE)
_ATTRIBUTE_NAME = re.compile("[a-z0-9]+")
FNV_OFFSET_BASIS = 0x811C9DC5
FNV_PRIME = 0x01000193


class OutboxViolation(ValueError):
    """A message the relay would refuse; `rule` names the rule it breaks."""

    def __init__(self, rule, message):
        super().__init__(message)
        self.rule = rule


class NoTransaction(RuntimeError):
    """add_message was called outside a transaction."""


def add_message(collection, session, message_type, payload, *, key=None,
                correlation_id=None, headers=None, subject=None,
                subject_prefix=DEFAULT_SUBJECT_PREFIX, subject_template=None,
                source=None, extensions=None):
    """Adds one message inside `session`'s transaction and returns its _id.

    `payload` is a dict (sent as JSON), bytes (sent as is) or a str (sent
    as UTF-8). `subject` overrides the default `<prefix>.<type>`. Give the
    relay's `--subject-template` as `subject_template` to have a message it
    would refuse (one without the key the template needs, say) refused here.
    `source` is the message's CloudEvents source, a URI-reference (without
    one, the relay's `--cloudevents-source`); `extensions` maps CloudEvents
    attribute names (lower-case letters and digits, at most 20) to string
    values, added to the headers (each overriding a header of its name).
    """
    document = new_document(message_type, payload, key=key,
                            correlation_id=correlation_id, headers=headers,
                            subject=subject, subject_prefix=subject_prefix,
                            subject_template=subject_template, source=source,
                            extensions=extensions)
    if session is None or not session.in_transaction:
        raise NoTransaction(
            "outbox messages must be added inside a transaction: start one "
            "(session.with_transaction) so the message commits with the "
            "write it announces")
    collection.insert_one(document, session=session)
    return document["_id"]


def new_document(message_type, payload, *, key=None, correlation_id=None,
                 headers=None, subject=None,
                 subject_prefix=DEFAULT_SUBJECT_PREFIX, subject_template=None,
                 source=None, extensions=None):
    """The outbox document for a message, checked; raises OutboxViolation
    (and ValueError for a `subject_template` that is no template)."""
    # In the relay's order, so a message that breaks two rules is refused
    # for the same one.
    _check_subject(subject_prefix)
    # First, as the Rust writer checks them: once among the headers, an
    # extension cannot be told from an ordinary header.
    _check_extension_names(extensions)
    headers = _with_extensions(headers, extensions)
    _check_type(message_type, subject_prefix)
    if subject is not None:
        _check_string("subject", subject)
        _check_subject(subject)
        _refuse_reserved(subject)
    _check_payload(payload)
    _check_string("correlationId", correlation_id)
    _check_string("key", key)
    _check_source(source)
    headers = _checked_headers(headers)
    # The relay sends these two as headers, which cannot break a line.
    for name, value in (("Outbox-Correlation-Id", correlation_id),
                        ("Outbox-Key", key)):
        if value is not None and ("\r" in value or "\n" in value):
            raise _line_break(name)
    # A CloudEvent's subject is the key.
    if key is not None and _has_control(key):
        raise OutboxViolation(
            "attribute",
            f"key {key!r} holds a control character, which no CloudEvents "
            "subject may")
    if subject is None and subject_template is not None:
        rendered = render_subject(subject_template, message_type, key=key,
                                  headers=headers,
                                  subject_prefix=subject_prefix)
        _check_subject(rendered)
        _refuse_reserved(rendered)
    document = {
        "_id": ObjectId(),
        "type": message_type,
        "payload": payload,
        "status": "pending",
        "createdAt": datetime.now(timezone.utc),
        # An Int64 whatever the value, as every writer stores it: pymongo
        # would store a small int as a 32-bit one.
        "keyHash": Int64(key_hash(key) if key is not None
                         else random.getrandbits(32)),
    }
    for name, value in (("correlationId", correlation_id), ("key", key),
                        ("subject", subject), ("source", source)):
        if value is not None:
            document[name] = value
    if headers:
        document["headers"] = headers
    return document


def key_hash(key):
    """The 32-bit FNV-1a hash of `key`'s UTF-8 bytes, stored as keyHash.

    The same in every writer; a keyless message stores a random value
    instead, so that keyless messages spread over the partitions.
    """
    hash_ = FNV_OFFSET_BASIS
    for byte in key.encode("utf-8"):
        hash_ = ((hash_ ^ byte) * FNV_PRIME) & 0xFFFFFFFF
    return hash_


def render_subject(template, message_type, *, key=None, headers=None,
                   subject_prefix=DEFAULT_SUBJECT_PREFIX):
    """The subject the relay gives a message that names none, with
    `--subject-template template` (docs/outbox-document.md): `{prefix}`,
    `{type}`, and `{key}` and `{header.NAME}` each escaped into one token
    (subject_token). Raises OutboxViolation("subject_template") for a
    missing or empty key or header, ValueError for a bad template."""
    parts = []
    for kind, value in _parse_template(template):
        if kind == "literal":
            parts.append(value)
        elif kind == "prefix":
            parts.append(subject_prefix)
        elif kind == "type":
            parts.append(message_type)
        elif kind == "key":
            parts.append(_template_token(template, key, "the message's key"))
        else:
            found = (headers or {}).get(value)
            parts.append(_template_token(template, found, f"header {value!r}"))
    return "".join(parts)


def subject_token(value):
    """`value` as one subject token, as the relay escapes a key or header:
    every UTF-8 byte but ASCII letters, digits, '-' and '_' as %XX. Any
    percent-decoder (urllib.parse.unquote) reads the value back."""
    return "".join(
        chr(byte) if chr(byte).isascii() and (chr(byte).isalnum() or byte in b"-_")
        else f"%{byte:02X}"
        for byte in value.encode("utf-8"))


def _template_token(template, value, what):
    if value:
        return subject_token(value)
    raise OutboxViolation(
        "subject_template",
        f"the subject template {template!r} needs {what}, and the message "
        f"has {'an empty one' if value == '' else 'none'}; give it one, or a "
        "subject of its own")


_PLACEHOLDERS = "{prefix}, {type}, {key} and {header.NAME}"


def _parse_template(template):
    """A template's parts, in order: ("literal", text), ("prefix", None),
    ("type", None), ("key", None) or ("header", NAME). Each placeholder is
    a whole token; ValueError says what is wrong."""
    parts, rest = [], template
    while rest:
        ends = [at for at in (rest.find("{"), rest.find("}")) if at >= 0]
        at = min(ends, default=-1)
        if at < 0:
            parts.append(("literal", rest))
            break
        if at > 0:
            parts.append(("literal", rest[:at]))
            rest = rest[at:]
            continue
        if rest[0] == "}":
            raise ValueError(f"a '}}' opens nothing in {template!r}")
        end = rest.find("}")
        if end < 0:
            raise ValueError(f"a '{{' is never closed in {template!r}: "
                             f"placeholders are {_PLACEHOLDERS}")
        parts.append(_placeholder(rest[1:end]))
        rest = rest[end + 1:]
    for n, (kind, _) in enumerate(parts):
        if kind == "literal":
            continue
        before = parts[n - 1] if n > 0 else None
        after = parts[n + 1] if n + 1 < len(parts) else None
        apart = ((before is None or (before[0] == "literal" and before[1].endswith(".")))
                 and (after is None or (after[0] == "literal" and after[1].startswith("."))))
        if not apart:
            raise ValueError(f"in {template!r}, each placeholder must be a whole "
                             "token, with a '.' or the template's end on each side")
    return parts


def _placeholder(name):
    if name in ("prefix", "type", "key"):
        return (name, None)
    if name.startswith("header."):
        header = name[len("header."):]
        if header.lower().startswith(RESERVED_HEADER_PREFIXES):
            raise ValueError(f"header {header!r} is the relay's own (every Nats-* "
                             "and Outbox-* header), and no document may set it")
        if header and all(0x21 <= ord(c) <= 0x7E and c != ":" for c in header):
            return ("header", header)
        raise ValueError(f"{header!r} cannot be a header's name: a name is "
                         "visible ASCII without ':'")
    raise ValueError(f"{{{name}}} is no placeholder: placeholders are {_PLACEHOLDERS}")


def _check_type(message_type, subject_prefix):
    if message_type is None:
        raise OutboxViolation("type", "the document has no type")
    if not _is_text(message_type):
        raise OutboxViolation(
            "type", f"type must be a string, found {_kind(message_type)}")
    if not message_type:
        raise OutboxViolation("type", "type must be a non-empty string")
    try:
        _check_subject(f"{subject_prefix}.{message_type}")
    except OutboxViolation as violation:
        raise OutboxViolation("type", str(violation)) from None


def _is_text(value):
    """A value pymongo stores as a BSON string (Code, a str, is stored as
    JavaScript code)."""
    return isinstance(value, str) and not isinstance(value, Code)


def _check_string(name, value):
    if value is not None and not _is_text(value):
        raise OutboxViolation(
            "field_type", f"{name} must be a string, found {_kind(value)}")


def _check_payload(payload):
    if payload is None:
        raise OutboxViolation("payload", "the document has no payload")
    if isinstance(payload, Binary) and payload.subtype != 0:
        raise OutboxViolation(
            "payload",
            f"payload is binData of subtype {payload.subtype}; use the generic subtype 0")
    if not (isinstance(payload, (Mapping, bytes)) or _is_text(payload)):
        raise OutboxViolation(
            "payload",
            f"payload must be a document, binData or string, found {_kind(payload)}")


def _check_source(source):
    _check_string("source", source)
    if source is None:
        return
    if not source:
        raise OutboxViolation("attribute", "source: a source must not be empty")
    # The pattern takes printable ASCII only, so a control character fails
    # it too.
    if _URI_REFERENCE.fullmatch(source) is None:
        raise OutboxViolation(
            "attribute",
            f"source: {source!r} is not a URI-reference (RFC 3986): use ASCII, "
            "percent-encode anything else (%XX), and give a scheme ('urn:', "
            "'https:') or a path ('/orders')")


def _check_extension_names(extensions):
    if extensions is None:
        return
    if not isinstance(extensions, Mapping):
        raise OutboxViolation(
            "field_type",
            "extensions must be a mapping of attribute names to strings, "
            f"found {_kind(extensions)}")
    for name in extensions:
        if not _is_attribute_name(name):
            raise OutboxViolation(
                "attribute",
                f"extension {name!r} is no CloudEvents attribute name: use "
                f"lower-case letters and digits, at most {MAX_ATTRIBUTE_NAME}")


def _with_extensions(headers, extensions):
    """The headers with the extensions added, each overriding a header of
    its name; headers that are no mapping as they are, to be refused."""
    if not extensions or not (headers is None or isinstance(headers, Mapping)):
        return headers
    return {**(headers or {}), **extensions}


def _is_attribute_name(name):
    """Whether a header of this name is a CloudEvents extension attribute."""
    return (isinstance(name, str) and len(name) <= MAX_ATTRIBUTE_NAME
            and _ATTRIBUTE_NAME.fullmatch(name) is not None)


def _has_control(value):
    """Whether `value` holds a character no CloudEvents string may."""
    return any(c <= "\x1f" or "\x7f" <= c <= "\x9f" for c in value)


def _check_subject(subject):
    def bad(why):
        return OutboxViolation("subject", f"invalid subject {subject!r}: {why}")

    if not subject:
        raise bad("it is empty")
    if len(subject) > MAX_SUBJECT_CHARS:
        raise bad(f"it is {len(subject)} characters long; the limit is "
                  f"{MAX_SUBJECT_CHARS}")
    if any(token == "" for token in subject.split(".")):
        raise bad("it has an empty token (leading, trailing or doubled '.')")
    if any(c == " " or unicodedata.category(c) == "Cc" for c in subject):
        raise bad("it contains a space or a control character")
    if "*" in subject or ">" in subject:
        raise bad("it contains a wildcard ('*' or '>')")


def _refuse_reserved(subject):
    if subject.startswith("$") or subject.split(".")[0] == "_INBOX":
        raise OutboxViolation(
            "reserved_subject",
            f"subject {subject!r} is reserved to NATS (subjects beginning "
            "with '$' or '_INBOX'); the relay never publishes there")


def _checked_headers(headers):
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        raise OutboxViolation(
            "field_type",
            f"headers must be a document of strings, found {_kind(headers)}")
    # Sorted by name first, as the Rust writer stores and the relay checks
    # them, so a message with two bad headers is refused for the same one.
    headers = dict(sorted(headers.items(), key=lambda item: str(item[0])))
    for name, value in headers.items():
        if not _is_text(value):
            raise OutboxViolation(
                "field_type",
                f"header {name!r} must be a string, found {_kind(value)}")
        visible = isinstance(name, str) and name and all(
            0x21 <= ord(c) <= 0x7E and c != ":" for c in name)
        if not visible:
            raise OutboxViolation(
                "header", f"invalid header name {name!r}: use visible ASCII "
                "characters other than ':'")
        if "\r" in value or "\n" in value:
            raise _line_break(name)
        if name.lower().startswith(RESERVED_HEADER_PREFIXES):
            raise OutboxViolation(
                "reserved_header",
                f"header {name!r} is reserved to the relay (every Nats-* and "
                "Outbox-* header)")
        if name.lower().startswith(CLOUDEVENTS_HEADER_PREFIX):
            raise OutboxViolation(
                "reserved_header",
                f"header {name!r} may not be given in headers: every ce-* "
                "header carries a CloudEvents attribute, which the relay "
                "derives from the document")
        if name in CORE_ATTRIBUTES:
            raise OutboxViolation(
                "reserved_header",
                f"header {name!r} may not be given in headers: it names a "
                "CloudEvents attribute, which the relay derives from the "
                "document")
        if name.lower() == "content-type" and (not value.strip(" ")
                                               or _has_control(value)):
            raise OutboxViolation(
                "attribute",
                f"header {name!r} is the event's datacontenttype, a media "
                "type: it must not be empty or hold a control character")
        if _is_attribute_name(name) and _has_control(value):
            raise OutboxViolation(
                "attribute",
                f"header {name!r} is a CloudEvents extension attribute, and "
                "its value holds a control character, which no attribute may")
    return headers


def _line_break(name):
    return OutboxViolation(
        "header", f"invalid value for header {name!r}: it contains a line break")


def _kind(value):
    return type(value).__name__
