"""The runtime the gateway and the workers share: Redis I/O (connections, the refusals
Redis answers with, consumer groups, its clock), the Redis Cluster client, reading a
stage's stats and queue state and rendering them as Prometheus metrics, and tracing.

``pipelines`` is the contract the two sides agree on; this package is code both run.
Imports point one way: ``conveyor → gateway, workers → runtime → pipelines``.
"""
