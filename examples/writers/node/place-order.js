// Writes an order and its outbox message in one transaction.
//
//     node place-order.js MONGODB_URI DATABASE [ORDER_ID]
//
// withTransaction retries the whole callback on a transient transaction
// error and the commit on an unknown commit result, as the drivers'
// convenient transaction API does everywhere.

import { MongoClient } from 'mongodb';
import { addMessage, DEFAULT_COLLECTION } from './outbox.js';

async function placeOrder(client, database, orderId, total) {
  const orders = client.db(database).collection('orders');
  const messages = client.db(database).collection(DEFAULT_COLLECTION);
  const session = client.startSession();
  try {
    let id;
    await session.withTransaction(async () => {
      await orders.insertOne({ _id: orderId, total }, { session });
      id = await addMessage(messages, session, 'order.placed', { orderId, total }, {
        key: orderId,
        correlationId: `checkout-${orderId}`,
      });
    });
    return id;
  } finally {
    await session.endSession();
  }
}

const [uri, database, orderId = 'order-1', ...rest] = process.argv.slice(2);
if (!database || rest.length > 0) {
  console.error('usage: node place-order.js MONGODB_URI DATABASE [ORDER_ID]');
  process.exit(2);
}
const client = new MongoClient(uri);
try {
  console.log((await placeOrder(client, database, orderId, 42)).toHexString());
} finally {
  await client.close();
}
