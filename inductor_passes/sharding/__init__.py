"""Sharding: per-op rules (OpStrategy/OpSpec), whole-graph propagation and the cost model."""
