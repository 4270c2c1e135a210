"""pika against ringmq: the calls a typical Python application makes, checked against the
results RabbitMQ gives for them. Run by tests/tests/cli.rs with the broker's port as argument;
prints "ok" last when every check held."""
import sys

import pika

conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", int(sys.argv[1])))
ch = conn.channel()
ch.confirm_delivery()
q = ch.queue_declare("", exclusive=True).method.queue
assert q.startswith("amq.gen-"), q
ch.exchange_declare("t1", "topic")
ch.queue_bind(q, "t1", "a.#")
for i in range(5):
    props = pika.BasicProperties(headers={"n": i, "l": [1, "x"], "t": {"k": "v"}}, delivery_mode=2)
    ch.basic_publish("t1", "a.b.%d" % i, b"hello %d" % i, props, mandatory=True)
try:
    ch.basic_publish("t1", "zzz", b"x", mandatory=True)
    raise AssertionError("an unroutable mandatory message was not returned")
except pika.exceptions.UnroutableError:
    pass

method, props, body = ch.basic_get(q)
assert (method.delivery_tag, method.message_count, body) == (1, 4, b"hello 0"), (method, body)
assert props.headers == {"n": 0, "l": [1, "x"], "t": {"k": "v"}}, props.headers
assert props.delivery_mode == 2
ch.basic_ack(method.delivery_tag)

got = []


def on_message(channel, method, properties, body):
    got.append(body)
    channel.basic_ack(method.delivery_tag)
    if len(got) == 4:
        channel.stop_consuming()


ch.basic_qos(prefetch_count=2)
ch.basic_consume(q, on_message)
ch.start_consuming()
assert got == [b"hello %d" % i for i in range(1, 5)], got

try:
    ch.queue_declare("nope", passive=True)
    raise AssertionError("passive declare of a missing queue succeeded")
except pika.exceptions.ChannelClosedByBroker as e:
    assert e.reply_code == 404, e

ch = conn.channel()
ch.tx_select()
ch.basic_publish("", q, b"tx")
ch.tx_rollback()
ch.basic_publish("", q, b"tx2")
ch.tx_commit()
assert ch.queue_declare(q, passive=True).method.message_count == 1
conn.close()
print("ok")
