"""Development tools, never imported by the product: the demo, the embedded ZooKeeper launcher, the
mock Kafka broker, the development Schema Registry and sample data. The CLI's `demo` and `zookeeper` commands
import them on demand.
"""
