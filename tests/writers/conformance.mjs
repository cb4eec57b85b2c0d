// Writes each case of the shared table with the Node.js writer.
//
//     node conformance.mjs MONGODB_URI DATABASE < cases.json
//     node conformance.mjs --templates < templates.json
//
// First the writer's key hash is checked against the table's keyHashes;
// any difference fails the script. Then each valid case is added in a
// transaction of its own; a refused one is reported with its rule. One
// JSON line a case: {name, id} or {name, refused, message}; a last line
// reports a call outside any transaction.
//
// With --templates, each case of the subject-template table is checked as
// a message is before it is written, without a database: one JSON line a
// case, {name, subject} or {name, refused}; then {value, token} for each
// token, and {template, error} for each template that must be refused.

import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';

const writerDir = new URL('../../examples/writers/node/', import.meta.url);
// The driver as the writer resolves it, from the writer's own install.
const { Binary, Code, Double, Long, MongoClient, ObjectId } = createRequire(
  new URL('package.json', writerDir),
)('mongodb');
const outbox = await import(new URL('outbox.js', writerDir));

// JavaScript values JSON cannot carry, which the driver would store as
// something the relay refuses: each with the rule it breaks.
function nativeCases() {
  return [
    ['native: Long as payload', 'payload', 't', Long.fromNumber(5)],
    ['native: Double as payload', 'payload', 't', new Double(1.5)],
    ['native: ObjectId as payload', 'payload', 't', new ObjectId()],
    ['native: Code as payload', 'payload', 't', new Code('x')],
    ['native: binData of subtype 4', 'payload', 't', new Binary(Buffer.alloc(16), 4)],
    ['native: a Date as payload', 'payload', 't', new Date()],
    ['native: an array as payload', 'payload', 't', [1]],
    ['native: a number as key', 'field_type', 't', {}, { key: 5 }],
    ['native: a URL object as source', 'field_type', 't', {}, { source: new URL('urn:x') }],
    ['native: a number as an extension', 'field_type', 't', {}, { extensions: { tenant: 5 } }],
    ['native: bad prefix', 'subject', 't', {}, { subjectPrefix: '' }],
  ];
}

function checkKeyHashes(vectors) {
  const wrong = [];
  for (const { key, hash } of vectors) {
    const computed = outbox.keyHash(key);
    if (computed !== hash) wrong.push(`${JSON.stringify(key)}: ${computed}, not ${hash}`);
  }
  if (wrong.length > 0) {
    console.error(`the Node.js writer's key hash differs from the table: ${wrong.join('; ')}`);
    process.exit(1);
  }
}

function payloadOf(payload) {
  if (payload === undefined || payload === null) return undefined;
  const [[kind, value]] = Object.entries(payload);
  return kind === 'bytes' ? Buffer.from(value, 'base64') : value;
}

function write(collection, session, c) {
  return outbox.addMessage(collection, session, c.type, payloadOf(c.payload), {
    key: c.key,
    correlationId: c.correlationId,
    headers: c.headers,
    subject: c.subject,
    source: c.source,
    extensions: c.extensions,
  });
}

function templates({ prefix, cases, tokens, badTemplates }) {
  for (const c of cases) {
    const line = { name: c.name };
    const fields = { key: c.key, headers: c.headers, subjectPrefix: prefix };
    try {
      outbox.newDocument(c.type, {}, { ...fields, subject: c.ownSubject, subjectTemplate: c.template });
      line.subject = c.ownSubject ?? outbox.renderSubject(c.template, c.type, fields);
    } catch (error) {
      if (!(error instanceof outbox.OutboxViolation)) throw error;
      Object.assign(line, { refused: error.rule, message: error.message });
    }
    console.log(JSON.stringify(line));
  }
  for (const { value } of tokens) {
    console.log(JSON.stringify({ value, token: outbox.subjectToken(value) }));
  }
  for (const template of badTemplates) {
    const line = { template, error: null };
    try {
      outbox.renderSubject(template, 't', { key: 'k' });
    } catch (error) {
      if (error instanceof outbox.OutboxViolation) throw error;
      line.error = error.message;
    }
    console.log(JSON.stringify(line));
  }
}

if (process.argv[2] === '--templates') {
  templates(JSON.parse(readFileSync(0, 'utf8')));
  process.exit(0);
}
const [uri, database] = process.argv.slice(2);
const { cases, keyHashes } = JSON.parse(readFileSync(0, 'utf8'));
checkKeyHashes(keyHashes);
const client = new MongoClient(uri);
try {
  const collection = client.db(database).collection(outbox.DEFAULT_COLLECTION);
  const session = client.startSession();
  for (const c of cases) {
    const line = { name: c.name };
    try {
      let id;
      await session.withTransaction(async () => {
        id = await write(collection, session, c);
      });
      line.id = id.toHexString();
    } catch (error) {
      if (!(error instanceof outbox.OutboxViolation)) throw error;
      Object.assign(line, { refused: error.rule, message: error.message });
    }
    console.log(JSON.stringify(line));
  }
  for (const [name, expected, type, payload, options] of nativeCases()) {
    const line = { name, expected };
    try {
      outbox.newDocument(type, payload, options);
    } catch (error) {
      if (!(error instanceof outbox.OutboxViolation)) throw error;
      Object.assign(line, { refused: error.rule, message: error.message });
    }
    console.log(JSON.stringify(line));
  }
  const line = { name: 'outside a transaction' };
  try {
    await write(collection, session, cases[0]);
  } catch (error) {
    if (!(error instanceof outbox.NoTransaction)) throw error;
    Object.assign(line, { refused: 'no_transaction', message: error.message });
  }
  console.log(JSON.stringify(line));
  await session.endSession();
} finally {
  await client.close();
}
