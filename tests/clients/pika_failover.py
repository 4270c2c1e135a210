"""A plain pika application on a ringmq cluster whose members are killed under it: what
any production pika application does — on a lost connection it connects to the next
member, declares again, sends again what was not confirmed, and consumes on. It knows
nothing of sessions. Run by tests/tests/proxies/plain_clients.rs with the members' AMQP
ports as arguments; it prints "published N" as it goes (the test kills members then) and,
last, one JSON line with what it saw:

  {"confirmed": [bodies], "resent": [bodies], "deliveries": [[body, redelivered]],
   "reconnects": n}

The test checks the plain client's guarantee, at-least-once: nothing confirmed is lost,
and every delivery beyond the copies the publisher sent is marked redelivered."""
import json
import sys
import time

import pika

PORTS = [int(p) for p in sys.argv[1:]]
QUEUE = "pika-failover"
MESSAGES = 400
DEADLINE = time.monotonic() + 120


class Session:
    """One connection at a time, to the members in turn."""

    def __init__(self):
        self.member = 0
        self.reconnects = -1
        self.conn = None
        self.ch = None
        self.connect()

    def connect(self):
        while True:
            if time.monotonic() > DEADLINE:
                raise SystemExit("no member took a connection before the deadline")
            port = PORTS[self.member % len(PORTS)]
            try:
                params = pika.ConnectionParameters(
                    "127.0.0.1", port, heartbeat=2, blocked_connection_timeout=30,
                    connection_attempts=1, socket_timeout=5,
                )
                self.conn = pika.BlockingConnection(params)
                self.ch = self.conn.channel()
                self.ch.confirm_delivery()
                self.ch.queue_declare(QUEUE, durable=True)
                self.reconnects += 1
                return
            except (pika.exceptions.AMQPError, OSError):
                self.member += 1
                time.sleep(0.2)

    def lost(self):
        self.member += 1
        try:
            self.conn.close()
        except Exception:
            pass
        self.connect()


s = Session()
confirmed, resent = [], []
for i in range(MESSAGES):
    body = "p%d" % i
    attempts = 0
    while True:
        try:
            s.ch.basic_publish(
                "", QUEUE, body.encode(), pika.BasicProperties(delivery_mode=2), mandatory=True
            )
            confirmed.append(body)
            break
        except pika.exceptions.NackError:
            # Refused (its queue was failing over): sent again, as an application would.
            attempts += 1
            resent.append(body)
            time.sleep(0.1)
        except (pika.exceptions.AMQPError, OSError):
            attempts += 1
            resent.append(body)
            s.lost()
        if time.monotonic() > DEADLINE:
            raise SystemExit("publishing did not finish before the deadline")
    if i % 50 == 49:
        print("published %d" % (i + 1), flush=True)

deliveries = []
received = set()
while not set(confirmed) <= received:
    if time.monotonic() > DEADLINE:
        missing = sorted(set(confirmed) - received)[:10]
        raise SystemExit("confirmed messages never delivered, e.g. %s" % missing)
    try:
        method, props, body = s.ch.basic_get(QUEUE)
        if method is None:
            time.sleep(0.05)
            continue
        text = body.decode()
        deliveries.append([text, bool(method.redelivered)])
        received.add(text)
        s.ch.basic_ack(method.delivery_tag)
        if len(deliveries) % 50 == 0:
            print("consumed %d" % len(deliveries), flush=True)
    except (pika.exceptions.AMQPError, OSError):
        s.lost()

print(json.dumps({
    "confirmed": confirmed, "resent": resent, "deliveries": deliveries,
    "reconnects": s.reconnects,
}), flush=True)
