"""Keys: the partitioners (Kafka-exact), key formats and key schemas (with the Schema Registry client that
reads them), and where a key lives (key location). Pure values; no ZooKeeper, no HTTP.
"""
