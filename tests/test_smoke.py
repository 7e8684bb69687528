from producer import Priority, Producer


def test_round_trip(shared_redis, queue, start_consumer):
    start_consumer(shared_redis.url, queue, "--strategy", "priority", "--model",
                   "consumer.models:noop")
    with Producer(shared_redis.url, queue) as p:
        assert p.submit({"x": 1}, priority=Priority.HIGH).result(timeout=10) == {"x": 1}
        handles = p.submit_many([{"i": i} for i in range(50)], priority="low")
        assert [h.result(timeout=10) for h in handles] == [{"i": i} for i in range(50)]
