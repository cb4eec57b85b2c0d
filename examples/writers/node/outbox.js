// Adding outbox messages from Node.js (the official `mongodb` driver),
// inside the caller's transaction.
//
// An outbox message means something only if it commits or aborts with the
// business write it announces, so addMessage refuses a session with no
// transaction in progress. Each message is checked as the relay checks it
// (the rules of docs/contract.md, as every relay holds them), so a bad one
// fails here, in the application, and not later as a dead letter; the
// reason's rule name is the one the Rust writer and the relay report.
//
// For a relay that sends each message as a CloudEvent, a message may name
// its own `source` (a URI-reference) and carry `extensions`: headers whose
// names are CloudEvents attribute names, sent as attributes of the event.

import { randomInt } from 'node:crypto';
import { Long, ObjectId } from 'mongodb';

export const DEFAULT_COLLECTION = 'outbox';
export const DEFAULT_SUBJECT_PREFIX = 'outbox';
export const DEFAULT_SUBJECT_TEMPLATE = '{prefix}.{type}';
export const MAX_SUBJECT_CHARS = 512;
const RESERVED_HEADER_PREFIXES = ['nats-', 'outbox-'];
// The prefix of every header a CloudEvents receiver reads as an attribute.
const CLOUDEVENTS_HEADER_PREFIX = 'ce-';
// The attributes CloudEvents defines itself, and `data`: no header may take
// one of these names, or a receiver would read it as the attribute the
// relay derives from the document.
export const CORE_ATTRIBUTES = Object.freeze([
  'specversion',
  'id',
  'source',
  'type',
  'subject',
  'time',
  'datacontenttype',
  'dataschema',
  'data',
]);
export const MAX_ATTRIBUTE_NAME = 20;
// A URI-reference (RFC 3986), ASCII only, matched whole: the relay's own
// pattern (src/contract/cloudevents.rs), character for character, so that a
// source is refused here exactly when the relay would refuse it. Raw, so
// that its backslashes stay as they are.
export const URI_REFERENCE = String.raw`^(?:[A-Za-z][A-Za-z0-9+.\-]*:(?://(?:(?:[!$&-.0-;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*@)?(?:\[[!$&-.0-;=A-Z_a-z~]+\]|(?:[!$&-.0-9;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|/(?:(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?://(?:(?:[!$&-.0-;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*@)?(?:\[[!$&-.0-;=A-Z_a-z~]+\]|(?:[!$&-.0-9;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|/(?:(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?:[!$&-.0-9;=@-Z_a-z~]|%[0-9A-Fa-f]{2})+(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?)?)(?:\?(?:[!$&-;=?-Z_a-z~]|%[0-9A-Fa-f]{2})*)?(?:#(?:[!$&-;=?-Z_a-z~]|%[0-9A-Fa-f]{2})*)?$`;
const URI_REFERENCE_REGEX = new RegExp(URI_REFERENCE);
const FNV_OFFSET_BASIS = 0x811c9dc5;
const FNV_PRIME = 0x01000193;

/** A message the relay would refuse; `rule` names the rule it breaks. */
export class OutboxViolation extends Error {
  constructor(rule, message) {
    super(message);
    this.name = 'OutboxViolation';
    this.rule = rule;
  }
}

/** addMessage was called outside a transaction. */
export class NoTransaction extends Error {
  constructor() {
    super(
      'outbox messages must be added inside a transaction: start one ' +
        '(session.withTransaction) so the message commits with the write it announces',
    );
    this.name = 'NoTransaction';
  }
}

/**
 * Adds one message inside `session`'s transaction and returns its _id.
 *
 * `payload` is a plain object or a Map (sent as JSON), a Buffer or
 * Uint8Array (sent as is) or a string (sent as UTF-8). `subject` overrides
 * the default `<prefix>.<type>`. Give the relay's `--subject-template` as
 * `subjectTemplate` to have a message it would refuse (one without the key
 * the template needs, say) refused here. `source` is the message's
 * CloudEvents source, a URI-reference (without one, the relay's
 * `--cloudevents-source`); `extensions` is an object of CloudEvents attribute
 * names (lower-case letters and digits, at most 20) and string values, added
 * to the headers (each overriding a header of its name). JavaScript has one
 * kind of number: a whole one is stored as an integer (so `1.0` is sent as
 * `1`), any other as a double.
 */
export async function addMessage(collection, session, type, payload, options = {}) {
  const document = newDocument(type, payload, options);
  if (!session || !session.inTransaction()) {
    throw new NoTransaction();
  }
  await collection.insertOne(document, { session });
  return document._id;
}

/**
 * The outbox document for a message, checked; throws OutboxViolation (and
 * an Error for a `subjectTemplate` that is no template).
 */
export function newDocument(type, payload, options = {}) {
  const { key, correlationId, subject, subjectTemplate, source, extensions } = options;
  const prefix = options.subjectPrefix ?? DEFAULT_SUBJECT_PREFIX;
  // In the relay's order, so a message that breaks two rules is refused
  // for the same one.
  checkSubject(prefix);
  // First, as the Rust writer checks them: once among the headers, an
  // extension cannot be told from an ordinary header.
  checkExtensionNames(extensions);
  const headers = withExtensions(options.headers, extensions);
  checkType(type, prefix);
  if (subject !== undefined && subject !== null) {
    checkString('subject', subject);
    checkSubject(subject);
    refuseReserved(subject);
  }
  checkPayload(payload);
  checkString('correlationId', correlationId);
  checkString('key', key);
  checkSource(source);
  const checkedHeaders = checkHeaders(headers);
  // The relay sends these two as headers, which cannot break a line.
  for (const [name, value] of [['Outbox-Correlation-Id', correlationId], ['Outbox-Key', key]]) {
    if (typeof value === 'string' && /[\r\n]/.test(value)) throw lineBreak(name);
  }
  // A CloudEvent's subject is the key.
  if (typeof key === 'string' && hasControl(key)) {
    throw new OutboxViolation(
      'attribute',
      `key ${JSON.stringify(key)} holds a control character, which no CloudEvents subject may`,
    );
  }
  if ((subject === undefined || subject === null) && subjectTemplate != null) {
    const rendered = renderSubject(subjectTemplate, type, {
      key,
      headers: checkedHeaders,
      subjectPrefix: prefix,
    });
    checkSubject(rendered);
    refuseReserved(rendered);
  }
  const document = {
    _id: new ObjectId(),
    type,
    payload: widened(payload),
    status: 'pending',
    createdAt: new Date(),
    // A Long whatever the value, as every writer stores it: the driver
    // would store a number past 2^31 - 1 as a double.
    keyHash: Long.fromNumber(typeof key === 'string' ? keyHash(key) : randomInt(0, 2 ** 32)),
  };
  const optional = [
    ['correlationId', correlationId],
    ['key', key],
    ['subject', subject],
    ['source', source],
  ];
  for (const [name, value] of optional) {
    if (value !== undefined && value !== null) document[name] = value;
  }
  if (checkedHeaders && checkedHeaders.size > 0) document.headers = checkedHeaders;
  return document;
}

/**
 * The 32-bit FNV-1a hash of `key`'s UTF-8 bytes, stored as keyHash. The
 * same in every writer; a keyless message stores a random value instead,
 * so that keyless messages spread over the partitions.
 */
export function keyHash(key) {
  let hash = FNV_OFFSET_BASIS;
  for (const byte of Buffer.from(key, 'utf8')) {
    // Math.imul keeps the product's low 32 bits, where `*` would round
    // it to a double's 53; `>>> 0` reads them as unsigned.
    hash = Math.imul(hash ^ byte, FNV_PRIME) >>> 0;
  }
  return hash;
}

/**
 * The subject the relay gives a message that names none, with
 * `--subject-template template` (docs/outbox-document.md): `{prefix}`,
 * `{type}`, and `{key}` and `{header.NAME}` each escaped into one token
 * (subjectToken). Throws OutboxViolation('subject_template') for a missing
 * or empty key or header, an Error for a bad template. `headers` is an
 * object or a Map.
 */
export function renderSubject(template, type, options = {}) {
  const { key, headers } = options;
  const prefix = options.subjectPrefix ?? DEFAULT_SUBJECT_PREFIX;
  const headerOf = (name) =>
    headers instanceof Map ? headers.get(name) : headers && Object.hasOwn(headers, name) ? headers[name] : undefined;
  return parseTemplate(template)
    .map(([kind, value]) => {
      switch (kind) {
        case 'literal':
          return value;
        case 'prefix':
          return prefix;
        case 'type':
          return type;
        case 'key':
          return templateToken(template, key, "the message's key");
        default:
          return templateToken(template, headerOf(value), `header ${JSON.stringify(value)}`);
      }
    })
    .join('');
}

/**
 * `value` as one subject token, as the relay escapes a key or header:
 * every UTF-8 byte but ASCII letters, digits, '-' and '_' as %XX. Any
 * percent-decoder (decodeURIComponent) reads the value back.
 */
export function subjectToken(value) {
  let token = '';
  for (const byte of Buffer.from(value, 'utf8')) {
    const c = String.fromCharCode(byte);
    token += /[A-Za-z0-9_-]/.test(c) ? c : `%${byte.toString(16).toUpperCase().padStart(2, '0')}`;
  }
  return token;
}

function templateToken(template, value, what) {
  if (typeof value === 'string' && value !== '') return subjectToken(value);
  throw new OutboxViolation(
    'subject_template',
    `the subject template ${JSON.stringify(template)} needs ${what}, and the message has ` +
      `${value === '' ? 'an empty one' : 'none'}; give it one, or a subject of its own`,
  );
}

const PLACEHOLDERS = '{prefix}, {type}, {key} and {header.NAME}';

/**
 * A template's parts, in order: ['literal', text], ['prefix'], ['type'],
 * ['key'] or ['header', NAME]. Each placeholder is a whole token; the
 * Error says what is wrong.
 */
function parseTemplate(template) {
  const parts = [];
  let rest = template;
  while (rest !== '') {
    const ends = [rest.indexOf('{'), rest.indexOf('}')].filter((at) => at >= 0);
    const at = ends.length > 0 ? Math.min(...ends) : -1;
    if (at < 0) {
      parts.push(['literal', rest]);
      break;
    }
    if (at > 0) {
      parts.push(['literal', rest.slice(0, at)]);
      rest = rest.slice(at);
      continue;
    }
    if (rest[0] === '}') throw new Error(`a '}' opens nothing in ${JSON.stringify(template)}`);
    const end = rest.indexOf('}');
    if (end < 0) {
      throw new Error(`a '{' is never closed in ${JSON.stringify(template)}: placeholders are ${PLACEHOLDERS}`);
    }
    parts.push(placeholder(rest.slice(1, end)));
    rest = rest.slice(end + 1);
  }
  parts.forEach(([kind], n) => {
    if (kind === 'literal') return;
    const before = parts[n - 1];
    const after = parts[n + 1];
    const apart =
      (before === undefined || (before[0] === 'literal' && before[1].endsWith('.'))) &&
      (after === undefined || (after[0] === 'literal' && after[1].startsWith('.')));
    if (!apart) {
      throw new Error(
        `in ${JSON.stringify(template)}, each placeholder must be a whole token, ` +
          "with a '.' or the template's end on each side",
      );
    }
  });
  return parts;
}

function placeholder(name) {
  if (['prefix', 'type', 'key'].includes(name)) return [name];
  if (name.startsWith('header.')) {
    const header = name.slice('header.'.length);
    if (RESERVED_HEADER_PREFIXES.some((prefix) => header.toLowerCase().startsWith(prefix))) {
      throw new Error(
        `header ${JSON.stringify(header)} is the relay's own (every Nats-* and Outbox-* header), and no document may set it`,
      );
    }
    if (/^[\x21-\x39\x3b-\x7e]+$/.test(header)) return ['header', header];
    throw new Error(`${JSON.stringify(header)} cannot be a header's name: a name is visible ASCII without ':'`);
  }
  throw new Error(`{${name}} is no placeholder: placeholders are ${PLACEHOLDERS}`);
}

function checkType(type, prefix) {
  if (type === undefined || type === null) {
    throw new OutboxViolation('type', 'the document has no type');
  }
  if (typeof type !== 'string') {
    throw new OutboxViolation('type', `type must be a string, found ${kind(type)}`);
  }
  if (type === '') throw new OutboxViolation('type', 'type must be a non-empty string');
  try {
    checkSubject(`${prefix}.${type}`);
  } catch (violation) {
    throw new OutboxViolation('type', violation.message);
  }
}

function checkString(name, value) {
  if (value !== undefined && value !== null && typeof value !== 'string') {
    throw new OutboxViolation('field_type', `${name} must be a string, found ${kind(value)}`);
  }
}

function isPlainObject(value) {
  return Object.prototype.toString.call(value) === '[object Object]';
}

function checkPayload(payload) {
  if (payload === undefined || payload === null) {
    throw new OutboxViolation('payload', 'the document has no payload');
  }
  // The driver's own types (Long, Code, Binary, ...) pass for plain
  // objects; of them only generic binary data is a payload.
  if (payload._bsontype === 'Binary' && payload.sub_type !== 0) {
    throw new OutboxViolation('payload', `payload is binData of subtype ${payload.sub_type}; use the generic subtype 0`);
  }
  const bsonValue = payload._bsontype !== undefined && payload._bsontype !== 'Binary';
  const fits =
    !bsonValue &&
    (isPlainObject(payload) ||
      payload instanceof Map ||
      payload instanceof Uint8Array ||
      payload._bsontype === 'Binary' ||
      typeof payload === 'string');
  if (!fits) {
    throw new OutboxViolation(
      'payload',
      `payload must be a document, binData or string, found ${kind(payload)}`,
    );
  }
}

function checkSource(source) {
  checkString('source', source);
  if (source === undefined || source === null) return;
  if (source === '') throw new OutboxViolation('attribute', 'source: a source must not be empty');
  // The pattern takes printable ASCII only, so a control character fails
  // it too.
  if (!URI_REFERENCE_REGEX.test(source)) {
    throw new OutboxViolation(
      'attribute',
      `source: ${JSON.stringify(source)} is not a URI-reference (RFC 3986): use ASCII, ` +
        "percent-encode anything else (%XX), and give a scheme ('urn:', 'https:') or a path ('/orders')",
    );
  }
}

function checkExtensionNames(extensions) {
  if (extensions === undefined || extensions === null) return;
  if (!isPlainObject(extensions)) {
    throw new OutboxViolation(
      'field_type',
      `extensions must be an object of attribute names and strings, found ${kind(extensions)}`,
    );
  }
  for (const name of Object.keys(extensions)) {
    if (!isAttributeName(name)) {
      throw new OutboxViolation(
        'attribute',
        `extension ${JSON.stringify(name)} is no CloudEvents attribute name: use lower-case ` +
          `letters and digits, at most ${MAX_ATTRIBUTE_NAME}`,
      );
    }
  }
}

/**
 * The headers with the extensions added, each overriding a header of its
 * name; headers that are no object as they are, to be refused.
 */
function withExtensions(headers, extensions) {
  const none = extensions === undefined || extensions === null || Object.keys(extensions).length === 0;
  if (none || !(headers === undefined || headers === null || isPlainObject(headers))) return headers;
  return { ...headers, ...extensions };
}

/** Whether a header of this name is a CloudEvents extension attribute. */
function isAttributeName(name) {
  return name.length <= MAX_ATTRIBUTE_NAME && /^[a-z0-9]+$/.test(name);
}

/** Whether `value` holds a character no CloudEvents string may. */
function hasControl(value) {
  return /[\u0000-\u001f\u007f-\u009f]/.test(value);
}

function checkSubject(subject) {
  const bad = (why) => new OutboxViolation('subject', `invalid subject ${JSON.stringify(subject)}: ${why}`);
  if (subject === '') throw bad('it is empty');
  // Characters as the relay counts them: code points, not UTF-16 units.
  const length = [...subject].length;
  if (length > MAX_SUBJECT_CHARS) {
    throw bad(`it is ${length} characters long; the limit is ${MAX_SUBJECT_CHARS}`);
  }
  if (subject.split('.').some((token) => token === '')) {
    throw bad("it has an empty token (leading, trailing or doubled '.')");
  }
  if (/[ \u0000-\u001f\u007f-\u009f]/u.test(subject)) {
    throw bad('it contains a space or a control character');
  }
  if (/[*>]/.test(subject)) throw bad("it contains a wildcard ('*' or '>')");
}

function refuseReserved(subject) {
  if (subject.startsWith('$') || subject.split('.')[0] === '_INBOX') {
    throw new OutboxViolation(
      'reserved_subject',
      `subject ${JSON.stringify(subject)} is reserved to NATS (subjects beginning with '$' or ` +
        "'_INBOX'); the relay never publishes there",
    );
  }
}

function checkHeaders(headers) {
  if (headers === undefined || headers === null) return null;
  if (!isPlainObject(headers)) {
    throw new OutboxViolation('field_type', `headers must be a document of strings, found ${kind(headers)}`);
  }
  // Sorted by name first, as the Rust writer stores and the relay checks
  // them, so a message with two bad headers is refused for the same one;
  // kept in a Map, which holds that order (an object puts names that look
  // like numbers first).
  const sorted = new Map(Object.entries(headers).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
  for (const [name, value] of sorted) {
    if (typeof value !== 'string') {
      throw new OutboxViolation('field_type', `header ${JSON.stringify(name)} must be a string, found ${kind(value)}`);
    }
    if (!/^[\x21-\x39\x3b-\x7e]+$/.test(name)) {
      throw new OutboxViolation(
        'header',
        `invalid header name ${JSON.stringify(name)}: use visible ASCII characters other than ':'`,
      );
    }
    if (/[\r\n]/.test(value)) throw lineBreak(name);
    if (RESERVED_HEADER_PREFIXES.some((prefix) => name.toLowerCase().startsWith(prefix))) {
      throw new OutboxViolation(
        'reserved_header',
        `header ${JSON.stringify(name)} is reserved to the relay (every Nats-* and Outbox-* header)`,
      );
    }
    if (name.toLowerCase().startsWith(CLOUDEVENTS_HEADER_PREFIX)) {
      throw new OutboxViolation(
        'reserved_header',
        `header ${JSON.stringify(name)} may not be given in headers: every ce-* header carries ` +
          'a CloudEvents attribute, which the relay derives from the document',
      );
    }
    if (CORE_ATTRIBUTES.includes(name)) {
      throw new OutboxViolation(
        'reserved_header',
        `header ${JSON.stringify(name)} may not be given in headers: it names a CloudEvents ` +
          'attribute, which the relay derives from the document',
      );
    }
    if (name.toLowerCase() === 'content-type' && (value.replace(/ /g, '') === '' || hasControl(value))) {
      throw new OutboxViolation(
        'attribute',
        `header ${JSON.stringify(name)} is the event's datacontenttype, a media type: it must not ` +
          'be empty or hold a control character',
      );
    }
    if (isAttributeName(name) && hasControl(value)) {
      throw new OutboxViolation(
        'attribute',
        `header ${JSON.stringify(name)} is a CloudEvents extension attribute, and its value ` +
          'holds a control character, which no attribute may',
      );
    }
  }
  return sorted;
}

/**
 * The payload with each whole number outside 32 bits (and safe) made a
 * Long: the driver would store it as a double, which the relay sends as
 * `2147483648.0` where the other writers' `2147483648` goes.
 */
function widened(value) {
  if (typeof value === 'number') {
    const wide = Number.isSafeInteger(value) && (value > 2147483647 || value < -2147483648);
    return wide ? Long.fromNumber(value) : value;
  }
  if (Array.isArray(value)) return value.map(widened);
  if (value instanceof Map) return new Map([...value].map(([k, v]) => [k, widened(v)]));
  if (isPlainObject(value) && value._bsontype === undefined) {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, widened(v)]));
  }
  return value;
}

function lineBreak(name) {
  return new OutboxViolation('header', `invalid value for header ${JSON.stringify(name)}: it contains a line break`);
}

function kind(value) {
  if (Array.isArray(value)) return 'array';
  if (value instanceof Date) return 'date';
  return typeof value;
}
