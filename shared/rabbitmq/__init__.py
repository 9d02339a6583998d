"""RabbitMQ: connections and the topology every service declares (I/O)."""
