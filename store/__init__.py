"""Where sessions live outside the model: the tiered KV store (device, host, disk), the Redis
session directory (owners, versions, token logs, turn marks) and the embedded redis-server."""
