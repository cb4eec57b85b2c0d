"""Writes an order and its outbox message in one transaction.

    python place_order.py MONGODB_URI DATABASE [ORDER_ID]

with_transaction retries the whole callback on a transient transaction
error and the commit on an unknown commit result, as the drivers'
convenient transaction API does everywhere.
"""

import sys

from pymongo import MongoClient

import outbox


def place_order(client, database, order_id, total):
    orders = client[database]["orders"]
    messages = client[database][outbox.DEFAULT_COLLECTION]

    def write(session):
        orders.insert_one({"_id": order_id, "total": total}, session=session)
        return outbox.add_message(
            messages, session, "order.placed",
            {"orderId": order_id, "total": total},
            key=order_id, correlation_id=f"checkout-{order_id}")

    with client.start_session() as session:
        return session.with_transaction(write)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: place_order.py MONGODB_URI DATABASE [ORDER_ID]")
    order_id = sys.argv[3] if len(sys.argv) == 4 else "order-1"
    with MongoClient(sys.argv[1]) as client:
        message_id = place_order(client, sys.argv[2], order_id, 42)
    print(message_id)


if __name__ == "__main__":
    main()
